"""docs/operations.md: the procedures that call the policy's vLLM work under `olp up`.

The vLLM `olp up` starts refuses any call without its key (a random one each run unless
`policy.api_key` names one), so a procedure without it only ever got 401.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.test_cli_errors import _KeyedVllm
from tests.http_stub import serving

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()


def _commands(text: str) -> list[str]:
    """Shell commands of the doc's bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [c for b in blocks for c in b.replace("\\\n", " ").splitlines() if c.strip()]


def test_every_call_to_the_policys_vllm_sends_its_key() -> None:
    calls = [c for c in _commands(OPERATIONS) if "curl" in c and ":8100" in c]
    assert calls, "the adapter-loading procedure is gone"
    for call in calls:
        assert "Authorization: Bearer $OLP_POLICY__API_KEY" in call, call


def test_replay_direct_says_which_key_it_sends() -> None:
    section = OPERATIONS[OPERATIONS.index("## Replay and shadow evaluation") :]
    assert "policy.api_key" in section and "OLP_POLICY__API_KEY" in section


@pytest.mark.parametrize("key", [None, "not-the-key"])
def test_replay_direct_refused_says_what_to_do(tmp_path: Path, key: str | None) -> None:
    source = tmp_path / "export.jsonl"
    source.write_text('{"hello": 1}\n')
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    with serving(_KeyedVllm) as url:
        env["OLP_POLICY__EXTERNAL_URLS"] = f"[{url}]"
        if key is not None:
            env["OLP_POLICY__API_KEY"] = key
        done = subprocess.run(
            [sys.executable, "-m", "deploy.cli", "replay", "run", str(source),
             "--model", "policy", "--out", str(tmp_path / "o.jsonl"), "--direct"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "OLP_POLICY__API_KEY" in done.stderr and "--api-key" in done.stderr, done.stderr
    if key is None:
        assert "next start" in done.stderr, done.stderr
    else:
        assert "is wrong" in done.stderr and "started with" in done.stderr, done.stderr
