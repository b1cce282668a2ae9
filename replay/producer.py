"""KafkaSink: a RecordSink whose `put_*` never blocks the event loop and never loses a record.

`put_*` only enqueues onto a bounded queue. One background thread validates, encodes and
sends with a kafka-python producer (acks=all, idempotent when the broker allows). When the
broker is unreachable, or a send is not acknowledged in time, records go to the durable
spill; while the spill holds anything, new records are appended behind it so order is kept,
and the thread drains it oldest segment first once the broker answers again, deleting a
segment only after every record in it was acknowledged. A drain cut short sends only the
rest of its segment again, but a restart reads the whole segment again, so a record may be
delivered twice: consumers de-duplicate by event_id (a record's DLQ envelope included, whose
event_id is derived from the record's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import queue
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import structlog
from kafka import KafkaProducer
from kafka.errors import KafkaError, MessageSizeTooLargeError, UnsupportedVersionError
from prometheus_client import CollectorRegistry, Counter, Gauge

from replay.config import StreamConfig
from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    decode_record,
    derived_event_id,
    dlq_envelope,
    dlq_event_id,
    encode_record,
    validate_record,
)
from replay.spill import SpillEntry, SpillReadError, SpillStore
from replay.topics import TopicNames, ensure_topics

log = structlog.get_logger(__name__)

_RECORD_OVERHEAD_BYTES = 1024
# How long the sender thread waits for records before it looks at the spill and the broker
# again. `close` wakes it at once, so this only spaces out the checks of an idle sink (each
# wake-up of a sleeping thread costs ~0.1 ms of CPU on a small VM).
_IDLE_TAKE_S = 0.25
_WAKE_UP: Any = object()  # put by `close`: not a record
# Backoff between spill writes while the disk refuses them (ENOSPC, EIO): doubling, capped.
_DISK_RETRY_FIRST_S = 0.5
_DISK_RETRY_MAX_S = 30.0
# Pause before reading a spill segment again after a read error (EIO, EACCES); the store
# moves it to quarantine after READ_ATTEMPTS failures in a row.
_SPILL_READ_RETRY_S = 1.0
# A DLQ envelope the broker refuses for good is sent once more with its payload cut to this.
_DLQ_TRUNCATED_BYTES = 4096
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
class _Item:
    kind: RecordKind
    record: dict[str, Any]


def prepare_entry(
    config: StreamConfig, topics: TopicNames, metrics: ProducerMetrics, item: _Item
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
    config: StreamConfig, topics: TopicNames, metrics: ProducerMetrics, item: _Item
) -> SpillEntry:
    record = item.record
    key = _session_key(record)
    topic = topics.trajectories if item.kind is RecordKind.TRAJECTORY else topics.feedback
    try:
        validate_record(item.kind, record)
        value = encode_record(record)
        limit = config.max_request_size_bytes - _RECORD_OVERHEAD_BYTES
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
    item: _Item,
    key: bytes | None,
    reason: str,
) -> SpillEntry:
    """The DLQ envelope of a refused record: parsed when it encodes, else its repr, else bare."""
    reason = _utf8_safe(reason)
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
    limit = config.max_request_size_bytes - _RECORD_OVERHEAD_BYTES
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


def tcp_reachable(bootstrap_servers: str, timeout_s: float = 1.0) -> bool:
    """Whether any bootstrap server accepts a TCP connection (a cheap probe before a client)."""
    for server in bootstrap_servers.split(","):
        host, _, port = server.strip().rpartition(":")
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
        self._kind_by_topic = {
            self.topics.trajectories: RecordKind.TRAJECTORY.value,
            self.topics.feedback: RecordKind.FEEDBACK.value,
            self.topics.dlq: "dlq",
        }
        self._queue: queue.Queue[_Item | SpillEntry] = queue.Queue(maxsize=config.queue_size)
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
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._closed = False
        self._overflow_logged_at = 0.0
        # Spill-bound records a disk error kept in memory, oldest first; they go ahead of
        # anything newer, to the spill once the disk takes them or to the broker once the
        # spill is empty. `_held_sending` counts those taken out for a send in progress.
        self._held: list[SpillEntry] = []
        self._held_sending = 0
        self._held_lock = threading.Lock()
        self._disk_failures = 0
        self._disk_retry_at = 0.0
        self._thread = threading.Thread(target=self._run, name="olp-kafka-sink", daemon=True)
        self._thread.start()

    # ---- request path (event loop): enqueue only ------------------------------------------

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self._put(_Item(RecordKind.TRAJECTORY, record))

    def put_feedback(self, event: dict[str, Any]) -> None:
        self._put(_Item(RecordKind.FEEDBACK, event))

    def put_entry(self, entry: SpillEntry) -> None:
        """A record already validated and encoded elsewhere (a DLQ envelope included): sent
        or spilled as it is, so it is not prepared (and counted in `dlq`) a second time."""
        self._put(entry)

    def _put(self, item: _Item | SpillEntry) -> None:
        if not self._closed:
            try:
                self._queue.put_nowait(item)
                self.metrics.queued.labels(self._kind_of(item)).inc()
                return
            except queue.Full:
                now = time.monotonic()
                if now - self._overflow_logged_at > 10:
                    self._overflow_logged_at = now
                    log.warning("producer_queue_full_spilling", queue_size=self.config.queue_size)
        else:
            log.warning("put_after_close_spilling", kind=self._kind_of(item))
        self._spill_entries(self._prepare([item]), retry_now=self._closed)
        if self._closed and not self._thread.is_alive():  # nobody is left to retry the disk
            with self._held_lock:
                lost, self._held = self._held, []
            self._count_lost(lost, "disk_error")

    def held_records(self) -> int:
        """Records a disk error keeps in memory (not durable yet), including any being sent."""
        with self._held_lock:
            return len(self._held) + self._held_sending

    def _kind_of(self, item: _Item | SpillEntry) -> str:
        if isinstance(item, SpillEntry):
            return self._kind_by_topic.get(item.topic, "other")
        return item.kind.value

    # ---- background thread ---------------------------------------------------------------

    def _prepare(self, items: list[_Item | SpillEntry]) -> list[SpillEntry]:
        """Entries of `items`; one that is an entry already (`put_entry`) is kept as it is."""
        entries = (
            item
            if isinstance(item, SpillEntry)
            else prepare_entry(self.config, self.topics, self.metrics, item)
            for item in items
        )
        return [entry for entry in entries if entry is not None]

    def _take_batch(self, timeout_s: float) -> list[_Item | SpillEntry]:
        items: list[_Item | SpillEntry] = []
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
            entries = self._prepare(items)
            try:
                self._step(entries)
            except Exception:
                # Never lose the batch in hand: log loudly, spill it, reconnect later.
                log.exception("producer_step_failed")
                self._mark_down()
                self._spill_entries(entries)
            finally:
                for _ in items:
                    self._queue.task_done()
                self.metrics.queue_depth.set(self._queue.qsize())
            if stopping and not items and self._queue.empty():
                break
        self._shutdown()

    def _step(self, entries: list[SpillEntry]) -> None:
        """Send or spill `entries`; raises only before it took charge of them."""
        if not self._ensure_producer():
            self._spill_entries(entries)
            return
        if not self.spill.is_empty():
            self._spill_entries(entries)
            if time.monotonic() < self._drain_retry_at:
                return
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
            return
        held = self._take_held()
        try:
            self._send_or_spill(held + entries)  # held records are older: they go first
        finally:
            self._held_sent()

    def _send_or_spill(self, batch: list[SpillEntry]) -> None:
        try:
            failed = self._send(batch) if batch else []
        except Exception:
            log.exception("producer_send_failed")
            failed = batch
        if failed:
            self._mark_down()
            self._spill_entries(failed)

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
        except KafkaError as exc:
            log.warning("broker_connect_failed", error=repr(exc))
            self._retry_at = time.monotonic() + self.config.reconnect_backoff_s
            return False
        self.metrics.broker_up.set(1)
        log.info("broker_connected", idempotence=self._idempotence)
        return True

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

        A record the broker refuses for good is not returned (it could never be sent): the
        DLQ record `_reject` makes of it is sent in its place, at the next stage, and returned
        in its place when that is not acknowledged."""
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
                log.warning("broker_send_failed", error=repr(exc))
                break  # this one and the rest stay in their slots
        try:
            producer.flush(timeout=self.config.delivery_timeout_ms / 1000 + 1)
        except KafkaError as exc:
            log.warning("broker_flush_timed_out", error=repr(exc))
        for index, future in futures:
            entry = entries[index]
            if future.succeeded():
                slots[index] = None
                self.metrics.sent.labels(self._kind_by_topic.get(entry.topic, "other")).inc()
            elif future.failed() and not future.retriable():
                slots[index] = None
                self._reject(index, entry, future.exception, stage, replacements)
        for next_stage, replacing in replacements.items():
            if replacing:
                sent = self._send_slots([entry for _, entry in replacing], next_stage)
                for (index, _), still in zip(replacing, sent, strict=True):
                    slots[index] = still
        return slots

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

    def _spill_entries(self, entries: list[SpillEntry], *, retry_now: bool = False) -> None:
        """Append behind the spill. While the disk refuses writes the records stay in memory
        (at most queue_size of them) and the write is retried with a doubling backoff."""
        with self._held_lock:
            batch, self._held = self._held + entries, []
            if not batch:
                return
            # The backoff only spares the disk while memory has room; when full, try anyway.
            backing_off = not retry_now and time.monotonic() < self._disk_retry_at
            if backing_off and len(batch) <= self.config.queue_size:
                self._hold(batch)
                return
            try:
                stored = self.spill.append(batch)
            except OSError as exc:
                stored = getattr(exc, "stored", 0)
                self._disk_failed(exc, len(batch) - stored)
                self._hold(batch[stored:])
            else:
                if self._disk_failures:
                    log.info("spill_disk_recovered", failures=self._disk_failures)
                self._disk_failures = 0
        for entry in batch[:stored]:
            self.metrics.spilled.labels(self._kind_by_topic.get(entry.topic, "other")).inc()
        self.metrics.spill_bytes.set(self.spill.total_bytes())

    def _disk_failed(self, error: OSError, unstored: int) -> None:
        self._disk_failures += 1
        delay = min(_DISK_RETRY_FIRST_S * 2 ** (self._disk_failures - 1), _DISK_RETRY_MAX_S)
        self._disk_retry_at = time.monotonic() + delay
        self.metrics.spill_errors.inc()
        log.error("spill_write_failed", error=repr(error), in_memory=unstored, retry_in_s=delay)

    def _hold(self, entries: list[SpillEntry]) -> None:
        """Keep spill-bound records in memory (lock held); beyond queue_size they are lost."""
        room = max(self.config.queue_size - len(self._held), 0)
        self._held.extend(entries[:room])
        self._count_lost(entries[room:], "disk_error")

    def _count_lost(self, entries: list[SpillEntry], reason: str) -> None:
        if not entries:
            return
        log.error("records_lost", reason=reason, records=len(entries))
        for entry in entries:
            self.metrics.failed.labels(self._kind_by_topic.get(entry.topic, "other"), reason).inc()

    def _take_held(self) -> list[SpillEntry]:
        with self._held_lock:
            held, self._held = self._held, []
            self._held_sending = len(held)
            return held

    def _held_sent(self) -> None:
        with self._held_lock:
            self._held_sending = 0

    def _on_spill_full(self, dropped: int) -> None:
        self.metrics.failed.labels("any", "spill_full").inc(dropped)

    def _mark_down(self) -> None:
        producer, self._producer = self._producer, None
        self.metrics.broker_up.set(0)
        self._retry_at = time.monotonic() + self.config.reconnect_backoff_s
        if producer is not None:
            # A fresh producer after reconnect: a restarted broker forgets producer ids.
            producer.close(timeout=0)
            log.warning("broker_down_spilling", retry_in_s=self.config.reconnect_backoff_s)

    def _shutdown(self) -> None:
        deadline = time.monotonic() + self.config.close_timeout_s
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
            self._producer.close(timeout=self.config.close_timeout_s)
            self._producer = None
        self._spill_entries([], retry_now=True)  # a last try for what the disk refused
        with self._held_lock:
            lost, self._held = self._held, []
        self._count_lost(lost, "disk_error")
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
        self._closed = True
        self._stop.set()
        with contextlib.suppress(queue.Full):  # a full queue means the thread is not waiting
            self._queue.put_nowait(_WAKE_UP)
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)


