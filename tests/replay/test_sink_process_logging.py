"""What the sink's worker process writes to the proxy's log: a spawned process does not
inherit the proxy's logging set-up, and structlog's defaults print every frame's local
variables with a logged exception (there: raw captures, unredacted)."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

from tests.python_run import run_python

SECRET = "sk-proj-LocalVariableSecret0123456789abcdef"

# A file, not `python -c`: the spawned worker imports the failing builder from it by name.
SCRIPT = textwrap.dedent(
    f"""
    import functools
    import sys
    from pathlib import Path

    from deploy.logs import configure_logging
    from replay.config import StreamConfig
    from replay.sink_process import KafkaSinkProcess


    def failing_build(capture, status):
        request_body = {{"messages": [{{"role": "user", "content": capture}}]}}
        raise ValueError("this capture does not build")


    if __name__ == "__main__":
        bootstrap, prefix, state, fmt = sys.argv[1:5]
        configure_logging(fmt) if fmt != "none" else None
        init = functools.partial(configure_logging, fmt) if fmt != "none" else None
        config = StreamConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
        sink = KafkaSinkProcess(config, Path(state), child_init=init)
        failures = []
        sink.build_records_with(failing_build, on_failures=failures.append)
        sink.put_capture("my key is {SECRET}", "ok")
        assert sink.wait_idle(60)
        sink.close()
        print("failed builds", sum(failures))
    """
)


@pytest.mark.parametrize("fmt", ["json", "console", "none"])
def test_a_failed_build_logs_no_local_variables_in_the_proxys_format(
    kafka_bootstrap: str, tmp_path: Path, fmt: str
) -> None:
    script = tmp_path / "sink_logging_script.py"
    script.write_text(SCRIPT)
    prefix = f"log{os.getpid()}{fmt}"
    done = run_python(str(script), kafka_bootstrap, prefix, str(tmp_path), fmt)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "failed builds 1"
    # Unconfigured, structlog prints to stdout; configured, olp logs to stderr.
    logged = done.stdout + done.stderr
    assert "trajectory_build_failed" in logged
    assert "this capture does not build" in logged  # the traceback is still there
    assert SECRET not in logged
    assert "request_body" not in logged  # no frame's locals at all
    if fmt == "json":
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        events = [json.loads(line)["event"] for line in lines]  # every line is JSON
        assert "trajectory_build_failed" in events
