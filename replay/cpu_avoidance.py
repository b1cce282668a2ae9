"""Keeps the sink's worker process off the CPU that the proxy's event loop last ran on.

The worker runs at idle priority (SCHED_IDLE), so it fills whatever gaps a CPU has. The
gaps of the event loop's own CPU (while a request waits for upstream) are the worst place
for it: when the loop wakes there again, the worker has pushed the loop's code and objects
out of that core's caches. Measured on 2 vCPUs with bench/bench_capture_cpu.py (training off
and on in alternating quarter-second segments): in segments in which the worker ran, the
loop took up to 13 % more CPU per request than in its quiet neighbours with the worker placed
anywhere (10-13 % with it pinned to the loop's CPU), and up to 10 % with it kept off that
CPU as this class does; the estimated CPU cost of capture came out 0.2-7 points lower in
every row of two runs (docs/perf/capture_cpu.md).

Only the worker is moved, never the proxy: a pinned event loop could not escape a CPU that
something else keeps busy. The loop's CPU is read from /proc on each feeder tick (Linux
only; elsewhere, or with a single CPU allowed, nothing is done).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)


class CpuAvoidance:
    """Keeps every thread of a process on the allowed CPUs but the one `thread_id` (a thread
    of this process, by its native id) last ran on."""

    def __init__(self, thread_id: int) -> None:
        self._stat = Path(f"/proc/self/task/{thread_id}/stat")
        get_affinity = getattr(os, "sched_getaffinity", None)
        self._allowed: frozenset[int] = frozenset(get_affinity(0)) if get_affinity else frozenset()
        self.enabled = len(self._allowed) >= 2 and hasattr(os, "sched_setaffinity")
        self._placed: tuple[int, int] | None = None  # (pid, cpu avoided) last applied

    def loop_cpu(self) -> int:
        """The CPU the thread last ran on (field 39 of its /proc stat line)."""
        raw = self._stat.read_text()
        return int(raw[raw.rindex(")") + 2 :].split()[36])

    def place(self, pid: int) -> None:
        """Move `pid`'s threads off the loop's CPU if the loop moved (or `pid` is new).

        A thread the worker starts later inherits its creator's CPUs; a worker that is gone
        is skipped. Any other failure (no /proc, a container that forbids it) turns this off
        for good, with one warning: the feeder that calls this must not stop over a
        placement."""
        if not self.enabled:
            return
        try:
            cpu = self.loop_cpu()
            if (pid, cpu) == self._placed or cpu not in self._allowed:
                return
            cpus = self._allowed - {cpu}
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except FileNotFoundError:
                return  # the worker died: the feeder starts another, placed on a later tick
            for tid in tids:
                with contextlib.suppress(ProcessLookupError):  # a thread that ended since
                    os.sched_setaffinity(int(tid), cpus)
        except Exception as exc:  # the feeder that calls this must go on feeding whatever
            self.enabled = False
            log.warning("sink_cpu_avoidance_off", error=repr(exc))
            return
        self._placed = (pid, cpu)
