"""Durable local spill: append-only, fsync'd, size-capped segment files, drained oldest first.

Records land here when the broker is unreachable or the producer queue is full, so nothing a
user did is lost while Kafka is down. Each segment is a sequence of frames
`[u32 payload length][u32 crc32][payload]`, payload = `[u16 topic len][topic][i32 key len or
-1][key][value]`. A frame torn by a crash fails its length or CRC check, or (zeros a power loss
left behind pass the CRC) its decoding; with no intact frame after it, it is a torn tail and
ends the segment. A bad frame followed by intact ones is corruption in the middle: reading
resumes at the next intact frame, and the segment, once drained, is moved to `quarantine/`
instead of being deleted with the bytes it could not read. So is a segment whose file cannot
be read (EIO, EACCES) `read_attempts` times in a row, so it cannot hold back the newer ones.
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
_NONZERO = re.compile(rb"[^\x00]")
# Smallest payload of an intact frame: topic length, a one-byte topic, key length.
_MIN_PAYLOAD = _TOPIC_LEN.size + 1 + _KEY_LEN.size
_MAX_TOPIC_LEN = 249  # Kafka's limit on a topic name
# Reads of one sealed segment failing (EIO, EACCES) this many times in a row move it to
# quarantine: retried forever, it would hold back every newer record until the cap.
READ_ATTEMPTS = 5
QUARANTINE_DIR_NAME = "quarantine"


class SpillReadError(OSError):
    """Reading a sealed segment failed; it stays and is read again (see READ_ATTEMPTS)."""


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


@dataclass(frozen=True)
class _Parsed:
    """What a segment's bytes hold: intact records, skipped byte ranges between intact
    frames (corruption in the middle) and the bytes of a torn tail."""

    entries: list[SpillEntry]
    corrupt: list[tuple[int, int]]
    torn_tail_bytes: int


def _frame_at(data: bytes, pos: int) -> tuple[SpillEntry, int] | None:
    """The intact frame at `pos` and the offset after it, or None."""
    if pos + _HEADER.size > len(data):
        return None
    length, crc = _HEADER.unpack_from(data, pos)
    end = pos + _HEADER.size + length
    if length < _MIN_PAYLOAD or end > len(data):
        return None
    # The payload's own header first: a resync (`_next_frame`) tries every offset of the
    # damage, and checking the CRC of a random length's bytes at each made an 8 MiB
    # segment of garbage take seconds per read.
    start = pos + _HEADER.size
    (topic_len,) = _TOPIC_LEN.unpack_from(data, start)
    key_at = start + _TOPIC_LEN.size + topic_len
    if not 0 < topic_len <= _MAX_TOPIC_LEN or key_at + _KEY_LEN.size > end:
        return None
    (key_len,) = _KEY_LEN.unpack_from(data, key_at)
    if key_len < -1 or key_at + _KEY_LEN.size + max(key_len, 0) > end:
        return None
    payload = data[start:end]
    if zlib.crc32(payload) != crc:
        return None
    try:
        return _decode_payload(payload), end
    except (struct.error, ValueError):
        return None  # torn like a failed CRC: raising would fail every drain of the spill


def _next_frame(data: bytes, pos: int) -> int | None:
    """The offset of the first intact frame after the bad one at `pos`, or None.

    The framing has no sync marker, so every offset is a candidate; a random one passes the
    CRC-32 and the decoding with odds of about 2**-32. Only lengths from _MIN_PAYLOAD up are
    frames, so a run of zeros (a power loss) is skipped at once."""
    last = len(data) - _HEADER.size - _MIN_PAYLOAD
    zero_lead = len(data) < 1 << 24  # then every length field starts with a zero byte
    candidate = pos + 1
    while candidate <= last:
        if zero_lead:
            candidate = data.find(b"\x00", candidate, last + 1)
            if candidate < 0:
                return None
        if data[candidate : candidate + 4] == b"\x00\x00\x00\x00":
            # A length field holds a non-zero byte: a frame starts at most 3 bytes before
            # the end of this run of zeros.
            nonzero = _NONZERO.search(data, candidate)
            if nonzero is None:
                return None
            candidate = max(candidate + 1, nonzero.start() - 3)
            continue
        if _frame_at(data, candidate) is not None:
            return candidate
        candidate += 1
    return None


def _parse_segment(data: bytes) -> _Parsed:
    entries: list[SpillEntry] = []
    corrupt: list[tuple[int, int]] = []
    pos = 0
    while pos < len(data):
        frame = _frame_at(data, pos)
        if frame is not None:
            entries.append(frame[0])
            pos = frame[1]
            continue
        resume = _next_frame(data, pos)
        if resume is None:  # nothing intact follows: a torn tail (crash while writing)
            return _Parsed(entries, corrupt, len(data) - pos)
        corrupt.append((pos, resume))
        pos = resume
    return _Parsed(entries, corrupt, 0)


def _log_damage(name: str, parsed: _Parsed) -> None:
    if parsed.corrupt:
        log.error(
            "spill_segment_corrupt",
            segment=name,
            intact_records=len(parsed.entries),
            skipped_bytes=sum(end - start for start, end in parsed.corrupt),
            skipped_ranges=parsed.corrupt[:10],
        )
    if parsed.torn_tail_bytes:
        log.error(
            "spill_segment_torn_tail",
            segment=name,
            intact_records=len(parsed.entries),
            lost_bytes=parsed.torn_tail_bytes,
        )


def read_segment(path: Path) -> list[SpillEntry]:
    """Every intact record of a segment file, in append order; a torn tail, or corruption in
    the middle (read on past at the next intact frame), is logged."""
    parsed = _parse_segment(Path(path).read_bytes())
    _log_damage(Path(path).name, parsed)
    return parsed.entries


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpillStore:
    """Thread-safe segment store; `on_full(dropped)` is called when the size cap refuses records,
    `on_quarantine(reason)` when a segment is moved to `quarantine/` ("read_error", "corrupt").
    """

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        segment_bytes: int,
        on_full: Callable[[int], None] | None = None,
        on_quarantine: Callable[[str], None] | None = None,
        read_attempts: int = READ_ATTEMPTS,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.quarantine_dir = self.directory / QUARANTINE_DIR_NAME
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.read_attempts = max(1, read_attempts)
        self._on_full = on_full
        self._on_quarantine = on_quarantine
        self._read_failures: dict[int, int] = {}  # seq -> failed reads in a row
        self._corrupt: set[int] = set()  # seqs read with corruption in the middle
        # seq -> why a segment left the drain before `delete` ("read_error", "missing"),
        # so that `delete` can say so instead of reporting it drained.
        self._set_aside: dict[int, str] = {}
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
            except (OSError, ValueError) as exc:  # ValueError: a file closed already
                # The torn bytes stay at the end of a sealed segment: reading stops there,
                # after every record that was reported stored.
                log.error("spill_truncate_failed", segment=segment.path.name, error=repr(exc))
        try:
            self._seal_locked()  # sealed even when closing its file fails
        except OSError as exc:
            log.error("spill_seal_failed", segment=segment.path.name, error=repr(exc))

    def _open_locked(self) -> None:
        path = self.directory / f"seg-{self._next_seq:020d}.spill"
        # Unbuffered: a failed write leaves nothing in a buffer to be written later.
        self._active_file = open(path, "ab", buffering=0)  # noqa: SIM115 - held open
        self._active = SpillSegment(self._next_seq, path, 0)
        self._next_seq += 1
        _fsync_dir(self.directory)

    def _seal_locked(self) -> None:
        """Close the active segment and keep it to drain (an empty one is removed). Every
        frame in it was fsync'd when written, so it is sealed even when closing its file
        fails (EIO), which is raised afterwards: left active, its file closed all the same
        (FileIO releases the descriptor before it reports the error), the next write to it
        raised ValueError instead of a disk error."""
        segment, file = self._active, self._active_file
        if segment is None:
            return
        self._active, self._active_file = None, None
        error: OSError | None = None
        if file is not None:
            try:
                file.close()
            except OSError as exc:
                error = exc
        if segment.size > 0:
            self._sealed.append(segment)
        else:
            segment.path.unlink(missing_ok=True)
        if error is not None:
            raise error

    def oldest_segment(self) -> SpillSegment | None:
        """The oldest segment to drain, sealing the active one when nothing older is left."""
        with self._lock:
            if not self._sealed and self._active is not None and self._active.size > 0:
                self._seal_locked()
            return self._sealed[0] if self._sealed else None

    def read(self, segment: SpillSegment) -> list[SpillEntry]:
        """Every intact record of a sealed segment, in append order; damage is logged.

        A segment file removed behind the store's back reads as empty (logged): raising
        would fail every drain attempt, and the records behind it would never be sent. Any
        other read error raises SpillReadError, until the `read_attempts`-th in a row moves
        the segment to quarantine and it reads as empty. A segment corrupt in the middle
        is moved there by `delete` instead of being removed."""
        try:
            data = segment.path.read_bytes()
        except FileNotFoundError:
            log.error("spill_segment_missing", segment=segment.path.name, bytes=segment.size)
            with self._lock:
                self._sealed = [s for s in self._sealed if s.seq != segment.seq]
                self._set_aside[segment.seq] = "missing"
            return []
        except OSError as exc:
            failures = self._read_failures.get(segment.seq, 0) + 1
            if failures < self.read_attempts:
                self._read_failures[segment.seq] = failures
                log.error(
                    "spill_segment_read_failed",
                    segment=segment.path.name,
                    error=repr(exc),
                    failures=failures,
                    quarantine_after=self.read_attempts,
                )
                raise SpillReadError(
                    exc.errno, f"reading spill segment {segment.path.name} failed: {exc}"
                ) from exc
            self._read_failures.pop(segment.seq, None)
            with self._lock:
                self._set_aside_locked(segment, "read_error", repr(exc))
            return []
        self._read_failures.pop(segment.seq, None)
        parsed = _parse_segment(data)
        _log_damage(segment.path.name, parsed)
        if parsed.corrupt:
            with self._lock:
                self._corrupt.add(segment.seq)
        return parsed.entries

    def delete(self, segment: SpillSegment) -> str:
        """Remove a drained segment (call only after the broker acknowledged all its records)
        and say what became of it: "deleted", or why it was not.

        One read with corruption in the middle is moved to quarantine instead ("corrupt"):
        the bytes it could not read may hold records. One `read` already set aside is left
        alone ("read_error": quarantined unread; "missing": its file was gone); "unknown"
        for a segment the store does not hold (deleted before)."""
        with self._lock:
            if all(s.seq != segment.seq for s in self._sealed):
                return self._set_aside.pop(segment.seq, "unknown")
            if segment.seq in self._corrupt:
                self._corrupt.discard(segment.seq)
                self._set_aside_locked(segment, "corrupt", "corrupt frames in the middle")
                return self._set_aside.pop(segment.seq)
            self._sealed = [s for s in self._sealed if s.seq != segment.seq]
            segment.path.unlink(missing_ok=True)
            _fsync_dir(self.directory)
            return "deleted"

    def _set_aside_locked(self, segment: SpillSegment, reason: str, detail: str) -> None:
        """Stop draining `segment` and move its file to quarantine/, for an operator: never
        deleted, never read again by the store (lock held)."""
        self._sealed = [s for s in self._sealed if s.seq != segment.seq]
        self._set_aside[segment.seq] = reason
        target = self.quarantine_dir / segment.path.name
        suffix = 0
        try:
            self.quarantine_dir.mkdir(exist_ok=True)
            while target.exists():  # sequence numbers start again once the spill was empty
                suffix += 1
                target = self.quarantine_dir / f"{segment.path.stem}.{suffix}.spill"
            os.rename(segment.path, target)
        except OSError as exc:
            # Left in place: skipped until the next start, which tries it again.
            log.error(
                "spill_segment_quarantine_failed",
                segment=segment.path.name,
                reason=reason,
                detail=detail,
                error=repr(exc),
            )
        else:
            # Moved all the same (counted below); each directory synced on its own: the spill
            # dir's sync makes the old name's removal durable.
            for directory in (self.quarantine_dir, self.directory):
                try:
                    _fsync_dir(directory)
                except OSError as exc:
                    log.error(
                        "spill_quarantine_not_synced",
                        segment=segment.path.name,
                        directory=str(directory),
                        error=repr(exc),
                    )
            log.error(
                "spill_segment_quarantined",
                segment=segment.path.name,
                reason=reason,
                detail=detail,
                bytes=segment.size,
                path=str(target),
            )
            # Counted once moved (the metric counts segments in quarantine/): one left in
            # place was counted at every start that read it again.
            if self._on_quarantine is not None:
                self._on_quarantine(reason)

    def close(self) -> None:
        """Close the active file; its records stay on disk for the next start."""
        with self._lock:
            self._seal_locked()
