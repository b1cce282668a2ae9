"""KafkaSink: a RecordSink whose `put_*` never blocks the event loop and never loses a record.

`put_*` only enqueues onto a bounded queue. One background thread validates, encodes and
sends with a kafka-python producer (acks=all, idempotent when the broker allows). When the
broker is unreachable, or a send is not acknowledged (in time, or for any reason but the
record itself: a restarted broker that forgot the producer's id), records go to the durable
spill; while the spill holds anything, new records are appended behind it so order is kept,
and the thread drains it oldest segment first once the broker answers again, deleting a
segment only after every record in it was acknowledged. A drain cut short sends only the
rest of its segment again, but a restart reads the whole segment again, so a record may be
delivered twice: consumers de-duplicate by event_id (a record's DLQ envelope included, whose
event_id is derived from the record's).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from kafka import KafkaProducer
from kafka.errors import (
    CorruptRecordError,
    InvalidRecordError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    UnsupportedCodecError,
    UnsupportedCompressionTypeError,
    UnsupportedVersionError,
)
from prometheus_client import CollectorRegistry, Counter, Gauge

from replay.config import StreamConfig
from replay.partitioner import producer_options
from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    cut_reason,
    decode_record,
    dlq_envelope,
    dlq_event_id,
    encode_record,
    validate_record,
)
from replay.spill import SpillEntry, SpillReadError, SpillStore
from replay.topics import TopicNames, ensure_topics

log = structlog.get_logger(__name__)

RECORD_OVERHEAD_BYTES = 1024
# How long the sender thread waits for records before it looks at the spill and the broker
# again. `close` wakes it at once, so this only spaces out the checks of an idle sink (each
# wake-up of a sleeping thread costs ~0.1 ms of CPU on a small VM).
_IDLE_TAKE_S = 0.25
# How often an idle sink with a producer probes the broker (a TCP connect), so that
# `olp_stream_broker_up` goes to 0 when the broker goes away between records: it stayed 1
# until the next record failed, however long the sink was idle.
_IDLE_PROBE_S = 5.0
_WAKE_UP: Any = (-1, object())  # put by `close`: not a record (no put's sequence number)
# A flush waits in slices of this length, so that a `close` during it ends the wait at its
# deadline (`close_timeout_s`) instead of after the whole delivery timeout.
_FLUSH_SLICE_S = 0.25
# Backoff between spill writes while the disk refuses them (ENOSPC, EIO): doubling, capped.
_DISK_RETRY_FIRST_S = 0.5
_DISK_RETRY_MAX_S = 30.0
# Pause before reading a spill segment again after a read error (EIO, EACCES); the store
# moves it to quarantine after READ_ATTEMPTS failures in a row.
_SPILL_READ_RETRY_S = 1.0
# A DLQ envelope the broker refuses for good is sent once more with its payload cut to this.
_DLQ_TRUNCATED_BYTES = 4096
# Errors about the record itself, which no retry can fix: only these send it to the DLQ.
# Any other failure (a restarted broker that forgot this producer's id, a sequence gap, a
# timeout, a bare KafkaError from InitProducerId) says nothing about the record: it is kept,
# spilled in order and sent again on a fresh producer.
_RECORD_REFUSED: tuple[type[KafkaError], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    CorruptRecordError,
    InvalidRecordError,
)
# `stream.compression_type` refused: by the record builder (codec library missing) or by the
# broker on produce. kafka-python raises ValueError (lz4/zstd against a broker too old for
# them) or RuntimeError (library missing) when the producer is made: see `_codec_error`.
_CODEC_REFUSED: tuple[type[KafkaError], ...] = (
    UnsupportedCodecError,
    UnsupportedCompressionTypeError,
)
# What a record sent in `_send` is: as queued or spilled, a DLQ envelope of a refused record,
# or such an envelope truncated (refused once more, it is dropped).
_Stage = Literal["original", "envelope", "truncated"]


class ProducerMetrics:
    """Prometheus series of one KafkaSink, registered on the registry the owner passes in."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.queued = Counter(
            "olp_stream_queued",
            "Records accepted into the producer queue",
            ["kind"],
            registry=registry,
        )
        self.spilled = Counter(
            "olp_stream_spilled",
            "Records written to the durable spill",
            ["kind"],
            registry=registry,
        )
        self.sent = Counter(
            "olp_stream_sent", "Records acknowledged by the broker", ["kind"], registry=registry
        )
        self.failed = Counter(
            "olp_stream_failed",
            "Records lost or rejected by the broker",
            ["kind", "reason"],
            registry=registry,
        )
        self.dlq = Counter(
            "olp_stream_dlq", "Records routed to the DLQ on produce", ["kind"], registry=registry
        )
        self.spill_bytes = Gauge(
            "olp_stream_spill_bytes", "Bytes waiting in the spill", registry=registry
        )
        self.queue_depth = Gauge(
            "olp_stream_queue_depth", "Records waiting in the producer queue", registry=registry
        )
        self.queue_bytes = Gauge(
            "olp_stream_queue_bytes",
            "Bytes of captures waiting for the sink's worker (KafkaSinkProcess; 0 for KafkaSink, "
            "which takes built records)",
            registry=registry,
        )
        self.broker_up = Gauge(
            "olp_stream_broker_up", "1 while the producer reaches the broker", registry=registry
        )
        self.spill_errors = Counter(
            "olp_stream_spill_errors",
            "Spill writes that failed with a disk error (the records stay in memory, retried)",
            registry=registry,
        )
        self.spill_quarantined = Counter(
            "olp_stream_spill_quarantined",
            "Spill segments moved to quarantine/ (unreadable, or corrupt in the middle)",
            ["reason"],
            registry=registry,
        )


