"""Disconnects a client that stopped reading its streamed answer but keeps the connection.

Its socket buffer full, the relay's next write waits for ever: aiohttp does not time a
write, and the upstream read is paused meanwhile (aiohttp's `sock_read` timeout does not
run while paused), so `read_timeout_s` never fires either. The tenant's concurrency slot,
an upstream connection and the generation on vLLM stayed taken until the client closed
the connection, if it ever did (the response-side twin of `body_timeout_s`).

A timer around every write would cost each streamed chunk a timer handle on the hot path;
instead one task looks at the watched connections a few times per timeout: a write buffer
that holds bytes and has not changed size since the last look is a client reading
nothing, and once that has lasted `send_timeout_s` the connection is aborted. The relay
then sees a departure (`aborted`, upstream closed, slot released), as for a client that
closed its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import structlog
from aiohttp import web

log = structlog.get_logger(__name__)

_MAX_LOOK_INTERVAL_S = 5.0


class StalledClientWatch:
    """The requests whose answers are being written, and how long each has been stuck."""

    def __init__(self, send_timeout_s: float) -> None:
        self.send_timeout_s = send_timeout_s
        # id(request) -> (request, its write buffer's size at the last look, when that last
        # changed); by id, since a request (a mapping) is not hashable.
        self._watched: dict[int, tuple[web.Request, int, float]] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, request: web.Request) -> None:
        self._watched[id(request)] = (request, 0, time.monotonic())

    def forget(self, request: web.Request) -> None:
        self._watched.pop(id(request), None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = min(self.send_timeout_s / 4, _MAX_LOOK_INTERVAL_S)
        while True:
            await asyncio.sleep(interval)
            try:
                self.look(time.monotonic())
            except Exception:  # one bad look must not end the watch for the process's life
                log.exception("stalled_client_watch_failed")

    def look(self, now: float) -> int:
        """Abort the connections stuck for `send_timeout_s`; returns how many."""
        aborted = 0
        for key, (request, size, since) in list(self._watched.items()):
            transport = request.transport
            if transport is None or transport.is_closing():
                continue
            buffered = transport.get_write_buffer_size()
            if buffered == 0 or buffered != size:
                self._watched[key] = (request, buffered, now)
                continue
            if now - since >= self.send_timeout_s:
                log.warning(
                    "client_not_reading",
                    stalled_s=round(now - since, 1),
                    buffered_bytes=buffered,
                    note="the connection is closed; the upstream request is cancelled",
                )
                transport.abort()
                self._watched.pop(key, None)
                aborted += 1
        return aborted
