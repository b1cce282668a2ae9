"""Run Python in a fresh process with the project importable, for what changes a process's
global state (logging set-up, environment) or needs a file its spawned children import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_python(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python *args` in the repository root; `env` replaces the inherited environment."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**(os.environ if env is None else env), "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