# ---- the same sink in a child process ------------------------------------------------------

# Every wake-up of a sleeping thread costs ~60-120 µs of CPU on a small VM (cold caches),
# more than pickling a capture. The feeder therefore runs on a fixed tick while there is work
# (one wake per tick, however many records arrive in it) and the child reports on the same
# tick; at 50 requests/s that is one wake per five records, not two per record.
_STATUS_INTERVAL_S = 0.1
_IDLE_POLL_S = 1.0  # the feeder's check on an idle child (a new record wakes it at once)
_METRICS_INTERVAL_S = 1.0  # the child's metric values ride on a status message this often
_FEED_INTERVAL_S = 0.1  # batching tick: records reach the child at most this late
_CHILD_NICE = 10
_CHILD_GC_YOUNG_THRESHOLD = 20_000
_CHILD_START_TIMEOUT_S = 60.0
_RESTART_BACKOFF_S = 1.0


def _metric_values(metrics: ProducerMetrics) -> dict[str, dict[tuple[str, ...], float]]:
    """Every series of a ProducerMetrics as {attribute: {label values: value}}."""
    out: dict[str, dict[tuple[str, ...], float]] = {}
    for name, metric in vars(metrics).items():
        series: dict[tuple[str, ...], float] = {}
        for family in metric.collect():
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                series[tuple(sample.labels.values())] = sample.value
        out[name] = series
    return out


