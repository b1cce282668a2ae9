"""`olp proxy`: run the proxy in the foreground until SIGINT/SIGTERM/SIGHUP, then drain and
close."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.config import INTERNAL_ADMIN_TOKEN_ENV, ProxyConfig, TenantConfig, sha256_hex
from proxy.context import CONTEXT
from proxy.event_loop import run_with_loop
from proxy.gc_tuning import tune_gc
from replay.config import STREAM_ID_ENV, StreamConfig
from replay.sink import JsonlSink
from replay.sink_process import KafkaSinkProcess
from safety.audit import AuditLog
from safety.config import SafetyConfig
from safety.redaction import Redactor

log = structlog.get_logger(__name__)


def make_sink(
    config: ProxyConfig,
    stream: StreamConfig,
    state_dir: Path,
    registry: CollectorRegistry | None = None,
    child_init: Callable[[], None] | None = None,
) -> Any:
    """The RecordSink the config asks for; a Kafka sink's `olp_stream_*` series go on
    `registry`, and its worker process runs `child_init` first (the logging set-up)."""
    if config.sink == "jsonl":
        return JsonlSink(state_dir / config.state.records_dir)
    # In a child process: schema validation, encoding and kafka-python stay off the
    # interpreter that serves requests (bench/bench_proxy.py measures both).
    # Called on the event loop's thread (serve_proxy): the worker is kept off its CPU.
    return KafkaSinkProcess(
        stream,
        state_dir,
        registry,
        child_init=child_init,
        loop_thread_id=threading.get_native_id(),
    )


async def serve_proxy(
    config: ProxyConfig,
    tenants: list[TenantConfig],
    state_dir: Path,
    *,
    stream: StreamConfig | None = None,
    safety: SafetyConfig | None = None,
    stop: asyncio.Event | None = None,
    sink: Any = None,
    internal_admin_token: str | None = None,
    stream_id: str | None = None,
    owns_process: bool = False,
    sink_child_init: Callable[[], None] | None = None,
) -> None:
    """Serve until `stop` is set (or a signal arrives when `stop` is None).

    `sink` overrides the RecordSink the config names (embedding, benchmarks); `stream_id`
    names the stream the sink writes (`olp up` names each start of its embedded broker);
    `sink_child_init` is run first in a Kafka sink's worker process (the logging set-up).
    `owns_process` applies the process-wide settings (`config.gc`) once it listens."""
    state_dir = Path(state_dir)
    safety = safety or SafetyConfig()
    redactor = Redactor.from_config(safety.redaction)
    audit = AuditLog.from_config(safety.audit, state_dir, redactor)
    sink_registry = None
    if sink is None:
        # Its own registry, served on /metrics next to the proxy's: spill, DLQ and broker
        # health are what an operator watches the stream by.
        sink_registry = CollectorRegistry()
        sink = make_sink(
            config, stream or StreamConfig(), state_dir, sink_registry, sink_child_init
        )
    app = build_app(
        config,
        tenants,
        sink,
        state_dir,
        redactor=redactor,
        audit=audit,
        internal_admin_key_sha256=sha256_hex(internal_admin_token)
        if internal_admin_token
        else None,
    )
    app[CONTEXT].stream_id = stream_id
    if sink_registry is not None:
        app[CONTEXT].metrics.also_serve(sink_registry)
    runner = app_runner(app)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        log.info(
            "proxy_listening",
            host=config.host,
            port=config.port,
            event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
        )
        if owns_process:
            frozen = tune_gc(config.gc)
            app[CONTEXT].metrics.gc_frozen.set(frozen)
            log.info("gc_tuned", frozen_objects=frozen, **config.gc.model_dump())
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            # SIGHUP too (a closed terminal), as `olp up`, `olp broker` and `olp policy` do:
            # the proxy drains and closes its sink instead of dying with records in it.
            for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if signum == signal.SIGHUP and signal.getsignal(signum) == signal.SIG_IGN:
                    continue  # `nohup olp proxy`: it is meant to outlive the terminal
                loop.add_signal_handler(signum, stop.set)
        await stop.wait()
        log.info("proxy_stopping")
    finally:
        await runner.cleanup()
        await sink.aclose()


def app_runner(app: web.Application) -> web.AppRunner:
    """The proxy's runner. A client that goes away cancels its handler (aiohttp's
    `handler_cancellation`): the upstream request is closed, so vLLM stops generating, the
    tenant's concurrency slot is freed and the trajectory is recorded `aborted`. Without it
    only a stream noticed (on its next write); an unstreamed request ran to its end.

    `idle_timeout_s` is aiohttp's keep-alive timeout, which also closes a connection whose
    request headers never complete: with aiohttp's default (an hour) a client that opens
    connections and trickles partial headers holds a file descriptor each for that long,
    before any key is checked (measured: 1,100 such connections all still open after 100 s)."""
    config = app[CONTEXT].config
    return web.AppRunner(
        app,
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=config.idle_timeout_s,
        # On stop, requests in flight get `drain_s`, then are cancelled as a client that went
        # away is: recorded `aborted`, before the sink closes. aiohttp's 60 s outlasted
        # `olp up`'s 30 s, which then killed the proxy with its sink (measured: a stream of
        # 121 s, stopped, left no record). aiohttp (3.14) waits this timeout twice: for the
        # handler, then again after cancelling the request's body, which a handler waiting
        # on upstream does not notice; only then is the handler cancelled. Half of it each
        # makes `drain_s` the whole wait (at `drain_s` 25 `olp up`'s budget killed the proxy
        # mid-drain, its in-flight trajectories lost).
        # (aiohttp reads 0 as no limit: drain_s 0 waited for every request to end.)
        shutdown_timeout=max(config.drain_s / 2, 0.001),
    )


def run_proxy(
    config: ProxyConfig,
    tenants: list[TenantConfig],
    state_dir: Path,
    *,
    stream: StreamConfig | None = None,
    safety: SafetyConfig | None = None,
    sink_child_init: Callable[[], None] | None = None,
) -> None:
    """Blocking entry point for the CLI (reads the `olp up` internal admin token from the
    environment, the one place the proxy looks there), on the loop `proxy.event_loop` names."""
    if not config.upstreams:
        raise ValueError("proxy.upstreams is empty: the launcher must fill it from `policy`")
    run_with_loop(
        config.event_loop,
        serve_proxy(
            config,
            tenants,
            state_dir,
            stream=stream,
            safety=safety,
            internal_admin_token=os.environ.get(INTERNAL_ADMIN_TOKEN_ENV) or None,
            stream_id=os.environ.get(STREAM_ID_ENV) or None,
            owns_process=True,
            sink_child_init=sink_child_init,
        ),
    )
