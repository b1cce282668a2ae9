"""Added latency and CPU cost of the olp proxy, side by side with its peers, in one run.

Against a fast local OpenAI-shaped fake upstream (aiohttp, this file), the same load goes
  direct        client → fake upstream
  passthrough   client → thinnest aiohttp relay (bytes in, bytes out) → fake upstream, on
                the event loop olp runs on (uvloop: `proxy.event_loop` auto)
  passthrough-asyncio
                the same relay on asyncio's own loop (main table only)
  olp-off       client → olp proxy, tenant without training (byte relay + auth/limits/metrics)
  olp-on        client → olp proxy, tenant with training (capture: raw bytes kept, additions
                stripped on the bytes; the KafkaSinkProcess worker builds, checks, redacts
                and sends the records)
  olp-on-thread the records built in the proxy and sent by a KafkaSink thread in it
  olp-on-nosink the same capture handed to a sink that drops the captures
  olp-on-pystrip olp-on with the Python strip instead of its C pass (proxy/_sse_strip.c)
  olp-on-down, olp-on-thread-down
                olp-on / olp-on-thread with the broker down: every record spills to disk
  litellm       client → LiteLLM proxy, one worker (installed in a separate venv; optional)
at concurrency 1 and 16, streamed and not. Prints p50/p99 latency, requests/s and the
relay's CPU ms per request (from /proc: the relay process alone, and with its child
processes); then measures what the ratio targets compare (direct, pass-through, olp-off,
olp-on, olp-on-nosink, olp-on-pystrip) again in alternating rounds, the added latency of
direct, pass-through, olp-off and olp-on once more in short interleaved segments, the
capture CPU once more against a paced upstream (one stream event per read, as a model
server sends them), and the instructions the proxy executes per request with training off
and on (valgrind's callgrind: a count that does not drift with the machine's load), and
writes docs/perf/proxy.md.

    python bench/bench_proxy.py [--requests 400] [--cpu-rounds 5] [--cpu-requests 300]
                                [--pace-ms 1] [--paced-rounds 5] [--paced-requests 200]
                                [--ir-rounds 2] [--ir-requests 200] [--interleave-cycles 150]
                                [--litellm PATH_TO_LITELLM_BIN] [--out FILE]

Each component runs in its own process (`python bench/bench_proxy.py serve-<kind> ...`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from generated_block import write_generated
from percentile import nearest_rank

ROOT = Path(__file__).resolve().parent.parent
STREAM_TOKENS = 16
PROMPT_IDS = list(range(1, 33))


# ------------------------------------------------------------------ fake upstream
def _fake_logprobs(chat: bool, n: int) -> dict[str, Any]:
    if chat:
        return {
            "content": [
                {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
                for _ in range(n)
            ]
        }
    return {
        "text_offset": list(range(n)),
        "token_logprobs": [-0.5] * n,
        "tokens": ["x"] * n,
        "top_logprobs": [{"x": -0.5}] * n,
    }


def fake_chat_answer(body: dict[str, Any]) -> bytes | list[bytes]:
    """An OpenAI/vLLM-shaped answer of STREAM_TOKENS tokens, honouring the vLLM extras: the
    whole JSON body, or the stream's SSE events."""
    want_ids = bool(body.get("return_token_ids"))
    want_lp = bool(body.get("logprobs"))
    usage = {
        "prompt_tokens": len(PROMPT_IDS),
        "completion_tokens": STREAM_TOKENS,
        "total_tokens": len(PROMPT_IDS) + STREAM_TOKENS,
    }
    base = {"id": "chatcmpl-bench", "created": 1, "model": body["model"]}
    if not body.get("stream"):
        payload = {
            **base,
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x" * 16},
                    "logprobs": _fake_logprobs(True, STREAM_TOKENS) if want_lp else None,
                    "finish_reason": "length",
                    "token_ids": list(range(100, 100 + STREAM_TOKENS)) if want_ids else None,
                }
            ],
            "usage": usage,
            "prompt_token_ids": PROMPT_IDS if want_ids else None,
        }
        return json.dumps(payload, separators=(",", ":")).encode()

    def event(obj: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    first = {
        **base,
        "object": "chat.completion.chunk",
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "prompt_token_ids": PROMPT_IDS if want_ids else None,
    }
    events = [event(first)]
    for i in range(STREAM_TOKENS):
        last = i == STREAM_TOKENS - 1
        chunk = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [
                {
                    "index": 0,
                    "delta": {"content": "x"},
                    "logprobs": _fake_logprobs(True, 1) if want_lp else None,
                    "finish_reason": "length" if last else None,
                    "token_ids": [100 + i] if want_ids else None,
                }
            ],
        }
        events.append(event(chunk))
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append(
            event({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        )
    events.append(b"data: [DONE]\n\n")
    return events


ANSWERS = web.AppKey("answers", dict)
PACE_S = web.AppKey("pace_s", float)


async def fake_chat(request: web.Request) -> web.StreamResponse:
    """Answers are serialised once per request shape and then replayed: the upstream is
    equally fast whether or not the proxy asked for logprobs and token ids, so olp's
    capture-on and capture-off rows read the upstream's answer at the same pace."""
    body = await request.json()
    key = json.dumps(body, sort_keys=True)
    answers = request.app[ANSWERS]
    if key not in answers:
        answers[key] = fake_chat_answer(body)
    answer = answers[key]
    if isinstance(answer, bytes):
        return web.Response(body=answer, content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    pace_s = request.app[PACE_S]
    for i, event in enumerate(answer):
        if pace_s and 0 < i <= STREAM_TOKENS:
            # One token at a time, the way a model server streams; like vLLM, the usage chunk
            # and [DONE] follow the last token at once (they come from no engine step).
            await asyncio.sleep(pace_s)
        await response.write(event)
    await response.write_eof()
    return response


async def fake_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "base", "object": "model"}]})


def serve_fake_upstream(port: int, pace_ms: float = 0.0) -> None:
    app = web.Application()
    app[ANSWERS] = {}
    app[PACE_S] = pace_ms / 1000
    app.router.add_post("/v1/chat/completions", fake_chat)
    app.router.add_get("/v1/models", fake_models)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# ------------------------------------------------------------------ thinnest pass-through
def serve_passthrough(port: int, upstream: str, event_loop: str = "auto") -> None:
    """The floor of any aiohttp gateway: read the body, POST it on, stream the bytes back;
    on the event loop `event_loop` names, as olp's `proxy.event_loop` does."""
    sys.path.insert(0, str(ROOT))
    from proxy.event_loop import loop_factory

    factory = loop_factory(event_loop)  # type: ignore[arg-type]

    async def start(app: web.Application) -> None:
        app["session"] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256), auto_decompress=False
        )

    async def stop(app: web.Application) -> None:
        await app["session"].close()

    async def relay(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with request.app["session"].post(
            upstream + request.path, data=body, headers={"Content-Type": "application/json"}
        ) as up:
            response = web.StreamResponse(
                status=up.status, headers={"Content-Type": up.content_type}
            )
            await response.prepare(request)
            async for data in up.content.iter_any():
                await response.write(data)
            await response.write_eof()
            return response

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", relay)
    loop = factory() if factory is not None else asyncio.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, loop=loop)


# ------------------------------------------------------------------ olp
class CountingSink:
    """Takes captures like KafkaSinkProcess does and drops them: the proxy process's own
    capture cost, without a worker process competing for the cores."""

    def __init__(self) -> None:
        self.trajectories = 0

    def build_records_with(self, build: Any, on_outcome: Any, on_failures: Any) -> None:
        pass

    def put_capture(self, capture: Any, status: str) -> None:
        self.trajectories += 1

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self.trajectories += 1

    def put_feedback(self, event: dict[str, Any]) -> None:
        pass

    async def aclose(self) -> None:
        pass


