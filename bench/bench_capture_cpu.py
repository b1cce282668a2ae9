"""Capture's CPU cost in the proxy process, measured so that the machine's drift cancels out.

An olp proxy (KafkaSinkProcess worker, embedded broker, bench_proxy's fast fake upstream)
serves one client whose requests go to a tenant with training off, then on, in alternating
quarter-second segments. Two such proxies run side by side, one with the sink's worker kept
off the CPU the event loop last ran on (`stream.sink_avoids_loop_cpu`, the default) and one
without (the baseline), in turns. The CPU of the proxy's event-loop thread is read at
every segment edge and charged to that segment; the CPU of the proxy's other threads (the
sink's feeder, which works only for captures) is charged to training on; the worker's CPU
is read too. Each repetition uses a new client session.

Why not rounds: bench_proxy.py's rounds (1.5 s lead, then a window of 2 s or more per
target) read the same target's CPU per request 10-25 % apart from one round to the next on
this machine, sharing a client session or not, pinned or not (2026-12-05); the medians of 7
to 11 rounds then moved by ±5 % between runs, the size of what the capture target (on <= 1.1x
off) decides. Segments a quarter of a second apart see the same machine: the repetitions'
ratios agree within a few percent.

What segments charge to the wrong side: the worker builds and sends what it received once a
second (`stream.sink_batch_wait_s`), so its bursts fall into off segments as often as into
on ones, and they slow the event loop while they run. The table shows that effect (loop CPU
per request of segments during which the worker used more than 20 ms of CPU, against their
quiet same-kind neighbours') and a ratio with the off segments' excess charged to on.

    python bench/bench_capture_cpu.py [--reps 5] [--seconds 15] [--segment 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import bench_proxy
from generated_block import write_generated

ROOT = Path(__file__).resolve().parent.parent
ROWS = ((False, 1), (False, 16), (True, 1), (True, 16))
BURST_CPU_S = 0.02  # worker CPU in a segment above which the segment counts as a burst's
NEIGHBOURS = 2  # quiet same-kind segments on each side that a segment is compared with
WARM_S = 2.0  # uncounted load at the start of each repetition
Results = dict[tuple[bool, int, str], list[dict[str, float]]]
# The sink's worker kept off the event loop's CPU (the default), and the baseline without.
CONFIGS = {"off-loop": [], "anywhere": ["--sink-near-loop"]}


@dataclass
class Segment:
    key: str  # "off" or "on"
    requests: int
    loop_s: float  # CPU of the proxy's event-loop (main) thread
    sink_threads_s: float  # CPU of the proxy's other threads
    worker_s: float  # CPU of the proxy's child processes (the sink's worker)


def _schedstat_s(path: Path) -> float:
    return int(path.read_text().split()[0]) / 1e9


def _threads_cpu(pid: int) -> tuple[float, float, list[int]]:
    """(main thread, other threads) CPU seconds of a process, and its children's pids."""
    main = other = 0.0
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            seconds = _schedstat_s(task / "schedstat")
            children += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            continue  # a thread that ended since the listing
        if task.name == str(pid):
            main += seconds
        else:
            other += seconds
    return main, other, children


def proxy_cpu(pid: int) -> tuple[float, float, float]:
    """(event-loop thread, other threads, descendants) CPU seconds of a proxy process."""
    loop, other, todo = _threads_cpu(pid)
    descendants = 0.0
    while todo:
        try:
            main, rest, children = _threads_cpu(todo.pop())
        except OSError:
            continue  # a process that ended since the listing
        descendants += main + rest
        todo += children
    return loop, other, descendants


async def run_rep(
    targets: dict[str, bench_proxy.Target],
    stream: bool,
    concurrency: int,
    seconds: float,
    segment_s: float,
) -> list[Segment]:
    """One repetition: WARM_S of load, then `seconds` of alternating segments."""
    pid = targets["on"].proc.pid
    current = {"key": "off"}
    counts = {"off": 0, "on": 0}
    stop = asyncio.Event()
    segments: list[Segment] = []
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            while not stop.is_set():
                key = current["key"]
                await bench_proxy.one_request(session, targets[key], stream)
                targets[key].issued += 1
                if key == current["key"]:  # one that straddled a switch counts nowhere
                    counts[key] += 1

        async def switcher() -> None:
            await asyncio.sleep(WARM_S)
            before = proxy_cpu(pid)
            counts["off"] = counts["on"] = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                await asyncio.sleep(segment_s)
                after, key = proxy_cpu(pid), current["key"]
                deltas = [b - a for a, b in zip(before, after, strict=True)]
                segments.append(Segment(key, counts[key], *deltas))
                counts[key] = 0
                current["key"] = "on" if key == "off" else "off"
                before = after
            stop.set()

        await asyncio.gather(switcher(), *(client() for _ in range(concurrency)))
    return segments


