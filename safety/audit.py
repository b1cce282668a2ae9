"""Tamper-evident, append-only audit log (hash-chained JSONL).

Each record holds `seq`, `ts`, `actor`, `event`, `payload`, `prev_hash` and `hash`, the
SHA-256 hex of the canonical JSON (sorted keys, compact separators, UTF-8) of the record
without `hash`. Several processes may append: each append takes an exclusive `flock` on a
side lock file, reads the tail under the lock, writes one line and fsyncs. Rotation renames
the live file to `audit.jsonl.<n>` (n = 1, 2, ... oldest first); the chain continues into
the new file. Only those names are read as the chain's segments, and only as a run from `.1`
with no gap: another file beside the log (a dated copy `audit.jsonl.20240501`, `.01`) is
not part of the chain, and `verify` lists it under `ignored`; rotation never writes the
segment that would close a gap before a numbered file (it would join the chain). A head file
(`audit.jsonl.head`) records the last seq and hash so that truncating the newest lines is
detected too. Payloads pass through the Redactor and a denylist of secret-looking keys
before they are hashed, so the log never holds secrets/PII.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import structlog

from safety.config import DEFAULT_SECRET_KEYS, AuditConfig
from safety.pseudonym import pseudonym
from safety.redaction import Redactor

log = structlog.get_logger(__name__)

GENESIS_HASH = "0" * 64
RECORD_FIELDS = ("seq", "ts", "actor", "event", "payload", "prev_hash", "hash")
SECRET_PLACEHOLDER = "[REDACTED:secret]"


class AuditError(RuntimeError):
    """The log cannot be appended to safely (e.g. its tail is not a valid record)."""


class AuditRecordWritten(AuditError):
    """An append failed after its record's line was written (the head file or the fsync
    could not follow): `record` is in the chain, and the change it records must stand. Any
    other exception from `append` means its line is not in the log."""

    def __init__(self, message: str, record: dict[str, Any]) -> None:
        super().__init__(message)
        self.record = record


def canonical_json(obj: Any) -> bytes:
    """The byte string that is hashed: sorted keys, no spaces, UTF-8, no NaN/Infinity."""
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


# Deeper than any record olp writes (a gate result is about 6 levels). A line nested near
# Python's recursion limit parses, then fails hashing (`canonical_json` recurses deeper).
_MAX_RECORD_DEPTH = 100


def _parse_json(data: bytes | str) -> Any:
    """`json.loads`, a line nested too deeply to hash (or to parse) raising ValueError as any
    damaged line does: its RecursionError went past every check, and `olp audit verify` and
    `show` ended in a traceback on a line an editor had replaced with `[[[...]]]`."""
    try:
        value = json.loads(data)
    except RecursionError as exc:
        raise ValueError("nested too deeply to read") from exc
    stack = [(value, 1)]  # walked without recursion
    while stack:
        node, depth = stack.pop()
        if depth > _MAX_RECORD_DEPTH:
            raise ValueError(f"nested more than {_MAX_RECORD_DEPTH} levels deep")
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)
    return value


def record_hash(record: Mapping[str, Any]) -> str:
    body = {key: value for key, value in record.items() if key != "hash"}
    return hashlib.sha256(canonical_json(body)).hexdigest()


def _secret_key_pattern(keys: Iterable[str]) -> re.Pattern[str]:
    # A key is secret when one of the names is its whole name or its last part(s) after a
    # `_`, a `-` or a camelCase boundary: `api_key`, `openai_api_key`, `X-Admin-Key`,
    # `dbPassword`, `XApiKey`; never `max_tokens` or `maxTokens`. The camelCase boundaries
    # (`bP`, `XAp`) are matched case-sensitively inside the otherwise case-blind pattern.
    alternatives = "|".join(re.escape(k).replace("_", "[_-]?") for k in keys)
    camel = r"(?-i:[a-z0-9](?=[A-Z])|[A-Z](?=[A-Z][a-z]))"
    return re.compile(rf"^(?:.*[_-]|.*{camel})?(?:{alternatives})$", re.IGNORECASE)


_DEFAULT_SECRET_KEY = _secret_key_pattern(DEFAULT_SECRET_KEYS)


def names_a_secret(key: str) -> bool:
    """Whether the audit log, with its default secret keys, drops the value under `key`."""
    return _DEFAULT_SECRET_KEY.match(key) is not None


class PayloadSanitizer:
    """Drops values under secret-looking keys, redacts PII/secrets in every string and
    writes non-finite numbers as strings ("nan", "inf", "-inf")."""

    def __init__(self, redactor: Redactor, secret_keys: Iterable[str] = DEFAULT_SECRET_KEYS):
        self.redactor = redactor
        self._secret_key = _secret_key_pattern(secret_keys)

    def sanitize(self, payload: Any) -> Any:
        redacted, _ = self.redactor.redact_obj(self._drop_secrets(payload))
        return redacted

    def _drop_secrets(self, obj: Any) -> Any:
        if isinstance(obj, Mapping):
            out: dict[str, Any] = {}
            for key, value in obj.items():
                out[self._unique_key(str(key), out)] = (
                    SECRET_PLACEHOLDER
                    if self._secret_key.match(str(key)) and value is not None
                    else self._drop_secrets(value)
                )
            return out
        if isinstance(obj, list | tuple):
            return [self._drop_secrets(value) for value in obj]
        if isinstance(obj, float) and not math.isfinite(obj):
            # JSON has no NaN/Infinity; a gate metric can be one (an infinite logprob). The
            # decision must still be recorded, so the value is kept as its name.
            return repr(obj)
        return obj

    def _unique_key(self, key: str, taken: Mapping[str, Any]) -> str:
        """The key as the record keeps it (redacted, as the Redactor does keys), made unique
        with `#2`, `#3`, ... where two keys come out alike (two e-mail addresses both read
        `[REDACTED:email]`, `1` and `"1"`): one of the values was lost without a word."""
        name, _ = self.redactor.redact_text(key)
        unique, number = name, 2
        while unique in taken:
            unique, number = f"{name}#{number}", number + 1
        return unique


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _is_live(path: Path) -> bool:
    """Whether a writer ever appended to `path` as a live file: the first append creates
    its lock and head files, which a rotated file never has (both stay named after the live
    one). This tells a live log named `audit.2024` from rotation 2024 of `audit`."""
    return head_path(path).exists() or lock_path(path).exists()


# Exactly the suffixes `_rotate` writes: a decimal number from 1, in ASCII, no leading zero.
_SEGMENT_SUFFIX = re.compile(r"[1-9][0-9]*")


def _scan_rotated(live: Path) -> tuple[list[Path], list[Path]]:
    """The rotated segments of `live` in chain order, and the files named like segments that
    are not part of the chain.

    Rotation names segments `.1`, `.2`, ... in turn, so the chain's segments are the run
    `.1` ... `.k` of regular files with exactly those names. Anything else numbered is not a
    segment the writer made: a copy with a date (`audit.jsonl.20240501`), a zero-padded or
    non-ASCII number (`.01`, `.١`), a directory, or a file after a gap in the numbers. Read
    as part of the chain, such a file made `verify` report tampering that was not there
    (or crash on a name `int` cannot read), and the writer extend or rotate after it; left
    out, it cannot hide tampering either: the chain must still run seq 1, 2, ... up to the
    head, so a missing segment still fails `verify`, which then names what it left out.
    Another log's live file (`audit.2024` beside `audit`) is neither.
    """
    numbered: dict[int, Path] = {}
    ignored: list[Path] = []
    for candidate in live.parent.glob(glob.escape(live.name) + ".*"):  # `[`, `*` are names
        suffix = candidate.name[len(live.name) + 1 :]
        if not suffix.isdigit():
            continue  # `.head`, `.lock`, `.head.tmp`, `.bak`: not named like a segment
        if _is_live(candidate):
            continue  # `audit.2024` beside `audit` is another log's live file
        if _SEGMENT_SUFFIX.fullmatch(suffix) and candidate.is_file():
            numbered[int(suffix)] = candidate
        else:
            ignored.append(candidate)
    segments = []
    while len(segments) + 1 in numbered:
        segments.append(numbered.pop(len(segments) + 1))
    ignored.sort(key=lambda path: path.name)
    ignored.extend(path for _, path in sorted(numbered.items()))  # after a gap, in order
    return segments, ignored


def rotated_files(live: Path) -> list[Path]:
    """`audit.jsonl.1`, `audit.jsonl.2`, ... in chain order (oldest first)."""
    return _scan_rotated(live)[0]


def ignored_files(live: Path) -> list[Path]:
    """Files named like rotated segments of `live` that are not part of its chain."""
    return _scan_rotated(live)[1]


def chain_files(live: Path) -> list[Path]:
    files = rotated_files(live)
    if live.exists():
        files.append(live)
    return files


def _last_line(path: Path, end: int | None = None) -> bytes | None:
    """The last line of a file (of its first `end` bytes), with its newline if it has one
    (a line without it is incomplete), read backwards in blocks."""
    with path.open("rb") as handle:
        if end is None:
            handle.seek(0, os.SEEK_END)
            end = handle.tell()
        if end == 0:
            return None
        block = 8192
        data = b""
        position = end
        while position > 0:
            step = min(block, position)
            position -= step
            handle.seek(position)
            data = handle.read(step) + data
            stripped = data[:-1] if data.endswith(b"\n") else data
            cut = stripped.rfind(b"\n")
            if cut >= 0:
                return data[cut + 1 :]
        return data


@dataclass(frozen=True)
class TornTail:
    """An incomplete last line of the live file: `keep` bytes before it."""

    keep: int
    length: int
    sha256: str


# The actor of the records the log writes about itself (`torn_tail_removed`, `head_caught_up`).
AUDIT_LOG_ACTOR = "olp-audit-log"


def _torn_tail(live: Path) -> TornTail | None:
    """The live file's incomplete last line, if it ends with one."""
    try:
        line = _last_line(live)
        size = live.stat().st_size
    except FileNotFoundError:
        return None
    if line is None or line.endswith(b"\n"):
        return None
    return TornTail(size - len(line), len(line), hashlib.sha256(line).hexdigest())


