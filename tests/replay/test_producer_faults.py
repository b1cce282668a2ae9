"""Faults inside the producer: odd records, a DLQ record the broker refuses, a failing disk.

None of them may stop the sender or feeder thread, block the spill, or raise into the caller
of `put_*`; the records get through (or are counted) once the fault is gone.
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import (
    InvalidRecordError,
    KafkaError,
    MessageSizeTooLargeError,
    OutOfOrderSequenceNumberError,
    UnknownProducerIdError,
)
from kafka.producer.future import FutureProduceResult
from prometheus_client import CollectorRegistry

import replay.producer as producer_module
import replay.spill as spill_module
from deploy.broker import start_broker
from deploy.ports import free_port
from replay.config import StreamConfig
from replay.producer import (
    KafkaSink,
    ProducerMetrics,
    QueuedRecord,
    prepare_entry,
)
from replay.schemas import RecordKind, decode_record
from replay.sink_process import KafkaSinkProcess
from replay.spill import SpillStore, read_segment
from replay.synthetic import make_feedback, make_trajectory
from replay.topics import TopicNames
from tests.replay.test_outage import _config, _sample, _wait_for
from tests.replay.test_sink_process import _consume_ids
from tests.replay.test_spill import _SegmentFile
from tests.replay.test_stream_kafka import _read_topic

LONE_SURROGATE = "abc\ud800"  # what json.loads makes of "abc\\ud800" in a client's body


def _dlq_envelopes(config: StreamConfig, expected: int) -> list[dict[str, Any]]:
    dlq = TopicNames.from_prefix(config.topic_prefix).dlq
    return [decode_record(r.value) for r in _read_topic(config.bootstrap_servers, dlq, expected)]


def _surrogate_feedback() -> dict[str, Any]:
    event = make_feedback(make_trajectory(session_id="x"))
    event["trajectory_id"] = event["session_id"] = LONE_SURROGATE
    event["metadata"] = {"note": LONE_SURROGATE}
    return event


def _dead_letter_feedback() -> dict[str, Any]:
    """A feedback event its schema refuses: the producer makes a DLQ envelope of it."""
    return make_feedback(make_trajectory(session_id="x"), kind="like")


# ---- records that cannot be prepared -------------------------------------------------------


def test_a_lone_surrogate_is_prepared_for_its_topic_as_its_escape() -> None:
    """Before: UnicodeEncodeError, and the record went to the DLQ."""
    config = StreamConfig()
    topics = TopicNames.from_prefix(config.topic_prefix)
    registry = CollectorRegistry()
    event = _surrogate_feedback()
    entry = prepare_entry(
        config, topics, ProducerMetrics(registry), QueuedRecord(RecordKind.FEEDBACK, event)
    )
    assert entry is not None and entry.topic == topics.feedback
    assert entry.key == LONE_SURROGATE.encode("utf-8", "surrogatepass")
    assert b"abc\\ud800" in entry.value
    assert decode_record(entry.value) == event
    assert registry.get_sample_value("olp_stream_dlq_total", {"kind": "feedback"}) is None


def test_an_unexpected_error_preparing_one_record_sends_it_to_the_dlq(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_validate = producer_module.validate_record

    def validate(kind: RecordKind, record: dict[str, Any]) -> None:
        if record.get("session_id") == "explodes":
            raise RuntimeError("a bug in a validator")
        real_validate(kind, record)

    monkeypatch.setattr(producer_module, "validate_record", validate)
    config = StreamConfig()
    topics = TopicNames.from_prefix(config.topic_prefix)
    registry = CollectorRegistry()
    metrics = ProducerMetrics(registry)
    bad = QueuedRecord(RecordKind.TRAJECTORY, make_trajectory(session_id="explodes"))
    good = QueuedRecord(RecordKind.TRAJECTORY, make_trajectory(session_id="fine"))
    entry = prepare_entry(config, topics, metrics, bad)
    assert entry is not None and entry.topic == topics.dlq
    assert "a bug in a validator" in decode_record(entry.value)["reason"]
    assert registry.get_sample_value("olp_stream_dlq_total", {"kind": "trajectory"}) == 1
    assert prepare_entry(config, topics, metrics, good).topic == topics.trajectories


def test_a_lone_surrogate_reaches_its_topic_from_the_worker_and_from_the_parent(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """In the worker, and in the parent, which spills a killed worker's records itself
    (before: both sent it to the DLQ)."""
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    records = [make_trajectory(session_id=f"s{i % 3}") for i in range(20)]
    odd = [_surrogate_feedback(), _surrogate_feedback()]
    try:
        sink.put_trajectory(records[0])
        sink.put_feedback(odd[0])
        for record in records[1:10]:
            sink.put_trajectory(record)
        assert sink.wait_idle(30)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # the worker confirms nothing more
        sink.put_feedback(odd[1])
        for record in records[10:]:
            sink.put_trajectory(record)
        _wait_for(lambda: len(sink._pending) == 11)
        os.kill(sink._proc.pid, signal.SIGKILL)  # the parent prepares and spills all 11
        _wait_for(lambda: sink.child_restarts == 1)
        assert sink.wait_idle(30)
        assert sink._thread.is_alive()
    finally:
        sink.close()
    assert _sample(registry, "olp_stream_dlq_total", kind="feedback") == 0
    assert _consume_ids(stream_config, 20) == {r["trajectory_id"] for r in records}
    feedback_topic = TopicNames.from_prefix(stream_config.topic_prefix).feedback
    read = [
        decode_record(r.value)
        for r in _read_topic(stream_config.bootstrap_servers, feedback_topic, 2)
    ]
    assert {e["event_id"]: e for e in read} == {e["event_id"]: e for e in odd}


# ---- a DLQ record the broker refuses for good ----------------------------------------------


class _DlqSizeLimit:
    """The producer as seen through a broker whose DLQ topic takes at most `limit` bytes:
    a larger record fails for good (MessageSizeTooLargeError is not retriable)."""

    def __init__(self, real: Any, dlq: str, limit: int) -> None:
        self.real, self.dlq, self.limit = real, dlq, limit

    def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> Any:
        if topic == self.dlq and len(value) > self.limit:
            future = FutureProduceResult(TopicPartition(topic, 0))
            return future.failure(MessageSizeTooLargeError("too large for the topic"))
        return self.real.send(topic, key=key, value=value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _oversized_invalid_trajectory() -> dict[str, Any]:
    record = make_trajectory(session_id="big")
    record["request"]["padding"] = "x" * 200_000
    record["status"] = "bogus"  # invalid: its ~200 KB DLQ envelope is what the DLQ refuses
    return record


@pytest.mark.parametrize(
    ("dlq_limit", "outcome"),
    [(64 * 1024, "truncated"), (1024, "dlq_dropped")],
)
def test_a_dlq_record_the_broker_refuses_does_not_block_the_stream(
    stream_config: StreamConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    dlq_limit: int,
    outcome: str,
) -> None:
    dlq = TopicNames.from_prefix(stream_config.topic_prefix).dlq
    new_producer = KafkaSink._new_producer
    monkeypatch.setattr(
        KafkaSink, "_new_producer", lambda self: _DlqSizeLimit(new_producer(self), dlq, dlq_limit)
    )
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    good = [make_trajectory(session_id="big") for _ in range(20)]
    try:
        sink.put_trajectory(_oversized_invalid_trajectory())
        for record in good:
            sink.put_trajectory(record)
        assert sink.wait_idle(30), "the refused DLQ record blocks the sink"
        assert _sample(registry, "olp_stream_spill_bytes") == 0
    finally:
        sink.close()
    assert _consume_ids(stream_config, 20) == {r["trajectory_id"] for r in good}
    rejected = _sample(registry, "olp_stream_failed_total", kind="dlq", reason="rejected")
    if outcome == "truncated":  # sent once more with its payload cut short
        assert rejected == 1
        [envelope] = _dlq_envelopes(stream_config, 1)
        assert "truncated" in envelope["reason"] and "too large" in envelope["reason"]
        assert len(envelope["raw"]) <= 4096
    else:  # the truncated copy was refused too: dropped, logged and counted
        assert rejected == 2
        assert _sample(registry, "olp_stream_failed_total", kind="dlq", reason="dlq_dropped") == 1


def test_a_spilled_dlq_record_over_the_request_size_does_not_block_the_spill(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The client itself refuses (at send) a spilled record larger than a lowered
    max_request_size_bytes: before, the whole segment was retried forever."""
    topics = TopicNames.from_prefix(stream_config.topic_prefix)
    big = prepare_entry(
        stream_config,
        topics,
        ProducerMetrics(CollectorRegistry()),
        QueuedRecord(RecordKind.TRAJECTORY, _oversized_invalid_trajectory()),
    )
    assert big is not None and big.topic == topics.dlq and len(big.value) > 200_000
    good = [make_trajectory(session_id="big") for _ in range(5)]
    metrics = ProducerMetrics(CollectorRegistry())
    entries = [big]
    for record in good:
        entry = prepare_entry(
            stream_config, topics, metrics, QueuedRecord(RecordKind.TRAJECTORY, record)
        )
        assert entry is not None
        entries.append(entry)
    spill = SpillStore(tmp_path / stream_config.spill_dir_name, 10**9, 10**8)
    assert spill.append(entries) == 6
    spill.close()

    config = stream_config.model_copy(update={"max_request_size_bytes": 64 * 1024})
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    try:
        assert sink.wait_idle(30), "the refused DLQ record blocks the spill"
        assert _sample(registry, "olp_stream_failed_total", kind="dlq", reason="rejected") == 1
    finally:
        sink.close()
    assert _consume_ids(config, 5) == {r["trajectory_id"] for r in good}
    [envelope] = _dlq_envelopes(config, 1)
    assert "truncated" in envelope["reason"]