def _per_request(segment: Segment) -> float:
    return segment.loop_s / segment.requests


def burst_excess(segments: list[Segment]) -> list[float | None]:
    """For each burst segment, its loop CPU per request over the mean of its quiet same-kind
    neighbours' (None for quiet segments and where no quiet neighbour is near)."""
    out: list[float | None] = []
    for i, segment in enumerate(segments):
        if segment.worker_s <= BURST_CPU_S or segment.requests == 0:
            out.append(None)
            continue
        near = [
            _per_request(other)
            for j in range(i - 2 * NEIGHBOURS, i + 2 * NEIGHBOURS + 1, 2)
            if j != i and 0 <= j < len(segments)
            for other in [segments[j]]
            if other.worker_s <= BURST_CPU_S and other.requests > 0
        ]
        out.append(_per_request(segment) / statistics.mean(near) if near else None)
    return out


def summarize(segments: list[Segment]) -> dict[str, float]:
    """One repetition's figures (ms per request; ratios)."""
    by_key = {key: [s for s in segments if s.key == key] for key in ("off", "on")}
    requests = {key: sum(s.requests for s in group) for key, group in by_key.items()}
    loop = {key: sum(s.loop_s for s in group) for key, group in by_key.items()}
    sink_threads = sum(s.sink_threads_s for s in segments)
    worker = sum(s.worker_s for s in segments)
    off = loop["off"] / requests["off"]
    on = (loop["on"] + sink_threads) / requests["on"]
    excess = burst_excess(segments)
    # What the worker's bursts added to off segments (or, where a burst segment came out
    # cheaper than its neighbours, took off them: noise either way), moved to training on.
    moved = sum(
        s.loop_s * (1 - 1 / e)
        for s, e in zip(segments, excess, strict=True)
        if e is not None and s.key == "off"
    )
    bursts = {
        key: [e for s, e in zip(segments, excess, strict=True) if e and s.key == key]
        for key in ("off", "on")
    }
    return {
        "requests_off": requests["off"],
        "requests_on": requests["on"],
        "off_ms": off * 1e3,
        "on_ms": on * 1e3,
        "ratio": on / off,
        "worker_ms": worker / requests["on"] * 1e3,
        "burst_share": sum(s.worker_s > BURST_CPU_S for s in segments) / len(segments),
        "burst_off": statistics.mean(bursts["off"]) if bursts["off"] else float("nan"),
        "burst_on": statistics.mean(bursts["on"]) if bursts["on"] else float("nan"),
        "charged_ratio": ((loop["on"] + sink_threads + moved) / requests["on"])
        / ((loop["off"] - moved) / requests["off"]),
    }


