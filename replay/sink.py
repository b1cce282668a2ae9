"""Where the proxy puts finished trajectories and feedback events: the RecordSink contract."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog

from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    encode_record,
    validate_record,
)

log = structlog.get_logger(__name__)

_JSONL_FILES = ("trajectories", "feedback", "dlq")


def _end_last_line(path: Path) -> None:
    """A last line without its newline (a crash mid-write before this start): the first
    record written after it was glued onto it, and that record read as one unparsable line
    with it. A line that is a whole record gets its newline; a torn one is cut back to the
    last whole line."""
    if not path.exists():
        return
    with path.open("rb") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size == 0:
            return
        handle.seek(size - 1)
        if handle.read(1) == b"\n":
            return
        keep, end, block = 0, size, 1 << 16
        while end > 0:  # the last newline, searched backwards a block at a time
            start = max(0, end - block)
            handle.seek(start)
            found = handle.read(end - start).rfind(b"\n")
            if found >= 0:
                keep = start + found + 1
                break
            end = start
        handle.seek(keep)
        last = handle.read()
    try:
        json.loads(last)
    except ValueError:
        os.truncate(path, keep)
        log.error("jsonl_torn_line_cut", file=path.stem, bytes=size - keep)
        return
    with path.open("ab") as handle:
        handle.write(b"\n")
    log.warning("jsonl_last_line_ended", file=path.stem)


@runtime_checkable
class RecordSink(Protocol):
    """Accepts records from the request path; must never block the event loop nor raise on
    broker (or, for a file sink, disk) trouble. The caller hands the dict over and must not
    mutate it afterwards."""

    def put_trajectory(self, record: dict[str, Any]) -> None: ...

    def put_feedback(self, event: dict[str, Any]) -> None: ...

    async def aclose(self) -> None: ...


class JsonlSink:
    """One JSON line per record in `<directory>/trajectories.jsonl` and `feedback.jsonl`.

    For development and tests without a broker. Invalid records go to `dlq.jsonl` with the
    reason, like KafkaSink does, so both sinks reject the same inputs the same way.

    The disk is this sink's broker: a write it refuses (ENOSPC, EFBIG, EIO) never raises into
    `put_*`. The torn part of the line is cut off again and the line kept in memory (at most
    `max_pending` lines per file) and written, in order, before the next record of its file
    and at `close()`; beyond that cap, or still refused at `close()`, records are dropped
    with an error log and counted in `lost` (by file). `write_errors` counts failed writes.
    """

    def __init__(self, directory: Path, max_pending: int = 10_000) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.max_pending = max_pending
        self.lost: dict[str, int] = {name: 0 for name in _JSONL_FILES}
        self.write_errors = 0
        self._lock = threading.Lock()
        self._closed = False
        for name in _JSONL_FILES:
            _end_last_line(self.directory / f"{name}.jsonl")
        # Unbuffered: a refused write leaves nothing in a buffer to be written twice later.
        self._files = {
            name: open(self.directory / f"{name}.jsonl", "ab", buffering=0)  # noqa: SIM115
            for name in _JSONL_FILES
        }
        self._pending: dict[str, list[bytes]] = {name: [] for name in _JSONL_FILES}
        self._failing: set[str] = set()

    def _put(self, kind: RecordKind, name: str, record: dict[str, Any]) -> None:
        try:
            validate_record(kind, record)
            line = encode_record(record)
            target = name
        except (SchemaValidationError, TypeError, ValueError) as exc:
            log.warning("record_rejected", kind=kind.value, reason=str(exc))
            line = encode_record({"kind": kind.value, "reason": str(exc), "raw": repr(record)})
            target = "dlq"
        with self._lock:
            if self._closed:
                self._count_lost(target, 1, "closed")
                return
            pending = self._pending[target]
            if len(pending) >= self.max_pending:
                self._count_lost(target, 1, "disk_error")
            else:
                pending.append(line + b"\n")
            self._write_pending_locked(target)

    def _write_pending_locked(self, target: str) -> None:
        """Write the waiting lines of `target`, oldest first; on a disk error cut the torn
        part off (a torn line would stop every reader there) and keep them all."""
        pending = self._pending[target]
        if not pending:
            return
        fd = self._files[target].fileno()
        size: int | None = None
        try:
            size = os.fstat(fd).st_size
            view = memoryview(b"".join(pending))
            while view:  # an unbuffered write may be short just before the disk fills up
                view = view[os.write(fd, view) :]
        except OSError as exc:
            self.write_errors += 1
            if size is not None:
                try:
                    os.ftruncate(fd, size)
                except OSError as cut:
                    log.error("jsonl_truncate_failed", file=target, error=repr(cut))
            if target not in self._failing:  # once per outage: every put retries
                self._failing.add(target)
                log.error(
                    "jsonl_write_failed", file=target, error=repr(exc), in_memory=len(pending)
                )
            return
        if target in self._failing:
            self._failing.discard(target)
            log.info("jsonl_write_recovered", file=target, written=len(pending))
        pending.clear()

    def _count_lost(self, target: str, records: int, reason: str) -> None:
        self.lost[target] += records
        log.error("records_lost", file=target, records=records, reason=reason)

    def pending_records(self) -> int:
        """Lines the disk refused so far, kept in memory to be written again."""
        with self._lock:
            return sum(len(lines) for lines in self._pending.values())

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self._put(RecordKind.TRAJECTORY, "trajectories", record)

    def put_feedback(self, event: dict[str, Any]) -> None:
        self._put(RecordKind.FEEDBACK, "feedback", event)

    def close(self) -> None:
        """Write what waits (one last try), count what the disk still refuses, close."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for target, handle in self._files.items():
                self._write_pending_locked(target)
                if self._pending[target]:
                    self._count_lost(target, len(self._pending[target]), "disk_error")
                    self._pending[target].clear()
                try:
                    handle.close()
                except OSError as exc:  # unbuffered: what was written is in the file already
                    log.error("jsonl_close_failed", file=target, error=repr(exc))

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
