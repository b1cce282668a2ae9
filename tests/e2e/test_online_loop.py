"""The whole product from scratch: `olp up` (broker, vLLM, proxy, learner), `olp demo`
traffic with feedback, a candidate promoted through the gate and hot-swapped, audited
rollback, and every process stopped by PID. Tests run in file order on one stack."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from deploy.ports import free_ports
from learner.checkpoint import CheckpointStore
from safety.audit import iter_records

pytestmark = pytest.mark.slow

ADMIN_KEY = "e2e-admin"
TENANT_KEY = "acme-key"


@dataclass
class RunningStack:
    proc: subprocess.Popen[str]
    config: Path
    proxy_url: str
    banner: str
    descendants: list[int]
    state_dir: Path
    policy_url: str


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
    proxy_port, policy_port, broker_port = free_ports(3)
    config = root / "olp.yaml"
    config.write_text(
        f"state_dir: {root / 'state'}\n"
        f"proxy: {{port: {proxy_port}, admin_key: {ADMIN_KEY}}}\n"
        f"policy: {{port: {policy_port}}}\n"
        f"stream: {{bootstrap_servers: '127.0.0.1:{broker_port}', join_window_s: 3, "
        "join_grace_s: 1, partitions: 2}\n"
        # Small batches so a candidate appears within a couple of demo minutes.
        "learner: {batch_size: 6, min_batch: 3, batch_timeout_s: 20, lr: 0.0005, "
        "progress_interval_s: 5}\n"
        "safety:\n  gates:\n"
        "    regression: {max_probes: 3}\n"
        "    kl: {max_prompts: 2, max_tokens: 8}\n"
        "    safety_probes: {max_probes: 2}\n"
        "    monitors: {max_probes: 2}\n"
        "    poisoning: {max_probes: 1}\n"
        # Training stays off until the demo enables it through the admin API.
        f"tenants: [{{name: acme, api_key: {TENANT_KEY}, training_enabled: false}}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_TEST_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=open(root / "up.err", "w"),  # noqa: SIM115 - lives as long as the process
        text=True,
        env=env,
    )
    try:
        banner = _read_banner(proc, timeout_s=600)
        descendants = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        yield RunningStack(
            proc,
            config,
            f"http://127.0.0.1:{proxy_port}",
            banner,
            descendants,
            root / "state",
            f"http://127.0.0.1:{policy_port}",
        )
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)


def olp(stack: RunningStack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args, "--config", str(stack.config)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OLP_ADMIN_KEY": ADMIN_KEY},
    )


def admin_status(stack: RunningStack) -> dict:
    return httpx.get(
        f"{stack.proxy_url}/admin/status",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    ).json()


def test_banner_names_every_endpoint(stack: RunningStack) -> None:
    for part in (
        "broker",
        "policy",
        "proxy",
        "learner",
        f"{stack.proxy_url}/v1",
        "/metrics",
        "/admin/ui",
        "olp ui",
        "olp tenant",
    ):
        assert part in stack.banner
    assert len(stack.descendants) >= 4  # broker, vLLM (and its engine), proxy, learner


def test_requests_flow_through_the_stack(stack: RunningStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.proxy_url}/v1", api_key=TENANT_KEY)
    out = client.chat.completions.with_raw_response.create(
        model="policy",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,  # sampled tokens may decode to no text at all
    )
    assert out.headers["x-olp-policy-version"] == "base"
    assert out.parse().choices[0].message.content
    # Training is off for the tenant: nothing is recorded.
    assert "x-olp-trajectory-id" not in out.headers


def _policy_key(stack: RunningStack) -> str:
    """This run's vLLM key, from the proxy child's environment (it is in no file)."""
    for pid in stack.descendants:
        process = psutil.Process(pid)
        if "proxy" in process.cmdline():
            return str(process.environ()["OLP_POLICY__API_KEY"])
    raise AssertionError("no proxy child")


def test_the_embedded_vllm_serves_only_this_runs_key(stack: RunningStack) -> None:
    """It served anyone who reached its port (any local process, or a web page through DNS
    rebinding), runtime LoRA loading included; the proxy, the learner and the gates now send
    a key made for the run, and the requests above went through with it."""
    assert httpx.get(f"{stack.policy_url}/v1/models", timeout=30).status_code == 401
    unload = {"lora_name": "policy-v1"}
    refused = httpx.post(f"{stack.policy_url}/v1/unload_lora_adapter", json=unload, timeout=30)
    assert refused.status_code == 401
    assert httpx.get(f"{stack.policy_url}/health", timeout=30).status_code == 200
    # vLLM's own key covers /v1 only: its SageMaker routes answered chats and loaded and
    # unloaded adapters without it, until olp's key guard (deploy/vllm_key_guard.py).
    chat = {"model": "base", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}
    outside_v1 = [
        ("POST", "/invocations", chat),
        ("POST", "/adapters", {"name": "mine", "src": str(stack.state_dir)}),
        ("DELETE", "/adapters/base", None),
        ("POST", "/tokenize", {"model": "base", "prompt": "hi"}),
        ("GET", "/metrics", None),
    ]
    for method, path, body in outside_v1:
        answer = httpx.request(method, f"{stack.policy_url}{path}", json=body, timeout=30)
        assert answer.status_code == 401, (path, answer.text)
    key = _policy_key(stack)
    with_key = {"Authorization": f"Bearer {key}"}
    listed = httpx.get(f"{stack.policy_url}/v1/models", headers=with_key, timeout=30)
    assert listed.status_code == 200 and "base" in listed.text
    answered = httpx.post(
        f"{stack.policy_url}/invocations", json=chat, headers=with_key, timeout=60
    )
    assert answered.status_code == 200 and answered.json()["choices"], answered.text
    for pid in stack.descendants:  # `ps` shows argv to every local user
        assert not any(key in arg for arg in psutil.Process(pid).cmdline())


def test_the_proxy_process_applies_its_gc_settings(stack: RunningStack) -> None:
    """`olp proxy` owns its process: start-up objects are frozen out of the collector's scans
    (proxy.gc), and the collector's work is on /metrics."""
    text = httpx.get(f"{stack.proxy_url}/metrics", timeout=30).text
    frozen = re.search(r"^olp_proxy_gc_frozen_objects (\S+)$", text, re.M)
    assert frozen is not None and float(frozen.group(1)) > 10_000
    assert re.search(r'^python_gc_collections_total\{generation="2"\} \d', text, re.M)


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


