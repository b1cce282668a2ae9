"""Producer and consumer against the real broker: round trip, keys, DLQ, DLQ ratio."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError, KafkaTimeoutError
from kafka.partitioner.default import murmur2 as kafka_murmur2
from prometheus_client import CollectorRegistry

import replay.consumer as consumer_module
from proxy.operator_data import topic_end_offsets
from replay.config import StreamConfig
from replay.consumer import DlqRatioExceeded, ScoredTrajectory, TrajectoryConsumer
from replay.export import export_records, read_export
from replay.producer import KafkaSink
from replay.schemas import decode_record, dlq_envelope, encode_record
from replay.synthetic import make_feedback, make_trajectory
from replay.topics import TopicNames, ensure_topics
from tests.replay.conftest import consume_until


def _read_topic(bootstrap: str, topic: str, expected: int) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        consumer.assign(tps)
        consumer.seek_to_beginning()
        records: list = []
        for _ in range(100):
            for batch in consumer.poll(200).values():
                records.extend(batch)
            if len(records) >= expected:
                break
        return records
    finally:
        consumer.close()


def test_ensure_topics_is_idempotent(stream_config: StreamConfig) -> None:
    names = TopicNames.from_prefix(stream_config.topic_prefix)
    assert sorted(ensure_topics(stream_config)) == sorted(names.all())
    assert ensure_topics(stream_config) == []
    consumer = KafkaConsumer(bootstrap_servers=stream_config.bootstrap_servers, group_id=None)
    try:
        assert {name: len(consumer.partitions_for_topic(name)) for name in names.all()} == {
            name: stream_config.partitions for name in names.all()
        }
    finally:
        consumer.close()


def test_round_trip_of_1000_trajectories(stream_config: StreamConfig, tmp_path: Path) -> None:
    rng = random.Random(4)
    sessions = [f"session-{i}" for i in range(37)]
    trajectories = [
        make_trajectory(
            session_id=rng.choice(sessions), prompt_tokens=40, completion_tokens=20, rng=rng
        )
        for _ in range(1000)
    ]
    # Zero join window: feedback counts when stamped no later than its trajectory.
    feedback = [
        make_feedback(t, kind="score", value=rng.random(), created_at=t["created_at"])
        for t in trajectories[:100]
    ]
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    for trajectory in trajectories:
        sink.put_trajectory(trajectory)
    for event in feedback:
        sink.put_feedback(event)
    assert sink.wait_idle(60)
    sink.close()
    assert registry.get_sample_value("olp_stream_sent_total", {"kind": "trajectory"}) == 1000
    assert registry.get_sample_value("olp_stream_sent_total", {"kind": "feedback"}) == 100
    assert registry.get_sample_value("olp_stream_spill_bytes") == 0

    consumer_registry = CollectorRegistry()
    with TrajectoryConsumer(stream_config, registry=consumer_registry) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 1000)
        assert consumer.poll(0.5) == []
        assert consumer.stats.invalid == 0 and consumer.stats.duplicates == 0
    assert consumer_registry.get_sample_value("olp_consumer_yielded_total") == 1000
    assert consumer_registry.get_sample_value("olp_consumer_feedback_joined_total") == 100
    assert consumer_registry.get_sample_value("olp_consumer_waiting") == 0
    by_id = {s.trajectory["trajectory_id"]: s for s in scored}
    assert len(by_id) == len(scored) == 1000
    for trajectory in trajectories:
        assert by_id[trajectory["trajectory_id"]].trajectory == trajectory
    for event in feedback:
        assert by_id[event["trajectory_id"]].feedback == [event]
    # A session's trajectories and feedback share one partition index: the one kafka-python's
    # (and the Java client's) default partitioner gives its key, which the sink's own
    # partitioner computes in fewer steps.
    partition_of_session: dict[str, int] = {}
    for s in scored:
        session = s.trajectory["session_id"]
        assert partition_of_session.setdefault(session, s.partition) == s.partition
        assert s.partition == (kafka_murmur2(session.encode()) & 0x7FFFFFFF) % 4
    assert len(set(partition_of_session.values())) == 4  # 37 sessions: every partition used


def test_invalid_records_go_to_the_dlq_with_the_reason(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    names = TopicNames.from_prefix(stream_config.topic_prefix)
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    good = make_trajectory(session_id="s1")
    bad = make_trajectory(session_id="s1")
    del bad["prompt_token_ids"]
    sink.put_trajectory(good)
    sink.put_trajectory(bad)
    sink.put_feedback({"trajectory_id": good["trajectory_id"], "kind": "accept"})
    assert sink.wait_idle(30)
    sink.close()
    assert registry.get_sample_value("olp_stream_dlq_total", {"kind": "trajectory"}) == 1
    assert registry.get_sample_value("olp_stream_dlq_total", {"kind": "feedback"}) == 1

    # A record that bypassed the producer's validation is caught by the consumer.
    raw = KafkaProducer(bootstrap_servers=stream_config.bootstrap_servers, acks="all")
    raw.send(names.trajectories, key=b"s1", value=b"{not json")
    raw.flush()
    raw.close()

    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 1)
        assert [s.trajectory for s in scored] == [good]
        assert consumer.stats.invalid == 1
        assert consumer.stats.dlq_seen == 2

    envelopes = [
        decode_record(r.value) for r in _read_topic(stream_config.bootstrap_servers, names.dlq, 3)
    ]
    by_origin = sorted((e["origin"], e["kind"]) for e in envelopes)
    assert by_origin == [
        ("consumer", "trajectory"),
        ("producer", "feedback"),
        ("producer", "trajectory"),
    ]
    reasons = {(e["origin"], e["kind"]): e["reason"] for e in envelopes}
    assert "prompt_token_ids" in reasons[("producer", "trajectory")]
    assert "schema_version" in reasons[("producer", "feedback")]
    assert "Expecting" in reasons[("consumer", "trajectory")]
    producer_traj = next(
        e for e in envelopes if e["origin"] == "producer" and e["kind"] == "trajectory"
    )
    assert producer_traj["record"] == bad
    consumer_traj = next(e for e in envelopes if e["origin"] == "consumer")
    assert consumer_traj["raw"] == "{not json"
    assert consumer_traj["source_topic"] == names.trajectories


def test_lone_surrogates_reach_their_topics_and_read_back_unchanged(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A client's JSON may carry `"\\ud800"`, which json.loads turns into a lone surrogate
    (UTF-8 has none): the record is written with its escape and read back as it was, by the
    consumer and by an export (before: it went to the DLQ)."""
    names = TopicNames.from_prefix(stream_config.topic_prefix)
    odd = "tab\ud800le \udc80"
    trajectory = make_trajectory(session_id="s\udcff", prompt=f"Say {odd}.")
    trajectory["choices"][0]["message"]["content"] = odd
    event = make_feedback(trajectory, created_at=trajectory["created_at"])
    event["metadata"] = {odd: odd}
    plain = make_trajectory(session_id="s1")
    registry = CollectorRegistry()
    sink = KafkaSink(stream_config, tmp_path, registry)
    sink.put_trajectory(trajectory)
    sink.put_feedback(event)
    sink.put_trajectory(plain)
    assert sink.wait_idle(30)
    sink.close()
    assert registry.get_sample_value("olp_stream_sent_total", {"kind": "trajectory"}) == 2
    assert registry.get_sample_value("olp_stream_sent_total", {"kind": "feedback"}) == 1
    assert registry.get_sample_value("olp_stream_dlq_total", {"kind": "trajectory"}) is None

    [raw] = [
        r
        for r in _read_topic(stream_config.bootstrap_servers, names.trajectories, 2)
        if r.key == "s\udcff".encode("utf-8", "surrogatepass")
    ]
    raw.value.decode("utf-8")  # strict UTF-8 on the wire
    assert b"tab\\ud800le \\udc80" in raw.value

    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 2)
        assert consumer.stats.invalid == 0 and consumer.stats.dlq_seen == 0
    by_id = {s.trajectory["trajectory_id"]: s for s in scored}
    assert by_id[trajectory["trajectory_id"]].trajectory == trajectory
    assert by_id[trajectory["trajectory_id"]].feedback == [event]
    assert by_id[plain["trajectory_id"]].trajectory == plain

    result = export_records(stream_config, tmp_path / "export.jsonl")
    assert result.counts == {"trajectories": 2, "feedback": 1} and result.invalid == 0
    exported = {item["record"]["event_id"]: item["record"] for item in read_export(result.path)}
    assert exported == {r["event_id"]: r for r in (trajectory, event, plain)}