# Outbox kinds besides the record kinds: the producer's capture-to-record function, and a
# capture the worker turns into a trajectory record with it.
_BUILDER = "builder"
_CAPTURE = "capture"
_SKIP = "skip"  # a placeholder the worker counts as done (keeps the parent's count aligned)
# A record the parent already validated and encoded (a SpillEntry, maybe a DLQ envelope) but
# could not spill: the worker sends or spills it as it is, so it is counted once.
_ENTRY = "entry"


class _CaptureBuilder:
    """Turns captures into records with the function the producer sent, counting outcomes
    (cumulative, as the parent mirrors them).

    A worker may die after building a capture but before the record was durable; the parent
    then builds it again. So that this is one record and one outcome, not two: the record's
    event_id is derived from its trajectory_id (the same in both builds), and an outcome is
    counted only by `release`, once the worker reports the record durable; the parent counts
    those of the captures it builds again itself."""

    def __init__(self) -> None:
        self.build_record: Callable[..., dict[str, Any]] | None = None
        self.outcomes: dict[tuple[str, bool], int] = {}
        self.failures = 0
        # (position in the worker's input, outcome or None for a failed build), oldest
        # first, not counted yet: appended by the receiving thread, released by the reporter.
        self._unreleased: collections.deque[tuple[int, tuple[str, bool] | None]] = (
            collections.deque()
        )

    def build(
        self, capture_and_status: tuple[Any, str], position: int = 0
    ) -> dict[str, Any] | None:
        """The record of a capture, or None when building failed (logged, counted)."""
        try:
            if self.build_record is None:
                raise RuntimeError("a capture arrived before the record builder")
            record = self.build_record(*capture_and_status)
            trajectory_id = record.get("trajectory_id")
            if isinstance(trajectory_id, str):
                record["event_id"] = derived_event_id("trajectory", trajectory_id)
            key = (str(record.get("status")), bool(record.get("trainable")))
        except Exception:
            # One bad capture must not stop the worker; it is logged and counted (the
            # proxy's olp_proxy_capture_failures_total).
            log.exception("trajectory_build_failed")
            self._unreleased.append((position, None))
            return None
        self._unreleased.append((position, key))
        return record

    def release(self, done: float) -> None:
        """Count the outcomes of the inputs before position `done` (durable by then)."""
        while self._unreleased and self._unreleased[0][0] < done:
            _, key = self._unreleased.popleft()
            if key is None:
                self.failures += 1
            else:
                self.outcomes[key] = self.outcomes.get(key, 0) + 1

    def totals(self) -> tuple[dict[tuple[str, bool], int], int]:
        return dict(self.outcomes), self.failures


