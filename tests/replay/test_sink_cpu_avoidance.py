"""The sink's worker process is kept off the CPU the proxy's event loop last ran on.

These tests move the test's own thread between CPUs (after the avoidance read the CPUs the
process may use) and read the worker's affinity back from the kernel. CI has two CPUs; on a
machine that allows one CPU only, the avoidance is off by design and the tests check that
instead."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from proxy.config import ProxyConfig
from proxy.server import make_sink
from replay.config import StreamConfig
from replay.cpu_avoidance import CpuAvoidance
from replay.sink_process import KafkaSinkProcess
from replay.synthetic import make_trajectory

ALLOWED = frozenset(os.sched_getaffinity(0))


@contextlib.contextmanager
def _this_thread_on(cpu: int) -> Iterator[None]:
    """Pin the calling thread to `cpu` (the kernel moves it there before the call returns)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _threads_affinity(pid: int) -> set[frozenset[int]]:
    """The CPU sets of every thread of `pid`."""
    return {frozenset(os.sched_getaffinity(int(tid))) for tid in os.listdir(f"/proc/{pid}/task")}


def _wait_for_affinity(pid: int, expected: frozenset[int], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _threads_affinity(pid) != {expected}:
        assert time.monotonic() < deadline, (_threads_affinity(pid), expected)
        time.sleep(0.05)


def _check_worker_kept_off(sink: KafkaSinkProcess, cpu: int) -> None:
    """Move this thread (the sink's loop thread) to `cpu`, send a record, and wait for the
    sink's worker to run on the other allowed CPUs only; then close the sink."""
    with _this_thread_on(cpu):
        try:
            sink.put_trajectory(make_trajectory())
            assert sink.wait_idle(60)
            expected = ALLOWED - {cpu} if len(ALLOWED) >= 2 else ALLOWED
            _wait_for_affinity(sink._proc.pid, frozenset(expected))
        finally:
            sink.close()


def test_a_process_is_moved_off_the_cpu_the_thread_runs_on_and_follows_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        avoidance = CpuAvoidance(threading.get_native_id())
        if len(ALLOWED) < 2:
            assert not avoidance.enabled
            avoidance.place(child.pid)
            assert _threads_affinity(child.pid) == {ALLOWED}
            return
        first, second = sorted(ALLOWED)[:2]
        with _this_thread_on(first):
            assert avoidance.loop_cpu() == first
            avoidance.place(child.pid)
            assert _threads_affinity(child.pid) == {ALLOWED - {first}}
        with _this_thread_on(second):
            avoidance.place(child.pid)  # the loop moved: so does the process
            assert _threads_affinity(child.pid) == {ALLOWED - {second}}
    finally:
        child.kill()
        child.wait()


def test_a_process_that_is_gone_is_skipped_and_its_successor_placed() -> None:
    """A worker that died between two feeder ticks: the next one is placed as usual."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    avoidance = CpuAvoidance(threading.get_native_id())
    avoidance.place(gone.pid)
    assert avoidance.enabled == (len(ALLOWED) >= 2)
    successor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cpu = min(ALLOWED)
        with _this_thread_on(cpu):
            avoidance.place(successor.pid)
            expected = ALLOWED - {cpu} if len(ALLOWED) >= 2 else ALLOWED
            assert _threads_affinity(successor.pid) == {expected}
    finally:
        successor.kill()
        successor.wait()


def test_a_loop_thread_it_cannot_read_turns_the_avoidance_off_without_raising() -> None:
    avoidance = CpuAvoidance(2**22 + 7)  # no such thread in this process
    avoidance.place(os.getpid())  # logged, not raised: the feeder calling it goes on
    assert not avoidance.enabled


def test_the_sink_keeps_its_worker_off_the_loop_threads_cpu(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    sink = KafkaSinkProcess(stream_config, tmp_path, loop_thread_id=threading.get_native_id())
    _check_worker_kept_off(sink, min(ALLOWED))


def test_the_avoidance_can_be_turned_off(stream_config: StreamConfig, tmp_path: Path) -> None:
    config = stream_config.model_copy(update={"sink_avoids_loop_cpu": False})
    sink = KafkaSinkProcess(config, tmp_path, loop_thread_id=threading.get_native_id())
    with _this_thread_on(min(ALLOWED)):
        try:
            sink.put_trajectory(make_trajectory())
            assert sink.wait_idle(60)
            time.sleep(0.3)  # several feeder ticks
            assert _threads_affinity(sink._proc.pid) == {ALLOWED}
        finally:
            sink.close()


def test_the_proxys_kafka_sink_avoids_its_event_loops_cpu(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """`make_sink` runs on the event loop's thread (serve_proxy) and names that thread."""

    async def build() -> KafkaSinkProcess:
        return make_sink(ProxyConfig(sink="kafka"), stream_config, tmp_path)

    _check_worker_kept_off(asyncio.run(build()), max(ALLOWED))
