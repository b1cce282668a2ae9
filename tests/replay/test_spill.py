"""The durable spill: ordered segments, size cap, torn-tail recovery, restart recovery."""

from __future__ import annotations

from pathlib import Path

from replay.spill import SpillEntry, SpillStore


def _entries(n: int, size: int = 100, topic: str = "olp.trajectories") -> list[SpillEntry]:
    return [
        SpillEntry(topic, f"s{i}".encode() if i % 3 else None, (f"{i:06d}" * size)[:size].encode())
        for i in range(n)
    ]


def _drain(store: SpillStore) -> list[SpillEntry]:
    out: list[SpillEntry] = []
    while (segment := store.oldest_segment()) is not None:
        out.extend(store.read(segment))
        store.delete(segment)
    return out


def test_records_come_back_in_order_across_segments(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=2_000)
    entries = _entries(100)
    assert store.append(entries[:40]) == 40
    assert store.append(entries[40:]) == 60
    assert len(list(tmp_path.glob("seg-*.spill"))) > 3
    assert _drain(store) == entries
    assert store.is_empty()
    assert store.total_bytes() == 0
    assert list(tmp_path.glob("seg-*.spill")) == []


def test_cap_refuses_and_reports(tmp_path: Path) -> None:
    dropped: list[int] = []
    store = SpillStore(tmp_path, max_bytes=5_000, segment_bytes=1_000, on_full=dropped.append)
    stored = store.append(_entries(100))
    assert 0 < stored < 100
    assert dropped == [100 - stored]
    assert store.total_bytes() <= 5_000
    assert _drain(store) == _entries(100)[:stored]
    # Room again after draining.
    assert store.append(_entries(5)) == 5


def test_restart_recovers_segments_and_torn_tail(tmp_path: Path) -> None:
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
    entries = _entries(10)
    store.append(entries)
    store.close()
    segment = sorted(tmp_path.glob("seg-*.spill"))[-1]
    with segment.open("ab") as handle:  # a crash in the middle of the next frame
        handle.write(b"\x00\x00\x01\x00\xde\xad")
    reopened = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
    assert not reopened.is_empty()
    reopened.append(_entries(2, topic="olp.feedback"))
    assert _drain(reopened) == entries + _entries(2, topic="olp.feedback")