# ---- a send that fails for a reason other than the record -----------------------------------


class _FailingSends:
    """Producers whose first `times` sends to `topic` fail with `error` (shared by every
    producer the sink makes, as a restarted broker fails the old producer only)."""

    def __init__(self, topic: str, error: KafkaError, times: int) -> None:
        self.topic, self.error, self.left = topic, error, times

    def wrap(self, real: Any) -> Any:
        failing = self

        class Producer:
            def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> Any:
                if topic == failing.topic and failing.left > 0:
                    failing.left -= 1
                    future = FutureProduceResult(TopicPartition(topic, 0))
                    return future.failure(failing.error)
                return real.send(topic, key=key, value=value)

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        return Producer()


@pytest.mark.parametrize(
    "error",
    [
        UnknownProducerIdError(),
        OutOfOrderSequenceNumberError(),
        KafkaError("Unexpected error in InitProducerIdResponse: [Error -1] UnknownError"),
    ],
    ids=["unknown_producer_id", "out_of_order_sequence", "init_producer_id"],
)
def test_a_producer_state_error_spills_the_record_and_sends_it_again(
    stream_config: StreamConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    error: KafkaError,
) -> None:
    """Not retriable, but not about the record: before, each such record became a DLQ
    envelope (dropped when the envelope failed the same way) and was never sent."""
    topics = TopicNames.from_prefix(stream_config.topic_prefix)
    sends = _FailingSends(topics.trajectories, error, times=2)
    new_producer = KafkaSink._new_producer
    monkeypatch.setattr(KafkaSink, "_new_producer", lambda self: sends.wrap(new_producer(self)))
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    records = [make_trajectory(session_id=f"p{i}") for i in range(6)]
    try:
        for record in records:
            sink.put_trajectory(record)
        assert sink.wait_idle(30)
    finally:
        sink.close()
    assert sends.left == 0
    assert _sample(registry, "olp_stream_spilled_total", kind="trajectory") >= 1
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="rejected") == 0
    assert _sample(registry, "olp_stream_dlq_total", kind="trajectory") == 0
    assert _sample(registry, "olp_stream_sent_total", kind="dlq") == 0
    assert _consume_ids(stream_config, 6) == {r["trajectory_id"] for r in records}


