"""Keyed pseudonyms of personal labels (session ids, users, e-mail actors).

A plain sha256 of an e-mail address is reversed by hashing a list of candidate addresses;
under HMAC with a key only the deployment holds, the same label still gives the same
pseudonym (records and feedback join, sessions stay on one Kafka partition) but a reader
of the topics or the logs cannot test guesses. The key is the config's, or a random one
kept in the state dir: every proxy whose records must join needs the same key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

KEY_FILE = "pseudonym.key"


def pseudonym(key: bytes | None, value: str) -> str:
    """64 hex digits: HMAC-SHA256 of `value` under `key` (a plain sha256 without a key, for
    library use outside a deployment). `surrogatepass`: header text aiohttp decoded from
    bytes that are not UTF-8 may hold lone surrogates."""
    data = value.encode("utf-8", "surrogatepass")
    if key is None:
        return hashlib.sha256(data).hexdigest()
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def deployment_key(directory: Path, configured: str | None = None) -> bytes:
    """The configured key, or the one kept in `directory` (made there the first time: 32
    random bytes, hex, readable by the owner only)."""
    if configured is not None:
        return configured.encode("utf-8")
    path = Path(directory) / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_bytes(32)
    # Written whole beside it, then linked into place (which fails when the name exists):
    # created empty and written after, a process that found it meanwhile read it empty and
    # refused to start, and a crash between the two left an empty key blocking every start.
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="ascii") as handle:
            handle.write(key.hex())
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:  # another process made it meanwhile: take theirs
            return _read_key(path)
        except OSError:  # a file system without hard links (vfat, some network volumes)
            if not _create_exclusively(path, key):
                return _read_key(path)  # another process made it meanwhile
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return key


def _create_exclusively(path: Path, key: bytes) -> bool:
    """Create it holding `key`; False when it exists. Created, then written: a process that
    finds it in between reads it empty (the hard link above avoids that where links exist)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w", encoding="ascii") as handle:
        handle.write(key.hex())
        handle.flush()
        os.fsync(handle.fileno())
    return True


def _read_key(path: Path) -> bytes:
    text = path.read_text(encoding="ascii", errors="replace").strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(
            f"{path} does not hold a pseudonym key (hex, 16 bytes or more); restore it, or "
            "remove it for a new one (pseudonyms made before then will no longer match)"
        )
    return key
