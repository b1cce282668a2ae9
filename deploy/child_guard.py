"""Stops a child's process group when the olp process that started it dies without stopping it.

`ChildProcess` runs this file as `python -I -S child_guard.py PARENT_PID CHILD_PID
[GRACE_S [GROUP_GRACE_S]]`, in a session of its own (a process cannot join the child's
group, which is in another session). While the parent lives, the guard checks once a second
and costs nothing else; when the parent is gone (SIGKILL, the OOM killer, a crash), the
guard's parent PID changes, and it stops the child's group the way `ChildProcess.stop()`
would: SIGTERM, up to GRACE_S for the child, then up to GROUP_GRACE_S for what it left in
its group (the proxy's stream worker saving its records), SIGKILL. With a fixed 10 s, a
proxy still draining its requests (35 s by default) and a worker still saving were killed.
It exits on its own once the child has exited, and on SIGTERM (`stop()` sends it).

Why a process and not PR_SET_PDEATHSIG: setting that needs code between fork and exec
(`preexec_fn`, unsafe in a process with threads), and it fires when the *thread* that
started the child exits, which need not be when olp does.

Standard library only, and run with `-I -S`: it must start in milliseconds and import
nothing of the project's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

POLL_S = 1.0
GRACE_S = 10.0  # without GRACE_S on the command line: a child's time to stop after SIGTERM


def identity(pid: int) -> str | None:
    """The process's start time (in clock ticks since boot) while it runs, None once it
    exited (a zombie counts as exited). A PID can be reused; PID and start time together
    name one process."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):  # ProcessLookupError too: read just as it was reaped
        return None
    if len(fields) < 20 or fields[0] == "Z":
        return None
    return fields[19]  # field 22 of proc(5), counted after the command name


def running(pid: int, started: str | None = None) -> bool:
    """`pid` runs, and is the process that started at `started` when given."""
    now = identity(pid)
    return now is not None and (started is None or now == started)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is already gone
        os.killpg(group, signum)


def stop_group(
    group: int, started: str, grace_s: float = GRACE_S, group_grace_s: float = 0.0
) -> None:
    """SIGTERM the group, wait up to `grace_s` for its leader, then up to `group_grace_s`
    for the rest of the group once the leader is gone, then SIGKILL the group (vLLM's
    engine core, a grandchild, is in it too). The SIGKILL is sent whatever went before (an
    error in a wait let processes that ignore SIGTERM live on)."""
    try:
        _signal(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while running(group, started) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not running(group, started):
            deadline = time.monotonic() + group_grace_s
            while _group_alive(group) and time.monotonic() < deadline:
                time.sleep(0.1)
    finally:
        _signal(group, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, child = int(argv[1]), int(argv[2])
    grace_s = float(argv[3]) if len(argv) > 3 else GRACE_S
    group_grace_s = float(argv[4]) if len(argv) > 4 else 0.0
    started = identity(child)
    while started is not None and running(child, started):
        if os.getppid() != parent:
            stop_group(child, started, grace_s, group_grace_s)
            return 0
        time.sleep(POLL_S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
