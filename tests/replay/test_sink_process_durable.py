"""KafkaSinkProcess forgets a record only once its worker made that record durable, whatever
the order the worker made them durable in. No broker: the worker's send step is faked."""

from __future__ import annotations

import errno
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from deploy.ports import free_port
from replay.producer import KafkaSink, QueuedRecord
from replay.schemas import RecordKind, decode_record
from replay.sink_process import KafkaSinkProcess
from replay.spill import SpillStore, read_segment
from replay.synthetic import make_feedback, make_trajectory
from tests.replay.test_outage import _config, _sample, _wait_for


def _send_step_blocks_forever(marker: str) -> None:
    """child_init: while `marker` exists when a worker starts, that worker's KafkaSink takes
    the broker for reachable and its send step never returns from its first records (a
    broker that holds the sender), so they are never durable."""
    if not os.path.exists(marker):
        return
    from replay.producer import KafkaSink

    step = KafkaSink._step

    def blocking_step(self: KafkaSink, entries: list[Any], *args: Any, **kwargs: Any) -> None:
        if entries:
            threading.Event().wait()
        step(self, entries, *args, **kwargs)

    KafkaSink._ensure_producer = lambda self: True  # type: ignore[method-assign]
    KafkaSink._step = blocking_step  # type: ignore[method-assign]


def _spilled_event_ids(spill_dir: Path) -> set[str]:
    return {
        decode_record(entry.value)["event_id"]
        for segment in sorted(spill_dir.glob("seg-*.spill"))
        for entry in read_segment(segment)
    }


def test_records_older_than_the_ones_the_worker_spilled_survive_its_death(
    tmp_path: Path,
) -> None:
    """queue_size=1: the worker's sender holds the first event, its queue takes at most one
    more and the rest are spilled at once, newer before older. Before, the worker reported
    a count ("3 done") and the parent forgot its 3 oldest events, which were the ones still
    in flight: killed, the worker took them with it, with no metric and no log line."""
    marker = tmp_path / "block-first-worker"
    marker.touch()
    config = _config(f"127.0.0.1:{free_port()}", queue_size=1)
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(
        config,
        tmp_path / "state",
        registry,
        child_init=functools.partial(_send_step_blocks_forever, str(marker)),
    )
    trajectory = make_trajectory(session_id="durable")
    events = [make_feedback(trajectory) for _ in range(4)]
    try:
        assert sink.wait_idle(60)  # the worker runs
        for event in events:
            sink.put_feedback(event)
        _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="feedback") >= 2)
        time.sleep(0.5)  # more statuses: each one says what the worker made durable
        worker = sink._proc
        os.kill(worker.pid, signal.SIGKILL)
        marker.unlink()  # the next worker finds no broker and leaves the spill alone
        _wait_for(lambda: sink.child_restarts == 1)
    finally:
        sink.close()
    assert _sample(registry, "olp_stream_failed_total", kind="feedback", reason="disk_error") == 0
    spilled = _spilled_event_ids(tmp_path / "state" / config.spill_dir_name)
    assert {event["event_id"] for event in events} <= spilled


def test_the_durable_watermark_waits_for_the_oldest_record_not_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sender holding its first record, a queue of one: the newer records are spilled at
    once, and the watermark stays at the first until its send step returns."""
    release = threading.Event()
    step = KafkaSink._step

    def blocking_step(self: KafkaSink, entries: list[Any], *args: Any, **kwargs: Any) -> None:
        if entries:
            release.wait()
        step(self, entries, *args, **kwargs)

    monkeypatch.setattr(KafkaSink, "_step", blocking_step)
    registry = CollectorRegistry()
    sink = KafkaSink(_config(f"127.0.0.1:{free_port()}", queue_size=1), tmp_path, registry)
    trajectory = make_trajectory(session_id="watermark")

    def put() -> int:
        return sink.put_item(QueuedRecord(RecordKind.FEEDBACK, make_feedback(trajectory)))

    try:
        # The sender takes the first record and holds it; only then do the others come (a
        # put that finds the queue full spills what the queue holds ahead of its own).
        seqs = [put()]
        _wait_for(lambda: sink._queue.qsize() == 0)
        seqs += [put() for _ in range(3)]
        assert seqs == [0, 1, 2, 3]
        _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="feedback") >= 2)
        time.sleep(0.3)
        assert sink.durable_watermark() == 0
        release.set()
        _wait_for(lambda: sink.durable_watermark() == 4)
    finally:
        release.set()
        sink.close()
    assert _sample(registry, "olp_stream_spilled_total", kind="feedback") == 4


def test_records_the_disk_refused_are_not_durable_until_it_takes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = threading.Event()
    full.set()
    write_frames = SpillStore._write_frames

    def failing(store: SpillStore, frames: list[bytes]) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        write_frames(store, frames)

    monkeypatch.setattr(SpillStore, "_write_frames", failing)
    registry = CollectorRegistry()
    sink = KafkaSink(_config(f"127.0.0.1:{free_port()}", queue_size=20), tmp_path, registry)
    try:
        for i in range(6):
            sink.put_trajectory(make_trajectory(session_id=f"h{i}"))
        _wait_for(lambda: sink.held_records() == 6)
        time.sleep(0.3)
        assert sink.durable_watermark() == 0
        full.clear()
        assert sink.put_item(QueuedRecord(RecordKind.TRAJECTORY, make_trajectory())) == 6
        _wait_for(lambda: sink.durable_watermark() == 7, timeout_s=15)
        assert sink.held_records() == 0
    finally:
        sink.close()
    assert _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 7