def _child_main(config_json: str, state_dir: str, conn: Any) -> None:
    """The child process: a KafkaSink fed by batches from the parent, reporting progress.

    Progress is `done`: how many received records are durable (acknowledged by the broker,
    spilled or routed to the DLQ). The queue is FIFO, so these are the oldest ones; the parent
    keeps every record until it is counted here, and spills the rest itself if this process
    dies."""
    import os
    import pickle

    # Background work: when the cores are busy, the proxy's requests go first (SCHED_BATCH:
    # waking up does not preempt them). The child still gets a share of the CPU; if it falls
    # behind, its full queue spills to disk, and no request waits on it.
    with contextlib.suppress(OSError, AttributeError):
        os.nice(_CHILD_NICE)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    # The parent decides when this process ends (its `close` message, or the pipe's end if
    # the parent died): a SIGTERM or Ctrl-C sent to the proxy's whole process group (`olp up`
    # stops its children that way, as do service managers) must not kill it before the
    # parent closed it, with records received and not yet sent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = StreamConfig.model_validate_json(config_json)
    sink = KafkaSink(config, Path(state_dir))
    # Each record allocates a few hundred containers that refcounting frees; with the
    # interpreter's young threshold (700) the collector ran every few records and took ~5 %
    # of this process's CPU under load, scanning start-up objects too. Those are frozen, and
    # cyclic garbage is still collected, later (the proxy process does the same: proxy.gc).
    gc.collect()
    gc.freeze()
    gc.set_threshold(_CHILD_GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
    received = 0
    builder = _CaptureBuilder()
    send_lock = threading.Lock()
    stop = threading.Event()
    metrics_sent_at = 0.0
    idle_values_sent = False
    last_idle_status: tuple[Any, ...] | None = None

    def status(final: bool = False) -> None:
        # Progress goes out every _STATUS_INTERVAL_S while there is work (a heartbeat the
        # parent's hang check relies on); an idle child says so once and then stays quiet
        # until something changes. The metric values, whose collection and mirroring cost
        # the parent's interpreter time, go once a second while busy and once on becoming
        # idle (so a caller that waited for idle reads final values).
        nonlocal metrics_sent_at, idle_values_sent, last_idle_status
        got = received  # read before unfinished_tasks: `done` may only be underestimated
        # A record leaves the queue only after it is held (kept in memory by a disk error)
        # or durable, so reading the queue before the held count never misses it.
        pending = sink._queue.unfinished_tasks
        pending += sink.held_records()
        idle = pending == 0 and sink.spill.is_empty()
        values = None
        now = time.monotonic()
        if final or (idle and not idle_values_sent) or now - metrics_sent_at >= _METRICS_INTERVAL_S:
            values, metrics_sent_at = _metric_values(sink.metrics), now
        idle_values_sent = idle and (values is not None or idle_values_sent)
        # Outcomes travel with the `done` they are counted up to: the parent pops exactly
        # those records, and counts the rest itself if it has to build them again.
        builder.release(got - pending)
        message = ("status", got - pending, idle, values, final, builder.totals())
        if idle and not final and values is None and message == last_idle_status:
            return
        last_idle_status = message if idle else None
        with send_lock:
            conn.send(message)

    def reporter() -> None:
        while not stop.wait(_STATUS_INTERVAL_S):
            try:
                status()
            except OSError:
                return

    thread = threading.Thread(target=reporter, name="olp-sink-status", daemon=True)
    thread.start()
    try:
        while True:
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the parent is gone: close the sink, which spills what is left
            if message == b"close":
                break
            for kind, record in pickle.loads(message):
                if kind == _CAPTURE:
                    built = builder.build(record, received)
                    if built is not None:
                        sink.put_trajectory(built)
                elif kind == _BUILDER:
                    builder.build_record = record
                elif kind == _SKIP:
                    pass
                elif kind == _ENTRY:
                    sink.put_entry(record)
                elif kind == RecordKind.TRAJECTORY.value:
                    sink.put_trajectory(record)
                else:
                    sink.put_feedback(record)
                received += 1  # a failed build or the builder itself counts as done at once
    finally:
        sink.close()
        stop.set()
        thread.join()
        with contextlib.suppress(OSError):
            status(final=True)
        conn.close()


class KafkaSinkProcess:
    """KafkaSink in a child process, so its CPU work (schema validation, JSON encoding,
    kafka-python) does not compete with the proxy's event loop for the GIL.

    `put_*` appends to an in-memory outbox (a deque append); a parent thread pickles batches
    to the child and keeps every record until the child reports it durable. If the child dies
    the parent spills the unconfirmed records itself (validated and encoded as the child would)
    and starts a new child, which drains the spill; a record may then be delivered twice,
    consumers de-duplicate by event_id. `metrics` mirrors the child's series.

    With `build_records_with`, the proxy hands over raw captures (`put_capture`) and the
    child builds, checks and redacts each trajectory record before it goes anywhere (the
    parent does the same for captures it has to spill itself).
    """

    def __init__(
        self,
        config: StreamConfig,
        state_dir: Path,
        registry: CollectorRegistry | None = None,
    ) -> None:
        import multiprocessing

        self.config = config
        self.state_dir = Path(state_dir)
        self.topics = TopicNames.from_prefix(config.topic_prefix)
        self.metrics = ProducerMetrics(registry if registry is not None else CollectorRegistry())
        self._mp = multiprocessing.get_context("spawn")
        self._outbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._pending: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._idle_waiting = False  # the feeder sleeps until woken (no work, child idle)
        self._poller: Any = None  # readiness of the child's status pipe (select.poll)
        self._closed = False
        self._idle = False
        self._seen: dict[str, dict[tuple[str, ...], float]] = {}
        self._lock = threading.RLock()  # guards the parent's own spilling
        self._feeder_done = False
        self._confirmed = 0
        self.child_restarts = 0
        self._progress_at = time.monotonic()  # the last status message from the child
        self._proc: Any = None
        self._conn: Any = None
        self._build_record: Callable[..., dict[str, Any]] | None = None
        self._on_outcome: Callable[[str, bool, int], None] | None = None
        self._on_failures: Callable[[int], None] | None = None
        self._outcomes_seen: tuple[dict[tuple[str, bool], int], int] = ({}, 0)
        self._start_child()
        self._thread = threading.Thread(target=self._run, name="olp-sink-feeder", daemon=True)
        self._thread.start()

    # ---- request path (event loop): append only ------------------------------------------

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self._put(RecordKind.TRAJECTORY.value, record)

    def put_feedback(self, event: dict[str, Any]) -> None:
        self._put(RecordKind.FEEDBACK.value, event)

    def build_records_with(
        self,
        build_record: Callable[..., dict[str, Any]],
        on_outcome: Callable[[str, bool, int], None] | None = None,
        on_failures: Callable[[int], None] | None = None,
    ) -> None:
        """Accept captures: `build_record(capture, status)` (picklable) makes the record in
        the worker; the callbacks get the counts of built records by (status, trainable)
        and of failed builds, each once its record is durable (sent or spilled): a capture
        the parent builds again after the worker died is counted once, by the parent."""
        self._build_record = build_record
        self._on_outcome, self._on_failures = on_outcome, on_failures
        self._outbox.appendleft((_BUILDER, build_record))
        self._wake.set()

    def put_capture(self, capture: Any, status: str) -> None:
        """A finished request's capture, built into a trajectory record by the worker."""
        if self._build_record is None:
            raise RuntimeError("put_capture needs build_records_with first")
        self._put(_CAPTURE, (capture, status))

    def _put(self, kind: str, record: Any) -> None:
        if self._closed:
            with self._lock:
                if self._feeder_done:
                    log.warning("put_after_close_spilling", kind=kind)
                    self._count_lost_entries(self._spill_here([(kind, record)]))
                    return
                self._outbox.append((kind, record))
            return
        self._outbox.append((kind, record))
        self._idle = False
        if self._idle_waiting:  # a ticking feeder takes the record on its next tick
            self._wake.set()
        if len(self._outbox) > self.config.queue_size:
            # The feeder may be stuck writing to a child that stopped reading; killing the
            # child frees it (the dead child's records are spilled, the outbox goes on).
            self._kill_if_hung()

    def _kill_if_hung(self) -> None:
        proc = self._proc
        waiting = self._pending or self._outbox
        silent_s = time.monotonic() - self._progress_at
        if proc is not None and waiting and silent_s > self.config.sink_hung_after_s:
            log.error(
                "sink_process_hung",
                silent_s=round(silent_s, 1),
                outbox=len(self._outbox),
                in_flight=len(self._pending),
            )
            self._progress_at = time.monotonic()  # one kill per silence
            proc.kill()

    # ---- feeder thread -------------------------------------------------------------------

    def _start_child(self) -> None:
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(
            target=_child_main,
            args=(self.config.model_dump_json(), str(self.state_dir), child_conn),
            name="olp-kafka-sink",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        self._progress_at = time.monotonic()
        self._proc, self._conn = proc, parent_conn
        # `Connection.poll` builds a selector on every call; one poll object is ~7x cheaper.
        self._poller = select.poll()
        self._poller.register(parent_conn.fileno(), select.POLLIN)
        self._seen = {}
        self._outcomes_seen = ({}, 0)
        if self._build_record is not None:  # a restarted worker needs the builder again
            self._outbox.appendleft((_BUILDER, self._build_record))

    def _run(self) -> None:
        import pickle

        while True:
            if self._outbox or self._pending or not self._idle:
                if not self._closed:  # the tick (close, wait_idle or a backlog cut it short)
                    self._wake.wait(_FEED_INTERVAL_S)
            else:
                self._idle_waiting = True
                if not self._outbox and not self._closed:  # a put after the flag sets _wake
                    self._wake.wait(_IDLE_POLL_S)
                self._idle_waiting = False
            self._wake.clear()
            stopping = self._closed
            batch: list[tuple[str, Any]] = []
            while self._outbox and len(batch) < self.config.producer_batch_records:
                batch.append(self._outbox.popleft())
            if len(self._outbox):
                self._wake.set()
            try:
                self._kill_if_hung()
                if batch:
                    self._pending.extend(batch)
                    data, sent = self._pickle(pickle, batch)
                    if sent is not batch:  # kept as sent: a capture built here is not again
                        for _ in batch:
                            self._pending.pop()
                        self._pending.extend(sent)
                    self._conn.send_bytes(data)
                self._read_statuses(block_s=0.0)
            except (OSError, EOFError):
                self._restart_child()
                if self._proc is None:
                    # It died while the sink was closing, with nothing left to hand over:
                    # no new worker. (Before, the loop went on reading the closed pipe and
                    # failed to restart it again and again, and close() never returned.)
                    break
                continue
            if stopping and not self._outbox:
                break
        self._close_child()
        with self._lock:  # records put while the child was closing
            left = self._spill_here(list(self._outbox))
            self._outbox.clear()
            self._feeder_done = True
        self._spill_until_deadline(left)

    def _restart_child(self) -> None:
        try:
            self._child_died()
        except Exception:
            # The feeder must outlive this: the next tick finds the child dead and retries.
            log.exception("sink_process_restart_failed")
            time.sleep(_RESTART_BACKOFF_S)

    def _pickle(
        self, pickle: Any, batch: list[tuple[str, Any]]
    ) -> tuple[bytes, list[tuple[str, Any]]]:
        """The batch pickled, and the items that holds (`batch` itself unless some did not
        pickle): the parent keeps those, so that if the worker dies a capture built (and
        counted) here is not built and counted a second time."""
        try:
            return pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL), batch
        except Exception:
            # A capture that does not pickle is built here; a record that does not pickle is
            # not JSON either: the child sends it to the DLQ.
            safe: list[tuple[str, Any]] = []
            for kind, record in batch:
                try:
                    pickle.dumps(record)
                except Exception:
                    if kind == _CAPTURE:
                        built = self._built_here([(kind, record)])
                        if not built:  # counted as a failed build; the child counts it done
                            safe.append((_SKIP, None))
                            continue
                        kind, record = built[0]
                        with contextlib.suppress(Exception):
                            pickle.dumps(record)
                            safe.append((kind, record))
                            continue
                    record = repr(record)[:65536]
                safe.append((kind, record))
            return pickle.dumps(safe, protocol=pickle.HIGHEST_PROTOCOL), safe

    def _read_statuses(self, block_s: float) -> bool:
        """Apply the child's status messages; True once its final one arrived."""
        final = False
        while self._poller.poll(block_s * 1000):
            _, done, idle, values, final, outcomes = self._conn.recv()
            self._mirror_outcomes(outcomes)
            self._progress_at = time.monotonic()
            for _ in range(min(done - self._confirmed, len(self._pending))):
                self._pending.popleft()
            self._confirmed = max(self._confirmed, done)
            if values is not None:
                self._mirror(values)
            self._idle = idle and not self._pending and not self._outbox
            block_s = 0.0
            if final:
                return True
        if not self._proc.is_alive() and not self._poller.poll(0):
            raise EOFError("the sink process exited")
        return final

    def _mirror_outcomes(self, totals: tuple[dict[tuple[str, bool], int], int]) -> None:
        """Pass the worker's new built/failed counts to the callbacks."""
        outcomes, failures = totals
        seen_outcomes, seen_failures = self._outcomes_seen
        if self._on_outcome is not None:
            for (status, trainable), count in outcomes.items():
                new = count - seen_outcomes.get((status, trainable), 0)
                if new > 0:
                    self._on_outcome(status, trainable, new)
        if self._on_failures is not None and failures > seen_failures:
            self._on_failures(failures - seen_failures)
        self._outcomes_seen = (outcomes, failures)

    def _mirror(self, values: dict[str, dict[tuple[str, ...], float]]) -> None:
        for name, series in values.items():
            metric = getattr(self.metrics, name, None)
            if metric is None:
                continue
            seen = self._seen.setdefault(name, {})
            for labels, value in series.items():
                target = metric.labels(*labels) if labels else metric
                if isinstance(metric, Gauge):
                    if name == "queue_depth":
                        value += len(self._outbox) + len(self._pending)
                    target.set(value)
                elif value > seen.get(labels, 0.0):
                    target.inc(value - seen.get(labels, 0.0))
                seen[labels] = value

    def _child_died(self) -> None:
        """Spill what the dead child had not confirmed, then start a new child."""
        proc = self._proc
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
        with contextlib.suppress(OSError):
            self._conn.close()
        lost = list(self._pending)
        self._pending.clear()
        self._confirmed = 0
        # `spilling` counts the entries made, not the unconfirmed items: those include the
        # builder a new worker gets first and placeholders, which are no records (before,
        # the builder made the log say one record more than was spilled).
        records = self._built_here(lost)
        with self._lock:
            entries = self._prepared_here(records)
            log.error("sink_process_died", exitcode=proc.exitcode, spilling=len(entries))
            # What the disk refused goes to the new child first (it sends or spills them), as
            # the entries made here: preparing a record again would count its DLQ routing
            # twice.
            refused = self._store_or_keep(entries)
        self._outbox.extendleft((_ENTRY, entry) for entry in reversed(refused))
        if self._closed and not self._outbox:
            self._proc = None
            return
        time.sleep(_RESTART_BACKOFF_S)
        self.child_restarts += 1
        self._start_child()

    def _spill_here(self, records: list[tuple[str, Any]]) -> list[SpillEntry]:
        """Validate, encode and spill in this process (only while no child runs); return
        the entries a disk error kept off the spill (oldest first). A retry takes these
        entries, never the records: each record is prepared (and counted) once."""
        records = self._built_here(records)
        with self._lock:
            return self._store_or_keep(self._prepared_here(records))

    def _prepared_here(self, records: list[tuple[str, Any]]) -> list[SpillEntry]:
        """Entries of built records, as the child makes them; an `_ENTRY` is one already."""
        entries: list[SpillEntry] = []
        for kind, record in records:
            if kind == _ENTRY:
                entries.append(record)
                continue
            item = _Item(RecordKind(kind), record)
            entry = prepare_entry(self.config, self.topics, self.metrics, item)
            if entry is not None:
                entries.append(entry)
        return entries

    def _store_or_keep(self, entries: list[SpillEntry]) -> list[SpillEntry]:
        """Spill `entries`; return those a disk error kept off the spill (logged, counted)."""
        if not entries:
            return []
        try:
            stored = self._store_here(entries)
        except OSError as exc:
            stored = getattr(exc, "stored", 0)
            self.metrics.spill_errors.inc()
            log.error("parent_spill_failed", error=repr(exc), not_stored=len(entries) - stored)
        return entries[stored:]

    def _kind_of(self, entry: SpillEntry) -> str:
        kinds = {self.topics.dlq: "dlq", self.topics.feedback: "feedback"}
        return kinds.get(entry.topic, RecordKind.TRAJECTORY.value)

    def _store_here(self, entries: list[SpillEntry]) -> int:
        spill = SpillStore(
            self.state_dir / self.config.spill_dir_name,
            max_bytes=self.config.spill_max_bytes,
            segment_bytes=self.config.spill_segment_bytes,
            on_full=lambda dropped: self.metrics.failed.labels("any", "spill_full").inc(dropped),
        )
        try:
            stored = spill.append(entries)
            for entry in entries[:stored]:
                self.metrics.spilled.labels(self._kind_of(entry)).inc()
            return stored
        finally:
            try:
                spill.close()
            except OSError as exc:  # what was stored is fsync'd: only the handle is lost
                log.error("parent_spill_close_failed", error=repr(exc))
            self.metrics.spill_bytes.set(spill.total_bytes())

    def _spill_until_deadline(self, entries: list[SpillEntry]) -> None:
        """No child is left to take them: retry the disk until close_timeout_s, then count
        what is still refused as lost."""
        deadline = time.monotonic() + self.config.close_timeout_s
        delay = 0.1
        while entries and time.monotonic() + delay < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
            with self._lock:
                entries = self._store_or_keep(entries)
        self._count_lost_entries(entries)

    def _count_lost_entries(self, entries: list[SpillEntry]) -> None:
        if not entries:
            return
        log.error("records_lost", reason="disk_error", records=len(entries))
        for entry in entries:
            self.metrics.failed.labels(self._kind_of(entry), "disk_error").inc()

    def _built_here(self, records: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
        """Captures the worker did not confirm, built into records here (the builder item
        is dropped); the rest as they are."""
        out: list[tuple[str, Any]] = []
        builder = _CaptureBuilder()
        builder.build_record = self._build_record
        for kind, record in records:
            if kind in (_BUILDER, _SKIP):
                continue
            if kind == _CAPTURE:
                record = builder.build(record)
                if record is None:
                    continue
                kind = RecordKind.TRAJECTORY.value
            out.append((kind, record))
        builder.release(float("inf"))  # counted here: the worker never reported these
        outcomes, failures = builder.totals()
        for (status, trainable), count in outcomes.items():
            if self._on_outcome is not None:
                self._on_outcome(status, trainable, count)
        if failures and self._on_failures is not None:
            self._on_failures(failures)
        return out

    def _close_child(self) -> None:
        if self._proc is None:
            return
        deadline = time.monotonic() + self.config.close_timeout_s + _CHILD_START_TIMEOUT_S
        try:
            self._conn.send_bytes(b"close")
            while time.monotonic() < deadline:
                if self._read_statuses(block_s=0.1):
                    break
        except (OSError, EOFError):
            pass
        self._proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._proc.is_alive():
            log.error("sink_process_close_timed_out")
            self._proc.kill()
            self._proc.join()
        with contextlib.suppress(OSError):
            self._conn.close()
        # The child closed its sink (sent or spilled everything it had); anything it had
        # not confirmed is spilled here.
        if self._pending:
            left = self._spill_here(list(self._pending))
            self._pending.clear()
            self._spill_until_deadline(left)
        self._proc = None

    # ---- lifecycle -----------------------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the child confirmed every record and its queue and spill are empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._idle and not self._outbox and not self._pending:
                return True
            self._wake.set()  # feed and read statuses now, not on the next tick
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Hand everything to the child, let it send what the broker takes within
        close_timeout_s (the rest stays in the spill) and stop it."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
