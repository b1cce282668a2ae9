"""KafkaSinkProcess: a KafkaSink in a child process, fed captures and records by a parent thread.

The proxy's choice for `sink: kafka`: building, checking and redacting a trajectory record,
schema validation, JSON encoding and kafka-python all run in the child, so none of it
competes with the proxy's event loop for the GIL. The parent keeps every record until the
child reports it durable; if the child dies, the parent spills what is unconfirmed itself
(built, validated and encoded as the child would) and starts a new child, which drains the
spill. Consumers de-duplicate by event_id, so a record delivered twice is one event.
"""

from __future__ import annotations

import array
import asyncio
import atexit
import collections
import contextlib
import fcntl
import gc
import io
import itertools
import select
import signal
import termios
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry, Gauge

from replay.config import SINK_FEED_INTERVAL_S, StreamConfig
from replay.cpu_avoidance import CpuAvoidance
from replay.producer import (
    RECORD_OVERHEAD_BYTES,
    KafkaSink,
    ProducerMetrics,
    QueuedRecord,
    prepare_entry,
)
from replay.schemas import RecordKind, derived_event_id
from replay.spill import SpillEntry, SpillStore
from replay.topics import TopicNames

log = structlog.get_logger(__name__)

# Every wake-up of a sleeping thread costs ~60-120 µs of CPU on a small VM (cold caches),
# more than pickling a capture. The feeder therefore runs on a fixed tick while there is work
# (one wake per tick, however many records arrive in it) and the child reports on the same
# tick; at 50 requests/s that is one wake per five records, not two per record.
_STATUS_INTERVAL_S = 0.1
_IDLE_POLL_S = 1.0  # the feeder's check on an idle child (a new record wakes it at once)
_METRICS_INTERVAL_S = 1.0  # the child's metric values ride on a status message this often
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


def _capture_bytes(capture: Any) -> int:
    """What a capture weighs against `proxy.capture_backlog_bytes`: its packed bytes (the
    proxy's captures are bytes by the time they are put; anything else weighs nothing)."""
    return len(capture) if isinstance(capture, (bytes, bytearray)) else 0


def _held_bytes(items: Iterable[tuple[str, Any]]) -> int:
    """The captures' bytes among outbox or unconfirmed items (`_capture_bytes` of each)."""
    return sum(_capture_bytes(record[0]) for kind, record in items if kind == _CAPTURE)


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


def _plain_tracebacks() -> None:
    """structlog as it is configured by default, but for its exception formatter. A spawned
    process starts with the defaults, whose console renderer prints every frame's local
    variables with a logged exception (`rich`): here those hold raw captures, so a capture
    that failed to build would write the client's request, unredacted, to the proxy's log."""
    processors = structlog.get_config()["processors"]
    renderer = structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(processors=[*processors[:-1], renderer])


