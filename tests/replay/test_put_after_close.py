"""A put that races `close()` is sent, spilled, or counted lost and logged: never left behind.

Each test holds one thread at the exact point of the race (an Event), so the interleaving is
the one that lost the record before, every run, without a timing loop.
"""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from deploy.ports import free_port
from replay.producer import _WAKE_UP, KafkaSink
from replay.sink_process import KafkaSinkProcess
from replay.spill import read_segment
from replay.synthetic import make_trajectory
from tests.replay.test_outage import _config, _sample
from tests.replay.test_producer_faults import _Disk


def _spilled(registry: CollectorRegistry) -> float:
    return _sample(registry, "olp_stream_spilled_total", kind="trajectory")


def _records_in_spill(directory: Path) -> int:
    return sum(len(read_segment(path)) for path in sorted(directory.glob("seg-*.spill")))


def test_a_put_enqueued_after_the_sender_stopped_reading_is_spilled(tmp_path: Path) -> None:
    """Before: the put passed the `closed` check, close() ran to the end, then the record
    went into a queue nobody read: not sent, not spilled, not counted."""
    config = _config(f"127.0.0.1:{free_port()}", close_timeout_s=1.0)
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    entered, release = threading.Event(), threading.Event()
    put_nowait = sink._queue.put_nowait

    def held_put(item: Any) -> None:
        if item is not _WAKE_UP:  # close() wakes the thread through the same queue
            entered.set()
            release.wait(30)
        put_nowait(item)

    sink._queue.put_nowait = held_put  # type: ignore[method-assign]
    putter = threading.Thread(target=sink.put_trajectory, args=(make_trajectory(),))
    putter.start()
    assert entered.wait(10)
    sink.close()  # the sender thread drains, shuts down and exits
    assert not sink._thread.is_alive()
    release.set()
    putter.join(10)
    assert not putter.is_alive()
    assert _spilled(registry) == 1
    assert _records_in_spill(tmp_path / config.spill_dir_name) == 1
    assert sink._queue.empty()
    assert sink.durable_watermark() == 1


def test_a_put_while_the_sender_shuts_down_on_a_refusing_disk_is_counted_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the caller's spill failed and kept the record in memory for a sender that had
    already dropped what it held and was about to exit: held for ever, never counted."""
    config = _config(f"127.0.0.1:{free_port()}", close_timeout_s=0.5)
    registry = CollectorRegistry()
    sink = KafkaSink(config, tmp_path, registry)
    in_shutdown, release = threading.Event(), threading.Event()
    drop_held = sink._drop_held

    def drop_then_wait(final: bool = False) -> None:
        drop_held(final)
        if threading.current_thread() is sink._thread:
            in_shutdown.set()
            release.wait(30)

    monkeypatch.setattr(sink, "_drop_held", drop_then_wait)
    _Disk(monkeypatch)
    closer = threading.Thread(target=sink.close)
    closer.start()
    assert in_shutdown.wait(10)
    sink.put_trajectory(make_trajectory())  # after close(): the caller spills, and fails
    release.set()
    closer.join(10)
    assert not sink._thread.is_alive()
    assert sink.held_records() == 0
    lost = _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="disk_error")
    assert lost == 1
    assert sink.durable_watermark() == 1


class _HeldAppends(collections.deque):  # type: ignore[type-arg]
    """The parent's outbox: an append from `holder` waits for `release` first (the put was
    past its `closed` check when close() began)."""

    def __init__(self) -> None:
        super().__init__()
        self.holder: threading.Thread | None = None
        self.entered, self.release = threading.Event(), threading.Event()

    def append(self, item: Any) -> None:
        if threading.current_thread() is self.holder:
            self.entered.set()
            self.release.wait(30)
        super().append(item)


def test_a_put_racing_close_of_the_sink_process_is_spilled(tmp_path: Path) -> None:
    """Before: the record landed in the outbox after the feeder had spilled it and stopped."""
    config = _config(f"127.0.0.1:{free_port()}", close_timeout_s=1.0)
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(config, tmp_path, registry)
    outbox = _HeldAppends()
    sink._outbox = outbox
    putter = threading.Thread(target=sink.put_trajectory, args=(make_trajectory(),))
    outbox.holder = putter
    putter.start()
    assert outbox.entered.wait(10)
    sink.close()
    assert not sink._thread.is_alive()
    outbox.release.set()
    putter.join(10)
    assert not putter.is_alive()
    assert not sink._outbox
    assert _records_in_spill(tmp_path / config.spill_dir_name) == 1
    assert _spilled(registry) == 1
