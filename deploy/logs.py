"""structlog, configured once per process: JSON lines in production, console in a terminal.

Request and session ids are bound with `structlog.contextvars.bind_contextvars` by the
proxy and merged into every line logged while the request runs.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import msgspec
import structlog

LogFormat = Literal["auto", "json", "console"]

# A value JSON cannot hold is written as its repr, as structlog's own JSON fallback does.
_JSON_ENCODER = msgspec.json.Encoder(enc_hook=repr)


def _json_line(event: dict[str, Any], **_: Any) -> bytes:
    """structlog's JSON serializer: msgspec instead of `json.dumps`. The proxy writes a
    line per request, and this halves what a line costs (with the bytes logger below)."""
    return _JSON_ENCODER.encode(event)


def configure_logging(fmt: LogFormat = "auto", level: str = "INFO") -> None:
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.typing.Processor
    factory: Any = structlog.PrintLoggerFactory(file=sys.stderr)
    if use_console:
        # structlog's default (rich) traceback prints every frame's local variables: a
        # `log.exception` in the proxy would write request headers (keys) and bodies.
        renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    else:
        shared.append(structlog.processors.format_exc_info)
        binary = getattr(sys.stderr, "buffer", None)
        if binary is not None:
            renderer = structlog.processors.JSONRenderer(serializer=_json_line)
            factory = structlog.BytesLoggerFactory(file=binary)
        else:  # a text-only stderr (some embedding hosts)
            renderer = structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    # Libraries that use stdlib logging (aiohttp, kafka-python) go to stderr at WARNING.
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr)