def _send_raw(config: StreamConfig, values: list[bytes | None], partition: int = 0) -> None:
    """Write values to one trajectories partition as a foreign producer would."""
    topic = TopicNames.from_prefix(config.topic_prefix).trajectories
    ensure_topics(config)
    raw = KafkaProducer(
        bootstrap_servers=config.bootstrap_servers,
        acks="all",
        max_request_size=config.max_request_size_bytes,
    )
    for value in values:
        raw.send(topic, key=b"k", value=value, partition=partition)
    raw.flush()
    raw.close()


def _send_to(config: StreamConfig, topic: str, values: list[bytes | None]) -> None:
    raw = KafkaProducer(bootstrap_servers=config.bootstrap_servers, acks="all")
    for value in values:
        raw.send(topic, key=b"k", value=value, partition=0)
    raw.flush()
    raw.close()


def _dlq_envelopes(config: StreamConfig, expected: int) -> list[Any]:
    """The records on the DLQ topic, decoded."""
    names = TopicNames.from_prefix(config.topic_prefix)
    return [
        decode_record(r.value) for r in _read_topic(config.bootstrap_servers, names.dlq, expected)
    ]


def _records_on(config: StreamConfig, topic: str) -> int:
    return sum(topic_end_offsets(config.bootstrap_servers, [topic], timeout_s=5)[topic].values())


