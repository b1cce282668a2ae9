"""A fake upstream: an aiohttp app on its own event loop in a thread, so the proxy under
test (on the test's loop) reaches it over a real socket, as it would a model server."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Self

from aiohttp import web


class ThreadedUpstream:
    """Subclasses add their routes in `add_routes`; `requests` keeps the bodies they saw."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.url = ""

    def add_routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def _start(self) -> None:
        app = web.Application()
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    def start(self) -> Self:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def stop(self) -> None:
        assert self._runner is not None
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
