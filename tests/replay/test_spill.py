"""The durable spill: ordered segments, size cap, torn-tail recovery, restart recovery."""

from __future__ import annotations

import errno
import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import replay.spill as spill_module
from replay.spill import SpillEntry, SpillReadError, SpillStore, SpillWriteError, read_segment


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


class _SegmentFile(io.FileIO):
    """A segment file whose next close fails with EIO once `fail_close` is set. A real
    FileIO.close() that fails has released the descriptor all the same (`really_closes`);
    the other case is checked too."""

    fail_close = False
    really_closes = True

    def close(self) -> None:
        if _SegmentFile.fail_close:
            _SegmentFile.fail_close = False
            if _SegmentFile.really_closes:
                super().close()
            raise OSError(errno.EIO, "Input/output error")
        super().close()


@pytest.mark.parametrize("really_closes", [True, False])
def test_a_segment_whose_close_fails_while_sealing_is_a_disk_error_and_the_store_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, really_closes: bool
) -> None:
    """Before: the failed close left the segment active with its file closed, and cutting
    the torn frame off asked that file for its descriptor: ValueError, not OSError, so a
    KafkaSink lost the batch it held (records the disk had refused before) with no count."""
    monkeypatch.setattr(_SegmentFile, "really_closes", really_closes)
    monkeypatch.setattr(
        spill_module, "open", lambda path, mode, buffering=-1: _SegmentFile(path, "a"), False
    )
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=2_000)
    entries = _entries(12, size=500)  # ~530 bytes a frame: three frames per segment
    assert store.append(entries[:2]) == 2
    _SegmentFile.fail_close = True  # the seal in front of the fourth frame
    with pytest.raises(SpillWriteError) as info:
        store.append(entries[2:6])
    assert info.value.errno == errno.EIO
    assert info.value.stored == 1  # the third frame is durable, in the segment it sealed
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
    assert store.delete(first) == "missing"  # not "deleted": its records never went out
    rest = _drain(store)
    assert rest and rest == entries[len(entries) - len(rest) :]
    assert store.is_empty()


# ---- damaged segments: torn tail, corruption in the middle, unreadable files ---------------


def _frame_offsets(path: Path) -> list[int]:
    """Where each frame of an intact segment file starts."""
    data, offsets, pos = path.read_bytes(), [], 0
    while pos < len(data):
        offsets.append(pos)
        (length,) = struct.unpack_from(">I", data, pos)
        pos += 8 + length
    return offsets


def _one_segment(tmp_path: Path, entries: list[SpillEntry]) -> Path:
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
    assert store.append(entries) == len(entries)
    store.close()
    [segment] = sorted(tmp_path.glob("seg-*.spill"))
    return segment


def _encode_frame_prefix(entry: SpillEntry, keep: int) -> bytes:
    return spill_module._encode_frame(entry)[:keep]


def test_a_torn_tail_is_deleted_with_its_segment_not_quarantined(tmp_path: Path) -> None:
    entries = _entries(6)
    segment = _one_segment(tmp_path, entries)
    with segment.open("ab") as handle:  # the last frame, half written by a crash
        handle.write(_encode_frame_prefix(entries[0], 40))
    reasons: list[str] = []
    store = SpillStore(
        tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000, on_quarantine=reasons.append
    )
    assert _drain(store) == entries
    assert reasons == []
    assert list(tmp_path.rglob("*.spill")) == []


@pytest.mark.parametrize(
    "damage",
    ["payload_byte", "length_field", "zeroed_frame"],
)
def test_corruption_in_the_middle_reads_on_and_keeps_the_segment_aside(
    tmp_path: Path, damage: str
) -> None:
    """Before: reading stopped at the bad frame and the segment was deleted with every
    record behind it, logged only as a torn tail."""
    entries = _entries(10)
    segment = _one_segment(tmp_path, entries)
    original = bytearray(segment.read_bytes())
    offsets = _frame_offsets(segment)
    start, end = offsets[3], offsets[4]
    damaged = bytearray(original)
    if damage == "payload_byte":
        damaged[end - 5] ^= 0xFF
    elif damage == "length_field":
        damaged[start : start + 4] = struct.pack(">I", 70_000)
    else:  # a page the file system never wrote, in the middle
        damaged[start:end] = bytes(end - start)
    segment.write_bytes(bytes(damaged))

    reasons: list[str] = []
    store = SpillStore(
        tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000, on_quarantine=reasons.append
    )
    assert _drain(store) == entries[:3] + entries[4:]  # only the damaged record is missing
    assert reasons == ["corrupt"]
    assert store.is_empty()
    assert not segment.exists()
    [kept] = (tmp_path / "quarantine").iterdir()
    assert kept.name == segment.name
    assert kept.read_bytes() == bytes(damaged)  # as it was, for an operator
    # A new store neither counts nor reads it.
    assert SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000).is_empty()


def test_a_segment_that_cannot_be_moved_to_quarantine_is_not_counted_there(
    tmp_path: Path,
) -> None:
    """`olp_stream_spill_quarantined_total` counts segments moved to quarantine/: one whose
    move failed stayed in place, was read again at each start and counted each time."""
    entries = _entries(5)
    segment = _one_segment(tmp_path, entries)
    damaged = bytearray(segment.read_bytes())
    damaged[_frame_offsets(segment)[3] - 5] ^= 0xFF
    segment.write_bytes(bytes(damaged))
    (tmp_path / "quarantine").write_text("a file where the directory goes")
    reasons: list[str] = []
    for _ in range(3):
        store = SpillStore(
            tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000, on_quarantine=reasons.append
        )
        assert _drain(store) == entries[:2] + entries[3:]
        store.close()
        assert segment.exists()  # left in place, tried again at the next start
    assert reasons == []