@dataclass(frozen=True)
class QueuedRecord:
    """A record waiting to be validated and encoded (`prepare_entry`) in the sending thread."""

    kind: RecordKind
    record: dict[str, Any]


def _series(cache: dict[str, Any], counter: Counter, kind: str) -> Any:
    """`counter.labels(kind)`, kept in `cache` after its first use."""
    series = cache.get(kind)
    if series is None:
        series = cache[kind] = counter.labels(kind)
    return series


def prepare_entry(
    config: StreamConfig, topics: TopicNames, metrics: ProducerMetrics, item: QueuedRecord
) -> SpillEntry | None:
    """Validate and encode; an invalid, oversized or unencodable record becomes a DLQ envelope.

    Never raises: one odd record must not stop the thread that prepares every record. None
    only when not even a bare envelope could be made (logged, counted as failed)."""
    try:
        return _prepare(config, topics, metrics, item)
    except Exception as exc:
        log.exception("record_prepare_failed", kind=item.kind.value)
        try:
            return _dlq_entry(
                config, topics, metrics, item, None, f"could not prepare the record: {exc!r}"
            )
        except Exception:
            log.exception("record_dropped_unencodable", kind=item.kind.value)
            metrics.failed.labels(item.kind.value, "unencodable").inc()
            return None


def _session_key(record: Any) -> bytes | None:
    session = record.get("session_id") if isinstance(record, dict) else None
    # JSON text may hold a lone surrogate, which strict UTF-8 refuses; surrogatepass still
    # gives every session id one stable key (and so one partition).
    return session.encode("utf-8", "surrogatepass") if isinstance(session, str) else None


def _decoded(value: bytes) -> dict[str, Any]:
    """The JSON object a wire value holds, or {} (only to read ids from: never raises)."""
    try:
        record = decode_record(value)
    except Exception:  # not JSON, not UTF-8, nested too deeply
        return {}
    return record if isinstance(record, dict) else {}