def test_a_record_the_broker_calls_invalid_goes_to_the_dlq(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error about the record itself is for good: its envelope goes to the DLQ, once."""
    topics = TopicNames.from_prefix(stream_config.topic_prefix)
    sends = _FailingSends(topics.trajectories, InvalidRecordError("refused"), times=1)
    new_producer = KafkaSink._new_producer
    monkeypatch.setattr(KafkaSink, "_new_producer", lambda self: sends.wrap(new_producer(self)))
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    refused, *rest = [make_trajectory(session_id="i") for _ in range(4)]
    try:
        sink.put_trajectory(refused)
        for record in rest:
            sink.put_trajectory(record)
        assert sink.wait_idle(30)
    finally:
        sink.close()
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="rejected") == 1
    assert _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 0
    assert _consume_ids(stream_config, 3) == {r["trajectory_id"] for r in rest}
    [envelope] = _dlq_envelopes(stream_config, 1)
    assert "InvalidRecordError" in envelope["reason"]


# ---- a failing disk ------------------------------------------------------------------------


class _Disk:
    """SpillStore writes fail with ENOSPC while `full` is set (for `times` writes, when given:
    the disk then has room again)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, times: int | None = None) -> None:
        self.full = True
        self.failures = 0
        write_frames = SpillStore._write_frames

        def failing(store: SpillStore, frames: list[bytes]) -> None:
            if self.full and (times is None or self.failures < times):
                self.failures += 1
                raise OSError(errno.ENOSPC, "No space left on device")
            write_frames(store, frames)

        monkeypatch.setattr(SpillStore, "_write_frames", failing)