def test_a_moved_segment_whose_directory_sync_fails_is_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rename and the directory syncs after it shared one `try`: a sync that failed
    after the move logged the move as failed ("left in place") and counted nothing, and
    the next start never read the moved segment again."""
    import replay.spill as spill_module

    entries = _entries(5)
    segment = _one_segment(tmp_path, entries)
    damaged = bytearray(segment.read_bytes())
    damaged[_frame_offsets(segment)[3] - 5] ^= 0xFF
    segment.write_bytes(bytes(damaged))
    synced = spill_module._fsync_dir

    synced_too: list[Path] = []

    def fails_in_quarantine(directory: Path) -> None:
        if directory.name == "quarantine":
            raise OSError(5, "Input/output error")
        synced(directory)
        synced_too.append(directory)

    monkeypatch.setattr(spill_module, "_fsync_dir", fails_in_quarantine)
    reasons: list[str] = []
    store = SpillStore(
        tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000, on_quarantine=reasons.append
    )
    assert _drain(store) == entries[:2] + entries[3:]
    store.close()
    assert not segment.exists() and reasons == ["corrupt"]
    assert [p.name for p in (tmp_path / "quarantine").iterdir()] == [segment.name]
    assert synced_too == [tmp_path]  # the spill dir's sync, tried after the failed one


def test_a_frame_hidden_in_the_damage_is_not_taken_for_a_record(tmp_path: Path) -> None:
    """Reading on past corruption needs an intact frame (length, CRC and decoding): random
    bytes and zeros after the damage read as a torn tail, not as records."""
    entries = _entries(3)
    segment = _one_segment(tmp_path, entries)
    noise = bytes((i * 131 + 7) % 256 for i in range(5000)) + bytes(3000)
    with segment.open("ab") as handle:
        handle.write(noise)
    assert read_segment(segment) == entries


def test_an_unreadable_segment_is_quarantined_after_repeated_failures_and_the_rest_drains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: EIO (or EACCES) on a sealed segment was raised on every drain attempt, and
    every newer record queued up behind it until the spill cap, then was dropped."""
    reasons: list[str] = []
    store = SpillStore(
        tmp_path,
        max_bytes=10_000_000,
        segment_bytes=2_000,
        on_quarantine=reasons.append,
        read_attempts=3,
    )
    entries = _entries(40)
    assert store.append(entries) == 40
    first = store.oldest_segment()
    assert first is not None
    broken = first.path
    read_bytes = Path.read_bytes

    def failing(path: Path) -> bytes:
        if path == broken:
            raise OSError(errno.EIO, "Input/output error")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", failing)
    for _ in range(2):  # retried: the disk may recover
        with pytest.raises(SpillReadError):
            store.read(first)
        assert store.oldest_segment() == first
    assert reasons == []
    assert store.read(first) == []  # the third failure in a row: set aside
    assert reasons == ["read_error"]
    # What the sender does next; the quarantined file is kept, and the sender is told.
    assert store.delete(first) == "read_error"
    rest = _drain(store)
    assert rest and rest == entries[len(entries) - len(rest) :]
    assert store.is_empty()
    assert [p.name for p in (tmp_path / "quarantine").iterdir()] == [broken.name]
    assert not broken.exists()


def test_a_read_error_that_goes_away_is_not_quarantined(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reasons: list[str] = []
    store = SpillStore(
        tmp_path,
        max_bytes=10_000_000,
        segment_bytes=1_000_000,
        on_quarantine=reasons.append,
        read_attempts=2,
    )
    entries = _entries(5)
    store.append(entries)
    segment = store.oldest_segment()
    assert segment is not None
    read_bytes = Path.read_bytes
    failures = iter([True, False, True, False])

    def flaky(path: Path) -> bytes:
        if next(failures, False):
            raise OSError(errno.EACCES, "Permission denied")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", flaky)
    for _ in range(2):  # failures are counted in a row: a good read starts again
        with pytest.raises(SpillReadError):
            store.read(segment)
        assert store.read(segment) == entries
    store.delete(segment)
    assert reasons == []
    assert store.is_empty()
    assert not (tmp_path / "quarantine").exists()


def test_segments_quarantined_under_the_same_name_are_all_kept(tmp_path: Path) -> None:
    """Sequence numbers start from 0 again once the spill was empty."""
    for round_ in range(2):
        segment = _one_segment(tmp_path, _entries(5))
        data = bytearray(segment.read_bytes())
        data[_frame_offsets(segment)[1] + 20] ^= 0xFF
        segment.write_bytes(bytes(data))
        store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
        assert len(_drain(store)) == 4
        assert len(list((tmp_path / "quarantine").iterdir())) == round_ + 1


def test_delete_says_whether_the_segment_was_deleted_or_quarantined(tmp_path: Path) -> None:
    """The sender logs `spill_segment_drained` only for a segment really deleted (before,
    also for one moved to quarantine/, as `records=0` when it was never read)."""
    entries = _entries(5)
    segment = _one_segment(tmp_path, entries)
    data = bytearray(segment.read_bytes())
    data[_frame_offsets(segment)[2] + 12] ^= 0xFF  # inside the third record's payload
    segment.write_bytes(bytes(data))
    store = SpillStore(tmp_path, max_bytes=10_000_000, segment_bytes=1_000_000)
    corrupt = store.oldest_segment()
    assert corrupt is not None
    assert store.read(corrupt) == entries[:2] + entries[3:]
    assert store.delete(corrupt) == "corrupt"
    assert store.delete(corrupt) == "unknown"  # a second call: nothing left to say
    assert store.append(entries) == 5
    intact = store.oldest_segment()
    assert intact is not None and store.read(intact) == entries
    assert store.delete(intact) == "deleted"
    assert store.is_empty()
