"""Draining the spill, and ids that stay the same when a record is made twice.

No broker: the sink's producer is a stand-in whose answers each test picks, and the drain
is driven by hand once the sink's own thread has stopped.
"""

from __future__ import annotations

import errno
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import MessageSizeTooLargeError, RequestTimedOutError
from kafka.producer.future import FutureProduceResult
from prometheus_client import CollectorRegistry

import replay.producer as producer_module
from deploy.ports import free_port
from replay.config import StreamConfig
from replay.producer import KafkaSink, ProducerMetrics, QueuedRecord, prepare_entry
from replay.schemas import RecordKind, decode_record
from replay.sink_process import _CaptureBuilder
from replay.spill import READ_ATTEMPTS, SpillEntry, SpillReadError, SpillStore
from replay.synthetic import make_feedback, make_trajectory
from replay.topics import TopicNames
from tests.replay.test_outage import _sample
from tests.replay.test_sink_process import build_from_capture

# What the stand-in broker answers to one send: acknowledged, or failed with this error.
Answer = Callable[[SpillEntry], BaseException | None]


class _Logs:
    """Stands in for a module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def __getattr__(self, level: str) -> Callable[..., None]:
        def record(event: str, **fields: Any) -> None:
            self.lines.append((level, event, fields))

        return record

    def events(self, name: str) -> list[dict[str, Any]]:
        return [fields for _, event, fields in self.lines if event == name]


class _Producer:
    """A KafkaProducer as `KafkaSink._send` uses it; `answer` decides each send."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.sent: list[SpillEntry] = []

    def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> Any:
        entry = SpillEntry(topic, key, value)
        self.sent.append(entry)
        future = FutureProduceResult(TopicPartition(topic, 0))
        error = self.answer(entry)
        return future.success(None) if error is None else future.failure(error)

    def flush(self, timeout: float | None = None) -> None:
        pass

    def close(self, timeout: float | None = None) -> None:
        pass


def _config() -> StreamConfig:
    return StreamConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", close_timeout_s=0.5)


def _spill_segments(config: StreamConfig, state_dir: Path, *batches: list[SpillEntry]) -> None:
    spill = SpillStore(state_dir / config.spill_dir_name, 10**9, 10**8)
    for batch in batches:  # one segment each
        assert spill.append(batch) == len(batch)
        spill.close()


def _entries(config: StreamConfig, records: list[dict[str, Any]]) -> list[SpillEntry]:
    topics = TopicNames.from_prefix(config.topic_prefix)
    metrics = ProducerMetrics(CollectorRegistry())
    entries = []
    for record in records:
        entry = prepare_entry(config, topics, metrics, QueuedRecord(RecordKind.TRAJECTORY, record))
        assert entry is not None and entry.topic == topics.trajectories
        entries.append(entry)
    return entries


def _stopped_sink(config: StreamConfig, state_dir: Path, registry: CollectorRegistry) -> KafkaSink:
    """A sink whose thread has ended (the broker was never there): the test drains."""
    sink = KafkaSink(config, state_dir, registry)
    sink.close()
    return sink


# ---- what the drain logs --------------------------------------------------------------------


def test_a_segment_quarantined_unread_is_not_logged_as_drained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: after the segment went to quarantine/ unread, `spill_segment_drained
    records=0` followed, as if its records had been delivered."""
    config = _config()
    records = [make_trajectory(session_id="q") for _ in range(3)]
    _spill_segments(config, tmp_path, _entries(config, records))
    registry = CollectorRegistry()
    sink = _stopped_sink(config, tmp_path, registry)
    [segment] = list(sink.spill.directory.glob("seg-*.spill"))
    read_bytes = Path.read_bytes

    def failing(path: Path) -> bytes:
        if path == segment:
            raise OSError(errno.EIO, "Input/output error")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", failing)
    logs = _Logs()
    monkeypatch.setattr(producer_module, "log", logs)
    producer = _Producer(lambda entry: None)
    sink._producer = producer  # type: ignore[assignment]
    for _ in range(READ_ATTEMPTS - 1):
        with pytest.raises(SpillReadError):
            sink._drain_one_segment()
    sink._drain_one_segment()  # the last failed read sets it aside
    assert sink.spill.is_empty()
    assert producer.sent == []
    assert logs.events("spill_segment_drained") == []
    [line] = logs.events("spill_segment_set_aside")
    assert line["reason"] == "read_error" and line["records_sent"] == 0
    assert _sample(registry, "olp_stream_spill_quarantined_total", reason="read_error") == 1


def test_a_corrupt_segment_is_logged_as_set_aside_with_the_records_it_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its intact records are sent, and the file goes to quarantine/: `drained` (the file
    deleted, every record delivered) was not true of it."""
    config = _config()
    records = [make_trajectory(session_id="c") for _ in range(5)]
    _spill_segments(config, tmp_path, _entries(config, records))
    sink = _stopped_sink(config, tmp_path, CollectorRegistry())
    [segment] = list(sink.spill.directory.glob("seg-*.spill"))
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the third of five frames
    segment.write_bytes(bytes(data))
    logs = _Logs()
    monkeypatch.setattr(producer_module, "log", logs)
    producer = _Producer(lambda entry: None)
    sink._producer = producer  # type: ignore[assignment]
    sink._drain_one_segment()
    assert len(producer.sent) == 4
    assert logs.events("spill_segment_drained") == []
    [line] = logs.events("spill_segment_set_aside")
    assert line["reason"] == "corrupt" and line["records_sent"] == 4
    assert [p.name for p in (sink.spill.directory / "quarantine").iterdir()] == [segment.name]


