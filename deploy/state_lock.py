"""One holder per state dir for what must not run twice on it (`olp up`, the learner).

An flock on `<state_dir>/run/<name>.lock`, which holds the holder's pid for the message:
the kernel drops the lock when its holder dies, however it dies, so a crash never leaves
it behind as a pid file alone would. The file is opened non-inheritable (Python's
default): children `olp up` starts with exec do not hold it on after their parent.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO


class LockHeld(RuntimeError):
    """Another process holds the lock; `holder` is its pid as it wrote it."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by pid {holder}")
        self.holder = holder


class StateDirLock:
    def __init__(self, state_dir: Path, name: str) -> None:
        self.path = state_dir / "run" / f"{name}.lock"
        self._fh: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock or raise LockHeld at once (never waits)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Owner-only, as the audit log's lock: the umask's 0644 (or 0666) was the default.
        fh = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600), "a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise LockHeld(self.path, holder) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh

    def release(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
