"""The proxy process's event loop: uvloop where it is installed, else asyncio's own.

Only the process's owner picks it (`run_proxy`, the benchmark), as with `proxy.gc`: a test
or an application that embeds the proxy keeps its own loop. Measured on the bench's fast
upstream (1,500 unstreamed requests at c=16, 6 alternating rounds, CPU time of the proxy
process): uvloop took the proxy from 0.239 to 0.224 ms per request, and the thinnest
aiohttp pass-through from 0.180 to 0.175 (docs/perf/proxy.md).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, Literal, TypeVar

EventLoopChoice = Literal["auto", "uvloop", "asyncio"]
T = TypeVar("T")


def loop_factory(choice: EventLoopChoice) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory `asyncio.Runner` takes for `choice`; None is asyncio's default loop.
    ValueError when `uvloop` is asked for and cannot be imported."""
    if choice == "asyncio":
        return None
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError as exc:
        if choice == "uvloop":
            raise ValueError(
                "proxy.event_loop is 'uvloop', but uvloop cannot be imported "
                f"({exc}); install it (pip install uvloop) or set proxy.event_loop to "
                "'auto' or 'asyncio'"
            ) from exc
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run_with_loop(choice: EventLoopChoice, main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `choice` names."""
    try:
        factory = loop_factory(choice)
    except ValueError:
        main.close()  # never awaited: no "coroutine was never awaited" warning on top
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