def test_a_drained_segment_is_logged_as_drained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _config()
    _spill_segments(config, tmp_path, _entries(config, [make_trajectory(session_id="d")] * 2))
    sink = _stopped_sink(config, tmp_path, CollectorRegistry())
    logs = _Logs()
    monkeypatch.setattr(producer_module, "log", logs)
    sink._producer = _Producer(lambda entry: None)  # type: ignore[assignment]
    sink._drain_one_segment()
    assert [line["records"] for line in logs.events("spill_segment_drained")] == [2]
    assert logs.events("spill_segment_set_aside") == []
    assert sink.spill.is_empty()


# ---- an interrupted drain ---------------------------------------------------------------------


def test_an_interrupted_drain_resends_only_what_was_not_acknowledged(tmp_path: Path) -> None:
    """Before: the whole segment was sent again, so the acknowledged records arrived twice
    and the record the broker refuses for good got a second DLQ envelope (and a second
    `rejected` count) on every retry."""
    config = _config()
    topics = TopicNames.from_prefix(config.topic_prefix)
    refused, flaky, fine, last = _entries(
        config, [make_trajectory(session_id=f"r{i}") for i in range(4)]
    )
    _spill_segments(config, tmp_path, [refused, flaky, fine, last])
    registry = CollectorRegistry()
    sink = _stopped_sink(config, tmp_path, registry)
    attempts = {"flaky": 0}

    def answer(entry: SpillEntry) -> BaseException | None:
        if entry == refused:
            return MessageSizeTooLargeError("too large for the topic")
        if entry == flaky:
            attempts["flaky"] += 1
            if attempts["flaky"] == 1:
                return RequestTimedOutError("no answer in time")  # retriable
        return None

    first = _Producer(answer)
    sink._producer = first  # type: ignore[assignment]
    sink._drain_one_segment()
    assert sink._producer is None  # the broker is taken as down; the segment stays
    assert not sink.spill.is_empty()
    second = _Producer(answer)
    sink._producer = second  # type: ignore[assignment]
    sink._drain_one_segment()
    assert sink.spill.is_empty()
    assert second.sent == [flaky]
    delivered = [e for e in first.sent + second.sent if e != refused and e.topic != topics.dlq]
    assert delivered == [flaky, fine, last, flaky]  # each acknowledged once
    envelopes = [decode_record(e.value) for e in first.sent + second.sent if e.topic == topics.dlq]
    assert len(envelopes) == 1
    assert envelopes[0]["source_topic"] == topics.trajectories
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="rejected") == 1
    assert _sample(registry, "olp_stream_sent_total", kind="trajectory") == 3


def test_an_unacknowledged_dlq_envelope_is_what_the_retry_sends(tmp_path: Path) -> None:
    """The envelope of a refused record that the broker then did not acknowledge is sent
    again as it is, in the refused record's place (not the record, which would be refused
    and counted again)."""
    config = _config()
    topics = TopicNames.from_prefix(config.topic_prefix)
    refused, fine = _entries(config, [make_trajectory(session_id=f"e{i}") for i in range(2)])
    _spill_segments(config, tmp_path, [refused, fine])
    registry = CollectorRegistry()
    sink = _stopped_sink(config, tmp_path, registry)
    dlq_answers = iter([RequestTimedOutError("no answer in time"), None])

    def answer(entry: SpillEntry) -> BaseException | None:
        if entry == refused:
            return MessageSizeTooLargeError("too large for the topic")
        return next(dlq_answers) if entry.topic == topics.dlq else None

    first = _Producer(answer)
    sink._producer = first  # type: ignore[assignment]
    sink._drain_one_segment()
    [envelope] = [e for e in first.sent if e.topic == topics.dlq]
    second = _Producer(answer)
    sink._producer = second  # type: ignore[assignment]
    sink._drain_one_segment()
    assert second.sent == [envelope]
    assert sink.spill.is_empty()
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="rejected") == 1


