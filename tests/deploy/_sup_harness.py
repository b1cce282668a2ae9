"""Run the real `olp up` / `olp policy` / `olp broker` with every child replaced by `sleep`.

Used by test_supervision.py as a subprocess: `python _sup_harness.py MODE STATE_DIR`.
Every child's PID is recorded as the empty file STATE_DIR/pids/<PID> as soon as it starts
(a name appears at once, a line can be read half-written), so the test can check (and,
when olp fails to, stop) each one by PID.

Modes: up-ready (every component ready at once), up-warming (vLLM never becomes ready),
policy-warming, broker-warming (the standalone launchers, stuck in start-up);
up-config-error, up-refused and up-crash-loop (ready, with `on_child_exit: restart`, and a
learner that exits at once with code 2, 3 or 1 every time it starts), up-restart (ready, with
`on_child_exit: restart`, children that run), up-stuck-child (ready, and
the learner outlives SIGKILL, as in uninterruptible sleep), up-crash-drain (ready, with
`on_child_exit: restart`, and a learner that dies after 2 s leaving a process in its group
that ignores SIGTERM, so its group drains for the whole grace before a restart). Each
start of a child whose command is replaced is also recorded as STATE_DIR/starts/<name>-<PID>,
holding the stream id `olp up` gave it (empty where none).
"""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import deploy.broker
import deploy.policy
import deploy.procs
import deploy.runtime
import deploy.supervisor
from deploy.cli import main
from deploy.config import DEFAULT_CONFIG_FILE
from deploy.ports import free_ports

MODE, STATE = sys.argv[1], Path(sys.argv[2])
PIDS = STATE / "pids"
STARTS = STATE / "starts"
LEARNER_EXIT = {"up-config-error": 2, "up-refused": 3, "up-crash-loop": 1}


class SleepChild(deploy.procs.ChildProcess):
    """A child that starts like the real one and then does nothing; its PID is recorded."""

    def __init__(self, name: str, argv: list[str], **kwargs: object) -> None:
        command = ["sleep", "1000"]
        if name == "learner" and MODE in LEARNER_EXIT:
            command = ["sh", "-c", f"echo learner failing; exit {LEARNER_EXIT[MODE]}"]
        if name == "learner" and MODE == "up-crash-drain":
            left = "sh -c 'trap \"\" TERM; while :; do sleep 0.2; done' &"
            command = ["sh", "-c", f"{left} sleep 2; echo learner dying; exit 1"]
        super().__init__(name, command, **kwargs)  # type: ignore[arg-type]
        PIDS.mkdir(exist_ok=True)
        (PIDS / str(self.pid)).touch()
        STARTS.mkdir(exist_ok=True)
        env = kwargs.get("env") or {}
        # What names the stream for a learner (deploy/learner_runner.py), "" where unset.
        stream_id = env.get("OLP_STREAM_ID", "")  # type: ignore[union-attr]
        (STARTS / f"{name}-{self.pid}").write_text(stream_id)
        # The --config it was given, "" where none (STATE_DIR/configs/<name>-<PID>).
        config = argv[argv.index("--config") + 1] if "--config" in argv else ""
        (STATE / "configs").mkdir(exist_ok=True)
        (STATE / "configs" / f"{name}-{self.pid}").write_text(config)
        if name == "learner" and MODE == "up-stuck-child":
            self.proc.wait = _never_ends(self.proc)  # type: ignore[method-assign]


def _never_ends(proc: subprocess.Popen[str]):  # type: ignore[no-untyped-def]
    """A wait() that times out whatever happens: a process SIGKILL does not end."""
    real = proc.wait

    def wait(timeout: float | None = None) -> int:
        if timeout is not None:
            raise subprocess.TimeoutExpired(proc.args, timeout)
        return real()

    return wait


def _fake_children(vllm_ready: bool) -> None:
    for module in (deploy.broker, deploy.policy, deploy.supervisor):
        module.ChildProcess = SleepChild  # type: ignore[attr-defined]
    deploy.broker.broker_binary = lambda: Path("sleep")
    deploy.broker.kafka_answers = lambda *a, **k: MODE != "broker-warming"
    deploy.policy.models_listed = lambda *a, **k: ["base"] if vllm_ready else None
    deploy.supervisor.resolve_model_dir = lambda *a, **k: STATE
    deploy.runtime.resolve_model_dir = lambda *a, **k: STATE
    deploy.supervisor._http_ok = lambda url: True


if __name__ == "__main__":
    STATE.mkdir(parents=True, exist_ok=True)
    policy_port, proxy_port, broker_port = free_ports(3)
    os.environ.update(
        {
            "OLP_STATE_DIR": str(STATE),
            "OLP_LOG_FORMAT": "json",
            "OLP_POLICY__STARTUP_TIMEOUT_S": "120",
            "OLP_POLICY__PORT": str(policy_port),
            "OLP_PROXY__PORT": str(proxy_port),
            "OLP_STREAM__BOOTSTRAP_SERVERS": f"127.0.0.1:{broker_port}",
        }
    )
    restarting = ("up-restart", "up-crash-drain", *LEARNER_EXIT)
    _fake_children(vllm_ready=MODE in ("up-ready", "up-stuck-child", *restarting))
    argv = [MODE.split("-")[0]]
    if MODE in restarting:
        config = STATE / "olp.yaml"
        restart = "\non_child_exit: restart\nmax_restarts: 5\n"
        if MODE == "up-crash-drain":  # a group grace of 2 * 1 + 5 s
            os.environ["OLP_STREAM__CLOSE_TIMEOUT_S"] = "1"
        config.write_text(DEFAULT_CONFIG_FILE.read_text() + restart)
        argv += ["--config", str(config)]
    print(f"harness pid {os.getpid()}", file=sys.stderr, flush=True)
    # With the output in a closed pipe, exit.txt is the only trace of how olp ended.
    try:
        main(argv)
    except SystemExit as exc:
        (STATE / "exit.txt").write_text(f"olp exited with {exc.code!r}\n")
        raise
    except BaseException:
        (STATE / "exit.txt").write_text(traceback.format_exc())
        raise
