"""Running a gate's requests side by side without leaving any behind when one fails."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def gather_or_cancel(*awaitables: Awaitable[T]) -> list[T]:
    """Their results, in order; on the first failure (or a cancellation) the others are
    cancelled and awaited before the error is raised.

    A plain `asyncio.gather` left them running: a gate failed by one bad answer returned, the
    suite closed its client, and the rest went on asking the model server (on a session the
    closed client opened again) after the report was written. `asyncio.TaskGroup` would
    raise an ExceptionGroup, which the suite's `except GateError` does not catch.

    Not for the suite's shared response tasks (`SuiteContext.respond`): another gate may
    still await those, and the suite cancels them itself when it ends."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        # Awaited, so none is still running (or holding the client) when the error leaves,
        # and their own failures are collected rather than logged as never retrieved.
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
