"""KafkaSink: a RecordSink whose `put_*` never blocks the event loop and never loses a record.

`put_*` only enqueues onto a bounded queue. One background thread validates, encodes and
sends with a kafka-python producer (acks=all, idempotent when the broker allows). When the
broker is unreachable, or a send is not acknowledged in time, records go to the durable
spill; while the spill holds anything, new records are appended behind it so order is kept,
and the thread drains it oldest segment first once the broker answers again, deleting a
segment only after every record in it was acknowledged. A retried segment may deliver a
record twice: consumers de-duplicate by event_id.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from kafka import KafkaProducer
from kafka.errors import KafkaError, UnsupportedVersionError
from prometheus_client import CollectorRegistry, Counter, Gauge

from replay.config import StreamConfig
from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    dlq_envelope,
    encode_record,
    validate_record,
)
from replay.spill import SpillEntry, SpillStore
from replay.topics import TopicNames, ensure_topics

log = structlog.get_logger(__name__)

_RECORD_OVERHEAD_BYTES = 1024


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


@dataclass(frozen=True)
class _Item:
    kind: RecordKind
    record: dict[str, Any]


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
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=config.queue_size)
        self.spill = SpillStore(
            Path(state_dir) / config.spill_dir_name,
            max_bytes=config.spill_max_bytes,
            segment_bytes=config.spill_segment_bytes,
            on_full=self._on_spill_full,
        )
        self.metrics.spill_bytes.set(self.spill.total_bytes())
        self._producer: KafkaProducer | None = None
        self._idempotence = config.idempotence
        self._retry_at = 0.0
        self._stop = threading.Event()
        self._closed = False
        self._overflow_logged_at = 0.0
        self._thread = threading.Thread(target=self._run, name="olp-kafka-sink", daemon=True)
        self._thread.start()

    # ---- request path (event loop): enqueue only ------------------------------------------

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self._put(_Item(RecordKind.TRAJECTORY, record))

    def put_feedback(self, event: dict[str, Any]) -> None:
        self._put(_Item(RecordKind.FEEDBACK, event))

    def _put(self, item: _Item) -> None:
        if not self._closed:
            try:
                self._queue.put_nowait(item)
                self.metrics.queued.labels(item.kind.value).inc()
                return
            except queue.Full:
                now = time.monotonic()
                if now - self._overflow_logged_at > 10:
                    self._overflow_logged_at = now
                    log.warning("producer_queue_full_spilling", queue_size=self.config.queue_size)
        else:
            log.warning("put_after_close_spilling", kind=item.kind.value)
        self._spill_entries([self._prepare(item)])

    # ---- background thread ---------------------------------------------------------------

    def _prepare(self, item: _Item) -> SpillEntry:
        """Validate and encode; an invalid or oversized record becomes a DLQ envelope."""
        record = item.record
        session = record.get("session_id") if isinstance(record, dict) else None
        key = session.encode() if isinstance(session, str) else None
        topic = (
            self.topics.trajectories if item.kind is RecordKind.TRAJECTORY else self.topics.feedback
        )
        try:
            validate_record(item.kind, record)
            value = encode_record(record)
            limit = self.config.max_request_size_bytes - _RECORD_OVERHEAD_BYTES
            if len(value) > limit:
                raise ValueError(f"record is {len(value)} bytes, over the {limit} byte limit")
            return SpillEntry(topic, key, value)
        except (SchemaValidationError, TypeError, ValueError) as exc:
            reason = str(exc)
        log.warning("record_to_dlq", kind=item.kind.value, reason=reason[:500])
        self.metrics.dlq.labels(item.kind.value).inc()
        try:
            envelope = dlq_envelope(
                reason=reason,
                source_topic=topic,
                origin="producer",
                kind=item.kind.value,
                record=record,
            )
            value = encode_record(envelope)
            if len(value) > self.config.max_request_size_bytes - _RECORD_OVERHEAD_BYTES:
                raise ValueError("record too large to keep in the DLQ")
        except (TypeError, ValueError):
            envelope = dlq_envelope(
                reason=reason,
                source_topic=topic,
                origin="producer",
                kind=item.kind.value,
                raw=repr(record)[:65536].encode(),
            )
            value = encode_record(envelope)
        return SpillEntry(self.topics.dlq, key, value)

    def _take_batch(self, timeout_s: float) -> list[_Item]:
        items: list[_Item] = []
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
        return items

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            busy = not self.spill.is_empty() and self._producer is not None
            items = self._take_batch(0.0 if (stopping or busy) else 0.05)
            entries = [self._prepare(item) for item in items]
            try:
                self._step(entries)
            except Exception:
                # Never lose the batch in hand: log loudly, spill it, reconnect later. A record
                # already acknowledged may be spilled again; consumers de-duplicate by event_id.
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
        if not self._ensure_producer():
            self._spill_entries(entries)
            return
        if not self.spill.is_empty():
            self._spill_entries(entries)
            self._drain_one_segment()
            return
        if entries:
            failed = self._send(entries)
            if failed:
                self._spill_entries(failed)
                self._mark_down()

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

    def _send(self, entries: list[SpillEntry]) -> list[SpillEntry]:
        """Send and wait for acks; return the entries that were not acknowledged."""
        assert self._producer is not None
        producer = self._producer
        futures = []
        failed: list[SpillEntry] = []
        for index, entry in enumerate(entries):
            try:
                futures.append(
                    (entry, producer.send(entry.topic, key=entry.key, value=entry.value))
                )
            except KafkaError as exc:
                log.warning("broker_send_failed", error=repr(exc))
                failed.extend(entries[index:])
                break
        try:
            producer.flush(timeout=self.config.delivery_timeout_ms / 1000 + 1)
        except KafkaError as exc:
            log.warning("broker_flush_timed_out", error=repr(exc))
        for entry, future in futures:
            kind = self._kind_by_topic.get(entry.topic, "other")
            if future.succeeded():
                self.metrics.sent.labels(kind).inc()
            elif future.failed() and not future.retriable() and entry.topic != self.topics.dlq:
                self._reject(entry, future.exception)
            else:
                failed.append(entry)
        if failed:
            log.warning("broker_unacknowledged", records=len(failed))
        return failed

    def _reject(self, entry: SpillEntry, error: BaseException | None) -> None:
        """The broker refused this record for good: keep a trace in the DLQ, do not retry."""
        kind = self._kind_by_topic.get(entry.topic, "other")
        log.error("record_rejected_by_broker", kind=kind, error=repr(error))
        self.metrics.failed.labels(kind, "rejected").inc()
        envelope = dlq_envelope(
            reason=f"broker rejected the record: {error!r}",
            source_topic=entry.topic,
            origin="producer",
            kind=kind,
            raw=entry.value[:65536],
        )
        assert self._producer is not None
        self._producer.send(self.topics.dlq, key=entry.key, value=encode_record(envelope))

    def _drain_one_segment(self) -> None:
        segment = self.spill.oldest_segment()
        if segment is None:
            return
        entries = self.spill.read(segment)
        failed = self._send(entries) if entries else []
        if failed:
            log.warning(
                "spill_drain_interrupted", segment=segment.path.name, unacknowledged=len(failed)
            )
            self._mark_down()
            return
        self.spill.delete(segment)
        self.metrics.spill_bytes.set(self.spill.total_bytes())
        log.info(
            "spill_segment_drained",
            segment=segment.path.name,
            records=len(entries),
            spill_bytes=self.spill.total_bytes(),
        )

    def _spill_entries(self, entries: list[SpillEntry]) -> None:
        if not entries:
            return
        stored = self.spill.append(entries)
        for entry in entries[:stored]:
            self.metrics.spilled.labels(self._kind_by_topic.get(entry.topic, "other")).inc()
        self.metrics.spill_bytes.set(self.spill.total_bytes())

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
        while self._producer is not None and not self.spill.is_empty():
            if time.monotonic() > deadline:
                break
            self._drain_one_segment()
        if self._producer is not None:
            self._producer.close(timeout=self.config.close_timeout_s)
            self._producer = None
        self.spill.close()
        remaining = self.spill.total_bytes()
        log.info("kafka_sink_closed", spill_bytes=remaining)

    # ---- lifecycle -----------------------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the queue and the spill are empty (everything acknowledged)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.unfinished_tasks == 0 and self.spill.is_empty():
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Send what the broker takes within close_timeout_s; the rest stays in the spill."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