def test_disk_errors_keep_the_sender_alive_and_lose_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()  # the broker is down at first: everything goes to the spill
    config = _config(f"127.0.0.1:{port}", queue_size=20)
    disk = _Disk(monkeypatch)
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path / "state", registry)
    records = [make_trajectory(session_id=f"d{i % 3}") for i in range(12)]
    broker = None
    try:
        for record in records[:6]:
            sink.put_trajectory(record)
        _wait_for(lambda: _sample(registry, "olp_stream_spill_errors_total") >= 1)
        assert sink._thread.is_alive()
        assert sink.held_records() == 6
        assert not sink.wait_idle(0.2)  # kept in memory: not durable, not idle
        disk.full = False
        for record in records[6:]:
            sink.put_trajectory(record)
        _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 12)
        assert sink.held_records() == 0
        broker = start_broker("127.0.0.1", port, tmp_path / "broker.log")
        assert sink.wait_idle(60)
        sink.close()
        assert _consume_ids(config, 12) == {r["trajectory_id"] for r in records}
    finally:
        sink.close()
        if broker is not None:
            broker.stop()


def test_put_never_raises_when_the_disk_fails_and_every_record_is_accounted_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config(f"127.0.0.1:{free_port()}", queue_size=2)
    disk = _Disk(monkeypatch)
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    try:
        for i in range(10):  # the queue is full at once: the caller spills, and fails
            sink.put_trajectory(make_trajectory(session_id=f"p{i}"))
        disk.full = False

        def accounted() -> float:
            spilled = _sample(registry, "olp_stream_spilled_total", kind="trajectory")
            lost = _sample(
                registry, "olp_stream_failed_total", kind="trajectory", reason="disk_error"
            )
            return spilled + lost

        _wait_for(lambda: accounted() == 10)
        assert sink._thread.is_alive()
    finally:
        sink.close()


def test_a_segment_close_failing_while_held_records_are_spilled_loses_none_of_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk refuses two records (held in memory), then takes them, but closing the
    segment sealed between them fails with EIO. Before: the store raised ValueError, which
    the sink did not expect, and the second held record was gone, uncounted."""
    config = _config(f"127.0.0.1:{free_port()}", queue_size=20, spill_segment_bytes=1024)
    disk = _Disk(monkeypatch)
    monkeypatch.setattr(
        spill_module, "open", lambda path, mode, buffering=-1: _SegmentFile(path, "a"), False
    )
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    records = [make_trajectory(session_id=f"e{i}") for i in range(2)]  # each over a segment
    try:
        for record in records:
            sink.put_trajectory(record)
        _wait_for(lambda: sink.held_records() == 2)
        _SegmentFile.fail_close = True
        disk.full = False
        _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 2)
        assert sink.durable_watermark() == 2
    finally:
        _SegmentFile.fail_close = False
        sink.close()
    spilled = [
        decode_record(entry.value)["trajectory_id"]
        for segment in sorted((tmp_path / config.spill_dir_name).glob("seg-*.spill"))
        for entry in read_segment(segment)
    ]
    assert spilled == [r["trajectory_id"] for r in records]
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="disk_error") == 0


def test_an_unexpected_error_from_the_spill_keeps_the_held_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the store raises, the records it was given (held ones included) stay in
    memory and are written later: raising out of the sink lost them, uncounted."""
    config = _config(f"127.0.0.1:{free_port()}", queue_size=20)
    disk = _Disk(monkeypatch)
    append = SpillStore.append
    broken = threading.Event()
    broken.set()

    def failing_append(store: SpillStore, entries: Any) -> int:
        if broken.is_set() and not disk.full:
            broken.clear()
            raise RuntimeError("a bug in the store")
        return append(store, entries)

    monkeypatch.setattr(SpillStore, "append", failing_append)
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    records = [make_trajectory(session_id=f"u{i}") for i in range(3)]
    try:
        for record in records[:2]:
            sink.put_trajectory(record)
        _wait_for(lambda: sink.held_records() == 2)
        disk.full = False
        sink.put_trajectory(records[2])
        _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 3)
        assert not broken.is_set()
        assert sink.durable_watermark() == 3
    finally:
        sink.close()
    spilled = [
        decode_record(entry.value)["trajectory_id"]
        for segment in sorted((tmp_path / config.spill_dir_name).glob("seg-*.spill"))
        for entry in read_segment(segment)
    ]
    assert spilled == [r["trajectory_id"] for r in records]