def head_path(live: Path) -> Path:
    return live.with_name(live.name + ".head")


def lock_path(live: Path) -> Path:
    return live.with_name(live.name + ".lock")


class AuditLog:
    """Appends hash-chained records to `path`; safe across threads and processes."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        redactor: Redactor | None = None,
        secret_keys: Iterable[str] = DEFAULT_SECRET_KEYS,
        rotate_bytes: int = 16 * 1024 * 1024,
        fsync: bool = True,
        pseudonym_key: bytes | None = None,
    ) -> None:
        self.path = Path(path)
        self.pseudonym_key = pseudonym_key  # of actors the Redactor finds PII in
        self.rotate_bytes = rotate_bytes
        self.fsync = fsync
        self._sanitizer = PayloadSanitizer(redactor or Redactor(), secret_keys)
        self._lock_path = lock_path(self.path)
        self._thread_lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @classmethod
    def from_config(
        cls,
        config: AuditConfig,
        state_dir: str | os.PathLike[str],
        redactor: Redactor,
        pseudonym_key: bytes | None = None,
    ) -> AuditLog:
        return cls(
            Path(state_dir) / config.path,
            redactor=redactor,
            secret_keys=config.secret_keys,
            rotate_bytes=config.rotate_bytes,
            fsync=config.fsync,
            pseudonym_key=pseudonym_key,
        )

    def actor_label(self, actor: str) -> str:
        """The actor as the log keeps it: actors are ids, never PII, so one the Redactor
        finds something in (an e-mail address, which `--actor` accepts) is written as a
        pseudonym (`safety.pseudonym`, the proxy's key). A `[REDACTED:email]` placeholder
        made every such operator the same one, in the record that is to say who decided
        what."""
        redacted, counts = self._sanitizer.redactor.redact_text(actor)
        if redacted == actor and not any(counts.values()):
            return actor
        return "redacted-" + pseudonym(self.pseudonym_key, actor)[:32]

    def append(self, actor: str, event: str, payload: Mapping[str, Any] | None = None) -> dict:
        """Sanitize the payload, chain it to the last record and write it durably."""
        if not actor or not event:
            raise ValueError("audit records need a non-empty actor and event")
        clean_payload = self._sanitizer.sanitize(dict(payload or {}))
        actor = self.actor_label(actor)
        canonical_json(clean_payload)  # fail before taking the lock on NaN / non-JSON values
        with self._thread_lock, self._locked():
            torn = _torn_tail(self.path)
            last = self._read_last_record(torn)
            behind = self._check_head(last)
            if torn is not None:
                if behind:
                    raise AuditError(
                        f"{self.path} ends with an incomplete line after a record its head "
                        "does not name; refusing to extend it; run `olp audit verify`"
                    )
                last = self._remove_torn_tail(torn, last)
            elif behind:
                assert last is not None
                last = self._catch_up_head(last)
            return self._append_record(actor, event, clean_payload, last)

    def _catch_up_head(self, last: dict) -> dict:
        """Bring a head one record behind up to date, and record that; returns the record
        written (the chain's newest now).

        An earlier append wrote its line but not its head (a crash in between), or somebody
        able to write the file appended a record of their own, hashed right, without the
        head: no file tells the two apart. `verify` says so in a note only while the head is
        behind, so adopting the record in silence left no trace of it after the next append
        (a forged `rollback` read as an operator's). The record says which one was adopted,
        for whoever compares it with what they did."""
        head = head_path(self.path)
        before = head.read_bytes() if head.exists() else None
        self._write_head(last)
        adopted = {"seq": last["seq"], "hash": last["hash"], "event": last.get("event")}
        log.error(
            "audit_head_caught_up",
            file=str(self.path),
            seq=last["seq"],
            hash=last["hash"],
            record_event=last.get("event"),
        )
        try:
            return self._append_record(AUDIT_LOG_ACTOR, "head_caught_up", adopted, last)
        except AuditRecordWritten as exc:
            raise AuditError(f"{exc}; the record asked for was not written") from exc
        except BaseException:
            # Its line is not in the log: the head goes back one record, so the adopted one
            # is still reported (and recorded by the next append that succeeds).
            if before is None:
                head.unlink(missing_ok=True)
            else:
                self._write_head(json.loads(before))
            raise

    def _append_record(
        self, actor: str, event: str, clean_payload: dict[str, Any], last: dict | None
    ) -> dict:
        """Write the record after `last` (the chain's newest) and its head; under the lock."""
        record: dict[str, Any] = {
            "seq": (last["seq"] + 1) if last else 1,
            "ts": _now_iso(),
            "actor": actor,
            "event": event,
            "payload": clean_payload,
            "prev_hash": last["hash"] if last else GENESIS_HASH,
        }
        record["hash"] = record_hash(record)
        line = canonical_json(record) + b"\n"
        self._write_line(line, record)
        try:
            self._write_head(record)
        except Exception as exc:
            # The line is in the chain (one record ahead of the head, which `verify`
            # accepts): the caller must keep what it records, not undo it.
            raise AuditRecordWritten(
                f"audit record seq {record['seq']} ({event}) is written, but "
                f"{head_path(self.path).name} could not be updated: {exc}",
                record,
            ) from exc
        try:
            if self.path.stat().st_size >= self.rotate_bytes:
                self._rotate()
        except OSError as exc:
            # The record and its head are written; the live file grows until a later
            # append's rotation goes through.
            log.error("audit_rotation_failed", file=str(self.path), error=str(exc))
        return record

    def iter_records(self) -> Iterator[dict]:
        # Its own path is the live file, whatever its name looks like: no resolving.
        return _iter_live_records(self.path)

    def verify(self) -> VerifyResult:
        return _verify_live(self.path, as_copy=False)  # its own log: never a copy

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with _flocked(os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600), fcntl.LOCK_EX):
            yield

    def _remove_torn_tail(self, torn: TornTail, last: dict | None) -> dict:
        """Cut off the incomplete line an append left when it was killed mid-write, and
        record that; returns the record written (the chain's newest now).

        Only called when the head names the record before it: the head is written after
        its line, so that line's append never finished, and nothing in the chain is lost.
        A kill (SIGKILL, the OOM killer, a supervisor's deadline) inside a write of more
        than a page leaves such a line; before, it made the log read as tampered and
        refuse every append (admin changes and promotions with it) until an operator
        repaired the file by hand."""
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.ftruncate(fd, torn.keep)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        log.error(
            "audit_torn_tail_removed", file=str(self.path), bytes=torn.length, sha256=torn.sha256
        )
        payload = {"file": self.path.name, "bytes": torn.length, "sha256": torn.sha256}
        try:
            return self._append_record(AUDIT_LOG_ACTOR, "torn_tail_removed", payload, last)
        except AuditRecordWritten as exc:
            # Its line is in the chain, the head one behind (which the next append mends);
            # the caller's own record is not written.
            raise AuditError(f"{exc}; the record asked for was not written") from exc

    def _read_last_record(self, torn: TornTail | None = None) -> dict | None:
        for candidate in reversed(chain_files(self.path)):
            end = torn.keep if torn is not None and candidate == self.path else None
            line = _last_line(candidate, end)
            if line is None:
                continue
            if not line.endswith(b"\n"):
                raise AuditError(
                    f"{candidate} ends with an incomplete line; run `olp audit verify` before "
                    "appending"
                )
            try:
                record = _parse_json(line)
                if record_hash(record) != record["hash"] or not isinstance(record["seq"], int):
                    raise ValueError("hash mismatch")
            except (ValueError, KeyError, TypeError) as exc:
                raise AuditError(
                    f"last record of {candidate} is not a valid audit record ({exc}); "
                    "refusing to extend a damaged chain; run `olp audit verify`"
                ) from exc
            return record
        return None

    def _check_head(self, last: Mapping[str, Any] | None) -> bool:
        """Refuse to extend a chain whose newest records were removed: the head names the
        newest record written, and an append must not turn a detectable deletion into a
        chain that verifies. The chain may be one record ahead (an append interrupted
        between its line and its head): then True, the head is behind."""
        head = head_path(self.path)
        if not head.exists():
            # No head yet and only seq 1 on disk: the very first append stopped between its
            # line and its head (the head is "seq 0", one record behind).
            if last is not None and not _first_record(last):
                raise AuditError(
                    f"{head} is missing but the log holds records; refusing to extend it; "
                    "run `olp audit verify`"
                )
            return last is not None
        try:
            head_record = _parse_json(head.read_bytes())
            head_seq, head_hash = int(head_record["seq"]), str(head_record["hash"])
        except (ValueError, KeyError, TypeError) as exc:
            raise AuditError(f"{head} is unreadable ({exc}); run `olp audit verify`") from exc
        if last is not None and last["seq"] == head_seq and last["hash"] == head_hash:
            return False
        if last is not None and last["seq"] == head_seq + 1 and last["prev_hash"] == head_hash:
            return True
        found = "no records" if last is None else f"seq {last['seq']}"
        raise AuditError(
            f"the audit chain ends at {found} but {head.name} records seq {head_seq}: "
            "records were deleted or the head was edited; refusing to extend it; "
            "run `olp audit verify`"
        )

    def _segment_path(self, number: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{number}")

    def _rotation_blocker(self, number: int, ignored: list[Path]) -> tuple[Path, str] | None:
        """The file outside the chain that rotating to segment `number` would harm, and how.

        One holding that name (a file after a gap, a directory) would be renamed over and
        lost, and a segment after it would not be read. A numbered file right after that
        name (left out of the chain by the gap the new segment closes) would join the chain,
        with the run of files after it: its records are another chain's (or an older part
        of this one), so `verify` failed, and every append, finding that file's last record
        at the chain's end instead of the head's, refused.
        """
        target = self._segment_path(number)
        if target.exists() or target.is_symlink():
            return target, "the next segment's name is taken by a file outside the chain"
        follower = self._segment_path(number + 1)
        if follower in ignored and follower.is_file():
            return follower, "a file outside the chain would join it after the next segment"
        return None

    def _write_line(self, line: bytes, record: dict[str, Any]) -> None:
        """Append `line`; on any failure, cut the file back to where it ended, so that the
        line is either in the chain whole (AuditRecordWritten when that cut fails after the
        whole line was written) or not at all (the original error)."""
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            end = os.fstat(fd).st_size  # under the lock: no other writer moves it
            written = 0
            try:
                written = os.write(fd, line)
                if written != len(line):
                    raise AuditError(f"short write to {self.path} ({written} of {len(line)} bytes)")
                if self.fsync:
                    os.fsync(fd)
            except Exception as exc:
                if not self._cut_back(fd, end) and written == len(line):
                    raise AuditRecordWritten(
                        f"audit record seq {record['seq']} is written to {self.path.name} "
                        f"but could not be synced ({exc}), nor taken back",
                        record,
                    ) from exc
                raise
        finally:
            os.close(fd)

    def _cut_back(self, fd: int, size: int) -> bool:
        """Truncate the live file to `size` after a failed write: whether that worked."""
        try:
            os.ftruncate(fd, size)
        except OSError as exc:
            log.error("audit_line_not_taken_back", file=str(self.path), error=str(exc))
            return False
        return True

    def _write_head(self, record: Mapping[str, Any]) -> None:
        head = head_path(self.path)
        tmp = head.with_name(head.name + ".tmp")
        tmp.write_bytes(canonical_json({"seq": record["seq"], "hash": record["hash"]}))
        if self.fsync:
            with tmp.open("rb") as handle:
                os.fsync(handle.fileno())
        os.replace(tmp, head)

    def _rotate(self) -> None:
        segments, ignored = _scan_rotated(self.path)
        target = self._segment_path(len(segments) + 1)
        blocker = self._rotation_blocker(len(segments) + 1, ignored)
        if blocker is not None:
            # The record is written; the live file just grows until an operator moves that
            # file away.
            log.error("audit_rotation_blocked", target=blocker[0].name, reason=blocker[1])
            return
        if ignored:
            log.warning("audit_files_not_in_chain", files=[path.name for path in ignored])
        os.replace(self.path, target)
        # An empty live file keeps `audit.jsonl` present for readers between rotations.
        os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
        if self.fsync:
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        log.info("audit_rotated", rotated_to=target.name)


@dataclass
class VerifyResult:
    ok: bool
    first_bad_seq: int | None = None
    reason: str = ""
    records: int = 0
    files: list[str] = field(default_factory=list)
    # Files named like rotated segments that are not part of the chain (not read).
    ignored: list[str] = field(default_factory=list)
    # Read as a copy: no head or lock file beside it, so no head proves where it ends, and it
    # may start past seq 1 (a later segment archived alone); `reason` says what is unproven.
    copy: bool = False
    first_seq: int | None = None  # the seq the records read start at (None: no records)
    # Accepted as an append interrupted by a crash (head one record behind, an incomplete
    # last line after the head's record): `reason` says which.
    interrupted: bool = False

    @property
    def empty(self) -> bool:
        """Nothing wrong found because there was nothing to check: no records and no head
        to say there were any (`reason` says what was found). Proves nothing: a log emptied
        together with its head looks the same as one never written."""
        return self.ok and self.records == 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "empty": self.empty,
            "first_bad_seq": self.first_bad_seq,
            "reason": self.reason,
            "records": self.records,
            "files": self.files,
            "ignored": self.ignored,
            "copy": self.copy,
            "first_seq": self.first_seq,
            "interrupted": self.interrupted,
        }


def resolve_live_path(path_or_dir: str | os.PathLike[str]) -> Path:
    """A directory means its `audit.jsonl`; a rotated file name means its live file.

    A name ending in `.<n>` is a rotated file only when it is one of the segments of the log
    named without the suffix (see `_scan_rotated`): a log configured as `audit.2024` is read
    as itself, and so is a copy beside a log (`audit.jsonl.20240501`), not the log it sits
    beside.
    """
    path = Path(path_or_dir)
    if path.is_dir():
        return path / "audit.jsonl"
    match = re.fullmatch(r"(.+)\.[1-9][0-9]*", path.name)
    if match is None or _is_live(path):
        return path
    live = path.with_name(match.group(1))
    if path in rotated_files(live):
        return live
    return path


def _iter_lines(files: list[Path]) -> Iterator[tuple[Path, int, bytes]]:
    for file in files:
        with file.open("rb") as handle:
            for number, line in enumerate(handle, start=1):
                yield file, number, line


def iter_records(path_or_dir: str | os.PathLike[str]) -> Iterator[dict]:
    """Every record in chain order across rotated files (no verification).

    A snapshot as of the first record read: under the writers' shared lock it lists the
    rotated files, opens the live file and notes its size; the lines are read after the
    lock is released. Rotated files never change and an open file survives its rotation, so
    an append or a rotation while the caller iterates neither drops nor repeats records, and
    a slow caller (a pager) never keeps writers waiting.
    """
    return _iter_live_records(resolve_live_path(path_or_dir))


def _iter_live_records(live: Path) -> Iterator[dict]:
    with _shared_lock(live):
        rotated = rotated_files(live)
        try:
            live_handle: IO[bytes] | None = live.open("rb")
        except FileNotFoundError:
            live_handle = None
        live_size = os.fstat(live_handle.fileno()).st_size if live_handle is not None else 0
    try:
        for file in rotated:
            with file.open("rb") as handle:
                yield from _records(file, handle, None)
        if live_handle is not None:
            yield from _records(live, live_handle, live_size)
    finally:
        if live_handle is not None:
            live_handle.close()


def _records(file: Path, handle: IO[bytes], limit: int | None) -> Iterator[dict]:
    """The records of one open chain file; with `limit` (the live file), of its first
    `limit` bytes only, which end with a whole line or with an append's incomplete one (a
    kill while it wrote: not a record, the next append removes it)."""
    for number, line in enumerate(handle, start=1):
        if limit is not None:
            if limit <= 0:
                return  # appended after the snapshot
            line = line[:limit]
            limit -= len(line)
            if not line.endswith(b"\n"):
                log.warning("audit_incomplete_last_line", file=str(file), bytes=len(line))
                return
        try:
            record = _parse_json(line)
        except ValueError as exc:
            raise AuditError(f"{file}:{number} is not valid JSON") from exc
        if not isinstance(record, dict):
            # Callers read records with `.get`: name the damaged line instead of crashing.
            raise AuditError(f"{file}:{number} is not a JSON object")
        yield record


@contextlib.contextmanager
def _shared_lock(live: Path) -> Iterator[None]:
    """Hold the writers' lock shared while reading, where a writer has created one.

    Without it an append or a rotation between reading the lines and reading the head looks
    like deleted records. A log no writer ever locked (a copy, read-only media) is read as is.
    """
    try:
        fd = os.open(lock_path(live), os.O_RDONLY)
    except OSError:
        yield
        return
    with _flocked(fd, fcntl.LOCK_SH):
        yield


@contextlib.contextmanager
def _flocked(fd: int, operation: int) -> Iterator[None]:
    """Hold `flock(fd, operation)`; unlock and close `fd` afterwards."""
    try:
        fcntl.flock(fd, operation)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def verify(path_or_dir: str | os.PathLike[str], *, require_head: bool = False) -> VerifyResult:
    """Check the whole chain; name the first seq at which it breaks.

    Detects an edited line (hash mismatch), a deleted line (seq gap or head mismatch), an
    inserted line (seq/prev_hash out of order) and reordered lines.

    A log with neither its head nor its lock file beside it was never appended to where it
    is: a copy (made without its head) or a rotated segment archived alone. It is read as a
    copy (`VerifyResult.copy`): its records' own chain is checked, from the seq its first
    record has, and `reason` says what no head proves (where it ends; for a later segment,
    the records before it). A writer creates the lock with its first record and the head
    with every one, so the live log is never read so; `require_head` (for a caller that
    means the live log) never reads any log as a copy.

    A check that fails (or finds a listed file renamed away) is read again under the
    writers' lock: an append or a rotation while it read may have caused it. Only then do
    appends wait for it (the proxy appends on its event loop, so a lock held for every
    check would stall requests on a long log).
    """
    live = resolve_live_path(path_or_dir)
    return _verify_live(live, as_copy=not require_head and not _is_live(live))


def _verify_live(live: Path, as_copy: bool) -> VerifyResult:
    try:
        result: VerifyResult | None = _verify_unlocked(live, as_copy)
    except FileNotFoundError:
        result = None  # a rotation renamed a listed file before it was opened
    # An append seen half done (its line read, its head not yet) looks like one a crash
    # interrupted: read again under the lock, where no append is half done. Accepted
    # unlocked, `verify` beside a working proxy reported an interrupted append in over
    # half of its checks.
    if result is None or not result.ok or result.interrupted:
        with _shared_lock(live):
            result = _verify_unlocked(live, as_copy)
    if result.ignored:
        log.warning("audit_files_not_in_chain", files=[Path(f).name for f in result.ignored])
    return result


def _verify_unlocked(live: Path, as_copy: bool = False) -> VerifyResult:
    files = chain_files(live)
    ignored = ignored_files(live)
    result = VerifyResult(
        ok=True, files=[str(f) for f in files], ignored=[str(f) for f in ignored], copy=as_copy
    )
    expected_seq = 1
    prev_hash = GENESIS_HASH

    def fail(reason: str) -> VerifyResult:
        result.ok = False
        result.first_bad_seq = expected_seq
        result.reason = reason
        if ignored:
            # A missing segment leaves the ones after it out of the chain: say so.
            result.reason += (
                f" (not read as part of the chain: {', '.join(p.name for p in ignored)}; "
                f"rotated segments run {live.name}.1, .2, ... with no gap)"
            )
        return result

    torn: str | None = None  # an incomplete last line of the live file
    for file, number, line in _iter_lines(files):
        where = f"{file.name}:{number}"
        if not line.endswith(b"\n"):
            if file == files[-1] and not as_copy and file == live:
                torn = f"{where}: incomplete last line ({len(line)} bytes)"
                break
            return fail(f"{where}: incomplete last line")
        try:
            record = _parse_json(line)
        except ValueError:
            return fail(f"{where}: not valid JSON")
        if not isinstance(record, dict) or set(record) != set(RECORD_FIELDS):
            return fail(f"{where}: fields are not {list(RECORD_FIELDS)}")
        if as_copy and not result.records and type(record["seq"]) is int and record["seq"] > 1:
            # A copy may start with a later segment: its first record links to one it does
            # not hold. From there on its chain is checked as the live one's is.
            expected_seq, prev_hash = record["seq"], record["prev_hash"]
        # `type(...) is int`: `true` and `1.0` equal 1 to Python, and their canonical JSON is
        # the line itself; a seq is written as an integer only.
        if type(record["seq"]) is not int or record["seq"] != expected_seq:
            return fail(f"{where}: expected seq {expected_seq}, found {record['seq']!r}")
        if record["prev_hash"] != prev_hash:
            return fail(f"{where}: prev_hash does not link to the previous record")
        try:
            computed = record_hash(record)
        except ValueError as exc:
            return fail(f"{where}: record is not canonical JSON ({exc})")
        if computed != record["hash"]:
            return fail(f"{where}: hash mismatch (record was edited)")
        if line != canonical_json(record) + b"\n":
            # Same record, other bytes (spaces, key order, a duplicated key that a reader
            # keeping the first one would show): every line is written canonical.
            return fail(f"{where}: not the canonical JSON of its record (line was edited)")
        if not result.records:
            result.first_seq = expected_seq
        result.records += 1
        prev_hash = record["hash"]
        expected_seq += 1

    head = head_path(live)
    last_seq = expected_seq - 1
    if as_copy and result.records and not head.exists():
        # A segment's or a dated copy's head is its live log's: `audit.jsonl.head`.
        named = re.fullmatch(r"(.+)\.[1-9][0-9]*", files[-1].name)
        base = files[-1].with_name(named.group(1)) if named else files[-1]
        unproven = []
        if result.first_seq != 1:
            unproven.append(
                f"the records before seq {result.first_seq}, which {files[0].name} does not "
                "hold (verify it together with the segments before it)"
            )
        unproven.append(
            f"where it ends: no head file shows that no record followed seq {last_seq} "
            f"(back up the live log with its {head_path(base).name}; a rotated segment is "
            "continued by the next one)"
        )
        result.reason = "read as a copy; not proven: " + "; ".join(unproven)
        if base != live and _is_live(base):
            # Beside a live log but not in its chain (a dated copy, a segment after a gap):
            # the log itself is what `verify` of the directory checks.
            result.reason += (
                f"; {live.name} lies beside the live log {base.name} but is not part of its "
                f"chain: verify {base.name} (or the directory) to check that log"
            )
        return result
    if head.exists():
        try:
            head_record = _parse_json(head.read_bytes())
            head_seq, head_hash = int(head_record["seq"]), str(head_record["hash"])
        except (ValueError, KeyError, TypeError):
            return fail(f"{head.name}: unreadable head file")
        # The head is written right after the line; a crash between the two leaves the chain
        # one record ahead of the head, which is not tampering.
        if head_seq == last_seq and head_hash == prev_hash:
            if torn is not None:
                # The line after the head's record never got its head: an append killed
                # while it wrote (a write of more than a page may stop part way).
                result.reason = (
                    f"{torn} after the head's record: an append interrupted while it "
                    "wrote; the next append removes it (audited as torn_tail_removed)"
                )
                result.interrupted = True
            return result
        if torn is not None:
            return fail(f"{torn}, and the head does not name the record before it")
        if head_seq == last_seq - 1 and result.records and _hash_at(files, head_seq) == head_hash:
            result.reason = "head file one record behind (interrupted append)"
            result.interrupted = True
            return result
        if head_seq > last_seq:
            expected_seq = last_seq + 1  # the newest records were removed
        elif head_seq < last_seq:
            expected_seq = head_seq + 1  # records beyond the head were added outside the log
        else:
            expected_seq = last_seq  # the last record was rewritten
        return fail(
            f"chain ends at seq {last_seq} but the head records seq {head_seq}: "
            "records were deleted or the head was edited"
        )
    if torn is not None:
        if not result.records:
            result.reason = (
                f"{torn} and no record before it: the first append interrupted while it "
                "wrote; the next append removes it (audited as torn_tail_removed)"
            )
            result.interrupted = True
            return result
        return fail(f"{torn}, and no {head.name} names the record before it")
    if result.records == 1 and last_seq == 1:
        # Accepted, since the first append stops exactly so when it dies between its line
        # and its head; but a log cut back to seq 1 with its head deleted is byte for byte
        # the same (the lock file stays either way), so the reason says both.
        result.reason = (
            f"{head.name} missing after the first record: an interrupted first append, or "
            "a log cut back to its first record with its head deleted (the two look alike)"
        )
        result.interrupted = True
        return result
    if result.records:
        return fail(f"{head.name} is missing")
    result.reason = no_records_reason(live, files)
    return result


def no_records_reason(live: Path, files: list[Path] | None = None) -> str:
    """What a log without records holds, for `VerifyResult.reason` and `olp audit show`."""
    files = chain_files(live) if files is None else files
    if not files:
        found = [f"no {live.name}"]
    elif len(files) == 1:
        found = [f"{files[0].name} is empty"]
    else:
        found = [f"{', '.join(f.name for f in files)} are empty"]
    head = head_path(live)
    found.append(f"{head.name} is there" if head.exists() else f"no {head.name}")
    return f"no records ({', '.join(found)}): an empty chain proves nothing"


def _first_record(record: Mapping[str, Any]) -> bool:
    return record.get("seq") == 1 and record.get("prev_hash") == GENESIS_HASH


def _hash_at(files: list[Path], seq: int) -> str | None:
    for _, _, line in _iter_lines(files):
        record = _parse_json(line)
        if record.get("seq") == seq:
            return record.get("hash")
    return None


_REASON_CHARS = 80


def _gate_results_line(results: Any) -> str:
    """A gate_result's verdicts as `[name metric<=threshold pass, ...]`: the whole results
    (about 6 KB, each monitor repeating the monitors' shared details) made one record fill a
    terminal. The details stay in the record: `olp audit show --json` prints them."""
    if not isinstance(results, list) or not all(isinstance(r, Mapping) for r in results):
        return json.dumps(results, ensure_ascii=False, sort_keys=True)
    parts = []
    for result in results:
        verdict = "pass" if result.get("verdict") == "pass" else "FAIL"
        metric = result.get("metric")
        if metric is None:
            reason = str((result.get("details") or {}).get("reason", ""))
            if len(reason) > _REASON_CHARS:
                reason = reason[: _REASON_CHARS - 1] + "…"
            parts.append(f"{result.get('name')} {verdict} ({reason})")
        else:
            bound = f"{result.get('comparison', '<=')}{result.get('threshold')}"
            parts.append(f"{result.get('name')} {metric}{bound} {verdict}")
    return "[" + ", ".join(parts) + "]"


def format_record(record: Mapping[str, Any]) -> str:
    """One readable line per record for `olp audit show`."""
    payload = record.get("payload") or {}
    if not isinstance(payload, Mapping):
        payload = {"payload": payload}  # a hand-edited record: shown as it is
    details = [
        f"{key}={_gate_results_line(value)}"
        if key == "results" and record.get("event") == "gate_result"
        else f"{key}={json.dumps(value, ensure_ascii=False, sort_keys=True)}"
        for key, value in sorted(payload.items())
    ]
    return " ".join(
        [
            f"#{record.get('seq')}",
            str(record.get("ts")),
            str(record.get("actor")),
            str(record.get("event")),
            *details,
            f"[{str(record.get('hash', ''))[:12]}]",
        ]
    )