def _poll_until(consumer: TrajectoryConsumer, done: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"not reached in time: {consumer.stats}"
        consumer.poll(0.2)


def test_a_record_without_a_value_is_skipped_as_a_tombstone_not_rejected(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A tombstone (null value) from a foreign producer or a tool, on any of the three
    topics: before, the consumer's poll and the export raised TypeError on it; then it was
    counted as a rejected record of ours (a DLQ envelope, `invalid`, weight in the DLQ
    ratio), and on the DLQ topic as a producer's rejection (`dlq_seen`)."""
    names = names_of(stream_config)
    good = [make_trajectory(session_id="k") for _ in range(2)]
    _send_raw(stream_config, [encode_record(good[0]), None, encode_record(good[1])])
    _send_to(stream_config, names.feedback, [None])
    _send_to(stream_config, names.dlq, [None])
    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 2)
        assert [s.trajectory for s in scored] == good
        _poll_until(consumer, consumer.caught_up)
        assert consumer.stats.tombstones == 3
        assert consumer.stats.invalid == 0 and consumer.stats.dlq_seen == 0
        offsets = consumer.processed_offsets()  # past every tombstone
        assert offsets[names.trajectories][0] == 3
        assert offsets[names.feedback][0] == 1 and offsets[names.dlq][0] == 1
    assert _records_on(stream_config, names.dlq) == 1  # the tombstone: no envelope made
    result = export_records(stream_config, tmp_path / "export.jsonl")
    assert result.counts == {"trajectories": 2}
    assert result.invalid == 0 and result.tombstones == 2


def test_one_record_rejected_twice_gives_envelopes_with_one_event_id(
    stream_config: StreamConfig,
) -> None:
    """A consumer that resumes before a rejection rejects the record again; a producer may
    make a record's envelope twice (a resent spill segment, a dead sink worker). Before:
    a new event_id each time, so a DLQ reader could not drop the repeat, and the consumer
    counted a repeated producer envelope twice in `dlq_seen` (and the DLQ ratio)."""
    names = names_of(stream_config)
    _send_raw(stream_config, [b"{not json"])
    for _ in range(2):  # the second consumer resumes from the start, as after a crash
        with TrajectoryConsumer(stream_config) as consumer:
            _poll_until(consumer, lambda c=consumer: c.stats.invalid == 1)
    envelopes = [
        decode_record(r.value) for r in _read_topic(stream_config.bootstrap_servers, names.dlq, 2)
    ]
    assert [e["origin"] for e in envelopes] == ["consumer", "consumer"]
    assert envelopes[0]["event_id"] == envelopes[1]["event_id"]

    repeated = dlq_envelope(
        reason="x", source_topic=names.feedback, origin="producer", kind="feedback", raw=b"{}"
    )
    other = dict(repeated, event_id="e" * 32)
    _send_to(stream_config, names.dlq, [encode_record(repeated)] * 2 + [encode_record(other)])
    with TrajectoryConsumer(stream_config) as consumer:
        _poll_until(consumer, consumer.caught_up)
        assert consumer.stats.dlq_seen == 2 and consumer.stats.duplicates == 1


def test_a_producer_envelope_is_counted_once_across_a_failed_batch_and_a_restart(
    stream_config: StreamConfig,
) -> None:
    """`dlq_seen` feeds the DLQ ratio that can stop the learner. A batch that fails on a DLQ
    record is read again from that record only (the ones before it were counted and are
    not re-read), and a consumer resuming from `processed_offsets()` reads nothing of the DLQ
    before its resume point (no look-back on that topic): each envelope is counted once."""
    names = names_of(stream_config)
    envelope = dlq_envelope(
        reason="x", source_topic=names.feedback, origin="producer", kind="feedback", raw=b"{}"
    )
    _send_to(
        stream_config,
        names.dlq,
        [encode_record(dict(envelope, event_id=f"{i}" * 32)) for i in range(3)],
    )
    with TrajectoryConsumer(stream_config) as consumer:
        count_dlq = consumer._count_dlq
        calls: list[int] = []

        def failing_once(record: Any) -> None:
            calls.append(record.offset)
            if len(calls) == 2:
                raise RuntimeError("handling failed")
            count_dlq(record)

        consumer._count_dlq = failing_once  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            _poll_until(consumer, lambda: len(calls) >= 2)
        _poll_until(consumer, consumer.caught_up)
        assert calls == [0, 1, 1, 2]  # from the failed record on, not the batch again
        assert consumer.stats.dlq_seen == 3 and consumer.stats.duplicates == 0
        offsets = consumer.processed_offsets()
    assert offsets[names.dlq][0] == 3
    with TrajectoryConsumer(stream_config, offsets) as resumed:
        _poll_until(resumed, resumed.caught_up)
        assert resumed.poll(0.5) == []
        assert resumed.stats.dlq_seen == 0 and resumed.stats.records == 0


def test_a_large_invalid_record_does_not_wedge_the_consumer(stream_config: StreamConfig) -> None:
    """An invalid record the topic takes (up to max_request_size_bytes) but whose DLQ
    envelope the consumer's producer refused (over its 1 MiB request size): before, every
    poll raised MessageSizeTooLargeError on it, so a learner restarted into the same crash."""
    good = [make_trajectory(session_id="k") for _ in range(2)]
    big = b'{"schema_version": 2, "padding": "' + b"x" * 1_500_000 + b'"}'
    _send_raw(stream_config, [encode_record(good[0]), big, encode_record(good[1])])
    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 2, timeout_s=15)
        assert [s.trajectory for s in scored] == good
        assert consumer.stats.invalid == 1
    dlq = TopicNames.from_prefix(stream_config.topic_prefix).dlq
    [envelope] = [
        decode_record(r.value) for r in _read_topic(stream_config.bootstrap_servers, dlq, 1)
    ]
    assert envelope["source_offset"] == 1 and "schema_version" in envelope["reason"]
    assert envelope["raw"] == big[:65536].decode()


