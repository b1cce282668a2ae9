"""Run the real `olp up` / `olp policy` / `olp broker` with every child replaced by `sleep`.

Used by test_supervision.py as a subprocess: `python _sup_harness.py MODE STATE_DIR`.
Every child's PID is recorded as the empty file STATE_DIR/pids/<PID> as soon as it starts
(a name appears at once, a line can be read half-written), so the test can check (and,
when olp fails to, stop) each one by PID.

Modes: up-ready (every component ready at once), up-warming (vLLM never becomes ready),
policy-warming, broker-warming (the standalone launchers, stuck in start-up).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import deploy.broker
import deploy.policy
import deploy.procs
import deploy.runtime
import deploy.supervisor
from deploy.cli import main
from deploy.ports import free_port

MODE, STATE = sys.argv[1], Path(sys.argv[2])
PIDS = STATE / "pids"


class SleepChild(deploy.procs.ChildProcess):
    """A child that starts like the real one and then does nothing; its PID is recorded."""

    def __init__(self, name: str, argv: list[str], **kwargs: object) -> None:
        super().__init__(name, ["sleep", "1000"], **kwargs)  # type: ignore[arg-type]
        PIDS.mkdir(exist_ok=True)
        (PIDS / str(self.pid)).touch()


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
    os.environ.update(
        {
            "OLP_STATE_DIR": str(STATE),
            "OLP_LOG_FORMAT": "json",
            "OLP_POLICY__STARTUP_TIMEOUT_S": "120",
            "OLP_POLICY__PORT": str(free_port()),
            "OLP_PROXY__PORT": str(free_port()),
            "OLP_STREAM__BOOTSTRAP_SERVERS": f"127.0.0.1:{free_port()}",
        }
    )
    _fake_children(vllm_ready=MODE == "up-ready")
    command = MODE.split("-")[0]
    print(f"harness pid {os.getpid()}", file=sys.stderr, flush=True)
    # With the output in a closed pipe, exit.txt is the only trace of how olp ended.
    try:
        main([command])
    except SystemExit as exc:
        (STATE / "exit.txt").write_text(f"olp exited with {exc.code!r}\n")
        raise
    except BaseException:
        (STATE / "exit.txt").write_text(traceback.format_exc())
        raise