def _child_main(
    config_json: str, state_dir: str, conn: Any, init: Callable[[], None] | None = None
) -> None:
    """The child process: a KafkaSink fed by batches from the parent, reporting progress.

    Progress is `done`: the received items before position `done` are all durable
    (acknowledged by the broker, spilled, routed to the DLQ, or counted as failed: a capture
    that did not build, a record the sink logged and counted as lost). It is a watermark, not
    a count: records do not become durable in order (a full queue spills the newest record
    at once while older ones wait to be sent), and a newer durable record does not move it.
    The parent keeps every item until `done` passes it, and spills the rest itself if this
    process dies."""
    import os
    import pickle

    _plain_tracebacks()
    if init is not None:
        init()  # the parent's logging set-up, so that its log gets one kind of line

    # Background work: when the cores are busy, the proxy's requests go first. Under
    # SCHED_IDLE any other task that wakes up takes the CPU from this process at once, and
    # the kernel places waking tasks on a CPU that runs only it as on an idle one; under
    # SCHED_BATCH (nice 10) a waking request handler could wait for this process's time slice
    # to end. Measured (20,000 requests at c=16 through a fast upstream, 3 runs each way):
    # the proxy served 1,731-2,559 requests/s instead of 1,386-1,851 and the records arrived
    # 0.9-1.8 s after the last response instead of 0.2-1.2 s. The child still gets the time
    # the others leave (its cgroup's share, too); if it falls behind, its full queue spills to
    # disk, and no request waits on it. Where SCHED_IDLE is missing, nice 10 still applies.
    with contextlib.suppress(OSError, AttributeError):
        os.nice(_CHILD_NICE)
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
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
    # Messages received and not yet built, and when they are due (sink_batch_wait_s after
    # the first): the records are built and sent in one burst a second, not one per feeder
    # tick (0.1 s). The worker's bursts cost the proxy's process CPU beyond their own
    # (the proxy's event loop slows while they run, even pinned to the other core).
    # Measured at streamed c=1 through a real broker, one proxy, training off and on in 4
    # alternating rounds of 8,000 requests, four runs each way: the proxy's CPU on/off
    # 1.053-1.115 (median of runs 1.111) with a 1 s wait, 1.063-1.165 (1.149) without;
    # this process's CPU 0.157-0.170 instead of 0.185-0.197 ms a record. The parent keeps
    # these records until they are durable, and a parent that dies still has them sent:
    # the loop ends on the pipe's end and builds them first.
    waiting: list[bytes] = []
    waiting_due = 0.0
    # A queue's worth goes at once, however long the wait (a message holds up to a batch).
    waiting_max = max(1, config.queue_size // config.producer_batch_records)
    # (the sink's sequence number, position here) of the items put into the sink, oldest
    # first, until the sink's durable watermark passes them (appended by the receiving
    # thread, dropped by the reporter).
    in_sink: collections.deque[tuple[int, int]] = collections.deque()
    builder = _CaptureBuilder()
    send_lock = threading.Lock()
    stop = threading.Event()
    metrics_sent_at = 0.0
    idle_values_sent = False
    values_received = 0  # `received` when the metric values last went out
    broker_up_sent = -1  # `sink.broker_up` when the metric values last went out
    last_idle_progress: tuple[Any, ...] | None = None

    def status(final: bool = False) -> None:
        # Progress goes out every _STATUS_INTERVAL_S while there is work (a heartbeat the
        # parent's hang check relies on); an idle child says so once and then stays quiet
        # until something changes. The metric values, whose collection and mirroring cost
        # the parent's interpreter time, go once a second while busy and once on becoming
        # idle (so a caller that waited for idle reads final values).
        nonlocal metrics_sent_at, idle_values_sent, last_idle_progress, values_received
        nonlocal broker_up_sent
        # `received` is read first (an item is in `in_sink` before it is counted there), so
        # `done` is at most what was received, and no item it passes is still in flight.
        got = received
        watermark = sink.durable_watermark()
        while in_sink and in_sink[0][0] < watermark:
            in_sink.popleft()
        done = min(got, in_sink[0][1]) if in_sink else got
        idle = done == got and not waiting and sink.spill.is_empty()
        values = None
        now = time.monotonic()
        # Idle: once on becoming idle, when the broker's reachability changes (the sink's
        # idle probe: the one value that moves while nothing is sent; a proxy started idle
        # showed the broker down until its first record, one whose broker went away while
        # idle showed it up), and, at the busy pace, when items came and went between two
        # ticks. Before, such a burst (one request's record, sent and acknowledged within
        # 0.1 s: most records at a low request rate) was never seen busy, and its counts
        # never reached the parent's /metrics. (At every tick, the values cost the proxy's
        # process ~15k instructions a captured request at 400 requests/s.)
        busy_due = now - metrics_sent_at >= _METRICS_INTERVAL_S
        broker_up = sink.broker_up
        idle_due = (
            not idle_values_sent
            or broker_up != broker_up_sent
            or (got != values_received and busy_due)
        )
        if final or (idle_due if idle else busy_due):
            values, metrics_sent_at, values_received = _metric_values(sink.metrics), now, got
            broker_up_sent = broker_up
        idle_values_sent = idle and (values is not None or idle_values_sent)
        # Outcomes travel with the `done` they are counted up to: the parent pops exactly
        # those records, and counts the rest itself if it has to build them again.
        builder.release(done)
        progress = (done, idle, builder.totals())
        # (Before, an idle child collected its values every second and so sent two
        # messages a second, each waking the proxy's feeder thread.)
        if idle and not final and values is None and progress == last_idle_progress:
            return
        last_idle_progress = progress if idle else None
        with send_lock:
            conn.send(("status", *progress[:2], values, final, progress[2]))

    def reporter() -> None:
        while not stop.wait(_STATUS_INTERVAL_S):
            try:
                status()
            except OSError:
                return

    thread = threading.Thread(target=reporter, name="olp-sink-status", daemon=True)
    thread.start()

    def take(messages: list[bytes]) -> None:
        # The messages' records are all built before the first goes to the sink: while
        # this thread built one as the sink's thread prepared the one before, the two
        # handed the GIL back and forth (measured at streamed c=1 through a real broker:
        # voluntary context switches 0.12-0.13 and 0.11-0.12 a record on these two
        # threads, 0.02 and 0.05-0.06 built first; this process's CPU 0.20-0.23 -> 0.19
        # ms a record).
        nonlocal received
        position = received
        built: list[tuple[QueuedRecord | SpillEntry, int]] = []
        for kind, record in itertools.chain.from_iterable(map(pickle.loads, messages)):
            item: QueuedRecord | SpillEntry | None = None
            if kind == _CAPTURE:
                trajectory = builder.build(record, position)
                if trajectory is not None:
                    item = QueuedRecord(RecordKind.TRAJECTORY, trajectory)
            elif kind == _BUILDER:
                builder.build_record = record
            elif kind == _SKIP:
                pass
            elif kind == _ENTRY:
                item = record
            elif kind == RecordKind.TRAJECTORY.value:
                item = QueuedRecord(RecordKind.TRAJECTORY, record)
            else:
                item = QueuedRecord(RecordKind.FEEDBACK, record)
            if item is not None:
                built.append((item, position))
            # Anything else (a failed build, logged and counted; the builder; a
            # placeholder) is done at once, once the items before it are.
            position += 1
        for item, at in built:
            in_sink.append((sink.put_item(item), at))
        # Counted once they are in `in_sink`: the reporter reads `received` first, and an
        # item counted there before it was in `in_sink` would pass for durable.
        received = position

    try:
        while True:
            if waiting and (
                len(waiting) >= waiting_max
                or time.monotonic() >= waiting_due
                or not conn.poll(waiting_due - time.monotonic())
            ):
                batch, waiting = waiting, []
                take(batch)
                continue
            try:
                message = conn.recv_bytes()
            except (EOFError, OSError):
                break  # the parent is gone: close the sink, which spills what is left
            if message == b"close":
                break
            if message == b"flush":  # `wait_idle`: what waits goes now
                batch, waiting = waiting, []
                take(batch)
                continue
            if not waiting:
                waiting_due = time.monotonic() + config.sink_batch_wait_s
            waiting.append(message)
    except (EOFError, OSError):
        pass  # `poll` found the parent gone
    finally:
        try:
            batch, waiting = waiting, []
            take(batch)  # the sink sends or spills them as it closes
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

    `child_init` (picklable) runs first in every child: the proxy passes its logging set-up,
    which a spawned process does not inherit. Without it the child logs in structlog's
    console format, with tracebacks that show no local variables.

    `loop_thread_id` (the proxy passes its event loop's thread): the feeder keeps the worker
    off the CPU that thread last ran on (replay/cpu_avoidance.py).
    """

    def __init__(
        self,
        config: StreamConfig,
        state_dir: Path,
        registry: CollectorRegistry | None = None,
        child_init: Callable[[], None] | None = None,
        loop_thread_id: int | None = None,
    ) -> None:
        import multiprocessing

        self.config = config
        self.state_dir = Path(state_dir)
        # The worker's spill and this process's own share the directory. One that cannot be
        # made (a file of its name) killed every worker at its start, restarted every 1.5 s
        # for ever, while nothing reached a healthy broker: refused here, at start-up, with
        # its path (an OSError, which `olp proxy` reports as an unusable state dir).
        (self.state_dir / config.spill_dir_name).mkdir(parents=True, exist_ok=True)
        self._child_init = child_init
        self.topics = TopicNames.from_prefix(config.topic_prefix)
        self.metrics = ProducerMetrics(registry if registry is not None else CollectorRegistry())
        self._mp = multiprocessing.get_context("spawn")
        self._outbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._pending: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._flush = False  # `wait_idle` asks the worker to build what it holds now
        self._idle_waiting = False  # the feeder sleeps until woken (no work, child idle)
        self._poller: Any = None  # readiness of the child's status pipe (select.poll)
        self._closed = False
        self._idle = False
        self._seen: dict[str, dict[tuple[str, ...], float]] = {}
        self._lock = threading.RLock()  # guards the parent's own spilling
        self._feeder_done = False
        self._confirmed = 0
        # The captures' bytes held here (`backlog_bytes`), in counters each written by one
        # thread only, so no update is lost between threads: what the event loop put, what
        # the feeder took from the outbox, and what it handed on and the worker has not
        # confirmed yet.
        self._put_bytes = 0
        self._taken_bytes = 0
        self._pending_bytes = 0
        self.child_restarts = 0
        self._progress_at = time.monotonic()  # the last status message from the child
        # Bytes of status messages waiting unread in the pipe at the last hang check (0 once
        # the feeder read them): more since then is a worker alive behind a stuck feeder.
        self._unread_at_check = 0
        self._pickle_buffer = io.BytesIO()  # the feeder pickles every batch into it
        self._proc: Any = None
        self._conn: Any = None
        self._build_record: Callable[..., dict[str, Any]] | None = None
        self._on_outcome: Callable[[str, bool, int], None] | None = None
        self._on_failures: Callable[[int], None] | None = None
        self._outcomes_seen: tuple[dict[tuple[str, bool], int], int] = ({}, 0)
        # Read at scrape time: a value the worker reported would freeze while it is starved
        # of CPU, the very time its backlog grows.
        self.metrics.queue_depth.set_function(self.backlog)
        self.metrics.queue_bytes.set_function(self.backlog_bytes)
        # `loop_thread_id`: the native id of the thread that serves requests (the proxy's
        # event loop), whose CPU the worker is kept off (`stream.sink_avoids_loop_cpu`).
        self._avoidance = (
            CpuAvoidance(loop_thread_id)
            if loop_thread_id is not None and config.sink_avoids_loop_cpu
            else None
        )
        self._start_child()
        self._thread = threading.Thread(target=self._run, name="olp-sink-feeder", daemon=True)
        self._thread.start()
        # The worker ignores SIGTERM and ends only when this object closes it (or its pipe
        # ends), and multiprocessing's own exit handler, which runs after this one, joins
        # it: a program that exits without `close` (an exception on its way out) would hang
        # for ever. A CI run did, after a test failed before its close.
        atexit.register(self._close_at_exit)

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
        self._put(_CAPTURE, (capture, status), _capture_bytes(capture))

    def _put(self, kind: str, record: Any, size: int = 0) -> None:
        if self._closed:
            with self._lock:
                if self._feeder_done:
                    log.warning("put_after_close_spilling", kind=kind)
                    self._count_lost_entries(self._spill_here([(kind, record)]))
                    return
                self._put_bytes += size
                self._outbox.append((kind, record))
            return
        self._put_bytes += size  # before the append: the feeder may take it at once
        self._outbox.append((kind, record))
        if self._closed:  # close() began since the check: the feeder may be done with it
            self._spill_outbox_after_close()
            return
        self._idle = False
        if self._idle_waiting:  # a ticking feeder takes the record on its next tick
            self._wake.set()
        if len(self._outbox) > self.config.queue_size:
            # The feeder may be stuck writing to a child that stopped reading; killing the
            # child frees it (the dead child's records are spilled, the outbox goes on).
            self.kill_if_hung()

    @property
    def max_record_bytes(self) -> int:
        """The largest record the topic takes (a larger one goes to the DLQ)."""
        return self.config.max_request_size_bytes - RECORD_OVERHEAD_BYTES

    def backlog(self) -> int:
        """Records (and captures) held in this process's memory, not yet durable: the outbox
        and what the worker has not confirmed, its own queue among them (a restarted worker's
        builder counts until its first report). The proxy stops capturing above a limit."""
        return len(self._outbox) + len(self._pending)

    def backlog_bytes(self) -> int:
        """The packed captures' bytes among them (`proxy.capture_backlog_bytes` limits it):
        a count of items alone let a backlog of large agent requests (up to half the topic's
        record size each) grow to gigabytes before capture paused. The worker holds its own
        copy of what it has not confirmed, so the two processes hold up to twice this."""
        return self._put_bytes - self._taken_bytes + self._pending_bytes

    def _spill_outbox_after_close(self) -> None:
        """Spill the outbox here once the feeder has left it for good.

        A put that passed the `closed` check just before `close()` may append after the
        feeder's last look at the outbox: nobody would send, spill or count that record."""
        with self._lock:
            if not self._feeder_done:
                return  # the feeder spills the outbox under this lock before it is done
            records = self._take_outbox()
            if records:
                log.warning("put_after_close_spilling", records=len(records))
                self._count_lost_entries(self._spill_here(records))

    def _take_outbox(self) -> list[tuple[str, Any]]:
        """Everything in the outbox, one popleft at a time: `list` then `clear` lost a
        record another thread appended in between."""
        records: list[tuple[str, Any]] = []
        with contextlib.suppress(IndexError):
            while True:
                records.append(self._outbox.popleft())
        self._taken_bytes += _held_bytes(records)  # the feeder's, or (once it is done) close's
        return records

    def kill_if_hung(self) -> None:
        """Kill a worker silent for `stream.sink_hung_after_s` with records in hand; the
        parent spills or hands on what it held, and a new worker starts.

        The feeder checks at each tick, but a worker that stops reading its pipe blocks the
        feeder in its write, and then only other threads can: a put over `queue_size`
        records, and the proxy while its capture is paused on the backlog (which, paused at
        `proxy.capture_backlog_bytes` long before `queue_size` records, puts nothing).
        Status messages the stuck feeder has not read count as heard: a worker that goes on
        reporting reads its pipe, only slowly."""
        proc = self._proc
        # Only records handed to the child count: its silence is measured from the first
        # of them (an idle child is quiet for as long as it likes).
        heard_at = self._progress_at
        silent_s = time.monotonic() - heard_at
        if proc is not None and self._pending and silent_s > self.config.sink_hung_after_s:
            unread = self._unread_status_bytes()
            if self._progress_at != heard_at:
                return  # the feeder heard from it meanwhile (another thread may ask)
            if unread > self._unread_at_check:
                # It went on reporting, unheard: the feeder is stuck writing a batch it reads
                # slowly (its own queue full behind a slow broker), not dead.
                self._unread_at_check = unread
                self._progress_at = time.monotonic()
                return
            log.error(
                "sink_process_hung",
                silent_s=round(silent_s, 1),
                outbox=len(self._outbox),
                in_flight=len(self._pending),
            )
            self._progress_at = time.monotonic()  # one kill per silence
            proc.kill()

    def _unread_status_bytes(self) -> int:
        """Bytes the worker wrote to the pipe that the feeder has not read (-1: no pipe)."""
        count = array.array("i", [0])
        try:
            fcntl.ioctl(self._conn.fileno(), termios.FIONREAD, count, True)
        except (OSError, AttributeError):  # closed, or no child yet
            return -1
        return count[0]

    # ---- feeder thread -------------------------------------------------------------------

    def _start_child(self) -> None:
        parent_conn, child_conn = self._mp.Pipe(duplex=True)
        proc = self._mp.Process(
            target=_child_main,
            args=(
                self.config.model_dump_json(),
                str(self.state_dir),
                child_conn,
                self._child_init,
            ),
            name="olp-kafka-sink",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        self._progress_at = time.monotonic()
        self._unread_at_check = 0
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
                    self._wake.wait(SINK_FEED_INTERVAL_S)
            else:
                self._idle_waiting = True
                if not self._outbox and not self._closed:  # a put after the flag sets _wake
                    self._wake.wait(_IDLE_POLL_S)
                self._idle_waiting = False
            self._wake.clear()
            if self._avoidance is not None and self._proc is not None:
                self._avoidance.place(self._proc.pid)
            stopping = self._closed
            # Only this thread takes from the outbox while it runs (others append), so the
            # items counted are there to take: a comprehension, not a loop testing the
            # outbox and the batch's length before each item.
            popleft = self._outbox.popleft
            take = min(len(self._outbox), self.config.producer_batch_records)
            batch: list[tuple[str, Any]] = [popleft() for _ in range(take)]
            if len(self._outbox):
                self._wake.set()
            try:
                self.kill_if_hung()
                if batch:
                    if not self._pending:
                        # An idle child is quiet: its silence counts from this batch on,
                        # not from its last report (which may be minutes old).
                        self._progress_at = time.monotonic()
                    self._pending.extend(batch)
                    taken = _held_bytes(batch)
                    self._pending_bytes += taken  # counted unconfirmed before it leaves the
                    self._taken_bytes += taken  # outbox's count, never in neither
                    data, sent = self._pickle(pickle, batch)
                    if sent is not batch:  # kept as sent: a capture built here is not again
                        for _ in batch:
                            self._pending.pop()
                        self._pending.extend(sent)
                        self._pending_bytes += _held_bytes(sent) - taken
                    try:
                        self._conn.send_bytes(data)
                    finally:
                        data.release()  # the buffer takes the next batch
                if self._flush:
                    self._flush = False
                    self._conn.send_bytes(b"flush")
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
            left = self._spill_here(self._take_outbox())
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
    ) -> tuple[memoryview, list[tuple[str, Any]]]:
        """The batch pickled (a view to release once sent), and the items that holds
        (`batch` itself unless some did not pickle): the parent keeps those, so that if the
        worker dies a capture built (and counted) here is not built and counted a second
        time.

        Pickled into one buffer that every batch reuses. `pickle.dumps` grew a new bytes
        object by doubling for each batch, copying it each time, on fresh pages the kernel
        had to fault in: measured with perf at unstreamed c=16 that was about a fifth of this
        thread's CPU. A pickler writing to a file flushes it a 64 KiB frame at a time.
        (pickle.dumps itself cost 40 % of it, freeing the batch's captures 25 %.)"""
        buffer = self._pickle_buffer
        buffer.seek(0)
        try:
            pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(batch)
            return buffer.getbuffer()[: buffer.tell()], batch
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
            return memoryview(pickle.dumps(safe, protocol=pickle.HIGHEST_PROTOCOL)), safe

    def _read_statuses(self, block_s: float) -> bool:
        """Apply the child's status messages; True once its final one arrived."""
        final = False
        while self._poller.poll(block_s * 1000):
            _, done, idle, values, final, outcomes = self._conn.recv()
            self._mirror_outcomes(outcomes)
            self._progress_at = time.monotonic()
            self._unread_at_check = 0
            popleft = self._pending.popleft
            confirmed = min(done - self._confirmed, len(self._pending))
            self._pending_bytes -= _held_bytes(popleft() for _ in range(confirmed))
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
            if metric is None or metric in (self.metrics.queue_depth, self.metrics.queue_bytes):
                continue  # the parent's own counts (`backlog`, `backlog_bytes`)
            seen = self._seen.setdefault(name, {})
            for labels, value in series.items():
                target = metric.labels(*labels) if labels else metric
                if isinstance(metric, Gauge):
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
        self._pending_bytes = 0  # built and spilled here, or kept in the outbox as entries
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
            item = QueuedRecord(RecordKind(kind), record)
            entry = prepare_entry(self.config, self.topics, self.metrics, item)
            if entry is not None:
                entries.append(entry)
        return entries

    def _store_or_keep(self, entries: list[SpillEntry]) -> list[SpillEntry]:
        """Spill `entries`; return those a disk error kept off the spill (logged, counted).
        Those the spill's size cap refused are not returned: `SpillStore.append` counted
        them (`spill_full`) and logged them; returned, they were retried until the close's
        deadline, counted again each time and once more as a disk error."""
        if not entries:
            return []
        try:
            self._store_here(entries)
        except OSError as exc:
            stored = getattr(exc, "stored", 0)
            self.metrics.spill_errors.inc()
            log.error("parent_spill_failed", error=repr(exc), not_stored=len(entries) - stored)
            return entries[stored:]
        return []

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
            self._pending_bytes = 0
            self._spill_until_deadline(left)
        self._proc = None

    # ---- lifecycle -----------------------------------------------------------------------

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the child confirmed every record and its queue and spill are empty."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._idle and not self._outbox and not self._pending:
                return True
            self._flush = True  # and the worker builds what it holds now, not after its wait
            self._wake.set()  # feed and read statuses now, not on the next tick
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Hand everything to the child, let it send what the broker takes within
        close_timeout_s (the rest stays in the spill) and stop it."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._close_at_exit)
        self._wake.set()
        self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def _close_at_exit(self) -> None:
        log.warning(
            "kafka_sink_closed_at_exit", outbox=len(self._outbox), in_flight=len(self._pending)
        )
        self.close()