def test_an_invalid_record_whose_reason_repeats_a_large_value_does_not_wedge_the_consumer(
    stream_config: StreamConfig,
) -> None:
    """jsonschema's message repeats the offending value: a 2 MB string where an object
    belongs made a 2 MB `reason`. Before, the envelope went over the consumer's DLQ producer
    request size (its 1 MiB default) and every poll raised MessageSizeTooLargeError on it."""
    good = [make_trajectory(session_id="k") for _ in range(2)]
    bad = make_trajectory(session_id="k")
    bad["request"] = "x" * 2_000_000
    _send_raw(stream_config, [encode_record(good[0]), encode_record(bad), encode_record(good[1])])
    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 2, timeout_s=15)
        assert [s.trajectory for s in scored] == good
        assert consumer.stats.invalid == 1
    [envelope] = _dlq_envelopes(stream_config, 1)
    assert envelope["source_offset"] == 1 and "request" in envelope["reason"]
    assert len(envelope["reason"]) < 4200 and envelope["reason"].endswith("characters in all)")


def test_a_dlq_envelope_fits_a_small_request_size(stream_config: StreamConfig) -> None:
    """An envelope over max_request_size_bytes keeps less of the record: here invalid UTF-8,
    each byte of which is a 3-byte U+FFFD in the envelope (36 KB for a 12 KB record)."""
    config = stream_config.model_copy(update={"max_request_size_bytes": 16 * 1024})
    good = make_trajectory(session_id="k")
    big = b"\xff" * 12_000
    _send_raw(config, [big, encode_record(good)])
    with TrajectoryConsumer(config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 1, timeout_s=15)
        assert [s.trajectory for s in scored] == [good]
        assert consumer.stats.invalid == 1
    [envelope] = _dlq_envelopes(config, 1)
    assert envelope["raw"] == big[:4096].decode(errors="replace")