def serve_olp(
    port: int,
    upstream: str,
    state_dir: Path,
    sink_kind: str,
    bootstrap: str | None,
    topic_prefix: str,
    python_strip: bool = False,
    gc_default: bool = False,
    sink_near_loop: bool = False,
) -> None:
    sys.path.insert(0, str(ROOT))
    if python_strip:  # the bench's side-by-side baseline for the C pass, not a product switch
        from proxy import relay

        relay._sse_strip = None
        relay.SSE_STRIP = "python"

    from deploy.logs import configure_logging
    from proxy.config import GcTuning, ProxyConfig, TenantConfig
    from proxy.event_loop import run_with_loop
    from proxy.server import serve_proxy
    from replay.config import StreamConfig
    from replay.producer import KafkaSink

    # Warnings and errors only, in the product's JSON lines, in the proxy and in its sink
    # worker alike (the worker is a spawned process: it gets the set-up passed along).
    log_setup = functools.partial(configure_logging, "json", "WARNING")
    log_setup()
    config = ProxyConfig(
        port=port,
        upstreams=[upstream],
        sink="jsonl" if sink_kind == "jsonl" else "kafka",
        base_model_aliases=["base"],
        # The bench's baseline for the proxy's GC settings: the interpreter's defaults.
        gc=GcTuning(freeze_after_start=False, young_threshold=0) if gc_default else GcTuning(),
    )
    stream = StreamConfig(
        bootstrap_servers=bootstrap or "127.0.0.1:9092",
        topic_prefix=topic_prefix,
        sink_avoids_loop_cpu=not sink_near_loop,  # bench_capture_cpu.py's baseline
    )
    tenants = [
        TenantConfig(
            name="on",
            api_key="key-on",
            training_enabled=True,
            requests_per_minute=0,
            max_concurrent=0,
        ),
        TenantConfig(
            name="off",
            api_key="key-off",
            training_enabled=False,
            requests_per_minute=0,
            max_concurrent=0,
        ),
    ]
    sink: Any = None  # "kafka-process" / "jsonl": the sink the proxy's config names (make_sink)
    if sink_kind == "none":
        sink = CountingSink()
    elif sink_kind == "kafka":  # the in-process KafkaSink, named explicitly
        sink = KafkaSink(stream, state_dir)
    run_with_loop(  # as `run_proxy` does: on `proxy.event_loop` (auto: uvloop)
        config.event_loop,
        serve_proxy(
            config,
            tenants,
            state_dir,
            stream=stream,
            sink=sink,
            owns_process=True,
            sink_child_init=log_setup,
        ),
    )


# ------------------------------------------------------------------ load and measurement
@dataclass
class Target:
    name: str
    url: str
    key: str
    model: str
    proc: subprocess.Popen | None
    # Stopped (SIGSTOP to its process group) except while its own requests run: LiteLLM's
    # proxy idles at about half a core on this machine (2.7 s of CPU in 5 s, measured
    # 2026-12-02), which every other row shared the two cores with.
    suspended: bool = False
    # Requests it answered, warm-ups and those outside a CPU window included: each of
    # olp-on's leaves a record, which the report looks for at the broker.
    issued: int = 0


def set_running(target: Target, running: bool) -> None:
    """Resume or stop a suspended target's whole process group (its workers too)."""
    if target.suspended and target.proc is not None:
        os.killpg(target.proc.pid, signal.SIGCONT if running else signal.SIGSTOP)


def _task_cpu_seconds(pid: int) -> float:
    """CPU time of a process's live threads in nanosecond resolution (/proc/*/schedstat);
    /proc/*/stat counts in 10 ms ticks, too coarse for a fraction of a millisecond per
    request. Falls back to the ticks where schedstat is missing."""
    total = 0.0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                total += int(handle.read().split()[0]) / 1e9
        return total
    except (OSError, ValueError, IndexError):
        raw = Path(f"/proc/{pid}/stat").read_text()
        fields = raw[raw.rindex(")") + 2 :].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time of a process alone, and of it with all its descendants."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry))
    own, total, todo = 0.0, 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            used = _task_cpu_seconds(current)
        except OSError:
            used = 0.0
        own = used if current == pid else own
        total += used
        todo.extend(children.get(current, []))
    return own, total


async def one_request(session: aiohttp.ClientSession, target: Target, stream: bool) -> float:
    body = {
        "model": target.model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": STREAM_TOKENS,
        "stream": stream,
    }
    started = time.perf_counter()
    async with session.post(
        target.url + "/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {target.key}"},
    ) as response:
        data = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{target.name}: HTTP {response.status}: {data[:300]!r}")
        if stream and not data.rstrip().endswith(b"data: [DONE]"):
            raise RuntimeError(f"{target.name}: stream did not end with [DONE]")
    return time.perf_counter() - started


# A steady CPU window opens after LEAD_PAST_WAIT_S past the sink's batch wait of load, and
# closes at its last counted response, no sooner than WINDOW_WAITS batch waits after it
# opened, while the load runs on. The sink's worker builds and sends what it received once
# a second (stream.sink_batch_wait_s): a window of a fraction of a second that started and
# ended with the load saw the worker's burst after it, on idle cores, and neither the
# burst's CPU nor its drag on the proxy's event loop; one inside a running load but shorter
# than the wait held a burst in some rounds and none in the others, and the median round
# had none. A window of two waits inside a running load holds two or three, overlapping
# requests as in production. (Before the worker's wait, the window ran 0.5 s past the last
# response instead, for the same reason at a 0.1 s tick.)
LEAD_PAST_WAIT_S = 0.5
WINDOW_WAITS = 2


def steady_window() -> tuple[float, float]:
    """(seconds of uncounted load first, shortest window) for the sink's default wait."""
    from replay.config import StreamConfig

    wait = StreamConfig().sink_batch_wait_s
    return wait + LEAD_PAST_WAIT_S, WINDOW_WAITS * wait


async def run_load(
    target: Target, stream: bool, concurrency: int, requests: int, steady: bool = False
) -> dict:
    set_running(target, True)
    try:
        lead_s, min_window_s = steady_window() if steady else (0.0, 0.0)
        return await _run_load(target, stream, concurrency, requests, lead_s, min_window_s)
    finally:
        set_running(target, False)


async def _run_load(
    target: Target,
    stream: bool,
    concurrency: int,
    requests: int,
    lead_s: float,
    min_window_s: float,
) -> dict:
    """At least `requests` responses, and at least `min_window_s` seconds of them, counted
    after 20 warm-up requests and `lead_s` seconds of uncounted load; the CPU is read where
    the count starts and where it ends."""
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):
            await one_request(session, target, stream)
            target.issued += 1
        latencies: list[float] = []
        window, done = asyncio.Event(), asyncio.Event()
        marks: dict[str, Any] = {}

        def cpu_now() -> tuple[float, float]:
            return cpu_seconds(target.proc.pid) if target.proc else (0.0, 0.0)

        async def opener() -> None:
            await asyncio.sleep(lead_s)
            marks["cpu_before"], marks["started"] = cpu_now(), time.perf_counter()
            window.set()

        async def worker() -> None:
            while not done.is_set():
                latency = await one_request(session, target, stream)
                target.issued += 1
                if window.is_set() and not done.is_set():
                    latencies.append(latency)
                    now = time.perf_counter()
                    if len(latencies) >= requests and now - marks["started"] >= min_window_s:
                        marks["cpu_after"], marks["ended"] = cpu_now(), now
                        done.set()

        await asyncio.gather(opener(), *(worker() for _ in range(concurrency)))
    cpu_before, cpu_after = marks["cpu_before"], marks["cpu_after"]
    counted = len(latencies)
    latencies.sort()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": nearest_rank(latencies, 0.99) * 1000,
        "rps": counted / (marks["ended"] - marks["started"]),
        "cpu_ms": (cpu_after[0] - cpu_before[0]) * 1000 / counted if target.proc else None,
        "cpu_total_ms": (cpu_after[1] - cpu_before[1]) * 1000 / counted if target.proc else None,
    }


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def spawn(
    args: list[str], log: Path, env: dict[str, str] | None = None, own_group: bool = False
) -> subprocess.Popen:
    handle = open(log, "wb")  # noqa: SIM115 - lives as long as the child
    return subprocess.Popen(
        args,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=own_group,
    )


