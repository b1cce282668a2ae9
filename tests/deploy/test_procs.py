"""ChildProcess (deploy/procs.py): what it does when the child's log cannot be written, and
how it stops a process group whose leader already died."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from structlog.testing import capture_logs

from deploy.procs import ChildProcess, _group_running

# 200 lines of 1 kB, more than a pipe holds (64 KiB): the child needs its output read.
_CHATTY = "for i in range(200): print('x' * 1000, flush=True)\nprint('DONE', flush=True)"


def test_a_log_file_that_cannot_be_written_does_not_freeze_the_child(capsys) -> None:
    """Before, the first failed write (disk full) ended the thread reading the child's
    output: nothing drained the pipe, the child blocked on its next write once 64 KiB were
    buffered and stayed alive, and `olp up` never noticed. Now the output is still read
    (its last lines kept for error messages), the file is left alone, and it is said once."""
    with capture_logs() as logs:
        child = ChildProcess("chatty", [sys.executable, "-c", _CHATTY], log_file=Path("/dev/full"))
        try:
            deadline = time.monotonic() + 20
            while child.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert child.poll() == 0, "the child is blocked writing its output"
        finally:
            child.stop(timeout_s=2)
    assert child.tail(1) == "DONE"
    said = capsys.readouterr().err
    assert said.count("olp: cannot write chatty's log /dev/full") == 1, said
    assert [e["event"] for e in logs].count("child_log_write_failed") == 1, logs


def test_a_log_file_that_cannot_be_opened_does_not_freeze_the_child(tmp_path: Path) -> None:
    """The same when the log cannot even be opened (here: a directory stands in its way)."""
    log_file = tmp_path / "chatty.log"
    log_file.mkdir()
    child = ChildProcess("chatty", [sys.executable, "-c", _CHATTY], log_file=log_file)
    try:
        deadline = time.monotonic() + 20
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.poll() == 0, "the child is blocked writing its output"
    finally:
        child.stop(timeout_s=2)
    assert child.tail(1) == "DONE"


# A leader with a worker in its group that ignores SIGTERM and, once the leader is gone
# (its pipe's end), needs SAVE_S to save what it holds, then writes the marker file: the
# proxy and its stream worker (replay/sink_process.py) in small.
_LEADER = r"""
import os, signal, sys, time
marker, save_s = sys.argv[1], float(sys.argv[2])
r, w = os.pipe()
# Ignored before the fork (the worker inherits it): set in the worker, a SIGTERM that came
# right after "up" could find it not yet set.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.close(w)
    os.read(r, 1)
    time.sleep(save_s)
    open(marker, "w").write("saved")
    os._exit(0)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