def test_a_created_at_too_large_for_a_float_goes_to_the_dlq(stream_config: StreamConfig) -> None:
    """A 400-digit `created_at` is a JSON number the schema took, but float() of it raised
    OverflowError: every poll raised on it (and, its event_id remembered already, the record
    was dropped as its own duplicate once read again)."""
    good = [make_trajectory(session_id="k") for _ in range(2)]
    huge = make_trajectory(session_id="k")
    huge["created_at"] = 10**400
    _send_raw(stream_config, [encode_record(good[0]), encode_record(huge), encode_record(good[1])])
    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 2, timeout_s=15)
        assert [s.trajectory for s in scored] == good
        assert consumer.stats.invalid == 1
    [envelope] = _dlq_envelopes(stream_config, 1)
    assert "created_at" in envelope["reason"] and "does not fit a float" in envelope["reason"]


def test_a_record_nested_too_deeply_to_parse_goes_to_the_dlq(stream_config: StreamConfig) -> None:
    """Before: parsing it raised RecursionError, not ValueError, so every poll raised on it
    (after rewinding to it) and a learner restarted into the same crash."""
    good = [make_trajectory(session_id="n") for _ in range(2)]
    _send_raw(stream_config, [encode_record(good[0]), b"[" * 200_000, encode_record(good[1])])
    with TrajectoryConsumer(stream_config) as consumer:
        scored = consume_until(consumer, lambda got: len(got) >= 2, timeout_s=30)
        assert [s.trajectory for s in scored] == good
        assert consumer.stats.invalid == 1


def test_a_record_whose_handling_raised_is_not_its_own_duplicate_when_read_again(
    stream_config: StreamConfig,
) -> None:
    """`poll` rewinds to a record whose handling raised; its event_id was remembered before
    it was handled, so the copy read again was dropped as a duplicate: never trained. (And
    `stats.records` counted it twice.)"""
    good = [make_trajectory(session_id="k") for _ in range(3)]
    _send_raw(stream_config, [encode_record(record) for record in good])
    with TrajectoryConsumer(stream_config) as consumer:
        add_trajectory = consumer._add_trajectory
        calls: list[int] = []

        def failing_once(tp: TopicPartition, offset: int, value: dict[str, Any]) -> None:
            calls.append(offset)
            if len(calls) == 2:
                raise RuntimeError("handling failed")
            add_trajectory(tp, offset, value)

        consumer._add_trajectory = failing_once  # type: ignore[method-assign]
        with pytest.raises(RuntimeError):
            _poll_until(consumer, lambda: len(calls) >= 2)
        scored = consume_until(consumer, lambda got: len(got) >= 3, timeout_s=15)
        assert [s.trajectory for s in scored] == good
        assert calls == [0, 1, 1, 2] and consumer.stats.duplicates == 0
        assert consumer.stats.records == 3  # read again after the rewind, counted once


class _SendResult:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def get(self, timeout: float | None = None) -> None:
        if self.error is not None:
            raise self.error


class _FlakyDlqProducer:
    """The consumer's DLQ producer; its first flush times out (a broker hiccup), or with
    `fail_first_send` its first send fails after a flush that returns normally (kafka-python's
    flush waits, it does not raise a send's error)."""

    flushes = 0
    fail_first_send = False
    sent: ClassVar[list[bytes]] = []

    def __init__(self, **_: Any) -> None:
        pass

    def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> _SendResult:
        type(self).sent.append(value)
        failed = type(self).fail_first_send and len(type(self).sent) == 1
        return _SendResult(KafkaError("the broker refused the envelope") if failed else None)

    def flush(self, timeout: float | None = None) -> None:
        type(self).flushes += 1
        if type(self).flushes == 1 and not type(self).fail_first_send:
            raise KafkaTimeoutError("flush timed out")

    def close(self, timeout: float | None = None) -> None:
        pass


