"""The durable spill: ordered segments, size cap, torn-tail recovery, restart recovery."""

from __future__ import annotations

import errno
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import replay.spill as spill_module
from replay.spill import SpillEntry, SpillStore, SpillWriteError


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


@pytest.mark.parametrize(
    "tail",
    [
        b"\x00" * 4096,  # a zero-filled tail, as a file system leaves one after a power loss
        struct.pack(">II", 3, zlib.crc32(b"abc")) + b"abc",  # a frame too short to decode
    ],
    ids=["zeros", "short_frame"],
)
def test_a_tail_whose_checksum_passes_but_cannot_be_decoded_reads_as_torn(
    tmp_path: Path, tail: bytes
) -> None:
    """An empty frame's CRC is 0, so zeros pass the check: before, decoding it raised
    struct.error on every drain attempt, and the sink never drained the spill again."""
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
    entries = _entries(5)
    store.append(entries)
    store.close()
    [segment] = sorted(tmp_path.glob("seg-*.spill"))
    with segment.open("ab") as handle:
        handle.write(tail)
    reopened = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
    assert _drain(reopened) == entries
    assert reopened.is_empty()


# Runs in a child process: RLIMIT_FSIZE makes the kernel cut a write short (EFBIG) exactly
# as a full disk does, without limiting the test process's own files.
_TORN_BY_EFBIG = """
import json, resource, signal, sys
from pathlib import Path
from replay.spill import SpillEntry, SpillStore, SpillWriteError, read_segment

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
directory = Path(sys.argv[1])
store = SpillStore(directory, max_bytes=10**9, segment_bytes=10**8)
entry = lambda i, n=100: SpillEntry("olp.trajectories", b"s", b"%d:" % i + b"x" * n)
first = store.append([entry(0)])
resource.setrlimit(resource.RLIMIT_FSIZE, (store.total_bytes() + 1000, resource.RLIM_INFINITY))
try:
    store.append([entry(1, 100_000)])
    error = None
except SpillWriteError as exc:
    error = [exc.errno, exc.stored]
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
later = store.append([entry(2), entry(3)])
store.close()
values = []
for path in sorted(directory.glob("seg-*.spill")):
    values += [e.value.split(b":")[0].decode() for e in read_segment(path)]
on_disk = sum(p.stat().st_size for p in directory.glob("seg-*.spill"))
print(json.dumps([first, error, later, values, on_disk == store.total_bytes()]))
"""


def test_a_frame_torn_by_a_full_disk_is_cut_off_and_later_records_survive(
    tmp_path: Path,
) -> None:
    """A write cut short mid-frame must not leave the torn frame in front of later records
    (they were reported stored, and reading stops at the first torn frame)."""
    done = subprocess.run(
        [sys.executable, "-c", _TORN_BY_EFBIG, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    first, error, later, values, sizes_agree = json.loads(done.stdout.strip().splitlines()[-1])
    assert first == 1
    assert error == [errno.EFBIG, 0]  # refused, and said so: nothing of it is durable
    assert later == 2
    assert values == ["0", "2", "3"]  # every record reported stored reads back
    assert sizes_agree  # no torn bytes left on disk


class _FailingFsync:
    """os.fsync failing with EIO on the `fails_at`-th fsync (1-based) of a segment file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fails_at: int) -> None:
        self.fails_at = fails_at
        self.calls = 0
        self._fsync = os.fsync
        monkeypatch.setattr(spill_module.os, "fsync", self.fsync)

    def fsync(self, fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".spill"):
            self.calls += 1
            if self.calls == self.fails_at:
                raise OSError(errno.EIO, "Input/output error")
        self._fsync(fd)


def test_a_failed_fsync_stores_nothing_of_its_segment_and_reports_earlier_segments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=2_000)
    entries = _entries(12, size=500)  # ~530 bytes a frame: three frames per segment
    with monkeypatch.context() as patch:
        _FailingFsync(patch, fails_at=2)  # the second segment's fsync
        with pytest.raises(SpillWriteError) as info:
            store.append(entries[:9])
    assert info.value.errno == errno.EIO
    assert info.value.stored == 3  # the first segment was durable before the second began
    assert store.append(entries[3:]) == 9  # the caller appends the rest again
    assert _drain(store) == entries


def test_a_segment_file_removed_behind_the_stores_back_reads_as_empty(tmp_path: Path) -> None:
    """Before: FileNotFoundError on every drain attempt, so the sink never drained the spill
    again and every later record queued up behind the missing file until the cap."""
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=2_000)
    entries = _entries(40)
    assert store.append(entries) == 40
    first = store.oldest_segment()
    assert first is not None
    first.path.unlink()  # an operator cleaning up, say
    assert store.read(first) == []
    store.delete(first)
    rest = _drain(store)
    assert rest and rest == entries[len(entries) - len(rest) :]
    assert store.is_empty()