def test_demo_traffic_leads_to_a_gated_promotion(stack: RunningStack) -> None:
    demo = olp(
        stack,
        "demo",
        "--api-key",
        TENANT_KEY,
        "--tenant",
        "acme",
        "--sessions",
        "2",
        "--n",
        "4",
        "--max-tokens",
        "12",
        "--requests",
        "16",
        "--minutes",
        "12",
        timeout=900,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    summary = json.loads((stack.state_dir / "demo" / "summary.json").read_text())
    assert summary["requests"] >= 16 and summary["errors"] == 0
    assert (stack.state_dir / "demo" / "reward.png").stat().st_size > 0

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if admin_status(stack)["serving_version"].startswith("policy-v"):
            break
        time.sleep(5)
    # The learner goes on training on the demo's traffic, so a newer version may be promoted
    # at any moment: hold what serves (promotions only; learning goes on) before looking.
    frozen = olp(stack, "freeze")
    assert frozen.returncode == 0, frozen.stderr
    serving = admin_status(stack)["serving_version"]
    assert serving.startswith("policy-v"), (stack.state_dir / "logs" / "learner.log").read_text()[
        -4000:
    ]
    events = [r["event"] for r in iter_records(stack.state_dir / "audit" / "audit.jsonl")]
    assert "gate_result" in events and "promotion" in events
    assert (stack.state_dir / "gates" / f"{serving}.json").is_file()

    client = openai.OpenAI(base_url=f"{stack.proxy_url}/v1", api_key=TENANT_KEY)
    out = client.chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": "What is 2 plus 3?"}], max_tokens=4
    )
    assert out.headers["x-olp-policy-version"] == serving