def start_litellm(binary: str, upstream: str, workdir: Path) -> Target:
    port = free_port()
    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        "  - model_name: base\n"
        "    litellm_params:\n"
        "      model: openai/base\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: unused\n"
        "general_settings:\n"
        "  master_key: sk-bench\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
    )
    proc = spawn(
        [
            binary,
            "--config",
            str(config),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--num_workers",
            "1",
        ],
        workdir / "litellm.log",
        env={"LITELLM_LOG": "ERROR", "DISABLE_SCHEMA_UPDATE": "true"},
        own_group=True,
    )
    wait_ready(f"http://127.0.0.1:{port}/health/liveliness", proc, timeout_s=180)
    target = Target("litellm", f"http://127.0.0.1:{port}", "sk-bench", "base", proc, True)
    set_running(target, False)
    return target


def count_records(bootstrap: str, topic: str) -> int:
    """Trajectories that reached the broker (all partitions of `topic`)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not partitions:
            return 0
        consumer.assign(partitions)
        consumer.seek_to_beginning()
        count, idle = 0, 0
        while idle < 3:
            batch = consumer.poll(timeout_ms=500)
            got = sum(len(records) for records in batch.values())
            count += got
            idle = 0 if got else idle + 1
        return count
    finally:
        consumer.close()


def captures_skipped(url: str) -> int:
    """Requests a proxy served without capturing them (`olp_proxy_captures_skipped_total`, all
    reasons): under sustained load the sink's worker may fall behind and the proxy pauses
    capture at its backlog limit, so fewer records than captured requests is not a loss."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return int(
        sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == "olp_proxy_captures_skipped"
            for sample in family.samples
            if sample.name.endswith("_total")
        )
    )


def count_spilled(directory: Path) -> int:
    """Records in the spill segments under `directory` (read without touching them)."""
    from replay.spill import read_segment

    return sum(len(read_segment(path)) for path in sorted(directory.glob("seg-*.spill")))


def litellm_requests(requests: int) -> int:
    """LiteLLM's rows are shorter: at 30-60 requests a second a full row took minutes."""
    return max(100, requests // 4)


def ratio(a: float | None, b: float | None) -> str:
    """a / b, or n/a where b is not above 0 (an added latency can be: a negative floor
    printed -25.00, which read as meeting a ≤ 1.5 target, and 0 raised)."""
    return "n/a" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", nargs="?", default="bench")
    parser.add_argument("--port", type=int)
    parser.add_argument("--upstream")
    parser.add_argument("--state")
    parser.add_argument(
        "--sink", default="kafka", choices=["kafka", "kafka-process", "jsonl", "none"]
    )
    parser.add_argument("--bootstrap")
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=None,
        help="pause before each token event: the paced upstream's (bench: default 1, 0 = no "
        "paced rows; serve-upstream: default 0)",
    )
    parser.add_argument("--topic-prefix", default="bench")
    parser.add_argument(
        "--python-strip", action="store_true", help="serve-olp: strip in Python, not C"
    )
    parser.add_argument(
        "--event-loop",
        default="auto",
        choices=["auto", "asyncio"],
        help="serve-passthrough: its event loop (auto: uvloop where installed, as olp's)",
    )
    parser.add_argument(
        "--gc-default", action="store_true", help="serve-olp: the interpreter's GC settings"
    )
    parser.add_argument(
        "--sink-near-loop",
        action="store_true",
        help="serve-olp: the sink's worker may run on the event loop's CPU",
    )
    parser.add_argument("--gc-rounds", type=int, default=5, help="rounds of the GC p99 table")
    parser.add_argument("--gc-requests", type=int, default=1000, help="requests per GC round")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument(
        "--cpu-rounds", type=int, default=5, help="alternating rounds for the ratio targets"
    )
    parser.add_argument("--cpu-requests", type=int, default=300, help="requests per round")
    parser.add_argument(
        "--sustained-rounds", type=int, default=2, help="alternating rounds of sustained load"
    )
    parser.add_argument(
        "--sustained-requests", type=int, default=10000, help="requests per sustained round"
    )
    parser.add_argument("--paced-rounds", type=int, default=5)
    parser.add_argument("--paced-requests", type=int, default=200)
    parser.add_argument(
        "--ir-rounds",
        type=int,
        default=2,
        help="alternating rounds per row of the instruction counts (valgrind; 0 = none)",
    )
    parser.add_argument("--ir-requests", type=int, default=200, help="requests per such round")
    parser.add_argument(
        "--interleave-cycles",
        type=int,
        default=150,
        help="cycles of the interleaved added-latency table (0 = none)",
    )
    parser.add_argument("--litellm", default=None, help="path of the litellm console script")
    parser.add_argument("--out", default=str(ROOT / "docs" / "perf" / "proxy.md"))
    args = parser.parse_args()
    if args.mode == "serve-upstream":
        return serve_fake_upstream(args.port, args.pace_ms or 0.0)
    if args.mode == "serve-passthrough":
        return serve_passthrough(args.port, args.upstream, args.event_loop)
    if args.mode == "serve-olp":
        return serve_olp(
            args.port,
            args.upstream,
            Path(args.state),
            args.sink,
            args.bootstrap,
            args.topic_prefix,
            args.python_strip,
            args.gc_default,
            args.sink_near_loop,
        )
    run_bench(args)


