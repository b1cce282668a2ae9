"""Throughput of the data layer with realistic ~4 KB trajectory records.

Measures, side by side with a bare kafka-python baseline on the same broker:
  * producer: KafkaSink (validation, queue, background send, acks=all) vs raw KafkaProducer
    sending pre-encoded bytes with acks=all;
  * put_* cost on the caller (what the proxy's event loop pays per record);
  * spill: records/s written to the durable spill while the broker is unreachable;
  * consumer: TrajectoryConsumer (validate, de-dup, join, offsets) vs raw KafkaConsumer;
  * CPU per record at a steady request rate (--rates): KafkaSinkProcess (the proxy's sink:
    its feeder thread in the caller's process, and the worker process) vs KafkaSink (all in
    the caller's process). At proxy rates the cost of waking threads dominates, not the
    records' own work.

    python bench/bench_stream.py [--bootstrap HOST:PORT] [--records N] [--runs R]
                                 [--rates 50,500,2500]
                                 [--prompt-tokens 300] [--completion-tokens 100]

Without --bootstrap it starts a private embedded broker on a free port and stops it after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from kafka import KafkaConsumer, KafkaProducer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from percentile import nearest_rank

from deploy.broker import start_broker
from deploy.ports import free_port
from replay.config import StreamConfig
from replay.consumer import TrajectoryConsumer
from replay.producer import KafkaSink
from replay.schemas import encode_record
from replay.sink_process import KafkaSinkProcess
from replay.synthetic import make_trajectory
from replay.topics import TopicNames, ensure_topics


def _config(bootstrap: str) -> StreamConfig:
    return StreamConfig(
        bootstrap_servers=bootstrap,
        topic_prefix=f"bench{uuid.uuid4().hex[:8]}",
        join_window_s=0.0,
        join_grace_s=0.0,
        queue_size=100_000,
    )


def _records(n: int, prompt_tokens: int = 300, completion_tokens: int = 100) -> list[dict]:
    return [
        make_trajectory(
            session_id=f"s{i % 64}",
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
        )
        for i in range(n)
    ]


def bench_sink(bootstrap: str, records: list[dict]) -> tuple[float, list[float]]:
    config = _config(bootstrap)
    ensure_topics(config)
    with tempfile.TemporaryDirectory() as state:
        sink = KafkaSink(config, Path(state))
        put_costs: list[float] = []
        started = time.perf_counter()
        for record in records:
            t = time.perf_counter()
            sink.put_trajectory(record)
            put_costs.append(time.perf_counter() - t)
        assert sink.wait_idle(600), "sink did not drain"
        elapsed = time.perf_counter() - started
        sink.close()
    return elapsed, put_costs


def bench_raw_producer(bootstrap: str, records: list[dict]) -> float:
    config = _config(bootstrap)
    ensure_topics(config)
    topic = TopicNames.from_prefix(config.topic_prefix).trajectories
    values = [(r["session_id"].encode(), encode_record(r)) for r in records]
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=5,
        batch_size=256 * 1024,
        max_request_size=8 * 1024 * 1024,
    )
    started = time.perf_counter()
    for key, value in values:
        producer.send(topic, key=key, value=value)
    producer.flush()
    elapsed = time.perf_counter() - started
    producer.close()
    return elapsed


def bench_spill(records: list[dict]) -> float:
    config = _config(f"127.0.0.1:{free_port()}")  # nothing listens there
    with tempfile.TemporaryDirectory() as state:
        sink = KafkaSink(config, Path(state))
        started = time.perf_counter()
        for record in records:
            sink.put_trajectory(record)
        while sink.metrics.spilled.labels("trajectory")._value.get() < len(records):
            time.sleep(0.005)
        elapsed = time.perf_counter() - started
        sink.close()
    return elapsed


def bench_consumers(bootstrap: str, records: list[dict]) -> tuple[float, float]:
    config = _config(bootstrap)
    with tempfile.TemporaryDirectory() as state:
        sink = KafkaSink(config, Path(state))
        for record in records:
            sink.put_trajectory(record)
        assert sink.wait_idle(600)
        sink.close()
    started = time.perf_counter()
    got = 0
    with TrajectoryConsumer(config) as consumer:
        while got < len(records):
            got += len(consumer.poll(0.5))
    ours = time.perf_counter() - started

    topic = TopicNames.from_prefix(config.topic_prefix).trajectories
    raw = KafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        max_poll_records=1000,
        fetch_max_bytes=50 * 1024 * 1024,
    )
    started = time.perf_counter()
    raw.assign([TopicPartition(topic, p) for p in raw.partitions_for_topic(topic)])
    raw.seek_to_beginning()
    got = 0
    while got < len(records):
        got += sum(len(v) for v in raw.poll(500).values())
    baseline = time.perf_counter() - started
    raw.close()
    return ours, baseline


def _thread_cpu_s(pid: int, tids: set[int] | None = None) -> float:
    """CPU seconds of a process's threads (all, or those in `tids`), ns resolution."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        if tids is None or int(tid) in tids:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as handle:
                total += int(handle.read().split()[0]) / 1e9
    return total


