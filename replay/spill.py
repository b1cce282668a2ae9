"""Durable local spill: append-only, fsync'd, size-capped segment files, drained oldest first.

Records land here when the broker is unreachable or the producer queue is full, so nothing a
user did is lost while Kafka is down. Each segment is a sequence of frames
`[u32 payload length][u32 crc32][payload]`, payload = `[u16 topic len][topic][i32 key len or
-1][key][value]`. A frame torn by a crash fails its length or CRC check, or (zeros a power loss
left behind pass the CRC) its decoding, and ends the segment.
A frame torn by a disk error (ENOSPC, EFBIG, EIO) is cut off at once and the segment sealed,
so nothing is ever appended behind a torn frame. A segment is deleted only after every record
in it was acknowledged by the broker.
"""

from __future__ import annotations

import os
import re
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from io import FileIO
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

_HEADER = struct.Struct(">II")
_TOPIC_LEN = struct.Struct(">H")
_KEY_LEN = struct.Struct(">i")
_SEGMENT_RE = re.compile(r"^seg-(\d{20})\.spill$")


class SpillWriteError(OSError):
    """A disk error while appending: the first `stored` entries are durable, the rest not."""

    def __init__(self, stored: int, cause: OSError) -> None:
        super().__init__(cause.errno, f"spill write failed after {stored} records: {cause}")
        self.stored = stored


@dataclass(frozen=True)
class SpillEntry:
    """One record waiting for the broker: destination topic, key and encoded value."""

    topic: str
    key: bytes | None
    value: bytes


@dataclass(frozen=True)
class SpillSegment:
    """A sealed segment file; read it, send it, then delete it."""

    seq: int
    path: Path
    size: int


def _encode_frame(entry: SpillEntry) -> bytes:
    topic = entry.topic.encode()
    key_len = -1 if entry.key is None else len(entry.key)
    payload = b"".join(
        [
            _TOPIC_LEN.pack(len(topic)),
            topic,
            _KEY_LEN.pack(key_len),
            entry.key or b"",
            entry.value,
        ]
    )
    return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def _decode_payload(payload: bytes) -> SpillEntry:
    """The entry of a frame's payload; struct.error or ValueError when it is none of ours,
    e.g. the zeros of a tail a power loss left (an empty frame's CRC is 0)."""
    (topic_len,) = _TOPIC_LEN.unpack_from(payload, 0)
    pos = _TOPIC_LEN.size
    topic = payload[pos : pos + topic_len].decode()
    pos += topic_len
    (key_len,) = _KEY_LEN.unpack_from(payload, pos)
    pos += _KEY_LEN.size
    if not topic or pos + max(key_len, 0) > len(payload):
        raise ValueError("not a spill record")
    key = None if key_len < 0 else payload[pos : pos + key_len]
    pos += max(key_len, 0)
    return SpillEntry(topic=topic, key=key, value=payload[pos:])


