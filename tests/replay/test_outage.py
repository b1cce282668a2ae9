"""Broker outages: records spill to disk, survive a sink restart, and arrive exactly once."""

from __future__ import annotations

import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from deploy.broker import EmbeddedBroker, start_broker
from deploy.ports import free_port
from replay.config import StreamConfig
from replay.consumer import TrajectoryConsumer
from replay.producer import KafkaSink
from replay.synthetic import make_feedback, make_trajectory
from tests.replay.conftest import consume_until, unique_prefix


def _config(bootstrap: str, **overrides: object) -> StreamConfig:
    settings: dict[str, object] = {
        "bootstrap_servers": bootstrap,
        "topic_prefix": unique_prefix(),
        "join_window_s": 0.0,
        "join_grace_s": 0.0,
        "reconnect_backoff_s": 0.2,
        "request_timeout_ms": 1_500,
        "delivery_timeout_ms": 2_000,
        "max_block_ms": 1_500,
        "bootstrap_timeout_ms": 1_500,
        "close_timeout_s": 3.0,
    }
    settings.update(overrides)
    return StreamConfig.model_validate(settings)


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _one_partition_sink(
    tmp_path: Path,
) -> tuple[int, StreamConfig, CollectorRegistry, EmbeddedBroker, KafkaSink]:
    """A broker of its own on a free port (to stop and start again there), and a sink on
    it writing one partition."""
    port = free_port()
    config = _config(f"127.0.0.1:{port}", partitions=1)
    registry = CollectorRegistry()
    broker = start_broker("127.0.0.1", port, tmp_path / "broker1.log")
    return port, config, registry, broker, KafkaSink(config, tmp_path / "state", registry)


def _consume_ids(config: StreamConfig, expected: int) -> list[str]:
    with TrajectoryConsumer(config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= expected)
        assert consumer.poll(0.5) == []
    return [s.trajectory["trajectory_id"] for s in scored]


def test_spilled_records_survive_outages_and_arrive_exactly_once(tmp_path: Path) -> None:
    port = free_port()
    config = _config(f"127.0.0.1:{port}")
    state_dir = tmp_path / "state"
    spill_dir = state_dir / config.spill_dir_name

    # Phase 1: the broker is not there at all. put_* returns at once; records go to disk.
    registry = CollectorRegistry()
    sink = KafkaSink(config, state_dir, registry)
    before_restart = [make_trajectory(session_id=f"s{i % 5}") for i in range(30)]
    for record in before_restart:
        sink.put_trajectory(record)
    _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 30)
    assert _sample(registry, "olp_stream_spill_bytes") > 30 * 300
    assert _sample(registry, "olp_stream_sent_total", kind="trajectory") == 0
    sink.close()  # the process stops while the broker is still down
    assert list(spill_dir.glob("seg-*.spill"))

    registry = CollectorRegistry()
    sink = KafkaSink(config, state_dir, registry)  # recovers the spill from disk
    after_restart = [make_trajectory(session_id=f"s{i % 5}") for i in range(20)]
    for record in after_restart:
        sink.put_trajectory(record)
    _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 20)

    broker: EmbeddedBroker = start_broker("127.0.0.1", port, tmp_path / "broker1.log")
    try:
        assert sink.wait_idle(60), "the spill was not drained after the broker came up"
        assert _sample(registry, "olp_stream_spill_bytes") == 0
        assert list(spill_dir.glob("seg-*.spill")) == []
        expected = [r["trajectory_id"] for r in before_restart + after_restart]
        got = _consume_ids(config, len(expected))
        assert sorted(got) == sorted(expected)

        # Phase 2: the broker goes away while the sink is live, then comes back.
        broker.stop()
        during_outage = [make_trajectory(session_id=f"s{i % 5}") for i in range(40)]
        feedback = [make_feedback(r, created_at=r["created_at"]) for r in during_outage[:10]]
        started = time.monotonic()
        for record in during_outage:
            sink.put_trajectory(record)
        for event in feedback:
            sink.put_feedback(event)
        assert time.monotonic() - started < 5, "put_* waited on the broker"
        _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") >= 60)
        assert _sample(registry, "olp_stream_broker_up") == 0
        # The embedded broker keeps data in memory: the restarted one starts empty.
        broker = start_broker("127.0.0.1", port, tmp_path / "broker2.log")
        assert sink.wait_idle(60)
        sink.close()
        assert _sample(registry, "olp_stream_broker_up") == 1
        with TrajectoryConsumer(config) as consumer:
            scored = consume_until(consumer, lambda got: len(got) >= 40)
            assert consumer.poll(0.5) == []
        assert sorted(s.trajectory["trajectory_id"] for s in scored) == sorted(
            r["trajectory_id"] for r in during_outage
        )
        joined = {s.trajectory["trajectory_id"]: s.feedback for s in scored}
        for event in feedback:
            assert joined[event["trajectory_id"]] == [event]
    finally:
        broker.stop()


def test_spill_cap_drops_loudly(tmp_path: Path) -> None:
    config = _config(f"127.0.0.1:{free_port()}", spill_max_bytes=20_000)
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    for i in range(40):
        sink.put_trajectory(
            make_trajectory(session_id=f"s{i}", prompt_tokens=300, completion_tokens=100)
        )

    def spilled() -> float:
        return _sample(registry, "olp_stream_spilled_total", kind="trajectory")

    def dropped() -> float:
        return _sample(registry, "olp_stream_failed_total", kind="any", reason="spill_full")

    _wait_for(lambda: spilled() + dropped() == 40)
    sink.close()
    spilled, dropped = spilled(), dropped()
    assert spilled > 0 and dropped > 0
    assert spilled + dropped == 40
    assert _sample(registry, "olp_stream_spill_bytes") <= 20_000