def run_bench(args: argparse.Namespace) -> None:
    # A SIGTERM (timeout, kill) unwinds through the `finally` below, which stops the
    # servers it started; by default it ended the bench and left them all running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.pace_ms is None:
        args.pace_ms = 1.0
    workdir = Path(tempfile.mkdtemp(prefix="olp-bench-proxy-"))
    me = [sys.executable, str(Path(__file__).resolve())]
    procs: list[subprocess.Popen] = []
    sys.path.insert(0, str(ROOT))
    from deploy.broker import start_broker

    broker = start_broker("127.0.0.1", free_port(), workdir / "broker.log")
    try:
        up_port = free_port()
        upstream_url = f"http://127.0.0.1:{up_port}"
        upstream = spawn([*me, "serve-upstream", "--port", str(up_port)], workdir / "up.log")
        procs.append(upstream)
        wait_ready(upstream_url + "/v1/models", upstream)
        paced_url = ""
        if args.pace_ms > 0:
            paced_port = free_port()
            paced_url = f"http://127.0.0.1:{paced_port}"
            paced = spawn(
                [*me, "serve-upstream", "--port", str(paced_port), "--pace-ms", str(args.pace_ms)],
                workdir / "up-paced.log",
            )
            procs.append(paced)
            wait_ready(paced_url + "/v1/models", paced)
        pt_port = free_port()
        passthrough = spawn(
            [*me, "serve-passthrough", "--port", str(pt_port), "--upstream", upstream_url],
            workdir / "pt.log",
        )
        procs.append(passthrough)
        pt_asyncio_port = free_port()
        command = [*me, "serve-passthrough", "--port", str(pt_asyncio_port)]
        command += ["--upstream", upstream_url, "--event-loop", "asyncio"]
        passthrough_asyncio = spawn(command, workdir / "pt-asyncio.log")
        procs.append(passthrough_asyncio)
        closed_port = free_port()  # nothing listens there: the "broker down" rows
        olps: dict[str, tuple[str, subprocess.Popen]] = {}
        olp_rows = [
            ("process", "kafka-process", broker.bootstrap, upstream_url),
            ("process-pystrip", "kafka-process", broker.bootstrap, upstream_url),
            ("process-gcdefault", "kafka-process", broker.bootstrap, upstream_url),
            ("thread", "kafka", broker.bootstrap, upstream_url),
            ("nosink", "none", None, upstream_url),
            ("process-down", "kafka-process", f"127.0.0.1:{closed_port}", upstream_url),
            ("thread-down", "kafka", f"127.0.0.1:{closed_port}", upstream_url),
        ]
        if paced_url:
            olp_rows += [
                ("paced", "kafka-process", broker.bootstrap, paced_url),
                ("paced-pystrip", "kafka-process", broker.bootstrap, paced_url),
                ("paced-nosink", "none", None, paced_url),
            ]
        for name, sink, bootstrap, upstream in olp_rows:
            port = free_port()
            command = [*me, "serve-olp", "--port", str(port), "--upstream", upstream]
            command += ["--state", str(workdir / f"state-{name}"), "--sink", sink]
            command += ["--topic-prefix", f"bench-{name}"]
            if bootstrap:
                command += ["--bootstrap", bootstrap]
            if name.endswith("-pystrip"):
                command += ["--python-strip"]
            if name.endswith("-gcdefault"):
                command += ["--gc-default"]
            proc = spawn(command, workdir / f"olp-{name}.log")
            procs.append(proc)
            olps[name] = (f"http://127.0.0.1:{port}", proc)
        for url, proc in olps.values():
            wait_ready(url + "/healthz", proc)
        time.sleep(1.0)

        def olp_target(target: str, name: str, key: str = "key-on") -> Target:
            return Target(target, olps[name][0], key, "base", olps[name][1])

        targets = [
            Target("direct", upstream_url, "unused", "base", None),
            Target("passthrough", f"http://127.0.0.1:{pt_port}", "unused", "base", passthrough),
            Target(
                "passthrough-asyncio",
                f"http://127.0.0.1:{pt_asyncio_port}",
                "unused",
                "base",
                passthrough_asyncio,
            ),
            olp_target("olp-off", "process", "key-off"),
            olp_target("olp-on", "process"),
            olp_target("olp-on-thread", "thread"),
            olp_target("olp-on-nosink", "nosink"),
            olp_target("olp-on-pystrip", "process-pystrip"),
            olp_target("olp-on-gcdefault", "process-gcdefault"),
            olp_target("olp-on-down", "process-down"),
            olp_target("olp-on-thread-down", "thread-down"),
        ]
        litellm_note = ""
        binary = (
            args.litellm
            or shutil.which("litellm")
            or str(Path.home() / ".cache/olp/bench-venvs/litellm/bin/litellm")
        )
        if Path(binary).exists():
            try:
                target = start_litellm(binary, upstream_url, workdir)
                procs.append(target.proc)
                targets.append(target)
            except RuntimeError as exc:
                litellm_note = f"LiteLLM did not start: {exc} (log {workdir}/litellm.log)"
        else:
            litellm_note = f"LiteLLM not installed at {binary}; its rows are missing."
        if litellm_note:
            print(litellm_note, file=sys.stderr)
        by_name = {t.name: t for t in targets}
        results: dict[tuple[str, bool, int], dict] = {}
        for stream in (False, True):
            for concurrency in (1, 16):
                for target in targets:
                    count = (
                        args.requests
                        if target.name != "litellm"
                        else litellm_requests(args.requests)
                    )
                    # In a steady window: the worker's share falls in the
                    # window at its steady rate, not after it or in the next row's.
                    results[(target.name, stream, concurrency)] = asyncio.run(
                        run_load(target, stream, concurrency, count, steady=True)
                    )
                    r = results[(target.name, stream, concurrency)]
                    print(
                        f"{target.name:18s} stream={stream!s:5s} c={concurrency:2d} "
                        f"p50={r['p50_ms']:.2f}ms p99={r['p99_ms']:.2f}ms "
                        f"rps={r['rps']:.0f} cpu/req={r['cpu_ms'] or 0:.2f}ms "
                        f"total={r['cpu_total_ms'] or 0:.2f}ms",
                        flush=True,
                    )
        rounds = alternating_rounds(by_name, args.cpu_rounds, args.cpu_requests)
        interleaved = (
            interleaved_rounds(by_name, args.interleave_cycles)
            if args.interleave_cycles > 0
            else None
        )
        sustained = (
            sustained_rounds(by_name, args.sustained_rounds, args.sustained_requests)
            if args.sustained_rounds > 0
            else None
        )
        gc_table = (
            gc_rounds(
                by_name["olp-on"],
                by_name["olp-on-gcdefault"],
                args.gc_rounds,
                args.gc_requests,
            )
            if args.gc_rounds > 0
            else None
        )
        paced_rounds: dict = {}
        if paced_url and args.paced_rounds > 0:
            paced_targets = {
                "olp-off": olp_target("olp-off", "paced", "key-off"),
                "olp-on": olp_target("olp-on", "paced"),
                "olp-on-nosink": olp_target("olp-on-nosink", "paced-nosink"),
                "olp-on-pystrip": olp_target("olp-on-pystrip", "paced-pystrip"),
            }
            print(f"paced upstream ({args.pace_ms} ms between events):", flush=True)
            paced_rounds = alternating_rounds(
                paced_targets, args.paced_rounds, args.paced_requests, (True,), CPU_TARGETS
            )
        instructions: dict = {}
        if args.ir_rounds > 0:
            instructions = instruction_rounds(
                me, workdir, upstream_url, broker.bootstrap, args.ir_rounds, args.ir_requests
            )
        time.sleep(3.0)  # let the sinks finish their last records
        counts = {
            "process": count_records(broker.bootstrap, "bench-process.trajectories"),
            "thread": count_records(broker.bootstrap, "bench-thread.trajectories"),
            "process-down": count_spilled(workdir / "state-process-down" / "spill"),
            "thread-down": count_spilled(workdir / "state-thread-down" / "spill"),
            "process-skipped": captures_skipped(by_name["olp-on"].url),
            "thread-skipped": captures_skipped(by_name["olp-on-thread"].url),
        }
        print(f"records: {counts}", flush=True)
        report = render(
            results,
            [t.name for t in targets],
            args.requests,
            counts,
            litellm_note,
            # The records each sink should hold: one per request its target answered (the
            # interleaved table's own loop counts olp-on's apart).
            expected={
                "process": by_name["olp-on"].issued
                + interleaved_olp_on_requests(args.interleave_cycles),
                "thread": by_name["olp-on-thread"].issued,
                "process-down": by_name["olp-on-down"].issued,
                "thread-down": by_name["olp-on-thread-down"].issued,
            },
        )
        report += render_rounds(rounds, args.cpu_rounds, args.cpu_requests)
        if interleaved is not None:
            report += render_interleaved(interleaved, args.interleave_cycles)
        if sustained is not None:
            report += render_sustained(sustained, args.sustained_rounds, args.sustained_requests)
        if gc_table is not None:
            report += render_gc(gc_table, args.gc_rounds, args.gc_requests)
        if paced_rounds:
            report += render_paced(paced_rounds, args)
        if instructions:
            report += render_instructions(instructions, args.ir_rounds, args.ir_requests)
        print(report)
        write_generated(Path(args.out), report, "bench_proxy.py")
    finally:
        broker.stop()
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(proc.pid) == proc.pid:  # a group it may have stopped: resume it
                    os.killpg(proc.pid, signal.SIGCONT)
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------ instruction counts
def _callgrind_totals(path: Path) -> int:
    for line in path.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"{path}: no totals line")