@pytest.mark.parametrize("send_fails", [False, True], ids=["flush_times_out", "send_fails"])
def test_a_poll_that_fails_mid_batch_loses_no_record_when_polled_again(
    stream_config: StreamConfig, monkeypatch: pytest.MonkeyPatch, send_fails: bool
) -> None:
    """Before: the records after the failing one in the fetched batch were skipped for good
    (the client's position was already past them) and processed_offsets() jumped them. And
    a DLQ send that failed after a normal flush was counted as sent: its envelope was lost."""
    monkeypatch.setattr(consumer_module, "KafkaProducer", _FlakyDlqProducer)
    _FlakyDlqProducer.flushes, _FlakyDlqProducer.sent = 0, []
    _FlakyDlqProducer.fail_first_send = send_fails
    good = [make_trajectory(session_id="k") for _ in range(4)]
    values = [encode_record(good[0]), b"{not json", *(encode_record(g) for g in good[1:])]
    _send_raw(stream_config, values)
    trajectories = TopicNames.from_prefix(stream_config.topic_prefix).trajectories
    with TrajectoryConsumer(stream_config) as consumer:
        with pytest.raises(KafkaError):
            for _ in range(50):  # until the batch with the invalid record arrives
                consumer.poll(0.2)
        assert consumer.processed_offsets()[trajectories][0] <= 1
        scored = consume_until(consumer, lambda got: len(got) >= 4, timeout_s=15)
        assert [s.trajectory for s in scored] == good
        assert consumer.stats.invalid == 1
        assert consumer.processed_offsets()[trajectories][0] == 5
    assert len(_FlakyDlqProducer.sent) == 2  # the failed send, then the one that went out


def test_dlq_ratio_breach_stops_the_consumer(stream_config: StreamConfig, tmp_path: Path) -> None:
    config = stream_config.model_copy(update={"dlq_max_ratio": 0.3, "dlq_min_records": 20})
    sink = KafkaSink(config, tmp_path)
    for i in range(30):
        record = make_trajectory(session_id=f"s{i}")
        if i % 2:
            record["status"] = "exploded"  # a bad deploy: every other record is broken
        sink.put_trajectory(record)
    assert sink.wait_idle(30)
    sink.close()
    with TrajectoryConsumer(config) as consumer, pytest.raises(DlqRatioExceeded) as info:
        consume_until(consumer, lambda got: False, timeout_s=30)
    assert "stream.dlq_max_ratio" in str(info.value)
    assert config.topic_prefix + ".dlq" in str(info.value)
    # It stays stopped: the next poll raises again rather than carrying on.
    with pytest.raises(DlqRatioExceeded):
        consumer.poll(0.1)