def test_a_broker_restart_the_idle_sink_did_not_notice_loses_nothing(tmp_path: Path) -> None:
    """The restarted broker forgot the idempotent producer's id: the next sends fail with
    UnknownProducerIdError, then a bare KafkaError from InitProducerId. Before, these (not
    retriable) counted as records refused for good: each valid record became a DLQ envelope,
    which failed on the same producer and was dropped (nothing reached either topic)."""
    # Session "a" hashes to partition 0 of 1 and of 4 (what the restarted broker makes when
    # the producer's metadata request creates the topic): the partition with sequence state.
    port, config, registry, broker, sink = _one_partition_sink(tmp_path)
    try:
        for _ in range(3):
            sink.put_trajectory(make_trajectory(session_id="a"))
        assert sink.wait_idle(30)
        broker.stop()
        # In memory: the restarted broker starts empty, and the sink did not see it go.
        broker = start_broker("127.0.0.1", port, tmp_path / "broker2.log")
        after = [make_trajectory(session_id="a") for _ in range(3)]
        for record in after:
            sink.put_trajectory(record)
        assert sink.wait_idle(60)
        sink.close()
        assert (
            _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="rejected") == 0
        )
        assert _sample(registry, "olp_stream_dlq_total", kind="trajectory") == 0
        assert _sample(registry, "olp_stream_sent_total", kind="trajectory") == 6
        assert sorted(_consume_ids(config, 3)) == sorted(r["trajectory_id"] for r in after)
    finally:
        sink.close()
        broker.stop()


def test_an_idle_sink_reports_a_broker_that_went_away(tmp_path: Path, monkeypatch) -> None:
    """`olp_stream_broker_up` stayed 1 while an idle sink's broker was down: only a failed
    send set it to 0. The idle sink now probes the broker."""
    import replay.producer as producer_module

    monkeypatch.setattr(producer_module, "_IDLE_PROBE_S", 0.2)
    port, _, registry, broker, sink = _one_partition_sink(tmp_path)
    try:
        sink.put_trajectory(make_trajectory(session_id="a"))
        assert sink.wait_idle(30)
        assert _sample(registry, "olp_stream_broker_up") == 1
        broker = _broker_down_and_up_is_seen(broker, port, registry, tmp_path)
    finally:
        sink.close()
        broker.stop()


def _broker_down_and_up_is_seen(
    broker: EmbeddedBroker, port: int, registry: CollectorRegistry, tmp_path: Path
) -> EmbeddedBroker:
    """Stop the broker and start it again on its port, each seen in `broker_up`; the new
    broker."""
    broker.stop()
    _wait_for(lambda: _sample(registry, "olp_stream_broker_up") == 0, timeout_s=10)
    broker = start_broker("127.0.0.1", port, tmp_path / "broker2.log")
    _wait_for(lambda: _sample(registry, "olp_stream_broker_up") == 1, timeout_s=10)
    return broker


def _probe_often() -> None:
    """`child_init` of a KafkaSinkProcess worker: its idle probe every 0.2 s."""
    import replay.producer as producer_module

    producer_module._IDLE_PROBE_S = 0.2


def test_the_proxys_sink_worker_reports_the_broker_while_idle(tmp_path: Path) -> None:
    """An idle worker reported its values once and then kept quiet: `olp proxy`'s /metrics
    (and the operator page) showed the broker down from start-up until the first record,
    and up while it was gone until the next one. A change of the broker's reachability is
    reported at once."""
    from replay.sink_process import KafkaSinkProcess

    port = free_port()
    config = _config(f"127.0.0.1:{port}", partitions=1)
    broker = start_broker("127.0.0.1", port, tmp_path / "broker1.log")
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(config, tmp_path / "state", registry, child_init=_probe_often)
    try:
        _wait_for(lambda: _sample(registry, "olp_stream_broker_up") == 1, timeout_s=30)
        assert _sample(registry, "olp_stream_sent_total", kind="trajectory") in (None, 0)
        broker = _broker_down_and_up_is_seen(broker, port, registry, tmp_path)
    finally:
        sink.close()
        broker.stop()


def test_close_against_a_broker_that_stopped_answering_spills_within_its_timeout(
    tmp_path: Path,
) -> None:
    """A broker that accepts connections and never answers (here: stopped with SIGSTOP)
    made each batch left in the queue wait a whole delivery timeout while closing, so a
    close took minutes and a supervisor's SIGKILL lost what was still in memory."""
    import os
    import signal

    port = free_port()
    config = _config(
        f"127.0.0.1:{port}",
        partitions=1,
        producer_batch_records=20,
        delivery_timeout_ms=20_000,
        request_timeout_ms=10_000,
        close_timeout_s=1.0,
    )
    registry = CollectorRegistry()
    broker = start_broker("127.0.0.1", port, tmp_path / "broker.log")
    sink = KafkaSink(config, tmp_path / "state", registry)
    pid = broker.child.proc.pid
    try:
        sink.put_trajectory(make_trajectory())
        _wait_for(lambda: _sample(registry, "olp_stream_sent_total", kind="trajectory") == 1)
        os.kill(pid, signal.SIGSTOP)
        for _ in range(200):  # ten batches
            sink.put_trajectory(make_trajectory())
        time.sleep(0.5)  # the first batch is in its flush
        started = time.monotonic()
        sink.close()
        took = time.monotonic() - started
    finally:
        os.kill(pid, signal.SIGCONT)
        broker.stop()
    assert took < 4.0, f"close took {took:.1f} s with close_timeout_s 1"
    spilled = _sample(registry, "olp_stream_spilled_total", kind="trajectory")
    sent = _sample(registry, "olp_stream_sent_total", kind="trajectory")
    assert spilled + sent == 201 and spilled >= 180
