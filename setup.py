"""The one C extension: relay.py's byte strip (`proxy/_sse_strip.c`), the proxy's hot path for
captured streams and whole responses. Everything else is in pyproject.toml.

`optional=True`: where no C compiler is found the install still succeeds and the proxy runs the
same rules in Python (it logs `sse_strip=python` at start)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "proxy._sse_strip",
            sources=["proxy/_sse_strip.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
