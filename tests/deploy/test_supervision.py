"""Signals and broken pipes never orphan the children of `olp up`, `olp policy`, `olp broker`.

The real supervisor runs in a subprocess (tests/deploy/_sup_harness.py) with `sleep` in
place of the broker, vLLM, the proxy and the learner; no vLLM or Kafka is needed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deploy.procs import GUARD

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("_sup_harness.py")


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan may wait a while to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _is_our_sleep(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep\0")
    except FileNotFoundError:
        return False


def _wait_for(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


class Harness:
    def __init__(self, mode: str, state: Path, *, merge_output_into_pipe: bool = False):
        self.state = state
        state.mkdir(parents=True)
        out = subprocess.PIPE if merge_output_into_pipe else (state / "out.txt").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(HARNESS), mode, str(state)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def pids(self) -> list[int]:
        path = self.state / "pids"
        return sorted(int(p.name) for p in path.iterdir()) if path.exists() else []

    def wait_children(self, count: int, timeout_s: float = 90) -> list[int]:
        assert _wait_for(lambda: len(self.pids()) >= count, timeout_s), self.output()
        return self.pids()

    def output(self) -> str:
        """What olp printed (when not sent into a pipe) and how it ended."""
        return "\n".join(
            path.read_text()
            for path in (self.state / "out.txt", self.state / "exit.txt")
            if path.exists()
        )

    def cleanup(self) -> None:
        """Stop what olp failed to stop, by PID: the harness, then each recorded child."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid in self.pids():
            if _is_our_sleep(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)  # each child leads its own group


@pytest.fixture
def harness(tmp_path: Path) -> Iterator[Callable[..., Harness]]:
    started: list[Harness] = []

    def start(mode: str, **kwargs: bool) -> Harness:
        started.append(Harness(mode, tmp_path / f"h{len(started)}", **kwargs))
        return started[-1]

    yield start
    for h in started:
        h.cleanup()


def _assert_all_stopped(h: Harness, children: list[int], timeout_s: float = 30) -> None:
    exited = _wait_for(lambda: h.proc.poll() is not None, timeout_s)
    orphans = [pid for pid in children if _running(pid)]
    assert exited, f"olp still running {timeout_s} s after the signal:\n{h.output()}"
    assert not orphans, f"children left running: {orphans}\n{h.output()}"


def _read_until(h: Harness, marker: bytes, timeout_s: float = 90) -> bytes:
    assert h.proc.stdout is not None
    os.set_blocking(h.proc.stdout.fileno(), False)
    seen = b""
    deadline = time.monotonic() + timeout_s
    while marker not in seen and time.monotonic() < deadline:
        seen += h.proc.stdout.read() or b""
        time.sleep(0.05)
    assert marker in seen, seen.decode(errors="replace")
    return seen


def test_ctrl_c_with_a_dead_output_pipe_still_stops_every_child(harness) -> None:
    # `olp up 2>&1 | tee log`, then Ctrl-C: tee dies too, and writing "stopping" fails.
    h = harness("up-ready", merge_output_into_pipe=True)
    _read_until(h, b"olp is up")
    children = h.wait_children(4)
    assert h.proc.stdout is not None
    h.proc.stdout.close()
    h.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(h, children)
    assert h.proc.returncode == 0, h.output()


def test_ctrl_c_during_vllm_warm_up_stops_at_once_even_with_a_dead_pipe(harness) -> None:
    h = harness("up-warming", merge_output_into_pipe=True)
    _read_until(h, b"starting vLLM policy server")
    children = h.wait_children(2)  # broker, vLLM (never ready: startup_timeout_s is 120)
    assert h.proc.stdout is not None
    h.proc.stdout.close()
    h.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(h, children)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_during_start_up_stop_every_child(harness, sig) -> None:
    h = harness("up-warming")
    children = h.wait_children(2)
    h.proc.send_signal(sig)
    _assert_all_stopped(h, children)
    assert h.proc.returncode == 0, h.output()
    assert "start-up interrupted" in h.output()


def test_closing_the_terminal_stops_a_running_stack(harness) -> None:
    h = harness("up-ready")
    children = h.wait_children(4)
    assert _wait_for(lambda: "olp is up" in h.output(), 30), h.output()
    h.proc.send_signal(signal.SIGHUP)
    _assert_all_stopped(h, children)
    assert h.proc.returncode == 0, h.output()


