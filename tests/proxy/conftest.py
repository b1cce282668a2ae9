"""A real proxy on a real port, in its own thread and event loop, in front of the real vLLM.

Running it in a thread lets the synchronous `openai` client and async clients in the test's
loop both talk to it. Records go to `CollectingSink`, which validates each against the
replay schema, so every test also checks the record contract.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.app import build_app
from proxy.config import ProxyConfig, TenantConfig
from proxy.context import CONTEXT, ProxyContext
from proxy.server import app_runner
from replay.schemas import validate_feedback, validate_trajectory

ADMIN_KEY = "admin-key-for-tests"
KEYS = {"alice": "key-alice", "bob": "key-bob", "carol": "key-carol"}


def default_tenants() -> list[TenantConfig]:
    return [
        TenantConfig(name="alice", api_key=KEYS["alice"], training_enabled=True),
        TenantConfig(name="bob", api_key=KEYS["bob"], training_enabled=False),
        TenantConfig(
            name="carol", api_key=KEYS["carol"], training_enabled=True, requests_per_minute=2
        ),
    ]


class CollectingSink:
    """A RecordSink that keeps records in memory after checking them against the schemas."""

    def __init__(self) -> None:
        self.trajectories: list[dict[str, Any]] = []
        self.feedback: list[dict[str, Any]] = []
        self.closed = False
        self._lock = threading.Lock()

    def put_trajectory(self, record: dict[str, Any]) -> None:
        validate_trajectory(record)
        with self._lock:
            self.trajectories.append(record)

    def put_feedback(self, event: dict[str, Any]) -> None:
        validate_feedback(event)
        with self._lock:
            self.feedback.append(event)

    async def aclose(self) -> None:
        self.closed = True


class ProxyHarness:
    """Runs `build_app(...)` on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def ctx(self) -> ProxyContext:
        return self.app[CONTEXT]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    async def _start(self) -> None:
        self._runner = app_runner(self.app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def start(self) -> ProxyHarness:
        self._thread.start()
        self.call(self._start())
        return self

    def settle(self) -> None:
        """Wait until the requests answered so far finished their bookkeeping: the proxy
        counts a request (metrics) after its answer went out, in the same event-loop step,
        and a test reading the registry from its own thread may come first."""
        self.call(asyncio.sleep(0))

    def drain(self) -> None:
        """Wait until every scheduled trajectory reached the sink."""
        self.call(self.ctx.capture.drain())

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        if self._runner is not None:
            self.call(self._runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)


@pytest.fixture
def make_proxy(tmp_path: Path) -> Iterator[Callable[..., tuple[ProxyHarness, CollectingSink]]]:
    """Factory: `make_proxy(upstreams=[...], tenants=None, **proxy_config_fields)`."""
    started: list[ProxyHarness] = []

    def make(
        upstreams: list[str],
        tenants: list[TenantConfig] | None = None,
        state_dir: Path | None = None,
        sink: Any = None,
        **fields: Any,
    ) -> tuple[ProxyHarness, CollectingSink]:
        fields.setdefault("admin_key", ADMIN_KEY)
        config = ProxyConfig(upstreams=upstreams, port=0, **fields)
        sink = sink if sink is not None else CollectingSink()
        app = build_app(
            config,
            default_tenants() if tenants is None else tenants,
            sink,
            state_dir or tmp_path / "state",
        )
        harness = ProxyHarness(app).start()
        started.append(harness)
        return harness, sink

    yield make
    for harness in started:
        harness.stop()


@pytest.fixture
def proxy(make_proxy, vllm_server) -> tuple[ProxyHarness, CollectingSink]:
    """A proxy in front of the shared vLLM server with the default tenants."""
    return make_proxy([vllm_server.base_url])