def instruction_rounds(
    me: list[str], workdir: Path, upstream: str, bootstrap: str, rounds: int, requests: int
) -> dict:
    """Instructions the proxy process executes per request, training off and on, counted by
    valgrind's callgrind: the same count for the same code and inputs whatever else the
    machine does, where CPU time per request drifts by more than the 10 % under test. The
    process is one olp-on proxy under callgrind with counting switched on only for each
    round (its sink worker is a spawned process, which runs natively and is not counted,
    as in the CPU figures' "CPU proxy"). {} with a note when valgrind is missing."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind not installed: no instruction counts", file=sys.stderr)
        return {}
    port = free_port()
    out_dir = workdir / "callgrind"
    out_dir.mkdir()
    command = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
    command += [f"--callgrind-out-file={out_dir}/cg.%p.out", *me, "serve-olp"]
    command += ["--port", str(port), "--upstream", upstream, "--sink", "kafka-process"]
    command += ["--state", str(workdir / "state-callgrind"), "--bootstrap", bootstrap]
    command += ["--topic-prefix", "bench-callgrind"]
    proc = spawn(command, workdir / "olp-callgrind.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/healthz", proc, timeout_s=600)
        pid = str(proc.pid)

        def control(*flags: str) -> None:
            subprocess.run(["callgrind_control", *flags, pid], check=True, capture_output=True)

        targets = {key: Target(key, url, f"key-{key}", "base", proc) for key in ("off", "on")}
        out: dict[tuple[bool, int], dict[str, list[float]]] = {}
        dumps = 0
        for stream in (False, True):
            for concurrency in (1, 16):
                counts: dict[str, list[float]] = {"off": [], "on": []}
                for round_ in range(rounds):
                    for key in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                        asyncio.run(run_load(targets[key], stream, concurrency, 20))  # warm
                        control("--zero")
                        control("--instr=on")
                        issued = targets[key].issued
                        asyncio.run(run_load(targets[key], stream, concurrency, requests))
                        time.sleep(1.5)  # the sink's feeder thread takes this round's captures
                        control("--instr=off")
                        control("--dump")
                        dumps += 1
                        dump = next(out_dir.glob(f"cg.{pid}.out.{dumps}"))
                        # Every request the window held: run_load's 20 warm-up requests,
                        # and at c=16 those still running when it counted its last.
                        counts[key].append(_callgrind_totals(dump) / (targets[key].issued - issued))
                out[(stream, concurrency)] = counts
                off = statistics.median(counts["off"])
                on = statistics.median(counts["on"])
                print(
                    f"instructions stream={stream!s:5s} c={concurrency:2d}: off {off / 1e3:.1f}k "
                    f"on {on / 1e3:.1f}k per request, on/off {on / off:.3f}",
                    flush=True,
                )
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def render_instructions(table: dict, rounds: int, requests: int) -> str:
    lines = [
        "",
        "### Capture cost in instructions (callgrind)",
        "",
        "Instructions the proxy process executed per request (its threads, the sink's feeder "
        "included; not the sink's worker process), counted by valgrind's callgrind on one "
        f"olp proxy: {rounds} alternating rounds of {requests} + 20 requests per row, training "
        "off and on. A count does not drift with the machine's "
        "load as CPU time does (two rounds of a row differ by a few tenths of a percent, "
        "where the CPU rounds above differ by tens of percent), so it settles the capture "
        "target (on ≤ 1.1× off) where they cannot; it leaves out what instructions do not "
        "show (cache misses, the kernel's share of a system call).",
        "",
        "| stream | conc | off instructions/req | on instructions/req | on/off | rounds on/off |",
        "|---|---|---|---|---|---|",
    ]
    for (stream, concurrency), counts in table.items():
        off, on = statistics.median(counts["off"]), statistics.median(counts["on"])
        per_round = ", ".join(
            f"{b / a:.3f}" for a, b in zip(counts["off"], counts["on"], strict=True)
        )
        lines.append(
            f"| {stream} | {concurrency} | {off / 1e3:.1f}k | {on / 1e3:.1f}k | "
            f"{on / off:.3f} | {per_round} |"
        )
    return "\n".join(lines) + "\n"


def print_medians(title: str, group: dict, metric: str, digits: int) -> None:
    """Progress line: each target's median of `metric` (ms) over its rounds."""
    medians = (
        f"{n} {metric}={statistics.median(g[metric]):.{digits}f}ms" for n, g in group.items()
    )
    print(f"{title}: " + " ".join(medians), flush=True)


# ------------------------------------------------------------------ sustained load
SUSTAINED_TARGETS = ("direct", "passthrough", "olp-off", "olp-on")