def read_segment(path: Path) -> list[SpillEntry]:
    """Every intact record of a segment file, in append order; a torn tail is logged."""
    data = Path(path).read_bytes()
    entries: list[SpillEntry] = []
    pos = 0
    while pos < len(data):
        if pos + _HEADER.size > len(data):
            break
        length, crc = _HEADER.unpack_from(data, pos)
        payload = data[pos + _HEADER.size : pos + _HEADER.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        try:
            entries.append(_decode_payload(payload))
        except (struct.error, ValueError):
            break  # torn like a failed CRC: raising would fail every drain of the spill
        pos += _HEADER.size + length
    if pos < len(data):
        log.error(
            "spill_segment_torn_tail",
            segment=Path(path).name,
            intact_records=len(entries),
            lost_bytes=len(data) - pos,
        )
    return entries


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpillStore:
    """Thread-safe segment store; `on_full(dropped)` is called when the size cap refuses records."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        segment_bytes: int,
        on_full: Callable[[int], None] | None = None,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self._on_full = on_full
        self._lock = threading.Lock()
        self._sealed: list[SpillSegment] = []
        self._active: SpillSegment | None = None
        self._active_file: FileIO | None = None
        self._full_logged = False
        for path in sorted(self.directory.iterdir()):
            match = _SEGMENT_RE.match(path.name)
            if match:
                self._sealed.append(SpillSegment(int(match.group(1)), path, path.stat().st_size))
        self._next_seq = (self._sealed[-1].seq + 1) if self._sealed else 0
        if self._sealed:
            log.warning(
                "spill_recovered",
                segments=len(self._sealed),
                bytes=self.total_bytes(),
                directory=str(self.directory),
            )

    def total_bytes(self) -> int:
        """Bytes on disk in all segments, sealed and active."""
        active = self._active.size if self._active else 0
        return sum(s.size for s in self._sealed) + active

    def is_empty(self) -> bool:
        with self._lock:
            return not self._sealed and (self._active is None or self._active.size == 0)

    def append(self, entries: Sequence[SpillEntry]) -> int:
        """Append and fsync; return how many were stored (fewer when the size cap was reached).

        Raises SpillWriteError (an OSError) when the disk fails: its `stored` leading entries
        are durable, the others were not stored and may be appended again."""
        if not entries:
            return 0
        with self._lock:
            stored = 0
            total = self.total_bytes()
            frames: list[bytes] = []
            for entry in entries:
                frame = _encode_frame(entry)
                if total + len(frame) > self.max_bytes:
                    break
                frames.append(frame)
                total += len(frame)
            stored = len(frames)
            if frames:
                self._write_frames(frames)
                self._full_logged = False
            dropped = len(entries) - stored
        if dropped:
            if not self._full_logged:
                self._full_logged = True
                log.error(
                    "spill_full_records_dropped",
                    dropped=dropped,
                    cap_bytes=self.max_bytes,
                    directory=str(self.directory),
                )
            if self._on_full is not None:
                self._on_full(dropped)
        return stored

    def _write_frames(self, frames: list[bytes]) -> None:
        """Write and fsync one segment's share at a time, so a sealed segment is always
        durable; on a disk error cut the torn part off and raise SpillWriteError."""
        pos = 0
        while pos < len(frames):
            try:
                if self._active is None or (
                    self._active.size > 0
                    and self._active.size + len(frames[pos]) > self.segment_bytes
                ):
                    self._seal_locked()
                    self._open_locked()
                end = self._chunk_end(frames, pos)
                self._write_durably(b"".join(frames[pos:end]))
            except OSError as exc:
                self._discard_torn_locked()
                raise SpillWriteError(pos, exc) from exc
            pos = end

    def _chunk_end(self, frames: list[bytes], pos: int) -> int:
        """End of the run of frames from `pos` that fits in the active segment (at least one)."""
        assert self._active is not None
        room = self.segment_bytes - self._active.size - len(frames[pos])
        end = pos + 1
        while end < len(frames) and len(frames[end]) <= room:
            room -= len(frames[end])
            end += 1
        return end

    def _write_durably(self, data: bytes) -> None:
        assert self._active is not None and self._active_file is not None
        fd = self._active_file.fileno()
        view = memoryview(data)
        while view:  # an unbuffered write may be short just before the disk fills up
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        self._active = replace(self._active, size=self._active.size + len(data))

    def _discard_torn_locked(self) -> None:
        """Cut a partly written frame off the active segment and seal it: a frame appended
        behind a torn one could never be read back."""
        if self._active is None:
            return
        segment = self._active
        if self._active_file is not None:
            try:
                os.ftruncate(self._active_file.fileno(), segment.size)
                os.fsync(self._active_file.fileno())
            except OSError as exc:
                # The torn bytes stay at the end of a sealed segment: reading stops there,
                # after every record that was reported stored.
                log.error("spill_truncate_failed", segment=segment.path.name, error=repr(exc))
        try:
            self._seal_locked()
        except OSError as exc:
            log.error("spill_seal_failed", segment=segment.path.name, error=repr(exc))
            if segment.size > 0:
                self._sealed.append(segment)
            self._active, self._active_file = None, None

    def _open_locked(self) -> None:
        path = self.directory / f"seg-{self._next_seq:020d}.spill"
        # Unbuffered: a failed write leaves nothing in a buffer to be written later.
        self._active_file = open(path, "ab", buffering=0)  # noqa: SIM115 - held open
        self._active = SpillSegment(self._next_seq, path, 0)
        self._next_seq += 1
        _fsync_dir(self.directory)

    def _seal_locked(self) -> None:
        if self._active is None:
            return
        if self._active_file is not None:
            self._active_file.close()
        if self._active.size > 0:
            self._sealed.append(self._active)
        else:
            self._active.path.unlink(missing_ok=True)
        self._active = None
        self._active_file = None

    def oldest_segment(self) -> SpillSegment | None:
        """The oldest segment to drain, sealing the active one when nothing older is left."""
        with self._lock:
            if not self._sealed and self._active is not None and self._active.size > 0:
                self._seal_locked()
            return self._sealed[0] if self._sealed else None

    def read(self, segment: SpillSegment) -> list[SpillEntry]:
        """Every intact record of a sealed segment, in append order; a torn tail is logged.

        A segment file removed behind the store's back reads as empty (logged): raising
        would fail every drain attempt, and the records behind it would never be sent."""
        try:
            return read_segment(segment.path)
        except FileNotFoundError:
            log.error("spill_segment_missing", segment=segment.path.name, bytes=segment.size)
            return []

    def delete(self, segment: SpillSegment) -> None:
        """Remove a drained segment (call only after the broker acknowledged all its records)."""
        with self._lock:
            self._sealed = [s for s in self._sealed if s.seq != segment.seq]
            segment.path.unlink(missing_ok=True)
            _fsync_dir(self.directory)

    def close(self) -> None:
        """Close the active file; its records stay on disk for the next start."""
        with self._lock:
            self._seal_locked()