def test_a_parent_disk_error_hands_a_dead_workers_records_to_the_next_worker(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    records = [make_trajectory(session_id=f"w{i % 2}") for i in range(10)]
    try:
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)
        for record in records:
            sink.put_trajectory(record)
        _wait_for(lambda: len(sink._pending) == 10)
        _Disk(monkeypatch)  # the parent's disk only: the worker is another process
        os.kill(sink._proc.pid, signal.SIGKILL)
        _wait_for(lambda: sink.child_restarts == 1)
        assert sink._thread.is_alive()
        assert sink.wait_idle(60)
        assert _sample(registry, "olp_stream_spill_errors_total") >= 1
    finally:
        sink.close()
    sink.put_trajectory(make_trajectory(session_id="late"))  # after close: spilled here, fails
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="disk_error") == 1
    assert _consume_ids(stream_config, 10) == {r["trajectory_id"] for r in records}


def test_a_dead_lettered_record_the_parent_disk_refused_is_counted_once_by_the_next_worker(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parent makes the DLQ envelope of a dead worker's record (counted); the disk
    refuses it, so the next worker takes the envelope as it is, not the record again."""
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    try:
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # it never prepares the record
        sink.put_feedback(_dead_letter_feedback())
        _wait_for(lambda: len(sink._pending) == 1)
        disk = _Disk(monkeypatch)  # the parent's disk only: the worker is another process
        os.kill(sink._proc.pid, signal.SIGKILL)
        _wait_for(lambda: sink.child_restarts == 1)
        assert sink.wait_idle(60)
        assert disk.failures >= 1
    finally:
        sink.close()
    assert _sample(registry, "olp_stream_dlq_total", kind="feedback") == 1
    [envelope] = _dlq_envelopes(stream_config, 1)
    assert "kind" in envelope["reason"] and envelope["record"]["kind"] == "like"


def test_a_dead_lettered_record_retried_after_a_parent_disk_error_at_close_is_counted_once(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no worker left, the parent retries the disk with the DLQ envelope it made, not
    by preparing the record (and counting it) again."""
    closing = threading.Event()
    close_child = KafkaSinkProcess._close_child

    def close_child_signalled(self: KafkaSinkProcess) -> None:
        closing.set()
        close_child(self)

    monkeypatch.setattr(KafkaSinkProcess, "_close_child", close_child_signalled)
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    closer = threading.Thread(target=sink.close)
    try:
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # it never confirms the record
        sink.put_feedback(_dead_letter_feedback())
        _wait_for(lambda: len(sink._pending) == 1)
        disk = _Disk(monkeypatch, times=1)  # the parent's first write fails, the retry not
        closer.start()
        assert closing.wait(30)
        os.kill(sink._proc.pid, signal.SIGKILL)  # the worker dies while it is being closed
        closer.join(60)
        assert not closer.is_alive()
        assert disk.failures == 1
    finally:
        sink.close()
    assert _sample(registry, "olp_stream_dlq_total", kind="feedback") == 1
    assert _sample(registry, "olp_stream_spilled_total", kind="dlq") == 1
    assert _sample(registry, "olp_stream_failed_total", kind="dlq", reason="disk_error") == 0


# ---- a damaged spill -----------------------------------------------------------------------


def test_an_unreadable_and_a_corrupt_segment_are_set_aside_and_the_rest_is_sent(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: EIO on the oldest segment was retried forever and every newer record queued
    up behind it; a corrupt frame in the middle lost the rest of its segment silently."""
    topics = TopicNames.from_prefix(stream_config.topic_prefix)
    metrics = ProducerMetrics(CollectorRegistry())
    spill = SpillStore(tmp_path / stream_config.spill_dir_name, 10**9, 10**8)
    batches = [[make_trajectory(session_id=f"q{i}") for i in range(5)] for _ in range(3)]
    for batch in batches:  # one segment each
        entries = [
            prepare_entry(
                stream_config, topics, metrics, QueuedRecord(RecordKind.TRAJECTORY, record)
            )
            for record in batch
        ]
        assert spill.append([entry for entry in entries if entry is not None]) == 5
        spill.close()
    unreadable, corrupt, _ = sorted(spill.directory.glob("seg-*.spill"))
    data = bytearray(corrupt.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the third of five frames
    corrupt.write_bytes(bytes(data))
    read_bytes = Path.read_bytes

    def failing(path: Path) -> bytes:
        if path == unreadable:
            raise OSError(errno.EIO, "Input/output error")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", failing)
    monkeypatch.setattr(producer_module, "_SPILL_READ_RETRY_S", 0.05)
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    later = [make_trajectory(session_id="later") for _ in range(3)]
    try:
        for record in later:
            sink.put_trajectory(record)
        assert sink.wait_idle(60), "the unreadable segment holds back the spill"
        assert _sample(registry, "olp_stream_broker_up") == 1  # the disk failed, not the broker
    finally:
        sink.close()
    quarantined = "olp_stream_spill_quarantined_total"
    assert _sample(registry, quarantined, reason="read_error") == 1
    assert _sample(registry, quarantined, reason="corrupt") == 1
    kept = sorted(p.name for p in (spill.directory / "quarantine").iterdir())
    assert kept == [unreadable.name, corrupt.name]
    expected = [batches[1][i] for i in (0, 1, 3, 4)] + batches[2] + later
    assert _consume_ids(stream_config, len(expected)) == {r["trajectory_id"] for r in expected}


def test_the_broker_probe_reaches_a_bracketed_ipv6_bootstrap() -> None:
    """`[::1]:9092` (the config's IPv6 form) was probed with its brackets, never resolved,
    and the sink spilled every record without a word while consumers reached the broker."""
    import socket

    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as listener:
        listener.bind(("::1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        assert producer_module.tcp_reachable(f"[::1]:{port}")
        assert producer_module.tcp_reachable(f"127.0.0.1:9, [::1]:{port}")
    assert not producer_module.tcp_reachable(f"[::1]:{port}", timeout_s=0.5)


def test_a_put_to_a_full_queue_is_spilled_behind_the_records_still_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A put that found the queue full was spilled alone, at once: the spill is drained
    before the queue, so it reached the broker ahead of the older records of its session
    still waiting in the queue (r0, r3, r1, r2). Now the queue's records are spilled ahead
    of it. A stand-in broker that holds its acknowledgement of the first batch."""
    import json
    from types import SimpleNamespace

    acked: list[str] = []
    release = threading.Event()

    class _SlowProducer:
        def __init__(self, **options: Any) -> None:
            self.futures: list[tuple[Any, bytes]] = []

        def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> Any:
            future = SimpleNamespace(done=False, exception=None)
            future.succeeded = lambda: future.done
            future.failed = lambda: False
            self.futures.append((future, value))
            return future

        def flush(self, timeout: float | None = None) -> None:
            release.wait(10)
            for future, value in self.futures:
                future.done = True
                acked.append(json.loads(value)["task"])
            self.futures = []

        def close(self, timeout: float | None = None) -> None:
            pass

    monkeypatch.setattr(producer_module, "KafkaProducer", _SlowProducer)
    monkeypatch.setattr(producer_module, "ensure_topics", lambda config: [])
    monkeypatch.setattr(producer_module, "tcp_reachable", lambda servers, timeout_s=1.0: True)
    monkeypatch.setattr(producer_module, "producer_id_missing", lambda producer: False)
    config = StreamConfig(
        bootstrap_servers=f"127.0.0.1:{free_port()}", queue_size=2, producer_batch_records=1
    )
    sink = KafkaSink(config, tmp_path, CollectorRegistry())
    records = [make_trajectory(session_id="S") for _ in range(4)]
    for index, record in enumerate(records):
        record["task"] = f"r{index}"
    try:
        sink.put_trajectory(records[0])
        deadline = time.monotonic() + 10
        while sink._queue.qsize() and time.monotonic() < deadline:
            time.sleep(0.01)  # r0 taken; its flush waits for the acknowledgement
        for record in records[1:]:  # r1 and r2 fill the queue, r3 finds it full
            sink.put_trajectory(record)
        release.set()
        assert sink.wait_idle(10)
    finally:
        release.set()
        sink.close()
    assert acked == ["r0", "r1", "r2", "r3"]
