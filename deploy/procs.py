"""Child processes that belong to olp: start in their own process group, stop by PID.

Why hand-written: the supervisor needs exactly three things the stdlib gives directly
(own process group, bounded graceful stop, a tail of the child's output for error
messages); a process-management library would add a dependency for no gain.

Children run in their own session, so a signal meant for olp (Ctrl-C, a closed terminal)
never reaches them: olp catches SIGINT, SIGTERM and SIGHUP (`install_stop_handlers`) and
stops them itself, also while it still waits for one to become ready (`wait_until`). A
signal olp cannot catch (SIGKILL) leaves that to each child's guard (deploy/child_guard.py).
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

import structlog

log = structlog.get_logger(__name__)

GUARD = str(Path(__file__).with_name("child_guard.py"))

# SIGHUP too: closing the terminal must stop the children, not orphan them.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# Exit codes of olp's own commands for failures no restart can fix: `olp up` never
# restarts a child that exits with one of them (docs/operations.md, "Start and stop").
EXIT_CONFIG_ERROR = 2  # the configuration or the installation is wrong
EXIT_REFUSED = 3  # the learner refuses its state dir (it will not guess about versions)


class StopRequested(Exception):
    """A stop signal arrived while waiting for a child to become ready."""


def stop_signals() -> tuple[signal.Signals, ...]:
    """`STOP_SIGNALS` less SIGHUP when it is ignored: `nohup olp up &` ignores it so that the
    stack outlives the terminal, and a handler put in its place stopped the whole stack when
    the SSH session dropped."""
    return tuple(
        sig
        for sig in STOP_SIGNALS
        if not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN)
    )


def install_stop_handlers(stop: threading.Event) -> None:
    """Turn SIGINT, SIGTERM and SIGHUP (`stop_signals`) into `stop.set()`; call before
    starting children."""
    for sig in stop_signals():
        signal.signal(sig, lambda *_: stop.set())


def say(message: str, stream: TextIO | None = None) -> None:
    """Print a status line, best-effort (default: stderr).

    With `olp up 2>&1 | tee log`, Ctrl-C kills tee too, and the next write raises
    BrokenPipeError (EIO once a closed terminal is gone); that must never keep olp from
    stopping its children. Nobody reads the stream any more, so the line is dropped.
    """
    out = sys.stderr if stream is None else stream
    try:
        print(message, file=out, flush=True)
    except OSError:
        _discard_output(out)


def _discard_output(stream: TextIO) -> None:
    """Point a dead stream's fd at /dev/null, so that later lines, structlog's and the
    interpreter's final flush succeed instead of raising the same error again."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # an in-memory stream (captured output): nothing to fix
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


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
        stop_grace_s: float | None = None,
        group_grace_s: float | None = None,
    ) -> None:
        """`stop_grace_s`, `group_grace_s`: what the child's guard gives it, and what it
        leaves in its group, after SIGTERM when olp dies without stopping it (as `stop()`
        is given them; the guard's defaults otherwise)."""
        self.name = name
        self.argv = list(argv)
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.stuck = False  # set by stop() when the process outlived SIGKILL
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
        self._guard = _start_guard(self.proc.pid, stop_grace_s, group_grace_s)
        self._reader = threading.Thread(target=self._read, name=f"{name}-output", daemon=True)
        self._reader.start()
        log.info("child_started", child=name, pid=self.proc.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        """Read the child's output to its end, keeping the last lines and teeing to the log.

        Whatever happens to the log file, the pipe is drained: a child whose output nobody
        reads blocks on its next write once the pipe is full (64 KiB) and stays alive,
        hung, where `olp up` cannot see it. A log that cannot be opened or written (a full
        disk) is therefore left alone from then on, and said once."""
        assert self.proc.stdout is not None
        sink: TextIO | None = None
        if self._log_file is not None:
            try:
                sink = self._log_file.open("a", encoding="utf-8")
            except OSError as exc:
                self._log_failed(exc)
        try:
            for line in self.proc.stdout:
                self._tail.append(line.rstrip("\n"))
                if sink is not None:
                    try:
                        sink.write(line)
                        sink.flush()
                    except OSError as exc:
                        self._log_failed(exc)
                        _close_quietly(sink)
                        sink = None
        finally:
            if sink is not None:
                _close_quietly(sink)

    def _log_failed(self, exc: OSError) -> None:
        log.error(
            "child_log_write_failed", child=self.name, path=str(self._log_file), error=str(exc)
        )
        say(
            f"olp: cannot write {self.name}'s log {self._log_file}: {exc.strerror or exc}; "
            "its output is no longer written there (its last lines are still kept for error "
            "messages)"
        )

    def _drain_group(self, grace_s: float) -> None:
        """The leader is gone: SIGTERM what is left of its group and wait, up to `grace_s`,
        until none of it runs (the SIGKILL that follows in stop() then finds nothing)."""
        if not _group_running(self.pid):
            return
        log.info("child_group_draining", child=self.name, pgid=self.pid, grace_s=grace_s)
        say(
            f"olp: {self.name} (pid {self.pid}) is gone; waiting up to {grace_s:.0f} s for "
            "the processes it left in its group to finish (a stream worker saving its "
            "records, say) before killing them"
        )
        _signal_group(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _group_running(self.pid):
            if time.monotonic() >= deadline:
                log.warning("child_group_kill", child=self.name, pgid=self.pid)
                return
            time.sleep(0.1)

    def tail(self, lines: int = 40) -> str:
        """Its last lines. Once it has exited, what it wrote last is read first (up to 2 s:
        a grandchild may hold the pipe open): a child that printed why and exited at once
        (a binary the loader refused) was reported with its reader a step behind, an empty
        "last output" 3 times in 10."""
        if self.proc.poll() is not None and self._reader.is_alive():
            self._reader.join(timeout=2)
        return "\n".join(list(self._tail)[-lines:])

    def poll(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(
        self,
        timeout_s: float = 20.0,
        kill_wait_s: float = 10.0,
        *,
        group_grace_s: float | None = None,
    ) -> int | None:
        """SIGTERM the child's process group, SIGKILL it after the timeout.

        When the child itself already died (a crash, the OOM killer), what it left in its
        group still gets SIGTERM and up to `group_grace_s` (default `timeout_s`) to finish
        before SIGKILL: the proxy's stream worker ignores SIGTERM and, once its parent is
        gone, sends or spills the records it holds (replay/sink_process.py); killed at once,
        it lost them.

        Returns the exit code, or None (and `stuck` is set) when the process is still
        there `kill_wait_s` after SIGKILL (uninterruptible sleep: a hung disk or NFS
        mount): logged and said with its PID, never raised, so that the caller goes on
        stopping its other children."""
        if self.proc.poll() is not None:
            self._drain_group(timeout_s if group_grace_s is None else group_grace_s)
        else:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("child_kill", child=self.name, pid=self.pid)
                _signal_group(self.proc.pid, signal.SIGKILL)
                try:
                    self.proc.wait(timeout=kill_wait_s)
                except subprocess.TimeoutExpired:
                    self.stuck = True
                    log.error("child_stuck", child=self.name, pid=self.pid)
                    say(
                        f"olp: {self.name} (pid {self.pid}) is still running {kill_wait_s:.0f} s "
                        "after SIGKILL (uninterruptible sleep?); see `ps -o pid,stat,wchan,cmd "
                        f"-p {self.pid}`"
                    )
        # vLLM's engine core runs as a grandchild in the same group: make sure it is gone.
        _signal_group(self.proc.pid, signal.SIGKILL)
        if self._guard is not None:
            self._guard.terminate()
            try:
                self._guard.wait(timeout=10)
            except subprocess.TimeoutExpired:  # hung as well: not worth failing the stop for
                log.warning("child_guard_stuck", child=self.name, pid=self._guard.pid)
        self._reader.join(timeout=2)
        if self.stuck:
            return None
        log.info("child_stopped", child=self.name, pid=self.pid, returncode=self.proc.returncode)
        return self.proc.returncode


def _close_quietly(sink: TextIO) -> None:
    """Close a log file whose last write may have failed (its buffer cannot be flushed)."""
    with contextlib.suppress(OSError):
        sink.close()


def _start_guard(
    child: int, grace_s: float | None = None, group_grace_s: float | None = None
) -> subprocess.Popen[bytes] | None:
    """Start the child's guard: it stops the child's group should olp die without stopping
    it. None (and a warning) when it cannot start: the child runs unguarded, as before."""
    argv = [sys.executable, "-I", "-S", GUARD, str(os.getpid()), str(child)]
    if grace_s is not None:
        argv += [f"{grace_s:g}", f"{group_grace_s or 0.0:g}"]
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is olp's to handle, as for children
        )
    except OSError as exc:
        log.warning("child_guard_not_started", pid=child, error=str(exc))
        return None


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, sig)


def _group_running(pgid: int) -> bool:
    """Some process of the group still runs. Zombies do not count: an orphan waits for
    init to reap it, and one that nobody reaps (a container without an init) never ends."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        entries = os.listdir("/proc")
    except OSError:  # no procfs: the signal test above is all there is
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        # After the command name: state, parent PID, process group (proc(5)).
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def wait_until(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    child: ChildProcess | None = None,
    interval_s: float = 0.5,
    progress: Callable[[float], None] | None = None,
    what: str = "service",
    stop: threading.Event | None = None,
) -> None:
    """Poll `check` until true; fail early with the child's own output if it died, and
    raise StopRequested as soon as `stop` is set (a vLLM warm-up can take minutes)."""
    started = time.monotonic()
    last_progress = started
    while True:
        if stop is not None and stop.is_set():
            raise StopRequested(f"stopped while waiting for {what}")
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
        if stop is not None:
            stop.wait(interval_s)
        else:
            time.sleep(interval_s)