# ---- ids of a record made twice -----------------------------------------------------------------


def test_a_capture_built_twice_is_the_same_record_with_the_same_event_id() -> None:
    """Before: each build drew a fresh event_id, so the parent's rebuild of a capture its dead
    worker had already sent was a second record to every consumer de-duplicating by
    event_id."""
    capture = ({"id": uuid.uuid4().hex, "session": "b"}, "ok")
    in_worker, in_parent = _CaptureBuilder(), _CaptureBuilder()
    in_worker.build_record = in_parent.build_record = build_from_capture
    first, again = in_worker.build(capture), in_parent.build(capture)
    assert first is not None and again is not None
    assert first["event_id"] == again["event_id"]
    assert len(first["event_id"]) == 32 and int(first["event_id"], 16) >= 0
    other = in_worker.build(({"id": uuid.uuid4().hex, "session": "b"}, "ok"))
    assert other is not None and other["event_id"] != first["event_id"]


def test_a_worker_counts_an_outcome_only_once_its_record_is_durable() -> None:
    """What the worker reports is not counted again by a parent that builds the rest."""
    builder = _CaptureBuilder()
    builder.build_record = build_from_capture
    for position in range(3):
        builder.build(({"id": uuid.uuid4().hex, "session": "o"}, "ok"), position)
    builder.build(({"broken": True}, "ok"), 3)
    assert builder.totals() == ({}, 0)  # built, not durable yet
    builder.release(2)
    assert builder.totals() == ({("ok", True): 2}, 0)
    builder.release(4)
    assert builder.totals() == ({("ok", True): 3}, 1)


def test_the_dlq_envelopes_of_one_record_share_an_event_id() -> None:
    """The worker and the parent of a dead worker each make the envelope of the same invalid
    record: before, two event_ids, so a DLQ reader could not tell a repeat from a second
    rejected record."""
    config = StreamConfig()
    topics = TopicNames.from_prefix(config.topic_prefix)
    event = make_feedback(make_trajectory(session_id="x"), kind="like")
    metrics = ProducerMetrics(CollectorRegistry())
    first = prepare_entry(config, topics, metrics, QueuedRecord(RecordKind.FEEDBACK, dict(event)))
    again = prepare_entry(config, topics, metrics, QueuedRecord(RecordKind.FEEDBACK, dict(event)))
    assert first is not None and again is not None
    assert first.topic == again.topic == topics.dlq
    first_id = decode_record(first.value)["event_id"]
    assert first_id == decode_record(again.value)["event_id"]
    assert first_id != event["event_id"]
    other = dict(event, event_id=uuid.uuid4().hex)
    third = prepare_entry(config, topics, metrics, QueuedRecord(RecordKind.FEEDBACK, other))
    assert third is not None and decode_record(third.value)["event_id"] != first_id


def test_a_batch_after_an_outage_waits_behind_a_drained_segment_not_dropped_by_a_full_spill(
    tmp_path: Path,
) -> None:
    """An outage filled the spill to its cap. Once the broker answered again, the next
    batch was appended behind the full spill first, and dropped (`spill_full`), with the
    broker there to take it; the drain came after. Now the oldest segment goes first and
    the batch is stored behind the rest, in order."""
    config = _config()
    old_first, old_second, new = (
        _entries(config, [make_trajectory(session_id="s") for _ in range(count)])
        for count in (3, 3, 2)  # the new batch fits where the first segment was
    )
    _spill_segments(config, tmp_path, old_first, old_second)
    full = SpillStore(tmp_path / config.spill_dir_name, 10**9, 10**8).total_bytes()
    config = config.model_copy(update={"spill_max_bytes": full})
    registry = CollectorRegistry()
    sink = _stopped_sink(config, tmp_path, registry)
    sink._close_deadline = None  # as a running sink's
    producer = _Producer(lambda entry: None)
    sink._producer = producer  # type: ignore[assignment]
    sink._step(new)
    assert not _sample(registry, "olp_stream_failed_total", kind="any", reason="spill_full")
    while not sink.spill.is_empty():
        sink._drain_one_segment()
    assert producer.sent == old_first + old_second + new