@pytest.mark.parametrize("mode", ["policy-warming", "broker-warming"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_launchers_stop_their_child_on_a_signal_during_start_up(harness, mode, sig) -> None:
    h = harness(mode)
    children = h.wait_children(1)
    h.proc.send_signal(sig)
    _assert_all_stopped(h, children)
    assert h.proc.returncode == 0, h.output()
    assert "Traceback" not in h.output()
    # The server's output goes to a file, as under `olp up` (it was dropped, errors too).
    log = h.state / "logs" / ("policy.log" if mode.startswith("policy") else "broker.log")
    assert log.exists() and f"output goes to {log}" in h.output(), h.output()


@pytest.mark.parametrize("mode", ["up-ready", "up-warming"])
def test_a_killed_olp_leaves_no_child_running(harness, mode) -> None:
    """SIGKILL (or the OOM killer) gives olp no chance to stop anything: each child's guard
    (deploy/child_guard.py) notices within a second and stops the child's group."""
    h = harness(mode)
    children = h.wait_children(4 if mode == "up-ready" else 2)
    guards = _guards_of(children)
    assert len(guards) == len(children), (children, guards)
    h.proc.kill()
    watched = children + guards
    assert _wait_for(lambda: not any(_running(pid) for pid in watched), 15), [
        pid for pid in watched if _running(pid)
    ]


def test_a_guard_ends_with_its_child_and_leaves_a_live_parent_alone(tmp_path: Path) -> None:
    from deploy.procs import ChildProcess

    # Long enough that the guard is still there to be found on a loaded machine.
    child = ChildProcess("short", ["sleep", "2"], log_file=tmp_path / "short.log")
    guard = child._guard
    assert guard is not None and _guards_of([child.pid]) == [guard.pid]
    assert _wait_for(lambda: guard.poll() is not None, 10)  # the child exited; so did it
    assert guard.returncode == 0 and child.poll() == 0
    child.stop()
    long = ChildProcess("long", ["sleep", "600"], log_file=tmp_path / "long.log")
    time.sleep(2.5)  # two of the guard's checks: a live parent is left alone
    assert long.alive() and long._guard is not None and long._guard.poll() is None
    long.stop(timeout_s=5)
    assert long._guard.poll() is not None and not _running(long.pid)


def test_a_guard_gives_what_the_child_left_in_its_group_its_grace(tmp_path: Path) -> None:
    """olp killed: the guard gave each child a fixed 10 s and SIGKILLed the group as soon as
    the child was gone, so the proxy's stream worker, still saving its records after the
    proxy exited, was killed. Here the group's worker needs 3 s after SIGTERM."""
    done, ready = tmp_path / "worker-saved", tmp_path / "worker-ready"
    worker = (
        f'trap "sleep 3; touch {done}; exit 0" TERM; touch {ready}; while :; do sleep 0.1; done'
    )
    leader = f"bash -c '{worker}' & trap 'exit 0' TERM; while :; do sleep 0.1; done"
    parent = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen(["bash", "-c", {leader!r}], start_new_session=True)
        guard = subprocess.Popen(
            [sys.executable, "-I", "-S", {GUARD!r}, str(os.getpid()), str(child.pid), "5", "10"],
            start_new_session=True,
        )
        print(child.pid, guard.pid, flush=True)
        time.sleep(600)
        """
    )
    fake_olp = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    assert fake_olp.stdout is not None
    child, guard = map(int, fake_olp.stdout.readline().split())
    assert _wait_for(ready.exists, 20)  # the worker is up, its trap set
    fake_olp.kill()  # as SIGKILL or the OOM killer would
    fake_olp.wait()
    assert _wait_for(lambda: not _running(guard), 20)
    assert done.exists(), "the worker was killed before it saved"
    assert not _running(child)


def _guards_of(children: list[int]) -> list[int]:
    """The running child guards (deploy/child_guard.py) watching one of `children`."""
    guards = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            argv = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            at = next((i for i, a in enumerate(argv) if a.endswith(b"child_guard.py")), None)
            if (
                at is not None
                and int(argv[at + 2]) in children  # ... child_guard.py PARENT CHILD [GRACES]
                and _running(int(entry.name))
            ):
                guards.append(int(entry.name))
    return guards


def _starts(h: Harness, name: str) -> list[int]:
    """The PIDs `name` ran as, in start order (see _sup_harness.py)."""
    path = h.state / "starts"
    found = [p for p in path.iterdir() if p.name.startswith(f"{name}-")] if path.exists() else []
    return [int(p.name.rsplit("-", 1)[1]) for p in sorted(found, key=lambda p: p.stat().st_mtime)]


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("up-config-error", "exit code 2 is a configuration error"),
        ("up-refused", "exit code 3: it refuses its state dir"),
    ],
)
def test_a_child_exiting_with_a_configuration_or_state_error_is_never_restarted(
    harness, mode: str, reason: str
) -> None:
    """`on_child_exit: restart`, `max_restarts: 5`: a learner that exits with 2 (config)
    or 3 (refused state dir) would fail the same way each time; the stack stops at once."""
    h = harness(mode)
    assert _wait_for(lambda: h.proc.poll() is not None, 60), h.output()
    out = h.output()
    assert h.proc.returncode == 1, out
    assert f"olp: not restarting learner: {reason}" in out, out
    assert "stopping the stack" in out and "restarting learner (" not in out, out
    assert len(_starts(h, "learner")) == 1, out
    assert not [pid for pid in h.pids() if _running(pid)], out


def test_a_child_failing_the_same_way_right_after_its_restart_is_not_restarted_again(
    harness,
) -> None:
    """Exit code 1 may be a passing crash: restarted once; failing again the same way
    within seconds of that restart is a crash loop, and the stack stops (max_restarts 5)."""
    h = harness("up-crash-loop")
    assert _wait_for(lambda: h.proc.poll() is not None, 60), h.output()
    out = h.output()
    assert h.proc.returncode == 1, out
    assert out.count("olp: restarting learner (") == 1, out
    assert "olp: not restarting learner: it failed the same way (exit code 1)" in out, out
    assert len(_starts(h, "learner")) == 2, out
    assert not [pid for pid in h.pids() if _running(pid)], out


def test_a_dead_vllm_is_started_again_with_on_child_exit_restart(harness) -> None:
    """vLLM was never restarted: one crash (the OOM killer, say) stopped the whole stack.
    Now it is started again like the proxy and the learner; the learner puts the serving
    adapter back once it answers (learner/reload.py)."""
    h = harness("up-restart")
    children = h.wait_children(4)
    assert _wait_for(lambda: "olp is up" in h.output(), 30), h.output()
    starts = h.state / "starts"
    (first,) = [int(p.name.split("-")[1]) for p in starts.glob("vllm-*")]
    os.kill(first, signal.SIGKILL)
    assert _wait_for(lambda: len(list(starts.glob("vllm-*"))) == 2, 30), h.output()
    assert "olp: restarting policy (1/5)" in h.output()
    assert _wait_for(lambda: not _running(first), 10)
    children = h.wait_children(5)
    h.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(h, children)
    assert h.proc.returncode == 0, h.output()


def test_a_stop_while_a_dead_childs_group_drains_exits_1(harness) -> None:
    """`on_child_exit: restart`: a stop that came while the dead learner's process group
    drained (before its restart) ended `olp up` with 0, as a plain stop; a child died and
    was not started again, which the docs give exit 1 for."""
    h = harness("up-crash-drain")
    children = h.wait_children(4)
    assert _wait_for(lambda: "waiting up to" in h.output(), 30), h.output()
    h.proc.send_signal(signal.SIGTERM)
    _assert_all_stopped(h, h.pids())
    out = h.output()
    assert h.proc.returncode == 1, out
    assert "olp: restarting learner" not in out and "Traceback" not in out, out
    assert len(children) >= 4


def test_a_child_outliving_sigkill_is_named_and_the_others_still_stop(harness) -> None:
    """A child in uninterruptible sleep survives SIGKILL: `olp up` names its PID, stops
    the other children and exits 1, without a traceback."""
    h = harness("up-stuck-child")
    children = h.wait_children(4)
    assert _wait_for(lambda: "olp is up" in h.output(), 30), h.output()
    (learner,) = _starts(h, "learner")
    h.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(h, children)
    out = h.output()
    assert h.proc.returncode == 1, out
    assert "Traceback" not in out, out
    assert f"olp: learner (pid {learner}) is still running" in out, out
    assert f"olp: stopped, except learner (pid {learner}): still running" in out, out


def test_stop_reports_a_process_outliving_sigkill_instead_of_raising(tmp_path: Path) -> None:
    import subprocess

    from structlog.testing import capture_logs

    from deploy.procs import ChildProcess

    child = ChildProcess("stuck", ["sleep", "600"], log_file=tmp_path / "stuck.log")
    real_wait = child.proc.wait

    def never_ends(timeout: float | None = None) -> int:
        raise subprocess.TimeoutExpired(child.argv, timeout or 0)

    child.proc.wait = never_ends  # type: ignore[method-assign]
    try:
        with capture_logs() as logs:
            assert child.stop(timeout_s=0.1) is None
        assert child.stuck
        assert {
            "event": "child_stuck",
            "child": "stuck",
            "pid": child.pid,
            "log_level": "error",
        } in logs
    finally:
        child.proc.wait = real_wait  # type: ignore[method-assign]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        real_wait(timeout=10)


def test_the_learner_keeps_its_stream_id_across_restarts_and_a_new_run_gets_another(
    harness,
) -> None:
    """The embedded broker keeps its data in memory: a learner restarted within one run
    resumes its offsets (same stream id), one started by the next `olp up` must not (a new
    id; learner/service.py drops offsets saved under another)."""
    h = harness("up-restart")
    children = h.wait_children(4)
    assert _wait_for(lambda: "olp is up" in h.output(), 30), h.output()
    starts = h.state / "starts"
    (first,) = [int(p.name.split("-")[1]) for p in starts.glob("learner-*")]
    (h.state / "olp.yaml").write_text("stream: {topic_prefix: edited}\n")  # for the next start
    os.kill(first, signal.SIGKILL)
    assert _wait_for(lambda: len(list(starts.glob("learner-*"))) == 2, 30), h.output()
    # Every child, the restarted learner too, read the file as this run loaded it: an edit
    # since (for the next start) ran a restarted child on another config than the others.
    pinned = h.state / "run" / "config.yaml"
    olp_children = [
        p for p in (h.state / "configs").iterdir() if p.name.split("-")[0] in ("proxy", "learner")
    ]
    assert sorted(p.name.split("-")[0] for p in olp_children) == ["learner", "learner", "proxy"]
    read = {p.read_text() for p in olp_children}  # (broker and vLLM read no olp config)
    assert read == {str(pinned)}, read
    assert "edited" not in pinned.read_text() and pinned.stat().st_mode & 0o077 == 0
    ids = {p.read_text() for p in starts.glob("learner-*")}
    assert len(ids) == 1 and next(iter(ids)).startswith("embedded-"), ids
    # The proxy gets it too: its operator page measures no lag in another stream.
    assert {p.read_text() for p in starts.glob("proxy-*")} == ids
    children = h.wait_children(5)
    h.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(h, children)

    second = harness("up-restart")
    assert _wait_for(lambda: "olp is up" in second.output(), 60), second.output()
    (learner,) = (second.state / "starts").glob("learner-*")
    assert learner.read_text().startswith("embedded-") and learner.read_text() not in ids
    children = second.wait_children(4)
    second.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(second, children)


def test_a_dead_embedded_broker_leaves_the_stack_serving(harness) -> None:
    """`on_child_exit: restart`: the embedded broker is not restarted (its data was in
    memory), and the stack keeps serving without it: the proxy spills what it records until
    `olp up` runs again (docs/operations.md, "Start and stop"). Before, the stack stopped
    and exited 1 without saying why. A stop then exits 1: a child died on the way."""
    h = harness("up-restart")
    children = h.wait_children(4)
    assert _wait_for(lambda: "olp is up" in h.output(), 30), h.output()
    (broker,) = _starts(h, "broker")
    os.kill(broker, signal.SIGKILL)
    assert _wait_for(lambda: "olp: not restarting broker" in h.output(), 30), h.output()
    time.sleep(3)  # several watch rounds: it stays up and says it once
    out = h.output()
    assert h.proc.poll() is None, out
    assert out.count("olp: not restarting broker") == 1, out
    assert "the proxy keeps serving and spills" in out, out
    assert "stopping the stack" not in out, out
    others = [pid for pid in children if pid != broker]
    assert all(_running(pid) for pid in others), out
    h.proc.send_signal(signal.SIGINT)
    _assert_all_stopped(h, children)
    assert h.proc.returncode == 1, h.output()