def sent_trajectories(url: str) -> float:
    """The trajectories the proxy's sink has had acknowledged, from its /metrics (the worker
    reports its counts once a second while busy and at once on becoming idle)."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^olp_stream_sent_total\{kind="trajectory"\} (\S+)$', text, re.M)
    return sum(float(value) for value in found)


def sink_backlog(url: str) -> float:
    """The records the proxy's sink holds that its worker has not reported durable
    (`olp_stream_queue_depth`: the proxy's live count, read at each scrape)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r"^olp_stream_queue_depth (\S+)$", text, re.M)
    return sum(float(value) for value in found)


# The worker's counts reach the proxy's /metrics once a second while it is busy.
_SENT_REFRESH_S = 1.0


def settled_sent_trajectories(url: str, timeout_s: float = 120.0) -> float:
    """`sent_trajectories` once the sink holds nothing unreported and the count has not
    moved for longer than the worker takes to report it. A count that merely held still for
    0.3 s could be read while the busy (or starved) worker still had thousands of older
    records to send: they then counted towards the next round, whose catch-up read short."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        now = sent_trajectories(url)
        if now == last and sink_backlog(url) == 0:
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(f"olp-on's sink did not settle in {timeout_s:g} s")
        last = now
        time.sleep(_SENT_REFRESH_S + 0.2)


def sustained_rounds(targets: dict[str, Target], rounds: int, requests: int) -> dict:
    """Added p50 at 16 concurrent requests held for seconds, not a fraction of one: the
    sink's worker runs at idle priority and may fall behind while the cores are busy, which a
    short round followed by a pause would hide. For olp-on also the seconds from its last
    response until the sink had every record of the round acknowledged."""
    out: dict[bool, dict[str, dict[str, list[float]]]] = {}
    for stream in (False, True):
        group = {name: {"p50": [], "rps": [], "catch_up": []} for name in SUSTAINED_TARGETS}
        for round_ in range(rounds):
            order = SUSTAINED_TARGETS if round_ % 2 == 0 else SUSTAINED_TARGETS[::-1]
            for name in order:
                target = targets[name]
                before = settled_sent_trajectories(target.url) if name == "olp-on" else 0.0
                skipped = captures_skipped(target.url) if name == "olp-on" else 0
                issued = target.issued
                r = asyncio.run(run_load(target, stream, 16, requests))
                if name == "olp-on":
                    ended = time.perf_counter()
                    # Warm-ups and the tail too, less the requests served without a capture
                    # (the proxy pauses capture at its backlog limit): else one skipped
                    # capture failed the round after 120 s.
                    uncaptured = captures_skipped(target.url) - skipped
                    expected = before + target.issued - issued - uncaptured
                    while sent_trajectories(target.url) < expected:
                        if time.perf_counter() - ended > 120:
                            raise RuntimeError("olp-on's records did not arrive in 120 s")
                        time.sleep(0.02)
                    group[name]["catch_up"].append(time.perf_counter() - ended)
                else:
                    time.sleep(LEAD_PAST_WAIT_S)
                group[name]["p50"].append(r["p50_ms"])
                group[name]["rps"].append(r["rps"])
        out[stream] = group
        print_medians(f"sustained stream={stream!s:5s}", group, "p50", 2)
    return out


def render_sustained(table: dict, rounds: int, requests: int) -> str:
    lines = [
        "",
        "### Sustained load",
        "",
        f"{rounds} alternating rounds of {requests} requests at concurrency 16 (after 20 "
        "warm-up requests), counted from their first request to their last: the sink's worker "
        "runs at idle priority (SCHED_IDLE) and may fall behind while the cores are busy. The "
        "rounds above count inside a running load too (at least 3.5 s each, longer than some "
        "of these rounds), so what this table adds is `catch-up`: seconds from olp-on's last "
        "response until its sink reported every record of the round acknowledged by the "
        "broker (polled every 20 ms; the worker reports within 0.1 s of becoming idle). A "
        "round starts once the proxy's sink holds nothing unreported and its sent count held "
        "for over a second (the busy worker reports once a second), and waits for the records "
        "of its captured requests only (the proxy pauses capture at its backlog limit: those "
        "are counted on the olp-on line above). Medians over the rounds.",
        "",
        "| stream | direct p50 ms | pass-through added | olp-off added | off / pass-through "
        "| olp-on added | on / pass-through | req/s pass-through, olp-off, olp-on "
        "| olp-on catch-up s per round |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for stream, group in table.items():
        median = {name: statistics.median(g["p50"]) for name, g in group.items()}
        added = {name: median[name] - median["direct"] for name in group}
        rps = ", ".join(
            f"{statistics.median(group[name]['rps']):.0f}"
            for name in ("passthrough", "olp-off", "olp-on")
        )
        catch_up = ", ".join(f"{s:.2f}" for s in group["olp-on"]["catch_up"])
        lines.append(
            f"| {stream} | {median['direct']:.2f} | {added['passthrough']:.2f} | "
            f"{added['olp-off']:.2f} | {ratio(added['olp-off'], added['passthrough'])} | "
            f"{added['olp-on']:.2f} | {ratio(added['olp-on'], added['passthrough'])} | "
            f"{rps} | {catch_up} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ garbage collector
def gc_collections(url: str) -> list[float]:
    """The proxy's python_gc_collections_total per generation, from its /metrics."""
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(r'^python_gc_collections_total\{generation="(\d)"\} (\S+)$', text, re.M)
    return [float(value) for _, value in sorted(found)]


def gc_rounds(tuned: Target, default: Target, rounds: int, requests: int) -> dict:
    """p99 at 16 concurrent requests of the proxy with and without its GC settings, in
    alternating rounds, with the collections each generation ran meanwhile."""
    out: dict[bool, dict[str, dict[str, list[float]]]] = {}
    for stream in (False, True):
        group: dict[str, dict[str, list[float]]] = {}
        for target in (tuned, default):
            group[target.name] = {"p99": [], "cpu": [], "collections": []}
        for round_ in range(rounds):
            for target in (tuned, default) if round_ % 2 == 0 else (default, tuned):
                before = gc_collections(target.url)
                r = asyncio.run(run_load(target, stream, 16, requests, steady=True))
                after = gc_collections(target.url)
                group[target.name]["p99"].append(r["p99_ms"])
                group[target.name]["cpu"].append(r["cpu_ms"] or 0.0)
                group[target.name]["collections"].append(
                    [b - a for a, b in zip(before, after, strict=True)]
                )
        out[stream] = group
        print_medians(f"gc rounds stream={stream!s:5s}", group, "p99", 1)
    return out


def render_gc(table: dict, rounds: int, requests: int) -> str:
    lines = [
        "",
        "### Tail latency and the garbage collector",
        "",
        f"{rounds} alternating rounds of at least {requests} requests at concurrency 16 "
        "(after 20 warm-up requests, in a steady window as in the rounds above): `olp-on` "
        "with the proxy's GC settings (`proxy.gc`), "
        "`olp-on-gcdefault` with the interpreter's. Collections per generation are summed "
        "over the rounds, from each proxy's `python_gc_collections_total`.",
        "",
        "| stream | target | median p99 ms | worst p99 ms | p99 per round | CPU ms/req "
        "| collections gen0/gen1/gen2 |",
        "|---|---|---|---|---|---|---|",
    ]
    for stream, group in table.items():
        for name, g in group.items():
            per_round = ", ".join(f"{p:.1f}" for p in g["p99"])
            gens = [sum(c[i] for c in g["collections"]) for i in range(3)]
            lines.append(
                f"| {stream} | {name} | {statistics.median(g['p99']):.1f} | {max(g['p99']):.1f} "
                f"| {per_round} | {statistics.median(g['cpu']):.3f} | "
                + "/".join(f"{n:.0f}" for n in gens)
                + " |"
            )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ alternating rounds
ROUND_TARGETS = ("direct", "passthrough", "olp-off", "olp-on", "olp-on-nosink", "olp-on-pystrip")
CPU_TARGETS = ("olp-off", "olp-on", "olp-on-nosink", "olp-on-pystrip")


def alternating_rounds(
    targets: dict[str, Target],
    rounds: int,
    requests: int,
    streams: tuple[bool, ...] = (False, True),
    names: tuple[str, ...] = ROUND_TARGETS,
) -> dict:
    """p50 latency and CPU per request of the targets the ratio targets compare, measured
    in alternating rounds.

    The targets are ratios near 1 (capture ≤ 1.1x, relay ≤ 1.5x the pass-through's added
    p50), smaller than the drift between two rows a minute apart on a shared 2-core
    machine; short rounds in alternating order, and medians over them, put every side under
    the same conditions."""
    out: dict[tuple[bool, int], dict[str, dict[str, list[float]]]] = {}
    for stream in streams:
        for concurrency in (1, 16):
            group = {name: {"p50": [], "cpu": [], "total": []} for name in names}
            for round_ in range(rounds):
                order = names if round_ % 2 == 0 else names[::-1]
                for name in order:
                    r = asyncio.run(
                        run_load(targets[name], stream, concurrency, requests, steady=True)
                    )
                    group[name]["p50"].append(r["p50_ms"])
                    group[name]["cpu"].append(r["cpu_ms"] or 0.0)
                    group[name]["total"].append(r["cpu_total_ms"] or 0.0)
            out[(stream, concurrency)] = group
            line = " ".join(f"{n}={statistics.median(group[n]['cpu']):.3f}" for n in CPU_TARGETS)
            print(f"rounds stream={stream!s:5s} c={concurrency:2d}: CPU {line} ms/req", flush=True)
    return out


_CPU_HEADER = [
    "| stream | conc | off ms/req | on ms/req | on/off | nosink ms/req | nosink/off "
    "| on total ms/req (incl. worker) | total on/off | rounds on/off "
    "| Python strip: on ms/req | on/off |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def paired_ratios(numerators: list[float], denominators: list[float]) -> list[float | None]:
    """Each round's own ratio (None where its denominator is not above 0)."""
    return [n / d if d > 0 else None for n, d in zip(numerators, denominators, strict=True)]


def median_ratio(numerators: list[float], denominators: list[float]) -> float | None:
    """The median of the rounds' own ratios: the pairing the alternating rounds exist for.
    The ratio of the two medians took them from different rounds (added p50 on/pass-through
    1.61 where the rounds' own ratios have a median of 1.44)."""
    ratios = [r for r in paired_ratios(numerators, denominators) if r is not None]
    return statistics.median(ratios) if ratios else None


def shown(value: float | None, digits: int = 3) -> str:
    """A ratio as the tables print it; a target's verdict reads 3 decimals (at 2, 1.1001
    printed as 1.10, a miss of the ≤ 1.1 target that read as met)."""
    return "n/a" if value is None else f"{value:.{digits}f}"


def _cpu_rows(rounds: dict) -> list[str]:
    lines = []
    for (stream, concurrency), group in rounds.items():
        med = {n: statistics.median(group[n]["cpu"]) for n in CPU_TARGETS}
        total_on = statistics.median(group["olp-on"]["total"])
        off = group["olp-off"]["cpu"]
        per_round = ", ".join(shown(r, 2) for r in paired_ratios(group["olp-on"]["cpu"], off))
        lines.append(
            f"| {stream} | {concurrency} | {med['olp-off']:.3f} | {med['olp-on']:.3f} | "
            f"{shown(median_ratio(group['olp-on']['cpu'], off))} | "
            f"{med['olp-on-nosink']:.3f} | "
            f"{shown(median_ratio(group['olp-on-nosink']['cpu'], off))} | {total_on:.3f} | "
            f"{shown(median_ratio(group['olp-on']['total'], group['olp-off']['total']))} | "
            f"{per_round} | {med['olp-on-pystrip']:.3f} | "
            f"{shown(median_ratio(group['olp-on-pystrip']['cpu'], off))} |"
        )
    return lines


def render_paced(rounds: dict, args: argparse.Namespace) -> str:
    lines = [
        "",
        f"### Capture CPU with a paced upstream ({args.pace_ms:g} ms between token events)",
        "",
        "A model server streams one token per engine step, so each event reaches the proxy "
        "in a read of its own; the fast upstream above sends a whole answer at once (a few "
        "reads per answer). As vLLM does, the paced upstream sends the usage chunk (when "
        "asked) and `[DONE]` right after the last token. Same 16-token answers; olp-off / "
        "olp-on / olp-on-nosink / olp-on-pystrip as above, "
        f"{args.paced_rounds} alternating rounds of at least {args.paced_requests} requests.",
        "",
        *_CPU_HEADER,
        *_cpu_rows(rounds),
        "",
    ]
    return "\n".join(lines)


def render_rounds(rounds: dict, count: int, requests: int) -> str:
    lead, window = steady_window()
    lines = [
        "",
        "### The ratio targets, in alternating rounds",
        "",
        f"{count} rounds of at least {requests} requests (after 20 warm-up requests) per "
        "target and "
        "row, the targets' order reversed every other round; medians over the rounds. A "
        "ratio is the median of the rounds' own ratios (each round's targets ran seconds "
        "apart, so the machine's drift falls on both; before 2026-12-05 the tables divided "
        "the two medians, taken from different rounds). A "
        f"round's CPU window opens after {lead:g} s of its load and closes at its "
        f"{requests}th counted response, or {window:g} s after it opened if that is later, "
        "while the load runs on, so the sink worker's bursts (it builds and sends what it "
        "received once a second, `stream.sink_batch_wait_s`) fall in it at their steady "
        "rate, two or three of them, overlapping requests as in production, not after it on "
        "idle cores (before 2026-12-05 14:00 the window closed 0.5 s after the last "
        "response, and the worker sent every 0.1 s). "
        "`olp-off` and "
        "`olp-on` are the same proxy (tenants with training off and on), its "
        "KafkaSinkProcess worker building, checking, redacting, validating, encoding and "
        "sending the records; `olp-on-nosink` is a proxy whose sink takes the captures and "
        "drops them (the proxy process's own capture work, with no worker using the cores); "
        "`olp-on-pystrip` is olp-on with the Python strip in place of its C pass "
        "(proxy/_sse_strip.c), the baseline for what the C pass saves.",
        "",
        "Capture CPU per request (target: on ≤ 1.1× off; rounds seconds apart drift by more "
        "than that on a small VM: bench_capture_cpu.py measures it in alternating "
        "quarter-second segments, docs/perf/capture_cpu.md):",
        "",
        *_CPU_HEADER,
    ]
    lines += _cpu_rows(rounds)
    lines += [
        "",
        "Added p50 latency (p50 minus direct's p50 in the same round; target: olp ≤ 1.5× the "
        "pass-through's):",
        "",
        "| stream | conc | direct p50 ms | pass-through added | olp-off added | off / pass-through "
        "| olp-on added | on / pass-through | rounds off / pass-through "
        "| rounds on / pass-through | CPU ms/req pass-through, olp-off | CPU off / pass-through |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (stream, concurrency), group in rounds.items():
        direct = group["direct"]["p50"]

        def added_per_round(name: str, group: dict = group, direct: list = direct) -> list[float]:
            return [p50 - d for p50, d in zip(group[name]["p50"], direct, strict=True)]

        floor, off, on = (
            statistics.median(added_per_round(name))
            for name in ("passthrough", "olp-off", "olp-on")
        )

        def per_round(name: str) -> str:
            ratios = paired_ratios(added_per_round(name), added_per_round("passthrough"))
            return ", ".join(shown(r, 2) for r in ratios)

        def ratio_of(name: str) -> str:
            return shown(median_ratio(added_per_round(name), added_per_round("passthrough")))

        cpu_floor = statistics.median(group["passthrough"]["cpu"])
        cpu_off = statistics.median(group["olp-off"]["cpu"])
        cpu_ratio = median_ratio(group["olp-off"]["cpu"], group["passthrough"]["cpu"])
        lines.append(
            f"| {stream} | {concurrency} | {statistics.median(direct):.2f} | {floor:.2f} | "
            f"{off:.2f} | {ratio_of('olp-off')} | {on:.2f} | {ratio_of('olp-on')} | "
            f"{per_round('olp-off')} | {per_round('olp-on')} | "
            f"{cpu_floor:.3f}, {cpu_off:.3f} | {shown(cpu_ratio)} |"
        )
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ interleaved segments
INTERLEAVED_TARGETS = ("direct", "passthrough", "olp-off", "olp-on")
# Requests per target and cycle: at c=1 a segment keeps the connection and the processes
# warm as a run of requests does; at c=16 each of the 16 workers sends four.
SEGMENT = {1: 20, 16: 64}
INTERLEAVE_WARMUP = 20


def interleaved_olp_on_requests(cycles: int) -> int:
    """olp-on's requests in the interleaved table (its records are counted at the broker)."""
    if cycles <= 0:
        return 0
    return 2 * sum(INTERLEAVE_WARMUP + cycles * segment for segment in SEGMENT.values())


async def _interleaved_row(
    targets: list[Target], stream: bool, concurrency: int, cycles: int
) -> dict[str, list[float]]:
    segment = SEGMENT[concurrency]
    sessions = {
        t.name: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))
        for t in targets
    }
    try:
        for target in targets:
            for _ in range(INTERLEAVE_WARMUP):
                await one_request(sessions[target.name], target, stream)
        latencies: dict[str, list[float]] = {t.name: [] for t in targets}
        for cycle in range(cycles):
            shift = cycle % len(targets)  # each target takes each place in the cycle in turn
            for target in targets[shift:] + targets[:shift]:
                left = iter(range(segment))

                async def worker(target: Target = target, left: Any = left) -> None:
                    for _ in left:
                        latency = await one_request(sessions[target.name], target, stream)
                        latencies[target.name].append(latency)

                await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies
    finally:
        for session in sessions.values():
            await session.close()


def interleaved_rounds(targets: dict[str, Target], cycles: int) -> dict:
    """Latencies of direct, pass-through, olp-off and olp-on, measured in short segments in
    turn (a cycle is one segment per target), pooled per target.

    The alternating rounds compare rounds of 400 requests a few seconds apart, and the
    machine's state drifts between them: a round's own on / pass-through ratio ranged over
    0.1-4.9 in one run, and the rounds' median moved by 0.2-0.6 from run to run. Segments a
    few milliseconds apart put every target under the same conditions at nearly the same
    time, and the p50 is taken over all of a target's requests."""
    out: dict[tuple[bool, int], dict[str, list[float]]] = {}
    row = [targets[name] for name in INTERLEAVED_TARGETS]
    for stream in (False, True):
        for concurrency in SEGMENT:
            latencies = asyncio.run(_interleaved_row(row, stream, concurrency, cycles))
            out[(stream, concurrency)] = latencies
            added = _interleaved_added(latencies)
            print(
                f"interleaved stream={stream!s:5s} c={concurrency:2d}: added p50 "
                + " ".join(f"{name}={added[name]:.3f}" for name in INTERLEAVED_TARGETS[1:])
                + " ms",
                flush=True,
            )
    return out


def _interleaved_added(latencies: dict[str, list[float]]) -> dict[str, float]:
    p50 = {name: statistics.median(values) * 1000 for name, values in latencies.items()}
    return {name: value - p50["direct"] for name, value in p50.items()}


def render_interleaved(table: dict, cycles: int) -> str:
    lines = [
        "",
        "### Added latency, interleaved",
        "",
        f"{cycles} cycles per row; in each cycle every target (direct, pass-through, olp-off, "
        f"olp-on) gets one segment of requests in turn ({SEGMENT[1]} at concurrency 1, "
        f"{SEGMENT[16]} at 16: 16 workers, 4 each), the order shifted by one target every "
        f"cycle, after {INTERLEAVE_WARMUP} warm-up requests per target. The p50 is over all "
        "of a target's requests in the row; `added` = p50 minus direct's. The targets are "
        "measured milliseconds apart instead of rounds seconds apart, so the machine's drift "
        "falls on all of them alike. `fifths` = on / pass-through within each fifth of the "
        "cycles, in order: how far the ratio moves inside one row. What this design charges "
        "elsewhere: olp-on's deferred work (the sink feeder's 0.1 s tick, the worker) runs "
        "partly during the other targets' segments, and a c=16 segment of 64 requests spends "
        "part of its time filling and draining, so it is not steady load at 16. Read it next "
        "to the rounds above, not instead of them.",
        "",
        "| stream | conc | requests per target | direct p50 ms | pass-through added "
        "| olp-off added | off / pass-through | olp-on added | on / pass-through | fifths on / "
        "pass-through |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (stream, concurrency), latencies in table.items():
        added = _interleaved_added(latencies)
        floor = added["passthrough"]
        count = len(latencies["direct"])
        fifths = []
        for part in range(5):
            window = slice(part * count // 5, (part + 1) * count // 5)
            part_added = _interleaved_added({n: v[window] for n, v in latencies.items()})
            fifths.append(ratio(part_added["olp-on"], part_added["passthrough"]))
        lines.append(
            f"| {stream} | {concurrency} | {count} | "
            f"{statistics.median(latencies['direct']) * 1000:.2f} | {floor:.3f} | "
            f"{added['olp-off']:.3f} | {ratio(added['olp-off'], floor)} | "
            f"{added['olp-on']:.3f} | {ratio(added['olp-on'], floor)} | {', '.join(fifths)} |"
        )
    return "\n".join(lines) + "\n"


def _skipped_note(arrived: int, expected: int, skipped: int) -> str:
    """What an arrival count means when the proxy skipped captures (none: nothing to add)."""
    if not skipped:
        return ""
    return (
        f"; {skipped} of those requests were served without a capture while the sink's "
        "backlog was at its limit (`olp_proxy_captures_skipped_total`): the records of "
        f"{arrived} of {expected - skipped} captured requests arrived"
    )


def render(
    results: dict,
    names: list[str],
    requests: int,
    counts: dict[str, int],
    note: str,
    expected: dict[str, int],
) -> str:
    lead, window = steady_window()
    lines = [
        "## Proxy overhead (bench/bench_proxy.py)",
        "",
        f"Fake OpenAI-shaped upstream answering {STREAM_TOKENS} tokens at once (aiohttp, own "
        "process; each answer shape is serialised once and replayed, so it answers as fast "
        f"with the extras olp asks for as without); {requests} requests per row "
        f"(LiteLLM's rows: {litellm_requests(requests)}, it serves some 30-60 a second) after "
        f"20 warm-up requests and {lead:g} s of uncounted load, for at least {window:g} s "
        "(more requests where that takes longer), each row's CPU read where its count "
        "starts and ends, inside the running load (the sink worker's bursts fall in it at "
        "their steady rate); "
        "client, relay and upstream share the machine's 2 cores, so "
        "absolute figures include contention. `added` = p50 minus the direct p50 of the "
        "same row group. `CPU proxy` = the relay process's own CPU time per request (its "
        "threads' /proc schedstat, ns resolution); `CPU total` adds its child processes "
        "(olp's KafkaSinkProcess worker, which builds, checks, redacts, validates, encodes "
        "and sends the records).",
        "",
        "- passthrough: the thinnest aiohttp relay, on the event loop olp runs on (uvloop, "
        "olp's `proxy.event_loop` default); passthrough-asyncio: the same relay on asyncio's "
        "own loop.",
        "- olp-on: the proxy keeps the raw upstream bytes, strips what it added on the bytes "
        "and hands the capture to `KafkaSinkProcess`, whose worker builds the record and "
        f"sends it to an embedded Tansu broker: {counts['process']} of {expected['process']} "
        "records arrived (this row's requests and olp-on's in the rounds below)"
        f"{_skipped_note(counts['process'], expected['process'], counts['process-skipped'])}.",
        "- olp-on-thread: the sink the proxy used before 2026-11-30, a KafkaSink in a thread "
        "of the proxy process, with the records built in the proxy: "
        f"{counts['thread']} of {expected['thread']} records arrived"
        f"{_skipped_note(counts['thread'], expected['thread'], counts['thread-skipped'])}.",
        "- olp-on-nosink: the same capture handed to a sink that drops the captures (the "
        "proxy process's own share of the capture cost, with no worker using the cores).",
        "- olp-on-pystrip: olp-on with the strip (streams and whole answers) in Python "
        "instead of its C pass (proxy/_sse_strip.c).",
        "- olp-on-gcdefault: olp-on with the interpreter's garbage-collector settings instead "
        "of the proxy's (`proxy.gc`: start-up objects frozen, young threshold 20000).",
        "- olp-on-down / olp-on-thread-down: olp-on / olp-on-thread with the sink pointed at a "
        "closed loopback port (broker down), so every record goes to the durable spill: "
        f"{counts['process-down']} and {counts['thread-down']} of {expected['process-down']} "
        f"and {expected['thread-down']} records were in the spill at the end.",
        "",
        "| stream | conc | target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s "
        "| CPU proxy ms/req | CPU total ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stream in (False, True):
        for concurrency in (1, 16):
            direct = results[("direct", stream, concurrency)]
            for name in names:
                r = results[(name, stream, concurrency)]
                cpu = "" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}"
                total = "" if r["cpu_total_ms"] is None else f"{r['cpu_total_ms']:.2f}"
                lines.append(
                    f"| {stream} | {concurrency} | {name} | {r['p50_ms']:.2f} | "
                    f"{r['p99_ms']:.2f} | {r['p50_ms'] - direct['p50_ms']:.2f} | "
                    f"{r['p99_ms'] - direct['p99_ms']:.2f} | {r['rps']:.0f} | {cpu} | {total} |"
                )
    lines += [
        "",
        "Ratios from the rows above (one row each; the rounds below are steadier):",
        "",
    ]
    for stream in (False, True):
        for concurrency in (1, 16):

            def key(name: str, stream: bool = stream, concurrency: int = concurrency) -> dict:
                return results[(name, stream, concurrency)]

            direct = key("direct")
            added = {n: key(n)["p50_ms"] - direct["p50_ms"] for n in names}
            added99 = {n: key(n)["p99_ms"] - direct["p99_ms"] for n in names}
            on, off = key("olp-on"), key("olp-off")
            parts = [
                f"olp-off added p50 / pass-through's = "
                f"{ratio(added['olp-off'], added['passthrough'])}",
                f"olp-on / pass-through = {ratio(added['olp-on'], added['passthrough'])}",
                f"capture CPU on/off, proxy process = {ratio(on['cpu_ms'], off['cpu_ms'])}",
                f"on/off incl. the sink process = {ratio(on['cpu_total_ms'], off['cpu_total_ms'])}",
                f"on/off with the sink in a thread = "
                f"{ratio(key('olp-on-thread')['cpu_ms'], off['cpu_ms'])}",
                f"on/off without a sink = {ratio(key('olp-on-nosink')['cpu_ms'], off['cpu_ms'])}",
                f"added p99 broker down/up = {ratio(added99['olp-on-down'], added99['olp-on'])} "
                f"(thread sink: "
                f"{ratio(added99['olp-on-thread-down'], added99['olp-on-thread'])})",
            ]
            if "litellm" in names:
                parts += [
                    f"olp-on added p50 / LiteLLM's = {ratio(added['olp-on'], added['litellm'])}",
                    f"olp-on req/s / LiteLLM's = {ratio(on['rps'], key('litellm')['rps'])}",
                ]
            lines.append(f"- stream={stream}, c={concurrency}: " + "; ".join(parts))
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
