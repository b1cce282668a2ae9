"""`olp replay run` through the proxy (no --direct): the proxy is asked once before any
recorded request goes out. The proxy runs in-process on a stand-in vLLM; the CLI is real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from replay.synthetic import make_trajectory
from tests.proxy.conftest import KEYS
from tests.proxy.test_proxy_fake_vllm import FakeVllm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def export(tmp_path: Path) -> Path:
    path = tmp_path / "export.jsonl"
    records = [make_trajectory(session_id=f"s{i}") for i in range(25)]
    lines = [
        {"kind": "trajectories", "partition": 0, "offset": i, "record": r}
        for i, r in enumerate(records)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _replay(
    port: int, export: Path, out: Path, key: str, model: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", "replay", "run", str(export), "--model", model,
         "--api-key", key, "--out", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OLP_PROXY__PORT": str(port),
             "OLP_STATE_DIR": str(out.parent / "state")},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip


def test_a_key_or_model_the_proxy_refuses_stops_the_replay_before_it_sends(
    make_proxy, export: Path, tmp_path: Path
) -> None:
    """Each request with a mistyped key counted towards the failed-key lockout: past 20 the
    proxy answered this machine's address 429, every local client with it. A version or a
    served name as the model was one 404 per record."""
    upstream = FakeVllm().start()
    try:
        # A lockout after 3 failed keys (20 by default), so that the test makes one quickly.
        harness, _ = make_proxy([upstream.url], auth_failures={"max_failures": 3, "window_s": 3600})
        out = tmp_path / "replayed.jsonl"
        wrong = _replay(harness.port, export, out, "key-alicee", "policy")
        assert wrong.returncode == 2, wrong.stdout + wrong.stderr
        assert "olp: replay run: the proxy refuses --api-key (401)" in wrong.stderr
        unknown = _replay(harness.port, export, out, KEYS["alice"], "policy-v1")
        assert unknown.returncode == 2, unknown.stdout + unknown.stderr
        assert "serves no model 'policy-v1' (its aliases: " in unknown.stderr
        assert "--direct" in unknown.stderr
        assert upstream.requests == []  # nothing was sent
        done = _replay(harness.port, export, out, KEYS["alice"], "policy")
        assert done.returncode == 0, done.stdout + done.stderr
        assert "25 ok, 0 errors" in done.stdout
        assert len(upstream.requests) == 25
        for _ in range(2):  # a client's mistyped key locks this address out
            _replay(harness.port, export, out, "key-alicee", "policy")
        locked = _replay(harness.port, export, out, KEYS["alice"], "policy")
        assert locked.returncode == 2, locked.stdout + locked.stderr
        assert "the proxy answers 429 to this address; retry after " in locked.stderr
        assert len(upstream.requests) == 25
    finally:
        upstream.stop()
