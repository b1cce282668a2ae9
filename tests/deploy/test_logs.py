"""What `configure_logging` writes: never a frame's local variables (keys, request bodies)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs in a subprocess: configure_logging changes structlog's process-wide configuration.
SCRIPT = textwrap.dedent(
    """
    import structlog
    from deploy.logs import configure_logging

    configure_logging(FORMAT)
    log = structlog.get_logger("test")

    def handle(headers):
        api_key = "sk-local-secret-123"
        raise RuntimeError("upstream failed")

    try:
        handle({"authorization": "Bearer sk-header-secret-456"})
    except RuntimeError:
        log.exception("request_failed")
    """
)


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_logged_exceptions_show_no_local_variables(fmt: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.replace("FORMAT", repr(fmt))],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "request_failed" in done.stderr
    assert "upstream failed" in done.stderr  # the traceback itself is still there
    assert "sk-local-secret-123" not in done.stderr
    assert "sk-header-secret-456" not in done.stderr