def render(results: Results, args: argparse.Namespace) -> str:
    def median(reps: list[dict[str, float]], name: str) -> float:
        return statistics.median(rep[name] for rep in reps)

    lines = [
        "## Capture CPU, training off and on in alternating segments (bench/bench_capture_cpu.py)",
        "",
        "Two olp proxies side by side: `off-loop` keeps the sink's worker off the CPU its event "
        "loop last ran on (`stream.sink_avoids_loop_cpu`, the default), `anywhere` lets the "
        "kernel place it (the baseline); one client. "
        f"{args.reps} repetitions per row and proxy (their order swapped every other one), "
        f"each of {args.seconds:g} s of "
        f"{args.segment * 1000:g} ms segments alternating between a tenant with training off "
        f"and one with it on (after {WARM_S:g} s of load), each repetition on a new client "
        "session; bench_proxy.py's fake upstream (16-token answers) and an embedded broker. "
        "`off` = the event-loop thread's CPU per request in off segments; `on` = its CPU in on "
        "segments plus all CPU of the proxy's other threads (the sink's feeder). Medians over "
        "the repetitions. `burst` = the segments in which the sink's worker used more than "
        f"{BURST_CPU_S * 1000:g} ms of CPU (it builds and sends once a second): their share, and "
        "their loop CPU per request over the mean of their quiet same-kind neighbours' "
        f"(up to {NEIGHBOURS} each side). `charged` = on/off with the excess of the off "
        "segments' bursts moved to on: the estimate of all-on against all-off that includes the "
        "worker's effect on the loop. `worker` = the worker's CPU per captured request.",
        "",
        "| stream | conc | sink worker | requests off/on | off ms/req | on ms/req | on/off "
        "| repetitions | burst share | burst off | burst on | charged on/off | worker ms/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (stream, concurrency, name), reps in results.items():
        total_off = sum(rep["requests_off"] for rep in reps)
        total_on = sum(rep["requests_on"] for rep in reps)
        each = ", ".join(f"{rep['ratio']:.3f}" for rep in reps)
        lines.append(
            f"| {stream} | {concurrency} | {name} | {total_off:.0f}/{total_on:.0f} "
            f"| {median(reps, 'off_ms'):.3f} | {median(reps, 'on_ms'):.3f} "
            f"| {median(reps, 'ratio'):.3f} "
            f"| {each} "
            f"| {median(reps, 'burst_share'):.2f} | {median(reps, 'burst_off'):.3f} "
            f"| {median(reps, 'burst_on'):.3f} | {median(reps, 'charged_ratio'):.3f} "
            f"| {median(reps, 'worker_ms'):.3f} |"
        )
    return "\n".join(lines) + "\n"


def start_olp(
    me: list[str], workdir: Path, upstream: str, bootstrap: str, name: str, extra: list[str]
) -> dict[str, bench_proxy.Target]:
    port = bench_proxy.free_port()
    command = [*me, "serve-olp", "--port", str(port), "--upstream", upstream]
    command += ["--sink", "kafka-process", "--state", str(workdir / f"state-{name}")]
    command += ["--bootstrap", bootstrap, "--topic-prefix", f"bench-capture-cpu-{name}", *extra]
    proc = bench_proxy.spawn(command, workdir / f"olp-{name}.log")
    url = f"http://127.0.0.1:{port}"
    bench_proxy.wait_ready(url + "/healthz", proc)
    return {
        key: bench_proxy.Target(f"{name}-{key}", url, f"key-{key}", "base", proc)
        for key in ("off", "on")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="repetitions per row")
    parser.add_argument("--seconds", type=float, default=15.0, help="counted seconds per rep")
    parser.add_argument("--segment", type=float, default=0.25, help="segment length, seconds")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "perf" / "capture_cpu.md")
    args = parser.parse_args()
    if args.reps < 1 or args.seconds <= 0 or not 0 < args.segment <= args.seconds:
        parser.error("--reps >= 1, --seconds > 0 and 0 < --segment <= --seconds")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.path.insert(0, str(ROOT))
    from deploy.broker import start_broker

    workdir = Path(tempfile.mkdtemp(prefix="olp-bench-capture-cpu-"))
    me = [sys.executable, str(ROOT / "bench" / "bench_proxy.py")]
    procs: list[subprocess.Popen] = []
    broker = start_broker("127.0.0.1", bench_proxy.free_port(), workdir / "broker.log")
    try:
        up_port = bench_proxy.free_port()
        upstream = f"http://127.0.0.1:{up_port}"
        procs.append(
            bench_proxy.spawn([*me, "serve-upstream", "--port", str(up_port)], workdir / "up.log")
        )
        bench_proxy.wait_ready(upstream + "/v1/models", procs[-1])
        proxies: dict[str, dict[str, bench_proxy.Target]] = {}
        for name, extra in CONFIGS.items():
            proxies[name] = start_olp(me, workdir, upstream, broker.bootstrap, name, extra)
            procs.append(proxies[name]["on"].proc)
        results: Results = {}
        for stream, concurrency in ROWS:
            for rep in range(args.reps):
                names = list(CONFIGS) if rep % 2 == 0 else list(reversed(CONFIGS))
                for name in names:  # side by side: each repetition runs both
                    segments = asyncio.run(
                        run_rep(proxies[name], stream, concurrency, args.seconds, args.segment)
                    )
                    figures = summarize(segments)
                    results.setdefault((stream, concurrency, name), []).append(figures)
                    print(
                        f"stream={stream!s:5s} c={concurrency:2d} {name:9s} rep {rep + 1}/"
                        f"{args.reps}: off {figures['off_ms']:.3f} on {figures['on_ms']:.3f} "
                        f"ms/req, on/off {figures['ratio']:.3f}, charged "
                        f"{figures['charged_ratio']:.3f}, bursts {figures['burst_off']:.3f}/"
                        f"{figures['burst_on']:.3f}",
                        flush=True,
                    )
        text = render(results, args)
        print(text)
        write_generated(args.out, text, "bench_capture_cpu.py")
        print(f"wrote {args.out}")
    finally:
        for proc in procs:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        broker.stop()


if __name__ == "__main__":
    main()