os.close(r)
print("up", flush=True)
time.sleep(1000)
"""


def _crashed_leader(tmp_path: Path, save_s: float) -> tuple[ChildProcess, Path]:
    marker = tmp_path / "saved"
    child = ChildProcess("proxy", [sys.executable, "-c", _LEADER, str(marker), str(save_s)])
    deadline = time.monotonic() + 20
    while child.tail(1) != "up" and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)  # the proxy crashes; its worker starts saving
    while child.alive():
        time.sleep(0.05)
    return child, marker


def test_a_crashed_childs_group_gets_its_grace_before_sigkill(tmp_path: Path) -> None:
    """Before, stop() on a child that had died already SIGKILLed its group at once: the
    worker saving its records was killed part-way and accepted records were lost. Now the
    group gets SIGTERM and up to group_grace_s to empty before SIGKILL."""
    child, marker = _crashed_leader(tmp_path, save_s=2)
    started = time.monotonic()
    child.stop(timeout_s=1, group_grace_s=20)
    assert marker.exists(), "the worker was killed before it saved what it held"
    assert time.monotonic() - started < 15  # it returns once the group is empty


def test_a_crashed_childs_group_is_killed_after_its_grace(tmp_path: Path) -> None:
    """The wait is bounded: a worker that does not finish within the grace is SIGKILLed."""
    child, marker = _crashed_leader(tmp_path, save_s=600)
    started = time.monotonic()
    child.stop(timeout_s=1, group_grace_s=1)
    assert time.monotonic() - started < 10
    deadline = time.monotonic() + 10
    while _group_running(child.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group_running(child.pid)
    assert not marker.exists()


def test_olp_up_gives_a_crashed_proxys_stream_worker_its_grace(tmp_path, monkeypatch) -> None:
    """The same through `olp up`'s Stack: the proxy dies, the stack stops, the worker still
    finishes saving (the grace comes from stream.close_timeout_s)."""
    from deploy.config import load_config
    from deploy.supervisor import Component, Stack

    monkeypatch.setenv("OLP_STATE_DIR", str(tmp_path / "state"))
    stack = Stack(load_config(), None, with_learner=False)
    child, marker = _crashed_leader(tmp_path, save_s=2)
    stack.components.append(Component("proxy", lambda: child, "proxy", child=child))
    assert stack.watch(poll_s=0.05) == 1
    assert stack.stop() == []
    assert marker.exists(), "the worker was killed before it saved what it held"
    assert stack.group_grace_s > stack.cfg.stream.close_timeout_s


def test_olp_up_gives_the_proxy_its_drain_and_its_sinks_close(tmp_path, monkeypatch) -> None:
    """`olp up` killed the proxy at 30 s, while it still drained a long stream (aiohttp's
    60 s) and before its sink closed: the request and the sink's memory were lost."""
    from deploy.config import load_config
    from deploy.supervisor import Component, Stack

    monkeypatch.setenv("OLP_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("OLP_PROXY__DRAIN_S", "40")
    monkeypatch.setenv("OLP_STREAM__CLOSE_TIMEOUT_S", "20")
    stack = Stack(load_config(), None, with_learner=False)
    proxy = Component("proxy", lambda: None, "proxy")  # type: ignore[arg-type, return-value]
    broker = Component("broker", lambda: None, "broker")  # type: ignore[arg-type, return-value]
    assert stack._stop_timeout_s(proxy.name) == 40 + 20 + 10
    assert stack._stop_timeout_s(broker.name) == 30


def test_a_stop_while_a_dead_childs_group_drains_starts_no_new_child(tmp_path, monkeypatch) -> None:
    """`on_child_exit: restart` drains a dead child's group (up to group_grace_s) before
    the new child starts: a Ctrl-C in that wait still started one."""
    import threading

    from deploy.config import load_config
    from deploy.supervisor import Component, Stack

    monkeypatch.setenv("OLP_STATE_DIR", str(tmp_path / "state"))
    stack = Stack(
        load_config().model_copy(update={"on_child_exit": "restart"}), None, with_learner=False
    )
    starts: list[ChildProcess] = []

    def start() -> ChildProcess:
        if not starts:
            child, _ = _crashed_leader(tmp_path, save_s=3.0)  # its worker saves for 3 s
        else:
            child = ChildProcess("learner", [sys.executable, "-c", "import time; time.sleep(60)"])
        starts.append(child)
        return child

    comp = Component("learner", start, "learner")
    comp.child = start()
    stack.components.append(comp)
    threading.Timer(1.0, stack.stop_requested.set).start()  # Ctrl-C while it drains
    assert stack.watch(poll_s=0.2) == 1  # a child died and was not started again
    assert len(starts) == 1, "a new child was started after the stop"
    stack.stop()


def test_an_ignored_sighup_stays_ignored_under_nohup() -> None:
    """`nohup olp up &` ignores SIGHUP so that the stack outlives the terminal; the stop
    handler put in its place stopped every child when the SSH session dropped."""
    import threading

    from deploy.procs import install_stop_handlers

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # what nohup does
        stop = threading.Event()
        install_stop_handlers(stop)
        os.kill(os.getpid(), signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN and not stop.is_set()
        os.kill(os.getpid(), signal.SIGTERM)  # still stops it
        assert stop.wait(5)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a terminal's: a closed one stops it
        again = threading.Event()
        install_stop_handlers(again)
        os.kill(os.getpid(), signal.SIGHUP)
        assert again.wait(5)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_the_tail_of_a_child_that_exited_holds_its_last_words() -> None:
    """A child that printed why and exited at once (the broker binary refused by the
    loader) was reported with an empty "last output" 3 times in 10: its reader thread had
    not yet read what it wrote. Read many times, not one miss."""
    for _ in range(20):
        child = ChildProcess("brief", ["sh", "-c", "echo refused by the loader; exit 1"])
        try:
            deadline = time.monotonic() + 10
            while child.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            assert child.tail(1) == "refused by the loader"
        finally:
            child.stop(timeout_s=2)
