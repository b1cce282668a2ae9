"""A fake upstream: an aiohttp app on its own event loop in a thread, so the proxy under
test (on the test's loop) reaches it over a real socket, as it would a model server."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
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


class NotingUpstream(ThreadedUpstream):
    """Answers each (method, path) of `routes` with its JSON payload and notes the connection
    (aiohttp's protocol object) every request came on, in `connections`: the keep-alive
    tests tell a reused connection from a new one by it."""

    def __init__(self, routes: dict[tuple[str, str], Any]) -> None:
        super().__init__()
        self.routes = routes
        self.connections: list[Any] = []

    def add_routes(self, app: web.Application) -> None:
        for (method, path), payload in self.routes.items():
            app.router.add_route(method, path, self._answering(payload))

    def _answering(self, payload: Any) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def answer(request: web.Request) -> web.Response:
            self.connections.append(request.protocol)
            return web.json_response(payload)

        return answer


def assert_reconnects_after_idle(
    call: Callable[[], object], connections: list[Any], idle_s: float = 0.6
) -> None:
    """Two calls back to back share a connection; one after `idle_s` of idleness (past the
    client's shortened keep-alive) comes on a new one."""
    for pause_s in (0.0, 0.0, idle_s):
        time.sleep(pause_s)
        call()
    first, second, third = connections[-3:]
    assert first is second, "back-to-back calls did not reuse their connection"
    assert third is not second, f"a connection idle for {idle_s} s was reused"