def test_a_catch_up_judges_the_dlq_ratio_in_the_order_records_were_produced(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The DLQ partition is read far ahead of the trajectory partitions in a catch-up: its
    envelopes came all at the end of the ratio's window, and 4.8 % rejected read as 40 %,
    stopping the learner at every restart."""
    config = stream_config.model_copy(
        update={"dlq_max_ratio": 0.2, "dlq_window_records": 50, "dlq_min_records": 20}
    )
    sink = KafkaSink(config, tmp_path)
    for i in range(400):
        sink.put_trajectory(make_trajectory(session_id=f"s{i % 8}"))
        if i % 20 == 0:
            broken = make_trajectory(session_id=f"s{i % 8}")
            broken["status"] = "exploded"  # refused by the sink: to the DLQ
            sink.put_trajectory(broken)
    assert sink.wait_idle(30)
    sink.close()
    with TrajectoryConsumer(config) as consumer:
        got = consume_until(consumer, lambda got: len(got) >= 400, timeout_s=60)
        assert len(got) == 400 and consumer.stats.dlq_seen == 20


def test_partition_selections_split_the_stream_without_overlap(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    trajectories = [make_trajectory(session_id=f"s{i}") for i in range(60)]
    feedback = [make_feedback(t, created_at=t["created_at"]) for t in trajectories]
    sink = KafkaSink(stream_config, tmp_path)
    for record in trajectories:
        sink.put_trajectory(record)
    for event in feedback:
        sink.put_feedback(event)
    assert sink.wait_idle(30)
    sink.close()
    ranks = []
    for selection in ({0, 2}, {1, 3}):
        with TrajectoryConsumer(stream_config, partitions=selection) as consumer:
            got: list[ScoredTrajectory] = []
            for _ in range(40):
                got.extend(consumer.poll(0.1))
                if consumer.caught_up() and not consumer.waiting() and got:
                    break
            assert {s.partition for s in got} <= selection
            assert set(consumer.processed_offsets()[names_of(stream_config).trajectories]) == (
                selection
            )
            ranks.append(got)
    ids = [s.trajectory["trajectory_id"] for rank in ranks for s in rank]
    assert sorted(ids) == sorted(t["trajectory_id"] for t in trajectories)
    assert all(len(s.feedback) == 1 for rank in ranks for s in rank)
    with pytest.raises(ValueError, match="subset"):
        TrajectoryConsumer(stream_config, partitions={7})


def test_shards_cover_the_partitions_the_broker_has_not_the_configured_count(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """Topics made with 4 partitions, a config that says 2: the learner's ranks used to split
    range(2) and leave partitions 2 and 3 to no one."""
    from learner.source import replay_consumer_factory

    sink = KafkaSink(stream_config, tmp_path)  # creates the topics with 4 partitions
    sink.close()
    says_two = stream_config.model_copy(update={"partitions": 2})
    make = replay_consumer_factory(says_two)
    assigned = []
    for rank in (0, 1):
        consumer = make(None, rank, 2)
        try:
            assert isinstance(consumer, TrajectoryConsumer)
            assigned.append(set(consumer.processed_offsets()[names_of(stream_config).trajectories]))
        finally:
            consumer.close()
    assert assigned == [{0, 2}, {1, 3}]
    with pytest.raises(ValueError, match="rank"):
        TrajectoryConsumer(stream_config, shard=(2, 2))


def test_shards_refuse_topics_whose_partition_counts_differ(stream_config: StreamConfig) -> None:
    """Both topics are keyed by session id: with 4 trajectories partitions and 6 feedback
    ones, a session's feedback lands on another index, which another rank reads (there it
    waited as an orphan and its trajectory trained without it). One learner reading every
    partition still joins them all."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    names = names_of(stream_config)
    admin = KafkaAdminClient(bootstrap_servers=stream_config.bootstrap_servers)
    try:
        admin.create_topics([NewTopic(names.feedback, 6, 1)])  # made elsewhere, before us
    finally:
        admin.close()
    with pytest.raises(ValueError, match=r"has 4, .*feedback has 6"):
        TrajectoryConsumer(stream_config, shard=(0, 2))
    with TrajectoryConsumer(stream_config, shard=(0, 1)) as consumer:
        assert set(consumer.processed_offsets()[names.feedback]) == set(range(6))


def names_of(config: StreamConfig) -> TopicNames:
    return TopicNames.from_prefix(config.topic_prefix)


def test_closing_a_consumer_with_an_unsent_dlq_envelope_stops_its_producer(
    stream_config: StreamConfig,
) -> None:
    """kafka-python's `close()` raises KafkaTimeoutError while a batch is unsent (the broker
    gone after a DLQ envelope was sent) before it stops its I/O thread, which then retries
    for ever. The consumer's close raised with it and left that thread behind; now the
    producer's sender is force-closed and close() returns."""

    class StuckSender:
        def __init__(self) -> None:
            self.closed = False

        def force_close(self) -> None:
            self.closed = True

        def join(self, timeout: float | None = None) -> None:
            pass

    class UnsentProducer:
        def __init__(self) -> None:
            self._sender = StuckSender()
            self.close_calls: list[float | None] = []

        def close(self, timeout: float | None = None) -> None:
            self.close_calls.append(timeout)
            if not self._sender.closed:
                raise KafkaTimeoutError("Timeout after waiting for 5 secs.")

    consumer = TrajectoryConsumer(stream_config)
    stuck = UnsentProducer()
    consumer._dlq_producer = stuck  # type: ignore[assignment]
    consumer.close()  # before: KafkaTimeoutError, the sender left running
    assert stuck._sender.closed
    assert stuck.close_calls == [5.0, 0]
