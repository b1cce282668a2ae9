"""Child processes that belong to olp: start in their own process group, stop by PID.

Why hand-written: the supervisor needs exactly three things the stdlib gives directly
(own process group, bounded graceful stop, a tail of the child's output for error
messages); a process-management library would add a dependency for no gain.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


class ChildProcess:
    """A started child whose output is kept (last lines) and optionally teed to a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        log_file: Path | None = None,
        cwd: Path | None = None,
        tail_lines: int = 200,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._log_file = log_file
        if log_file is not None:
            log_file.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            self.argv,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # own process group: Ctrl-C reaches us, we stop it
            text=True,
            errors="replace",
        )
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()
        log.info("child_started", child=name, pid=self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        sink = self._log_file.open("a", encoding="utf-8") if self._log_file else None
        try:
            for line in self.proc.stdout:
                self._tail.append(line.rstrip("\n"))
                if sink is not None:
                    sink.write(line)
                    sink.flush()
        finally:
            if sink is not None:
                sink.close()

    def tail(self, lines: int = 40) -> str:
        return "\n".join(list(self._tail)[-lines:])

    def poll(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after the timeout."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("child_kill", child=self.name, pid=self.pid)
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # vLLM's engine core runs as a grandchild in the same group: make sure it is gone.
        _signal_group(self.proc.pid, signal.SIGKILL)
        self._reader.join(timeout=2)
        log.info("child_stopped", child=self.name, pid=self.pid, returncode=self.proc.returncode)
        return self.proc.returncode


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def wait_until(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    child: ChildProcess | None = None,
    interval_s: float = 0.5,
    progress: Callable[[float], None] | None = None,
    what: str = "service",
) -> None:
    """Poll `check` until true; fail early with the child's own output if it died."""
    started = time.monotonic()
    last_progress = started
    while True:
        if check():
            return
        now = time.monotonic()
        if child is not None and not child.alive():
            raise RuntimeError(
                f"{what} exited with code {child.poll()} before it was ready; "
                f"its last output:\n{child.tail()}"
            )
        if now - started > timeout_s:
            tail = f"; its last output:\n{child.tail()}" if child else ""
            raise TimeoutError(f"{what} not ready after {timeout_s:.0f} s{tail}")
        if progress is not None and now - last_progress >= 5:
            progress(now - started)
            last_progress = now
        time.sleep(interval_s)