def test_rollback_restores_the_previous_version_and_the_audit_verifies(
    stack: RunningStack,
) -> None:
    """A rollback works while frozen. The freeze keeps the learner, which goes on training,
    from promoting a newer version between reading what serves and rolling it back (a CI
    run saw policy-v2 promoted in that gap and rolled back to the policy-v1 read before)."""
    frozen = olp(stack, "freeze")  # in force since the demo test; again when run on its own
    assert frozen.returncode == 0, frozen.stderr
    try:
        before = admin_status(stack)
        assert before["frozen"] is True
        rolled = olp(stack, "rollback")
        assert rolled.returncode == 0, rolled.stderr
        after = admin_status(stack)
        assert after["serving_version"] != before["serving_version"]
        history = [e for e in after["history"] if e.get("kind") == "rollback"]
        assert history and history[-1]["previous"] == before["serving_version"]
        verify = olp(stack, "audit", "verify")
        assert verify.returncode == 0 and "OK" in verify.stdout
        shown = olp(stack, "audit", "show", "--event", "rollback")
        assert before["serving_version"] in shown.stdout
    finally:
        unfrozen = olp(stack, "unfreeze")
        assert unfrozen.returncode == 0, unfrozen.stderr


def test_the_policy_key_reaches_no_log_and_no_shown_config(stack: RunningStack) -> None:
    key = _policy_key(stack)
    logs = list((stack.state_dir / "logs").glob("*.log"))
    assert logs and all(key not in path.read_text(errors="replace") for path in logs)
    shown = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "config", "show", "--config", str(stack.config)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OLP_POLICY__API_KEY": key},
    )
    assert shown.returncode == 0 and '"api_key": "**********"' in shown.stdout
    assert key not in shown.stdout


def test_ctrl_c_stops_every_child(stack: RunningStack) -> None:
    stack.proc.send_signal(signal.SIGINT)
    assert stack.proc.wait(timeout=120) == 0
    alive = [
        pid
        for pid in stack.descendants
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert alive == []


def test_up_again_on_the_same_state_dir_resumes_the_learner(stack: RunningStack) -> None:
    """The embedded broker keeps its data in memory. The learner's saved offsets then lay
    past the end of the new, empty stream: it refused to start, and `olp up` stopped the
    whole stack. Now it keeps its weights and version and reads the new stream from its
    start."""
    if stack.proc.poll() is None:  # run on its own, without the Ctrl-C test before it
        stack.proc.send_signal(signal.SIGINT)
        stack.proc.wait(timeout=120)
    checkpoint = CheckpointStore(stack.state_dir).load()
    assert checkpoint is not None and checkpoint.offsets, "needs the demo test's training first"
    log_file = stack.state_dir / "logs" / "learner.log"
    seen = log_file.read_text().count('"learner_stream_new"')
    errors = stack.config.parent / "up-again.err"
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "up", "--config", str(stack.config)],
        stdout=subprocess.PIPE,
        stderr=open(errors, "w"),  # noqa: SIM115 - lives as long as the process
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("OLP_TEST_")},
    )
    try:
        _read_banner(proc, timeout_s=600)
        deadline = time.monotonic() + 120
        while log_file.read_text().count('"consumer_assigned"') < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(5)  # the refusal came at the first poll, a second after the assignment
        text = log_file.read_text()
        assert text.count('"learner_stream_new"') == seen + 1, text[-3000:]
        assert "ResumeOffsetError" not in text
        assert proc.poll() is None and '"child_exited"' not in errors.read_text()
        resumed = [
            json.loads(line)
            for line in text.splitlines()
            if line.startswith("{") and '"learner_resume"' in line
        ][-1]
        assert resumed["version"] == checkpoint.version >= 1
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0