def _feed_at_rate(sink: KafkaSink | KafkaSinkProcess, records: list[dict], rate: float) -> None:
    started = time.monotonic()
    for i, record in enumerate(records):
        sink.put_trajectory(record)
        delay = started + (i + 1) / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    if not sink.wait_idle(120):
        raise RuntimeError("the sink did not drain")


def bench_rate(bootstrap: str, records: list[dict], rate: float) -> tuple[float, float, float]:
    """CPU µs per record at `rate` records/s: KafkaSinkProcess's feeder thread (what the
    proxy's process pays) and its worker process, and KafkaSink's threads."""
    me = os.getpid()
    warm = records[: min(20, len(records))]
    with tempfile.TemporaryDirectory() as state:
        worker_sink = KafkaSinkProcess(_config(bootstrap), Path(state))
        try:
            _feed_at_rate(worker_sink, warm, rate)
            time.sleep(1.0)
            feeder, child = {worker_sink._thread.native_id}, worker_sink._proc.pid
            before = _thread_cpu_s(me, feeder), _thread_cpu_s(child)
            _feed_at_rate(worker_sink, records, rate)
            after = _thread_cpu_s(me, feeder), _thread_cpu_s(child)
        finally:
            worker_sink.close()
    with tempfile.TemporaryDirectory() as state:
        thread_sink = KafkaSink(_config(bootstrap), Path(state))
        try:
            _feed_at_rate(thread_sink, warm, rate)
            time.sleep(1.0)
            main = {threading.main_thread().native_id}
            others = lambda: _thread_cpu_s(me) - _thread_cpu_s(me, main)  # noqa: E731
            thread_before = others()
            _feed_at_rate(thread_sink, records, rate)
            thread_after = others()
        finally:
            thread_sink.close()
    per = 1e6 / len(records)
    return (
        (after[0] - before[0]) * per,
        (after[1] - before[1]) * per,
        (thread_after - thread_before) * per,
    )


def _pct(values: list[float], q: float) -> float:
    return nearest_rank(sorted(values), q)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", help="HOST:PORT of a running broker")
    parser.add_argument("--records", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--rates",
        default="",
        help="comma-separated records/s for the CPU-per-record section (e.g. 50,500,2500); "
        "each rate feeds --rate-seconds worth of records",
    )
    parser.add_argument("--rate-seconds", type=float, default=3.0)
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=300,
        help="prompt token ids per record (a coding assistant's prompts run to thousands)",
    )
    parser.add_argument("--completion-tokens", type=int, default=100)
    args = parser.parse_args()

    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        broker = start_broker("127.0.0.1", free_port(), Path(tempfile.mkdtemp()) / "broker.log")
        bootstrap = broker.bootstrap
    try:
        records = _records(args.records, args.prompt_tokens, args.completion_tokens)
        size = statistics.mean(len(encode_record(r)) for r in records)
        mb = args.records * size / 1e6
        print(f"records={args.records} mean_size={size:.0f} B total={mb:.1f} MB runs={args.runs}")
        sink_runs, raw_runs, spill_runs, put_costs = [], [], [], []
        cons_runs, raw_cons_runs = [], []
        for _ in range(args.runs):
            elapsed, costs = bench_sink(bootstrap, records)
            sink_runs.append(elapsed)
            put_costs.extend(costs)
            raw_runs.append(bench_raw_producer(bootstrap, records))
            spill_runs.append(bench_spill(records))
            ours, base = bench_consumers(bootstrap, records)
            cons_runs.append(ours)
            raw_cons_runs.append(base)
        n = args.records

        def line(name: str, runs: list[float], base: list[float] | None = None) -> str:
            med = statistics.median(runs)
            text = f"{name:<34} {n / med:>9.0f} rec/s {mb / med:>7.1f} MB/s (median of {len(runs)})"
            if base:
                text += f"  x{statistics.median(base) / med:.2f} of baseline"
            return text

        print(line("producer KafkaSink", sink_runs, raw_runs))
        print(line("producer raw kafka-python", raw_runs))
        print(line("spill, broker unreachable", spill_runs))
        print(line("consumer TrajectoryConsumer", cons_runs, raw_cons_runs))
        print(line("consumer raw kafka-python", raw_cons_runs))
        print(
            "put_trajectory cost on caller: "
            f"p50={_pct(put_costs, 0.5) * 1e6:.1f} us p99={_pct(put_costs, 0.99) * 1e6:.1f} us "
            f"max={max(put_costs) * 1e6:.0f} us"
        )
        for rate in [float(r) for r in args.rates.split(",") if r.strip()]:
            count = max(20, int(rate * args.rate_seconds))
            runs = [
                bench_rate(bootstrap, (records * (count // len(records) + 1))[:count], rate)
                for _ in range(args.runs)
            ]
            feeder, child, thread = (statistics.median(r[i] for r in runs) for i in range(3))
            print(
                f"at {rate:.0f} records/s (CPU per record, median of {len(runs)}): "
                f"KafkaSinkProcess feeder thread {feeder:.1f} us + worker {child:.1f} us "
                f"= {feeder + child:.1f} us; KafkaSink threads {thread:.1f} us "
                f"(caller's share x{feeder / thread:.2f} of KafkaSink's)"
            )
    finally:
        if broker is not None:
            broker.stop()


if __name__ == "__main__":
    main()