def _utf8_safe(text: str) -> str:
    """`text` with any lone surrogate escaped, so it can be written as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _prepare(
    config: StreamConfig, topics: TopicNames, metrics: ProducerMetrics, item: QueuedRecord
) -> SpillEntry:
    record = item.record
    key = _session_key(record)
    topic = topics.trajectories if item.kind is RecordKind.TRAJECTORY else topics.feedback
    try:
        validate_record(item.kind, record)
        value = encode_record(record)
        limit = config.max_request_size_bytes - RECORD_OVERHEAD_BYTES
        if len(value) > limit:
            raise ValueError(f"record is {len(value)} bytes, over the {limit} byte limit")
        return SpillEntry(topic, key, value)
    except (SchemaValidationError, TypeError, ValueError) as exc:
        reason = str(exc)
    return _dlq_entry(config, topics, metrics, item, key, reason)


def _dlq_entry(
    config: StreamConfig,
    topics: TopicNames,
    metrics: ProducerMetrics,
    item: QueuedRecord,
    key: bytes | None,
    reason: str,
) -> SpillEntry:
    """The DLQ envelope of a refused record: parsed when it encodes, else its repr, else bare."""
    reason = _utf8_safe(cut_reason(reason))
    record = item.record
    log.warning("record_to_dlq", kind=item.kind.value, reason=reason[:500])
    metrics.dlq.labels(item.kind.value).inc()
    source = topics.trajectories if item.kind is RecordKind.TRAJECTORY else topics.feedback
    common: dict[str, Any] = {
        "reason": reason,
        "source_topic": source,
        "origin": "producer",
        "kind": item.kind.value,
    }
    with contextlib.suppress(Exception):  # an odd record still gets an envelope
        # The same id if this record is prepared again (by the parent of a dead worker).
        common["event_id"] = dlq_event_id("producer", source, record=record)
    limit = config.max_request_size_bytes - RECORD_OVERHEAD_BYTES
    try:
        value = encode_record(dlq_envelope(**common, record=record))
        if len(value) > limit:
            raise ValueError("record too large to keep in the DLQ")
        return SpillEntry(topics.dlq, key, value)
    except (TypeError, ValueError):
        pass  # kept as text below
    try:
        raw = _utf8_safe(repr(record)[:65536]).encode()
        return SpillEntry(topics.dlq, key, encode_record(dlq_envelope(**common, raw=raw)))
    except Exception:
        log.exception("record_repr_failed", kind=item.kind.value)
        return SpillEntry(topics.dlq, key, encode_record(dlq_envelope(**common)))


def close_producer(producer: KafkaProducer, timeout_s: float) -> None:
    """Close a producer; never raises, and never leaves its I/O thread running.

    kafka-python's `close()` flushes first and raises KafkaTimeoutError when a batch is still
    incomplete (never sent: an idempotent producer whose InitProducerId keeps failing sends
    nothing), before it stops its I/O thread, which then retries for ever; its `__del__`
    raises the same. Its sender is then force-closed, which fails the batches (the caller
    keeps the records) and stops the thread."""
    try:
        producer.close(timeout=timeout_s)
        return
    except Exception as exc:
        log.warning("producer_close_forced", error=repr(exc))
    sender = getattr(producer, "_sender", None)
    with contextlib.suppress(Exception):
        if sender is not None:
            sender.force_close()
            sender.join(max(timeout_s, 1.0))
        producer.close(timeout=0)  # the batches are failed now: this one completes


def producer_id_missing(producer: KafkaProducer) -> bool:
    """Whether an idempotent producer still has no producer id (InitProducerId never
    succeeded). kafka-python has no public call for this; False where it cannot tell."""
    manager = getattr(producer, "_transaction_manager", None)
    has_id = getattr(manager, "has_producer_id", None)
    if not callable(has_id):
        return False
    try:
        return not has_id()
    except Exception:
        return False


def tcp_reachable(bootstrap_servers: str, timeout_s: float = 1.0) -> bool:
    """Whether any bootstrap server accepts a TCP connection (a cheap probe before a client)."""
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
        host = host.strip("[]")  # `[::1]:9092`: the config's IPv6 form
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
                return True
        except OSError:
            continue
    return False


class KafkaSink:
    """RecordSink to `<prefix>.trajectories` / `<prefix>.feedback`, keyed by session id."""

    def __init__(
        self,
        config: StreamConfig,
        state_dir: Path,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.topics = TopicNames.from_prefix(config.topic_prefix)
        self.metrics = ProducerMetrics(registry if registry is not None else CollectorRegistry())
        # `olp_stream_broker_up` as a plain value, read by KafkaSinkProcess's worker at every
        # status tick (reading the gauge back means collecting the registry).
        self.broker_up = 0
        self._kind_by_topic = {
            self.topics.trajectories: RecordKind.TRAJECTORY.value,
            self.topics.feedback: RecordKind.FEEDBACK.value,
            self.topics.dlq: "dlq",
        }
        # The series counted for every record, by kind, each looked up once (`labels` takes
        # a lock and builds a key each time); filled as kinds first occur.
        self._queued_of: dict[str, Any] = {}
        self._sent_of: dict[str, Any] = {}
        # (sequence number of the put, item): see `durable_watermark`.
        self._queue: queue.Queue[tuple[int, QueuedRecord | SpillEntry]] = queue.Queue(
            maxsize=config.queue_size
        )
        self.spill = SpillStore(
            Path(state_dir) / config.spill_dir_name,
            max_bytes=config.spill_max_bytes,
            segment_bytes=config.spill_segment_bytes,
            on_full=self._on_spill_full,
            on_quarantine=lambda reason: self.metrics.spill_quarantined.labels(reason).inc(),
        )
        self.metrics.spill_bytes.set(self.spill.total_bytes())
        self._producer: KafkaProducer | None = None
        self._drain_retry_at = 0.0  # after a spill read error: the broker is not to blame
        # (segment seq, records of it not acknowledged yet, records read from it): what an
        # interrupted drain still has to send of the oldest segment.
        self._drain_rest: tuple[int, list[SpillEntry], int] | None = None
        self._idempotence = config.idempotence
        self._codec_refused_logged = False  # `_codec_refused` logs once, not per backoff
        self._retry_at = 0.0
        self._probe_at = 0.0  # the next idle probe of the broker (`_probe_idle`)
        self._stop = threading.Event()
        self._closed = False
        # Set by `close`: past it, what is left is spilled without another try at the broker.
        self._close_deadline: float | None = None
        # Set (under `_loop_lock`) once the sending thread stopped reading the queue, and
        # once it dropped the held records for the last time: from then on a put that
        # raced `close()` must spill its record itself, or count it lost.
        self._loop_lock = threading.Lock()
        self._loop_done = False
        self._final = False
        self._overflow_logged_at = 0.0
        # Spill-bound records a disk error kept in memory, oldest first; they go ahead of
        # anything newer, to the spill once the disk takes them or to the broker once the
        # spill is empty. `_held_sending` counts those taken out for a send in progress.
        self._held: list[SpillEntry] = []
        self._held_sending = 0
        self._held_lock = threading.Lock()
        # Which puts are durable: each put gets the next sequence number; `_watermark` is the
        # oldest one not durable yet and `_settled_early` those after it that are (records
        # do not become durable in put order: a put to a full queue is spilled at once, while
        # older ones wait in the queue or in a send). `_held_seqs` are the puts whose batch
        # left records in `_held` (all of the batch: a held record is not traced to its put,
        # so the whole batch waits for the held records to be durable).
        self._track_lock = threading.Lock()
        self._puts = 0
        self._watermark = 0
        self._settled_early: set[int] = set()
        self._held_seqs: list[int] = []
        self._disk_failures = 0
        self._disk_retry_at = 0.0
        self._thread = threading.Thread(target=self._run, name="olp-kafka-sink", daemon=True)
        self._thread.start()

    # ---- request path (event loop): enqueue only ------------------------------------------

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self._put(QueuedRecord(RecordKind.TRAJECTORY, record))

    def put_feedback(self, event: dict[str, Any]) -> None:
        self._put(QueuedRecord(RecordKind.FEEDBACK, event))

    def put_entry(self, entry: SpillEntry) -> None:
        """A record already validated and encoded elsewhere (a DLQ envelope included): sent
        or spilled as it is, so it is not prepared (and counted in `dlq`) a second time."""
        self._put(entry)

    @property
    def max_record_bytes(self) -> int:
        """The largest record the topic takes (a larger one goes to the DLQ)."""
        return self.config.max_request_size_bytes - RECORD_OVERHEAD_BYTES

    def put_item(self, item: QueuedRecord | SpillEntry) -> int:
        """`put_trajectory`/`put_feedback` (a QueuedRecord) or `put_entry` (a SpillEntry);
        returns the put's sequence number (0, 1, 2, ... in put order), for
        `durable_watermark`."""
        return self._put(item)

    def durable_watermark(self) -> int:
        """The sequence number of the oldest put that is not durable yet (the number of puts
        so far when every one is): every put before it was acknowledged by the broker
        (or routed to the DLQ), spilled, or counted as failed (`failed`, logged). Puts after
        it may be durable already: records do not become durable in put order."""
        with self._track_lock:
            return self._watermark

    def _register(self) -> int:
        with self._track_lock:
            seq = self._puts
            self._puts += 1
            return seq

    def _settle(self, seqs: Sequence[int]) -> None:
        """These puts are durable (or counted as failed)."""
        if not seqs:
            return
        with self._track_lock:
            early, watermark = self._settled_early, self._watermark
            early.update(seq for seq in seqs if seq >= watermark)
            while watermark in early:
                early.remove(watermark)
                watermark += 1
            self._watermark = watermark

    def _put(self, item: QueuedRecord | SpillEntry) -> int:
        seq = self._register()
        items = [(seq, item)]
        if not self._closed:
            try:
                self._queue.put_nowait((seq, item))
            except queue.Full:
                now = time.monotonic()
                if now - self._overflow_logged_at > 10:
                    self._overflow_logged_at = now
                    log.warning("producer_queue_full_spilling", queue_size=self.config.queue_size)
                # The queue's records go to the spill ahead of this one: spilled alone, it
                # was sent before the older records of its session still in the queue.
                items = [*self._drain_queue(), (seq, item)]
            else:
                _series(self._queued_of, self.metrics.queued, self._kind_of(item)).inc()
                if self._closed:  # close() began since the check: is anyone still reading?
                    self._take_back_queue()
                return seq
        else:
            log.warning("put_after_close_spilling", kind=self._kind_of(item))
        self._spill_entries(
            self._prepare([queued for _, queued in items]),
            [queued_seq for queued_seq, _ in items],
            retry_now=self._closed,
        )
        if self._closed and not self._thread.is_alive():  # nobody is left to retry the disk
            self._drop_held()
        return seq

    def _drain_queue(self) -> list[tuple[int, QueuedRecord | SpillEntry]]:
        """Take everything the queue holds, in put order (not the close's wake-up), at once.

        Under the queue's own lock (its documented `mutex`): taken one `get_nowait` at a
        time, the sending thread's batch could take an item between two of them and send it
        ahead of an older one spilled here."""
        pending = self._queue
        with pending.mutex:
            items = [item for item in pending.queue if item is not _WAKE_UP]
            woken = len(items) != len(pending.queue)
            pending.queue.clear()
            if woken:  # still the sending thread's, which `close` is waking
                pending.queue.append(_WAKE_UP)
            # As `task_done` for each item taken, and `get` for the room made.
            pending.unfinished_tasks -= len(items)
            if not pending.unfinished_tasks:
                pending.all_tasks_done.notify_all()
            pending.not_full.notify_all()
        self.metrics.queue_depth.set(pending.qsize())
        return items

    def _take_back_queue(self) -> None:
        """Spill what is left in the queue once the sending thread stopped reading it.

        A put that passed the `closed` check just before `close()` may enqueue after the
        thread's last look at the queue: nobody would send, spill or count that record."""
        items: list[tuple[int, QueuedRecord | SpillEntry]] = []
        with self._loop_lock:
            if not self._loop_done:
                return  # the thread checks the queue again before it stops
            while True:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for _ in items:
            self._queue.task_done()
        items = [item for item in items if item is not _WAKE_UP]
        if not items:
            return
        for _, item in items:
            log.warning("put_after_close_spilling", kind=self._kind_of(item))
        seqs = [seq for seq, _ in items]
        # What the disk refuses is counted lost by the thread's last `_drop_held`, or at
        # once by `_hold` when that has run.
        self._spill_entries(self._prepare([item for _, item in items]), seqs, retry_now=True)

    def held_records(self) -> int:
        """Records a disk error keeps in memory (not durable yet), including any being sent."""
        with self._held_lock:
            return len(self._held) + self._held_sending

    def _kind_of(self, item: QueuedRecord | SpillEntry) -> str:
        if isinstance(item, SpillEntry):
            return self._kind_by_topic.get(item.topic, "other")
        return item.kind.value

    # ---- background thread ---------------------------------------------------------------

    def _prepare(self, items: list[QueuedRecord | SpillEntry]) -> list[SpillEntry]:
        """Entries of `items`; one that is an entry already (`put_entry`) is kept as it is."""
        entries = (
            item
            if isinstance(item, SpillEntry)
            else prepare_entry(self.config, self.topics, self.metrics, item)
            for item in items
        )
        return [entry for entry in entries if entry is not None]

    def _take_batch(self, timeout_s: float) -> list[tuple[int, QueuedRecord | SpillEntry]]:
        items: list[tuple[int, QueuedRecord | SpillEntry]] = []
        try:
            items.append(
                self._queue.get(timeout=timeout_s) if timeout_s > 0 else self._queue.get_nowait()
            )
        except queue.Empty:
            return items
        while len(items) < self.config.producer_batch_records:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        if self._stop.is_set() and _WAKE_UP in items:  # only `close` puts it
            self._queue.task_done()
            items.remove(_WAKE_UP)
        return items

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            busy = (
                not self.spill.is_empty()
                and self._producer is not None
                and time.monotonic() >= self._drain_retry_at
            )
            items = self._take_batch(0.0 if (stopping or busy) else _IDLE_TAKE_S)
            seqs = [seq for seq, _ in items]
            entries = self._prepare([item for _, item in items])
            try:
                self._step(entries, seqs)
            except Exception:
                # Never lose the batch in hand: log loudly, spill it, reconnect later.
                log.exception("producer_step_failed")
                self._mark_down()
                self._spill_entries(entries, seqs)
            finally:
                for _ in items:
                    self._queue.task_done()
                self.metrics.queue_depth.set(self._queue.qsize())
            if not items and not busy and not stopping:
                self._probe_idle()
            if stopping and not items:
                with self._loop_lock:  # a put that raced close() sees the flag and spills
                    if self._queue.empty():
                        self._loop_done = True
                        break
        self._shutdown()

    def _step(self, entries: list[SpillEntry], seqs: Sequence[int] = ()) -> None:
        """Send or spill `entries` (made of the puts `seqs`); raises only before it took
        charge of them."""
        if self._past_close_deadline():
            # Closing and out of time (a broker that accepts connections and never answers
            # made each batch wait a whole delivery timeout): the rest goes to disk at once.
            self._spill_entries(entries, seqs)
            return
        if not self._ensure_producer():
            self._spill_entries(entries, seqs)
            return
        if not self.spill.is_empty():
            # The oldest segment goes first, then the batch behind what is left: appended
            # first, a batch that came once the broker was back was dropped by a spill an
            # outage had filled to its cap (`spill_full`), with the broker there to take it.
            if time.monotonic() >= self._drain_retry_at:
                try:
                    self._drain_one_segment()
                except SpillReadError:
                    # Logged by the store, which quarantines the segment after READ_ATTEMPTS
                    # failures in a row; the producer is fine, only the disk is retried later.
                    self._drain_retry_at = time.monotonic() + _SPILL_READ_RETRY_S
                except Exception:
                    # A send or a disk error deleting a segment: the segment stays and is sent
                    # again after the reconnect backoff (consumers de-duplicate by event_id).
                    log.exception("spill_drain_failed")
                    self._mark_down()
            self._spill_entries(entries, seqs)
            return
        held, held_seqs = self._take_held()
        try:
            # Held records are older: they go first.
            self._send_or_spill(held + entries, [*held_seqs, *seqs])
        except Exception:
            # The caller spills `entries`; the held records are kept (to be sent or spilled
            # again: a record twice rather than none).
            self._unhold(held, held_seqs)
            raise
        finally:
            self._held_sent()

    def _send_or_spill(self, batch: list[SpillEntry], seqs: Sequence[int]) -> None:
        try:
            failed = self._send(batch) if batch else []
        except Exception:
            log.exception("producer_send_failed")
            failed = batch
        if failed:
            self._mark_down()
            self._spill_entries(failed, seqs)
        else:
            self._settle(seqs)

    def _ensure_producer(self) -> bool:
        if self._producer is not None:
            return True
        if time.monotonic() < self._retry_at:
            return False
        if not tcp_reachable(self.config.bootstrap_servers):
            self._retry_at = time.monotonic() + self.config.reconnect_backoff_s
            return False
        try:
            ensure_topics(self.config)
            self._producer = self._new_producer()
        except Exception as exc:
            # A codec the broker is too old for raised ValueError here, taken for a bug:
            # a traceback per reconnect backoff, for ever. It is a setting to change.
            if self._codec_error(exc):
                self._codec_refused(exc)
            elif isinstance(exc, KafkaError):
                log.warning("broker_connect_failed", error=repr(exc))
            else:
                raise
            self._retry_at = time.monotonic() + self.config.reconnect_backoff_s
            return False
        self._set_broker_up(1)
        log.info("broker_connected", idempotence=self._idempotence)
        return True

    def _probe_idle(self) -> None:
        """Mirror, in `broker_up`, whether the broker still answers while nothing is sent.
        A probe that fails leaves the producer as it is: the next send finds out for sure
        (and spills) while this one only keeps the gauge honest."""
        if self._producer is None or time.monotonic() < self._probe_at:
            return
        self._probe_at = time.monotonic() + _IDLE_PROBE_S
        self._set_broker_up(1 if tcp_reachable(self.config.bootstrap_servers) else 0)

    def _set_broker_up(self, up: int) -> None:
        self.broker_up = up
        self.metrics.broker_up.set(up)

    def _codec_error(self, error: BaseException) -> bool:
        """Whether `error` says the configured compression cannot be used here."""
        if isinstance(error, _CODEC_REFUSED):
            return True
        codec = self.config.compression_type
        # kafka-python: "Zstd Requires >= Kafka 2.1 Brokers", "LZ4 Requires >= Kafka 0.8.2
        # Brokers", "Libraries for zstd compression codec not found".
        return (
            codec is not None
            and isinstance(error, (ValueError, RuntimeError))
            and codec.lower() in str(error).lower()
        )

    def _codec_refused(self, error: BaseException) -> None:
        """The compression setting is refused: one error naming it and the fix (then debug
        lines only). The caller keeps the records (spilled) and retries after the backoff,
        as for a broker that is down: an upgraded broker takes them."""
        if self._codec_refused_logged:
            log.debug("stream_compression_still_unsupported", error=repr(error))
            return
        self._codec_refused_logged = True
        log.error(
            "stream_compression_unsupported",
            setting="stream.compression_type",
            compression_type=self.config.compression_type,
            error=repr(error),
            fix="set stream.compression_type to null or gzip and restart (or upgrade the "
            "broker / install the codec's package); until then records are spilled and "
            "the broker is retried every reconnect_backoff_s",
        )

    def _new_producer(self) -> KafkaProducer:
        options: dict[str, Any] = {
            "bootstrap_servers": self.config.bootstrap_servers,
            "client_id": "olp-sink",
            "acks": "all",
            "linger_ms": self.config.linger_ms,
            "batch_size": self.config.batch_size_bytes,
            "max_request_size": self.config.max_request_size_bytes,
            "compression_type": self.config.compression_type,
            "request_timeout_ms": self.config.request_timeout_ms,
            "delivery_timeout_ms": self.config.delivery_timeout_ms,
            "max_block_ms": self.config.max_block_ms,
            "bootstrap_timeout_ms": self.config.bootstrap_timeout_ms,
            **producer_options(),
        }
        if self._idempotence:
            try:
                return KafkaProducer(enable_idempotence=True, **options)
            except (UnsupportedVersionError, KafkaError) as exc:
                if not tcp_reachable(self.config.bootstrap_servers):
                    raise
                log.warning("idempotence_unsupported_falling_back", error=repr(exc))
                self._idempotence = False
        return KafkaProducer(enable_idempotence=False, **options)

    def _send(self, entries: list[SpillEntry], stage: _Stage = "original") -> list[SpillEntry]:
        """Send and wait for acks; return the entries that were not acknowledged, in order.

        A record the broker refuses for good (an error about the record: `_RECORD_REFUSED`)
        is not returned (it could never be sent): the DLQ record `_reject` makes of it is sent
        in its place, at the next stage, and returned in its place when that is not
        acknowledged. Any other failure is returned: the caller marks the broker down and
        spills it, and a fresh producer sends it again."""
        left = self._send_slots(entries, stage)
        failed = [entry for entry in left if entry is not None]
        if failed:
            log.warning("broker_unacknowledged", records=len(failed))
        return failed

    def _send_slots(self, entries: list[SpillEntry], stage: _Stage) -> list[SpillEntry | None]:
        """`_send` position by position: None where the record (or the DLQ record sent in its
        place) was acknowledged or dropped, else what is still to be sent for it. Positions
        keep a retry in the spill's order."""
        assert self._producer is not None
        producer = self._producer
        slots: list[SpillEntry | None] = list(entries)
        futures = []
        replacements: dict[_Stage, list[tuple[int, SpillEntry]]] = {"envelope": [], "truncated": []}
        for index, entry in enumerate(entries):
            try:
                futures.append(
                    (index, producer.send(entry.topic, key=entry.key, value=entry.value))
                )
            except MessageSizeTooLargeError as exc:  # over max_request_size_bytes: for good
                slots[index] = None
                self._reject(index, entry, exc, stage, replacements)
                continue
            except KafkaError as exc:
                if self._codec_error(exc):
                    self._codec_refused(exc)
                else:
                    log.warning("broker_send_failed", error=repr(exc))
                break  # this one and the rest stay in their slots
        try:
            self._flush(producer, self.config.delivery_timeout_ms / 1000 + 1)
        except KafkaError as exc:
            log.warning("broker_flush_timed_out", error=repr(exc))
            self._check_producer_id(producer)
        broker_error: BaseException | None = None
        for index, future in futures:
            entry = entries[index]
            if future.succeeded():
                if self._codec_refused_logged:
                    self._codec_refused_logged = False
                    log.info(
                        "stream_compression_accepted", compression=self.config.compression_type
                    )
                slots[index] = None
                kind = self._kind_by_topic.get(entry.topic, "other")
                _series(self._sent_of, self.metrics.sent, kind).inc()
            elif future.failed() and isinstance(future.exception, _RECORD_REFUSED):
                slots[index] = None
                self._reject(index, entry, future.exception, stage, replacements)
            elif future.failed() and broker_error is None:
                broker_error = future.exception  # the slot keeps the record: sent again
        if broker_error is not None and self._codec_error(broker_error):
            self._codec_refused(broker_error)
        elif broker_error is not None:
            log.warning("broker_send_failed", error=repr(broker_error), stage=stage)
        for next_stage, replacing in replacements.items():
            if replacing:
                sent = self._send_slots([entry for _, entry in replacing], next_stage)
                for (index, _), still in zip(replacing, sent, strict=True):
                    slots[index] = still
        return slots

    def _past_close_deadline(self) -> bool:
        deadline = self._close_deadline
        return deadline is not None and time.monotonic() >= deadline

    def _flush(self, producer: KafkaProducer, timeout_s: float) -> None:
        """`producer.flush(timeout_s)`, in slices, ending early at the close deadline (then
        KafkaTimeoutError, as at the timeout: the records not acknowledged are spilled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            closing = self._close_deadline
            end = deadline if closing is None else min(deadline, closing)
            left = end - time.monotonic()
            try:
                producer.flush(timeout=max(min(left, _FLUSH_SLICE_S), 0.0))
                return
            except KafkaTimeoutError:
                if time.monotonic() >= end:
                    raise

    def _check_producer_id(self, producer: KafkaProducer) -> None:
        """After a flush that timed out: an idempotent producer without a producer id yet.

        kafka-python re-sends a failing InitProducerId for ever (retriable error, dropped
        connection) and sends no record meanwhile; `delivery_timeout_ms` does not end that
        wait. Past the flush deadline the sink gives up on idempotence (logged once, as for a
        broker that does not support it): the records not acknowledged are spilled and sent
        by a plain producer after the reconnect backoff (consumers de-duplicate by event_id)."""
        if not self._idempotence or not producer_id_missing(producer):
            return
        if not tcp_reachable(self.config.bootstrap_servers):
            return  # the broker went away: an outage, not a refused InitProducerId
        self._idempotence = False
        log.error(
            "idempotence_unavailable_falling_back",
            reason="InitProducerId did not succeed within delivery_timeout_ms",
            delivery_timeout_ms=self.config.delivery_timeout_ms,
        )

    def _reject(
        self,
        index: int,
        entry: SpillEntry,
        error: BaseException | None,
        stage: _Stage,
        replacements: dict[_Stage, list[tuple[int, SpillEntry]]],
    ) -> None:
        """The broker refused this record for good: add the DLQ record to send in its place.

        A refused record becomes an envelope with its payload; a refused DLQ record (or
        envelope) is sent once more with its payload truncated, then dropped (logged,
        counted): retrying it as it is would block the spill forever."""
        kind = self._kind_by_topic.get(entry.topic, "other")
        log.error("record_rejected_by_broker", kind=kind, stage=stage, error=repr(error))
        self.metrics.failed.labels(kind, "rejected").inc()
        reason = f"broker rejected the record: {error!r}"
        if stage == "original" and entry.topic != self.topics.dlq:
            next_stage: _Stage = "envelope"
            raw = entry.value[:65536]
            event_id = dlq_event_id("producer", entry.topic, record=_decoded(entry.value))
        elif stage != "truncated":
            next_stage = "truncated"
            raw = entry.value[:_DLQ_TRUNCATED_BYTES]
            reason += f" (payload truncated to its first {_DLQ_TRUNCATED_BYTES} bytes)"
            # The same dead letter, cut short: it keeps the refused envelope's event_id.
            envelope_id = _decoded(entry.value).get("event_id")
            event_id = envelope_id if isinstance(envelope_id, str) else None
        else:
            log.error("dlq_record_dropped", topic=entry.topic, bytes=len(entry.value))
            self.metrics.failed.labels("dlq", "dlq_dropped").inc()
            return
        envelope = dlq_envelope(
            reason=reason,
            source_topic=entry.topic,
            origin="producer",
            kind=kind,
            raw=raw,
            event_id=event_id,
        )
        replacements[next_stage].append(
            (index, SpillEntry(self.topics.dlq, entry.key, encode_record(envelope)))
        )

    def _drain_one_segment(self) -> None:
        """Send the oldest spill segment and delete it once all of it was acknowledged.

        After an interrupted send only what was not acknowledged is sent again (kept in
        memory; a restart reads the whole segment again): resending all of it delivered the
        rest twice and made another DLQ envelope of each record refused for good."""
        segment = self.spill.oldest_segment()
        if segment is None:
            return
        if self._drain_rest is not None and self._drain_rest[0] == segment.seq:
            _, entries, read = self._drain_rest
        else:
            entries = self.spill.read(segment)
            read = len(entries)
        failed = self._send(entries) if entries else []
        self._drain_rest = (segment.seq, failed, read)
        if failed:
            log.warning(
                "spill_drain_interrupted",
                segment=segment.path.name,
                unacknowledged=len(failed),
                records=read,
            )
            self._mark_down()
            return
        outcome = self.spill.delete(segment)
        self._drain_rest = None
        self.metrics.spill_bytes.set(self.spill.total_bytes())
        if outcome == "deleted":
            log.info(
                "spill_segment_drained",
                segment=segment.path.name,
                records=read,
                spill_bytes=self.spill.total_bytes(),
            )
        else:
            # Quarantined or gone (the store logged why): records_sent are the intact
            # records it still had; whatever else it held is in quarantine/ or lost.
            log.warning(
                "spill_segment_set_aside",
                segment=segment.path.name,
                reason=outcome,
                records_sent=read,
                spill_bytes=self.spill.total_bytes(),
            )

    def _spill_entries(
        self, entries: list[SpillEntry], seqs: Sequence[int] = (), *, retry_now: bool = False
    ) -> None:
        """Append behind the spill (`entries` are made of the puts `seqs`). While the disk
        refuses writes the records stay in memory (at most queue_size of them) and the write
        is retried with a doubling backoff."""
        with self._held_lock:
            batch, self._held = self._held + entries, []
            batch_seqs, self._held_seqs = [*self._held_seqs, *seqs], []
            if not batch:
                self._settle(batch_seqs)
                return
            # The backoff only spares the disk while memory has room; when full, try anyway.
            backing_off = (
                not retry_now and not self._final and time.monotonic() < self._disk_retry_at
            )
            if backing_off and len(batch) <= self.config.queue_size:
                self._hold(batch, batch_seqs)
                return
            try:
                stored = self.spill.append(batch)
            except Exception as exc:
                # A disk error (OSError); anything else is a bug in the store, kept the same
                # way: raising here lost the batch, held records included, uncounted.
                if not isinstance(exc, OSError):
                    log.exception("spill_append_failed_unexpectedly")
                stored = getattr(exc, "stored", 0)
                self._disk_failed(exc, len(batch) - stored)
                self._hold(batch[stored:], batch_seqs)
            else:
                if self._disk_failures:
                    log.info("spill_disk_recovered", failures=self._disk_failures)
                self._disk_failures = 0
                self._settle(batch_seqs)  # the few the size cap refused are counted
        for entry in batch[:stored]:
            self.metrics.spilled.labels(self._kind_by_topic.get(entry.topic, "other")).inc()
        self.metrics.spill_bytes.set(self.spill.total_bytes())

    def _disk_failed(self, error: Exception, unstored: int) -> None:
        self._disk_failures += 1
        delay = min(_DISK_RETRY_FIRST_S * 2 ** (self._disk_failures - 1), _DISK_RETRY_MAX_S)
        self._disk_retry_at = time.monotonic() + delay
        self.metrics.spill_errors.inc()
        log.error("spill_write_failed", error=repr(error), in_memory=unstored, retry_in_s=delay)

    def _hold(self, entries: list[SpillEntry], seqs: Sequence[int]) -> None:
        """Keep spill-bound records in memory (lock held); beyond queue_size they are lost
        (counted). The puts `seqs` are durable once nothing of them is held. After the
        sending thread's last `_drop_held` nobody would retry: they are lost (counted)."""
        room = 0 if self._final else max(self.config.queue_size - len(self._held), 0)
        self._held.extend(entries[:room])
        self._count_lost(entries[room:], "disk_error")
        if self._held:
            self._held_seqs.extend(seqs)
        else:
            self._settle(seqs)

    def _unhold(self, entries: list[SpillEntry], seqs: Sequence[int]) -> None:
        """Put records taken by `_take_held` back, ahead of any held since."""
        if not entries and not seqs:
            return
        with self._held_lock:
            self._held[:0] = entries
            self._held_seqs[:0] = seqs

    def _drop_held(self, final: bool = False) -> None:
        """Nobody is left to retry the disk: what it refused is lost (logged, counted).
        `final` (the sending thread's last call): nothing is held from then on."""
        with self._held_lock:
            self._final = self._final or final
            lost, self._held = self._held, []
            seqs, self._held_seqs = self._held_seqs, []
        self._count_lost(lost, "disk_error")
        self._settle(seqs)

    def _count_lost(self, entries: list[SpillEntry], reason: str) -> None:
        if not entries:
            return
        log.error("records_lost", reason=reason, records=len(entries))
        for entry in entries:
            self.metrics.failed.labels(self._kind_by_topic.get(entry.topic, "other"), reason).inc()

    def _take_held(self) -> tuple[list[SpillEntry], list[int]]:
        with self._held_lock:
            held, self._held = self._held, []
            seqs, self._held_seqs = self._held_seqs, []
            self._held_sending = len(held)
            return held, seqs

    def _held_sent(self) -> None:
        with self._held_lock:
            self._held_sending = 0

    def _on_spill_full(self, dropped: int) -> None:
        self.metrics.failed.labels("any", "spill_full").inc(dropped)

    def _mark_down(self) -> None:
        producer, self._producer = self._producer, None
        self._set_broker_up(0)
        self._retry_at = time.monotonic() + self.config.reconnect_backoff_s
        if producer is not None:
            # A fresh producer after reconnect: a restarted broker forgets producer ids.
            close_producer(producer, 0)
            log.warning("broker_down_spilling", retry_in_s=self.config.reconnect_backoff_s)

    def _shutdown(self) -> None:
        deadline = self._close_deadline or time.monotonic() + self.config.close_timeout_s
        try:
            while self._producer is not None and not self.spill.is_empty():
                if time.monotonic() > deadline:
                    break
                self._drain_one_segment()
            if self._producer is not None and self.held_records():
                self._step([])  # the spill is empty: send what the disk refused
        except Exception:
            log.exception("producer_shutdown_drain_failed")
        if self._producer is not None:
            # Every send was flushed already: a healthy producer closes at once, and a hung
            # one is not waited on past the deadline (half a second at least: a graceful
            # close of its I/O thread).
            close_producer(self._producer, max(deadline - time.monotonic(), 0.5))
            self._producer = None
        self._spill_entries([], retry_now=True)  # a last try for what the disk refused
        self._drop_held(final=True)
        try:
            self.spill.close()
        except OSError as exc:  # its records are fsync'd already: only the handle is lost
            log.error("spill_close_failed", error=repr(exc))
        remaining = self.spill.total_bytes()
        log.info("kafka_sink_closed", spill_bytes=remaining)

    # ---- lifecycle -----------------------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the queue and the spill are empty (everything acknowledged)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            idle = self._queue.unfinished_tasks == 0 and not self.held_records()
            if idle and self.spill.is_empty():
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Send what the broker takes within close_timeout_s; the rest stays in the spill."""
        if self._closed:
            return
        self._close_deadline = time.monotonic() + self.config.close_timeout_s
        self._closed = True
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a full queue means the thread is not waiting
            self._queue.put_nowait(_WAKE_UP)
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
