"""KafkaSinkProcess's accounting when its worker dies, checked without a worker or a broker:
the parent's `_child_died` runs on a stand-in for the dead process."""

from __future__ import annotations

import collections
import threading
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from replay.config import StreamConfig
from replay.producer import ProducerMetrics
from replay.sink_process import _BUILDER, KafkaSinkProcess
from replay.spill import read_segment
from replay.synthetic import make_trajectory
from replay.topics import TopicNames


class _DeadProcess:
    exitcode = -9

    def join(self, timeout: float | None = None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


class _ClosedConn:
    def close(self) -> None:
        pass


def _closed_sink(tmp_path: Path, pending: list[tuple[str, Any]]) -> KafkaSinkProcess:
    """A closed sink whose worker just died with `pending` unconfirmed: `_child_died`
    spills them and starts no new worker."""
    config = StreamConfig(bootstrap_servers="127.0.0.1:1", topic_prefix="counts")
    sink = KafkaSinkProcess.__new__(KafkaSinkProcess)
    sink.config = config
    sink.state_dir = tmp_path
    sink.topics = TopicNames.from_prefix(config.topic_prefix)
    sink.metrics = ProducerMetrics(CollectorRegistry())
    sink._lock = threading.RLock()
    sink._outbox = collections.deque()
    sink._pending = collections.deque(pending)
    sink._confirmed = 0
    sink._closed = True
    sink._proc, sink._conn = _DeadProcess(), _ClosedConn()
    sink._build_record = None
    sink._on_outcome = sink._on_failures = None
    return sink


def test_sink_process_died_logs_the_records_it_spills_not_the_builder(tmp_path: Path) -> None:
    """A restarted worker gets the capture builder first, and it stays unconfirmed with the
    records. Before: `spilling` counted it, one more than the records spilled."""
    records = [make_trajectory(session_id="d") for _ in range(2)]
    sink = _closed_sink(
        tmp_path,
        [(_BUILDER, object()), *(("trajectory", record) for record in records)],
    )
    with structlog.testing.capture_logs() as logs:
        sink._child_died()
    died = [entry for entry in logs if entry["event"] == "sink_process_died"]
    spilled = [
        entry
        for segment in sorted((tmp_path / sink.config.spill_dir_name).glob("seg-*.spill"))
        for entry in read_segment(segment)
    ]
    assert len(spilled) == 2
    assert [entry["spilling"] for entry in died] == [2]
