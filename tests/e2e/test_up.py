"""`olp up` from scratch: every child started, served through, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import psutil
import pytest

from deploy.ports import free_port

pytestmark = pytest.mark.slow


@dataclass
class RunningStack:
    proc: subprocess.Popen[str]
    config: Path
    proxy_url: str
    banner: str
    descendants: list[int]


def _read_banner(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout_s
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise AssertionError(f"olp up exited {proc.returncode}: {''.join(lines)}")
            continue
        lines.append(line)
        if "stop with Ctrl-C" in line:
            return "".join(lines)
    raise AssertionError("no ready banner in time:\n" + "".join(lines))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningStack]:
    root = tmp_path_factory.mktemp("up")
    proxy_port = free_port()
    config = root / "olp.yaml"
    config.write_text(
        f"state_dir: {root / 'state'}\n"
        f"proxy: {{port: {proxy_port}, admin_key: test-admin}}\n"
        f"policy: {{port: {free_port()}}}\n"
        f"stream: {{bootstrap_servers: '127.0.0.1:{free_port()}'}}\n"
        "tenants: [{name: acme, api_key: acme-key, training_enabled: true}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_TEST_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--config", str(config), "--no-learner"],
        stdout=subprocess.PIPE,
        stderr=open(root / "up.err", "w"),  # noqa: SIM115 - lives as long as the process
        text=True,
        env=env,
    )
    try:
        banner = _read_banner(proc, timeout_s=600)
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        yield RunningStack(proc, config, f"http://127.0.0.1:{proxy_port}", banner, descendants)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


def test_banner_names_every_endpoint(stack: RunningStack) -> None:
    for part in ("broker", "policy", "proxy", f"{stack.proxy_url}/v1", "/metrics", "olp tenant"):
        assert part in stack.banner
    assert len(stack.descendants) >= 3  # broker, vLLM (and its engine), proxy


def test_requests_flow_through_the_stack(stack: RunningStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.proxy_url}/v1", api_key="acme-key")
    out = client.chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert out.headers["x-olp-policy-version"] == "base"
    assert out.parse().choices[0].message.content


def test_second_up_is_refused(stack: RunningStack) -> None:
    second = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "up", "--config", str(stack.config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert second.returncode == 1
    assert "already running" in second.stderr
    assert stack.proc.poll() is None  # the first one is untouched


def test_ctrl_c_stops_every_child(stack: RunningStack) -> None:
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=120) == 0
    alive = [
        pid
        for pid in stack.descendants
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []
