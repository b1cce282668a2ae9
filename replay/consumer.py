"""TrajectoryConsumer: feedback joined to trajectories, with an exact resume point.

Reads `<prefix>.trajectories`, `<prefix>.feedback` and `<prefix>.dlq` from explicit offsets
(assign + seek, no consumer group). Exactly-once resumption rests on three rules:

* Trajectories of one partition are yielded in offset order (head of line), so everything
  before the first still-waiting trajectory has been yielded: that offset is the resume
  point of the partition.
* A feedback event is "needed" while it waits for its trajectory (orphan) or is attached to
  a waiting trajectory; the resume point of a feedback partition is its lowest needed offset.
  A rebuilt consumer re-reads those events and attaches them again.
* On start, up to `dedup_lookback_records` records before each resume point are re-read
  only to rebuild the de-duplication memory, so a retried copy of an already yielded record
  that lies after the resume point is still dropped.

A trajectory's window opens when its reply was finished (`created_at + timings.total_s`: a
slow reply must not eat the user's time to react) and closes `join_window_s + join_grace_s`
later, and only once the feedback partitions were read up to their high watermark.
Feedback joins when its `created_at` is at most `created_at + timings.total_s +
join_window_s` of its trajectory; later feedback, or feedback read after the trajectory was
yielded, is counted as late and logged. A reply stamped as finished after the moment it was
read (clock skew, milliseconds for seconds) has its window timed from that moment instead,
so it cannot hold back the trajectories behind it; feedback still joins it by the rule
above, so nothing is lost (counted in `future_created_at` when over 5 s ahead). Feedback
waiting for its trajectory expires `orphan_feedback_ttl_s` after its `created_at`, or after
the moment it was read when stamped later: a future stamp must not keep it, and so its
partition's resume point, forever (counted the same way).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from replay.config import StreamConfig
from replay.producer import close_producer
from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    decode_record,
    dlq_envelope,
    dlq_event_id,
    encode_record,
    validate_record,
)
from replay.topics import TopicNames, ensure_topics

log = structlog.get_logger(__name__)

Offsets = dict[str, dict[int, int]]
# A record stamped further ahead of the reading clock than this is counted and logged.
_FUTURE_TOLERANCE_S = 5.0
# A rejected record's DLQ envelope keeps its first 64 KiB: the topic takes records up to
# max_request_size_bytes, and an envelope of one that large would be refused, on every
# poll. The original stays where `source_topic`/`source_partition`/`source_offset` say.
# The smaller cuts, down to none, are for a max_request_size_bytes too small for 64 KiB
# (bytes that escape badly in JSON take several times their size in the envelope).
_DLQ_RAW_CUTS = (65536, 4096, 0)
_DLQ_OVERHEAD_BYTES = 1024  # record framing within max_request_size_bytes


class DlqRatioExceeded(RuntimeError):
    """Too many recent records were invalid: stop rather than silently train on nothing."""


class ResumeOffsetError(RuntimeError):
    """A resume offset lies beyond the end of its partition: the broker lost data."""


def start_kept_by_retention(tp: TopicPartition, start: int, earliest: int, event: str) -> int:
    """`start`, or the partition's first record still kept when retention deleted `start`
    (logged as `event`, naming both)."""
    if start < earliest:
        log.error(event, topic=tp.topic, partition=tp.partition, offset=start, earliest=earliest)
        return earliest
    return start


def check_start_offset(
    tp: TopicPartition,
    start: int,
    seeked: int,
    position: int | None,
    highwater: int | None,
    what: str = "resume offset",
) -> None:
    """Raise ResumeOffsetError when reading `tp` from `start` (seeked to `seeked`) cannot work.

    Either the partition ends before `start`, or the client reset an out-of-range position
    back to the start of the partition: going on would wait forever or re-read silently."""
    if (highwater is not None and highwater < start) or (
        position is not None and position < seeked
    ):
        raise ResumeOffsetError(
            f"{what} {start} of {tp.topic}[{tp.partition}] is beyond the end of the "
            f"partition (high watermark {highwater}): the broker lost data (an in-memory "
            "broker restarted?) or the offsets belong to another cluster"
        )


@dataclass(frozen=True)
class ScoredTrajectory:
    """A trajectory whose join window closed, with the feedback that arrived within it."""

    trajectory: dict[str, Any]
    feedback: list[dict[str, Any]]
    partition: int = -1  # where it was read from, for tracing; -1 when built by hand
    offset: int = -1


@dataclass
class ConsumerStats:
    """Counters since this consumer started."""

    records: int = 0
    yielded: int = 0
    feedback_joined: int = 0
    duplicates: int = 0
    invalid: int = 0
    dlq_seen: int = 0
    tombstones: int = 0
    late_feedback: int = 0
    orphaned_feedback: int = 0
    foreign_feedback: int = 0
    feedback_before_resume: int = 0
    future_created_at: int = 0


@dataclass
class _Pending:
    partition: TopicPartition
    offset: int
    trajectory: dict[str, Any]
    window_end: float
    deadline: float
    feedback: list[tuple[TopicPartition, int, dict[str, Any]]] = field(default_factory=list)


@dataclass(frozen=True)
class _Orphan:
    """Feedback waiting for its trajectory. Its expiry is timed from `timed_from`: its
    `created_at`, or the moment it was read if stamped later (a stamp in the future would
    otherwise never expire and pin its partition's resume point)."""

    partition: TopicPartition
    offset: int
    event: dict[str, Any]
    timed_from: float


class _BoundedSet:
    """Insertion-ordered set forgetting its oldest members beyond `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, None] = OrderedDict()

    def add(self, item: str) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        if len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def __contains__(self, item: object) -> bool:
        return item in self._items


class _StatsCollector(Collector):
    """Exposes a consumer's ConsumerStats and window state as Prometheus series."""

    def __init__(self, consumer: TrajectoryConsumer) -> None:
        self._consumer = consumer

    def collect(self) -> Iterable[Metric]:
        stats = self._consumer.stats
        for name, help_text in (
            ("records", "Records read past the resume point"),
            ("yielded", "Scored trajectories yielded"),
            ("feedback_joined", "Feedback events joined to a yielded trajectory"),
            ("duplicates", "Records dropped as duplicates"),
            ("invalid", "Records that failed validation on consume (sent to the DLQ)"),
            ("dlq_seen", "DLQ records from producers"),
            ("tombstones", "Records without a value (tombstones), skipped: none of ours"),
            ("late_feedback", "Feedback after the window or after its trajectory was yielded"),
            ("orphaned_feedback", "Feedback dropped because its trajectory never arrived"),
            ("foreign_feedback", "Feedback dropped because another tenant sent it"),
            (
                "future_created_at",
                "Trajectories and waiting feedback stamped over 5 s in the future "
                "(timed from when read)",
            ),
        ):
            yield CounterMetricFamily(f"olp_consumer_{name}", help_text, value=getattr(stats, name))
        yield GaugeMetricFamily(
            "olp_consumer_waiting",
            "Trajectories waiting for their join window",
            value=self._consumer.waiting(),
        )


def normalize_offsets(offsets: Any) -> Offsets:
    """Accept offsets after a JSON round trip (partition keys as strings).

    Raises ValueError, naming the topic, for anything else (a bare offset where the
    partitions belong, a null or negative offset): `olp replay export --from` exits 2 on it."""
    if offsets is None:
        return {}
    if not isinstance(offsets, dict):
        raise ValueError(f"offsets must be an object of topics, got {_shown(offsets)}")
    result: Offsets = {}
    for topic, parts in offsets.items():
        if not isinstance(parts, dict):
            raise ValueError(
                f"offsets of {topic!r} must be an object of partition: offset "
                f'(e.g. {{"0": 100}}), got {_shown(parts)}'
            )
        result[str(topic)] = {
            _offset_number(topic, "partition", part): _offset_number(topic, "offset", offset)
            for part, offset in parts.items()
        }
    return result


def _offset_number(topic: Any, what: str, value: Any) -> int:
    """A partition or an offset: a non-negative integer, or its decimal text (a JSON key)."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.strip().isdecimal():
        number = int(value)
    if number is None or number < 0:
        raise ValueError(
            f"offsets of {topic!r}: {what} must be a non-negative integer, got {_shown(value)}"
        )
    return number


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"{text[:60]}..."


class TrajectoryConsumer:
    """Yields ScoredTrajectory; `processed_offsets()` is the exact point to resume from.

    `partitions` restricts it to those partition indices of the three topics (one learner
    rank each): since both topics are keyed by session id and share the partition count, a
    session's trajectories and feedback land in the same selection. `shard=(rank, world)`
    selects the indices `p % world == rank` of the partitions the broker has (not the
    configured count: topics made elsewhere may have more, which no rank would read).
    """

    def __init__(
        self,
        config: StreamConfig,
        offsets: Offsets | None = None,
        *,
        clock: Callable[[], float] = time.time,
        client_id: str = "olp-learner",
        registry: CollectorRegistry | None = None,
        partitions: Iterable[int] | None = None,
        shard: tuple[int, int] | None = None,
    ) -> None:
        if partitions is not None and shard is not None:
            raise ValueError("give partitions or shard, not both")
        if shard is not None and not 0 <= shard[0] < shard[1]:
            raise ValueError(f"shard {shard} is not (rank, world) with 0 <= rank < world")
        self.config = config
        self.topics = TopicNames.from_prefix(config.topic_prefix)
        self.stats = ConsumerStats()
        self._clock = clock
        self._window = config.join_window_s
        self._grace = config.join_grace_s
        ensure_topics(config)
        self._consumer = KafkaConsumer(
            bootstrap_servers=config.bootstrap_servers,
            client_id=client_id,
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="none",
            max_poll_records=config.poll_max_records,
            fetch_max_bytes=config.fetch_max_bytes,
            max_partition_fetch_bytes=min(config.fetch_max_bytes, 16 * 1024 * 1024),
            bootstrap_timeout_ms=config.bootstrap_timeout_ms,
        )
        self._dlq_producer: KafkaProducer | None = None
        self._seen = _BoundedSet(config.dedup_memory_records)
        self._closed = _BoundedSet(config.closed_trajectory_memory)
        self._closed_before_start = _BoundedSet(config.closed_trajectory_memory)
        self._pending: dict[TopicPartition, OrderedDict[int, _Pending]] = {}
        self._pending_by_tid: dict[str, _Pending] = {}
        self._orphans: dict[str, list[_Orphan]] = {}
        self._needed: dict[TopicPartition, dict[int, str]] = {}
        self._next_offset: dict[TopicPartition, int] = {}
        self._replay_until: dict[TopicPartition, int] = {}
        # The offset up to which `stats.records` counted each partition: a record read again
        # after a rewind is one record, not two.
        self._counted_until: dict[TopicPartition, int] = {}
        self._seek_start: dict[TopicPartition, int] = {}
        self._recent_invalid: deque[bool] = deque(maxlen=config.dlq_window_records)
        # Records enter that window in the order they were produced, not read
        # (`_release_validity`): in a catch-up the small DLQ partition is read far ahead of
        # the others, and its envelopes, all at the window's end, read as 40 % rejected
        # where 4.8 % were, stopping the learner at every restart. Each record waits as
        # (timestamp ms, rejected) until every trajectory and feedback partition was read
        # past its time, or to its end.
        self._validity_held: list[tuple[int, bool]] = []
        self._data_read_at: dict[TopicPartition, int] = {}  # last record timestamp read
        self._failure: DlqRatioExceeded | None = None
        self._selection = None if partitions is None else frozenset(partitions)
        self._shard = shard
        try:
            self._assign(normalize_offsets(offsets))
        except BaseException:
            self._consumer.close()
            raise
        if registry is not None:
            registry.register(_StatsCollector(self))

    # ---- start -----------------------------------------------------------------------------

    def _partitions(self, topic: str) -> list[TopicPartition]:
        deadline = time.monotonic() + 15
        while True:
            parts = self._consumer.partitions_for_topic(topic)
            if parts:
                return [TopicPartition(topic, p) for p in sorted(parts)]
            if time.monotonic() > deadline:
                raise RuntimeError(f"topic {topic} has no partitions on the broker")
            time.sleep(0.2)

    def _check_join_partitions(self, tps: list[TopicPartition]) -> None:
        """Refuse a selection of some partitions when the trajectories and feedback topics
        have different partition counts: a session's feedback is then on another index
        than its trajectories (both are keyed by session id), so another rank reads it.
        Nothing checked this: with 4 and 6 partitions over 4 ranks, 45 of 100 feedback
        events waited as orphans on the wrong rank, held its resume offset back, and their
        trajectories trained without them."""
        counts = {
            topic: sum(1 for tp in tps if tp.topic == topic)
            for topic in (self.topics.trajectories, self.topics.feedback)
        }
        if len(set(counts.values())) > 1 and self._selection != {tp.partition for tp in tps}:
            shown = ", ".join(f"{topic} has {count}" for topic, count in counts.items())
            raise ValueError(
                f"a learner that reads some partitions needs the trajectories and feedback "
                f"topics to have the same partition count ({shown}): a session's feedback "
                "would be read by another rank than its trajectories; give both topics one "
                "count, or run a single learner"
            )

    def _assign(self, offsets: Offsets) -> None:
        tps = [tp for topic in self.topics.all() for tp in self._partitions(topic)]
        if self._shard is not None:
            rank, world = self._shard
            self._selection = frozenset(tp.partition for tp in tps if tp.partition % world == rank)
        if self._selection is not None:
            # Same partition index on every topic: a session's records stay together.
            known = {tp.partition for tp in tps}
            if not self._selection or not self._selection <= known:
                raise ValueError(
                    f"partitions {sorted(self._selection)} are not a non-empty subset "
                    f"of {sorted(known)}"
                )
            self._check_join_partitions(tps)
            tps = [tp for tp in tps if tp.partition in self._selection]
        self._consumer.assign(tps)
        beginnings = self._consumer.beginning_offsets(tps)
        for tp in tps:
            begin = beginnings.get(tp) or 0
            start = start_kept_by_retention(
                tp,
                offsets.get(tp.topic, {}).get(tp.partition, begin),
                begin,
                "resume_offset_below_retention",
            )
            lookback = 0 if tp.topic == self.topics.dlq else self.config.dedup_lookback_records
            self._seek_start[tp] = max(begin, start - lookback)
            self._consumer.seek(tp, self._seek_start[tp])
            self._replay_until[tp] = start
            self._next_offset[tp] = start
            if tp.topic == self.topics.trajectories:
                self._pending[tp] = OrderedDict()
            elif tp.topic == self.topics.feedback:
                self._needed[tp] = {}
        log.info("consumer_assigned", partitions=len(tps), offsets=self.processed_offsets())

    # ---- public ----------------------------------------------------------------------------

    def poll(self, timeout_s: float = 1.0) -> list[ScoredTrajectory]:
        """Read what is available (waiting up to timeout_s) and return closed trajectories."""
        if self._failure is not None:
            raise self._failure
        batch = self._consumer.poll(
            timeout_ms=int(timeout_s * 1000), max_records=self.config.poll_max_records
        )
        order = {self.topics.trajectories: 0, self.topics.feedback: 1, self.topics.dlq: 2}
        tps = sorted(batch, key=lambda t: (order[t.topic], t.partition))
        for done, tp in enumerate(tps):
            for record in batch[tp]:
                try:
                    self._handle(tp, record)
                except BaseException:
                    # The client's position is past the whole batch: without this, the
                    # records not handled yet would be skipped by the next poll for good.
                    later = [(t, batch[t][0].offset) for t in tps[done + 1 :] if batch[t]]
                    self._rewind(tp, record.offset, later)
                    raise
        self._check_positions()
        self._check_dlq_ratio()
        self._expire_orphans()
        return self._close_windows()

    def processed_offsets(self) -> Offsets:
        """topic → partition → next offset; a consumer built with it resumes exactly here."""
        result: Offsets = {}
        for tp, next_offset in self._next_offset.items():
            offset = next_offset
            if self._pending.get(tp):
                offset = next(iter(self._pending[tp]))
            elif self._needed.get(tp):
                offset = min(self._needed[tp])
            result.setdefault(tp.topic, {})[tp.partition] = offset
        return result

    def waiting(self) -> int:
        """Trajectories read but not yet yielded (their window is open)."""
        return len(self._pending_by_tid)

    def caught_up(self) -> bool:
        """Whether every assigned partition was read up to its last known high watermark."""
        return all(self._caught_up(tp) for tp in self._next_offset)

    def close(self) -> None:
        self._consumer.close()
        if self._dlq_producer is not None:
            # kafka-python's close() raises while a DLQ envelope is unsent (broker gone) and
            # then leaves its I/O thread retrying for ever: closed for good, never raising.
            close_producer(self._dlq_producer, 5.0)

    def __enter__(self) -> TrajectoryConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- records ---------------------------------------------------------------------------

    def _handle(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        if record.offset < self._replay_until[tp]:
            self._remember(tp, record)
            return
        self._next_offset[tp] = record.offset + 1
        if record.offset >= self._counted_until.get(tp, 0):
            self._counted_until[tp] = record.offset + 1
            self.stats.records += 1
        if record.value is None:
            self._skip_tombstone(tp, record)
            return
        if tp.topic == self.topics.dlq:
            self._count_dlq(record)
            return
        self._data_read_at[tp] = record.timestamp
        kind = (
            RecordKind.TRAJECTORY if tp.topic == self.topics.trajectories else RecordKind.FEEDBACK
        )
        try:
            value = decode_record(record.value)
            validate_record(kind, value)
        except (ValueError, SchemaValidationError) as exc:
            self._reject(tp, record, kind, str(exc))
            return
        if value["event_id"] in self._seen:
            self._note_validity(record, rejected=False)
            self.stats.duplicates += 1
            return
        if kind is RecordKind.TRAJECTORY:
            self._add_trajectory(tp, record.offset, value)
        else:
            self._add_feedback(tp, record.offset, value)
        # Only once handled: a record whose handling raised is read again after the rewind,
        # and must not be dropped then as a duplicate of itself.
        self._seen.add(value["event_id"])
        self._note_validity(record, rejected=False)

    def _rewind(
        self, failed: TopicPartition, offset: int, untouched: list[tuple[TopicPartition, int]]
    ) -> None:
        """Seek back to the record whose handling failed and to the first record of every
        partition not handled yet, so that a later poll reads them again."""
        if offset >= self._replay_until[failed]:
            self._next_offset[failed] = offset
        for tp, first in [(failed, offset), *untouched]:
            self._consumer.seek(tp, first)

    def _remember(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        """A record before the resume point: it was handled by the consumer we resume from."""
        try:
            value = decode_record(record.value)
        except ValueError:
            return
        if not isinstance(value, dict) or not isinstance(value.get("event_id"), str):
            return
        self._seen.add(value["event_id"])
        if tp.topic == self.topics.trajectories and isinstance(value.get("trajectory_id"), str):
            tid = value["trajectory_id"]
            self._closed_before_start.add(tid)
            # Its feedback may have been read first (the topics are read interleaved, and
            # the look-back is not done when the feedback after its resume point arrives):
            # waiting as orphans, it held the feedback partition back for the orphan TTL
            # and was then dropped as orphaned, after every restart. It is what feedback on
            # a trajectory closed before the resume point is when read after it.
            for orphan in self._orphans.pop(tid, []):
                self._needed[orphan.partition].pop(orphan.offset, None)
                self.stats.feedback_before_resume += 1

    def _skip_tombstone(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        """A record without a value (a key's tombstone, written by a tool, never by olp):
        no record of ours, and no rejected one either. Counted apart; no DLQ envelope, no
        weight in the DLQ ratio (before, each one counted as a rejection, and a run of them
        could stop the learner)."""
        self.stats.tombstones += 1
        log.info("tombstone_skipped", topic=tp.topic, partition=tp.partition, offset=record.offset)

    def _count_dlq(self, record: ConsumerRecord) -> None:
        try:
            envelope = decode_record(record.value)
        except ValueError:
            envelope = {}
        if not isinstance(envelope, dict):
            envelope = {}
        # Our own rejections were counted when we made them.
        if envelope.get("origin") == "consumer":
            return
        # One record rejected twice (a resent spill segment, a worker that died before
        # confirming) has envelopes with the same event_id: it is counted once.
        event_id = envelope.get("event_id")
        if isinstance(event_id, str):
            if event_id in self._seen:
                self.stats.duplicates += 1
                return
            self._seen.add(event_id)
        self.stats.dlq_seen += 1
        self._note_validity(record, rejected=True)

    def _reject(
        self, tp: TopicPartition, record: ConsumerRecord, kind: RecordKind, reason: str
    ) -> None:
        """Send the record's DLQ envelope, then count it: when the send raises, `poll`
        rewinds to this record and it is handled (and counted) once, on a later poll."""
        log.warning(
            "invalid_record_to_dlq",
            topic=tp.topic,
            partition=tp.partition,
            offset=record.offset,
            reason=reason[:500],
        )
        # The same id when a consumer resumed before this offset rejects it again.
        event_id = dlq_event_id(
            "consumer",
            tp.topic,
            source_partition=tp.partition,
            source_offset=record.offset,
            value=record.value,
        )
        limit = self.config.max_request_size_bytes - _DLQ_OVERHEAD_BYTES
        for raw_bytes in _DLQ_RAW_CUTS:  # the most of the record an envelope in `limit` holds
            envelope = dlq_envelope(
                reason=reason,  # cut by dlq_envelope: jsonschema repeats the offending value
                source_topic=tp.topic,
                origin="consumer",
                kind=kind.value,
                raw=None if record.value is None else record.value[:raw_bytes],
                source_partition=tp.partition,
                source_offset=record.offset,
                event_id=event_id,
            )
            value = encode_record(envelope)
            if len(value) <= limit:
                break
        if self._dlq_producer is None:
            self._dlq_producer = KafkaProducer(
                bootstrap_servers=self.config.bootstrap_servers,
                client_id="olp-consumer-dlq",
                acks="all",
                max_request_size=self.config.max_request_size_bytes,
                bootstrap_timeout_ms=self.config.bootstrap_timeout_ms,
            )
        sent = self._dlq_producer.send(self.topics.dlq, key=record.key, value=value)
        self._dlq_producer.flush(timeout=self.config.delivery_timeout_ms / 1000)
        # flush() only waits: a send the broker refused (or that ran out of retries) fails
        # its future, and raising it here keeps the envelope from being lost uncounted.
        sent.get(timeout=0)
        self.stats.invalid += 1
        self._note_validity(record, rejected=True)

    def _check_positions(self) -> None:
        """Stop loudly instead of waiting forever at an offset the partition never reaches."""
        for tp, seeked in self._seek_start.items():
            check_start_offset(
                tp,
                self._replay_until[tp],
                seeked,
                self._consumer.position(tp),
                self._consumer.highwater(tp),
            )

    def _note_validity(self, record: ConsumerRecord, rejected: bool) -> None:
        stamp = record.timestamp if isinstance(record.timestamp, int) else -1
        self._validity_held.append((stamp, rejected))

    def _release_validity(self) -> None:
        """Move the records every data partition was read past into the ratio's window, in
        the order of their timestamps."""
        if not self._validity_held:
            return
        behind = [
            self._data_read_at.get(tp, -1)
            for tp in self._next_offset
            if tp.topic != self.topics.dlq and not self._caught_up(tp)
        ]
        horizon = min(behind) if behind else None
        held = self._validity_held
        if horizon is None:
            released, self._validity_held = held, []
        else:
            released = [entry for entry in held if entry[0] <= horizon]
            self._validity_held = [entry for entry in held if entry[0] > horizon]
        released.sort(key=lambda entry: entry[0])
        self._recent_invalid.extend(rejected for _, rejected in released)

    def _check_dlq_ratio(self) -> None:
        self._release_validity()
        window = self._recent_invalid
        if len(window) < self.config.dlq_min_records:
            return
        ratio = sum(window) / len(window)
        if ratio > self.config.dlq_max_ratio:
            self._failure = DlqRatioExceeded(
                f"{ratio:.0%} of the last {len(window)} records on '{self.config.topic_prefix}' "
                f"went to the DLQ (limit {self.config.dlq_max_ratio:.0%}, "
                "stream.dlq_max_ratio): check the producer deploy and the DLQ topic "
                f"'{self.topics.dlq}'"
            )
            log.error("dlq_ratio_exceeded", ratio=round(ratio, 3), window=len(window))
            raise self._failure

    # ---- join ------------------------------------------------------------------------------

    def _add_trajectory(self, tp: TopicPartition, offset: int, value: dict[str, Any]) -> None:
        tid = value["trajectory_id"]
        # `_closed_before_start`: yielded by the consumer this one resumes from (a copy
        # under another event_id, built again by a sink worker's parent, is still a copy).
        if tid in self._pending_by_tid or tid in self._closed or tid in self._closed_before_start:
            self.stats.duplicates += 1
            log.warning("duplicate_trajectory_id", trajectory_id=tid, offset=offset)
            return
        finished = float(value["created_at"]) + float(
            (value.get("timings") or {}).get("total_s") or 0.0
        )
        window_end = finished + self._window
        # Windows close in offset order: one stamped in the future would hold back every
        # later trajectory of its partition, so it is timed from now at the latest.
        started = self._timed_from(finished, "trajectory_created_in_future", tid, offset)
        # Read after its window closed (a backlog, or records a producer's spill delivers
        # after an outage): it still waits the grace, from now. A spill drains in order, so
        # the feedback spilled after it arrives shortly after it; yielded at once, it found
        # that feedback missing and the feedback was dropped as late.
        deadline = max(started + self._window, self._clock()) + self._grace
        pending = _Pending(tp, offset, value, window_end, deadline)
        self._pending[tp][offset] = pending
        self._pending_by_tid[tid] = pending
        for orphan in self._orphans.pop(tid, []):
            self._needed[orphan.partition].pop(orphan.offset, None)
            self._attach_or_late(pending, orphan.partition, orphan.offset, orphan.event)

    def _timed_from(self, stamp: float, event: str, tid: str, offset: int) -> float:
        """`stamp`, or now when it lies in the future: a waiting record is timed from it,
        and a future stamp would hold back its partition (counted and logged when over
        _FUTURE_TOLERANCE_S ahead)."""
        now = self._clock()
        if stamp > now + _FUTURE_TOLERANCE_S:
            self.stats.future_created_at += 1
            log.warning(event, trajectory_id=tid, ahead_s=round(stamp - now, 1), offset=offset)
        return min(stamp, now)

    def _add_feedback(self, tp: TopicPartition, offset: int, event: dict[str, Any]) -> None:
        tid = event["trajectory_id"]
        pending = self._pending_by_tid.get(tid)
        if pending is not None:
            self._attach_or_late(pending, tp, offset, event)
        elif tid in self._closed:
            self._late(event, "trajectory already yielded")
        elif tid in self._closed_before_start:
            self.stats.feedback_before_resume += 1
        else:
            created = float(event["created_at"])
            started = self._timed_from(created, "feedback_created_in_future", tid, offset)
            self._orphans.setdefault(tid, []).append(_Orphan(tp, offset, event, started))
            self._needed[tp][offset] = tid

    def _attach_or_late(
        self, pending: _Pending, tp: TopicPartition, offset: int, event: dict[str, Any]
    ) -> None:
        if event["tenant"] != pending.trajectory["tenant"]:
            # The proxy refuses feedback on another tenant's trajectory only while it still
            # remembers the id (a bounded map, empty after a restart); past that, a tenant
            # that learned an id would steer the rewards of another's samples.
            self.stats.foreign_feedback += 1
            log.warning(
                "foreign_feedback_dropped", trajectory_id=event["trajectory_id"], kind=event["kind"]
            )
        elif float(event["created_at"]) <= pending.window_end:
            pending.feedback.append((tp, offset, event))
            self._needed[tp][offset] = event["trajectory_id"]
        else:
            self._late(event, "after the join window")

    def _late(self, event: dict[str, Any], why: str) -> None:
        self.stats.late_feedback += 1
        log.info("late_feedback", trajectory_id=event["trajectory_id"], kind=event["kind"], why=why)

    def _caught_up(self, tp: TopicPartition) -> bool:
        highwater = self._consumer.highwater(tp)
        return highwater is not None and self._consumer.position(tp) >= highwater

    def _feedback_caught_up(self) -> bool:
        return all(self._caught_up(tp) for tp in self._needed)

    def _expire_orphans(self) -> None:
        if not self._orphans:
            return
        if not all(self._caught_up(tp) for tp in self._pending):
            return
        horizon = self._clock() - self.config.orphan_feedback_ttl_s
        for tid in list(self._orphans):
            keep = []
            for orphan in self._orphans[tid]:
                if orphan.timed_from < horizon:
                    self._needed[orphan.partition].pop(orphan.offset, None)
                    self.stats.orphaned_feedback += 1
                    log.warning("orphaned_feedback_dropped", trajectory_id=tid)
                else:
                    keep.append(orphan)
            if keep:
                self._orphans[tid] = keep
            else:
                del self._orphans[tid]

    def _close_windows(self) -> list[ScoredTrajectory]:
        if not self._pending_by_tid or not self._feedback_caught_up():
            return []
        now = self._clock()
        closed: list[ScoredTrajectory] = []
        for queue in self._pending.values():
            while queue:
                pending = next(iter(queue.values()))
                if now < pending.deadline:
                    break
                queue.popitem(last=False)
                closed.append(self._yield(pending))
        return closed

    def _yield(self, pending: _Pending) -> ScoredTrajectory:
        tid = pending.trajectory["trajectory_id"]
        del self._pending_by_tid[tid]
        self._closed.add(tid)
        for ftp, foff, _event in pending.feedback:
            self._needed[ftp].pop(foff, None)
        self.stats.yielded += 1
        self.stats.feedback_joined += len(pending.feedback)
        return ScoredTrajectory(
            trajectory=pending.trajectory,
            feedback=[event for _tp, _off, event in pending.feedback],
            partition=pending.partition.partition,
            offset=pending.offset,
        )


def iter_scored(
    consumer: TrajectoryConsumer, *, idle_polls: int = 3, timeout_s: float = 0.5
) -> Iterable[ScoredTrajectory]:
    """Yield until nothing is waiting and `idle_polls` polls in a row brought nothing new."""
    idle = 0
    while idle < idle_polls:
        before = consumer.stats.records
        batch = consumer.poll(timeout_s)
        yield from batch
        quiet = not batch and consumer.stats.records == before and not consumer.waiting()
        idle = idle + 1 if quiet else 0
