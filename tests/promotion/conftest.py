"""A real proxy (`olp proxy` subprocess) in front of the session's vLLM, plus adapter helpers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from deploy.ports import free_port
from learner.adapter_store import AdapterStore
from learner.config import PromotionConfig
from learner.promotion import GateRunner, Promoter, ProxyAdmin, ReplicaSet
from safety.audit import AuditLog
from safety.config import GatesConfig

ADMIN_KEY = "test-admin-key"
TENANT_KEY = "acme-key"


@dataclass
class ProxyUnderTest:
    url: str
    state_dir: Path
    proc: subprocess.Popen[bytes]
    admin_key: str = ADMIN_KEY
    tenant_key: str = TENANT_KEY


def unload_policy_versions(base_url: str) -> None:
    """Versioned names repeat across tests' fresh state dirs: start each test clean."""
    served = httpx.get(f"{base_url}/v1/models", timeout=30).json()["data"]
    for item in served:
        if item["id"].startswith("policy-v"):
            httpx.post(
                f"{base_url}/v1/unload_lora_adapter", json={"lora_name": item["id"]}, timeout=30
            )


@pytest.fixture
def proxy(vllm_server, tmp_path: Path) -> Iterator[ProxyUnderTest]:
    unload_policy_versions(vllm_server.base_url)
    port = free_port()
    state_dir = tmp_path / "state"
    config = tmp_path / "olp.yaml"
    config.write_text(
        f"state_dir: {state_dir}\n"
        f"proxy: {{port: {port}, admin_key: {ADMIN_KEY}, sink: jsonl}}\n"
        f"policy: {{external_urls: ['{vllm_server.base_url}'], "
        f"served_model_name: {vllm_server.model_name}}}\n"
        f"tenants: [{{name: acme, api_key: {TENANT_KEY}, training_enabled: true}}]\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "deploy.cli", "proxy", "--config", str(config)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "proxy.log", "wb"),  # noqa: SIM115 - closed with the process
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
        time.sleep(0.3)
    else:
        raise AssertionError("proxy not ready: " + (tmp_path / "proxy.log").read_text())
    yield ProxyUnderTest(url, state_dir, proc)
    proc.terminate()
    proc.wait(timeout=30)
    unload_policy_versions(vllm_server.base_url)


@pytest.fixture
def small_gates() -> Callable[..., GatesConfig]:
    return make_small_gates


def make_small_gates(**overrides: object) -> GatesConfig:
    """The real suite with few probes, so a gate run stays short on two CPU cores."""
    data: dict[str, object] = {
        "regression": {"max_probes": 4},
        "kl": {"max_prompts": 2, "max_tokens": 8},
        "safety_probes": {"max_probes": 3},
        "monitors": {"max_probes": 3},
        "poisoning": {"max_probes": 1},
    }
    data.update(overrides)
    return GatesConfig.model_validate(data)


@pytest.fixture
def publish(make_lora_adapter, proxy: ProxyUnderTest) -> Callable[..., Path]:
    """Write `policy-v<N>` into the proxy's state dir as the learner would."""
    store = AdapterStore(proxy.state_dir)

    def make(version: int, scale: float, seed: int = 0) -> Path:
        files = proxy.state_dir / f"build-{version}"
        make_lora_adapter(files, seed=seed, rank=8, scale=scale)
        return store.publish(version, files, {"parent_version": version - 1})

    return make


@pytest.fixture
def make_promoter(vllm_server, proxy: ProxyUnderTest) -> Iterator[Callable[..., Promoter]]:
    made: list[Promoter] = []

    def make(
        gates: GatesConfig | None = None, gate_runner: GateRunner | None = None, **config: object
    ) -> Promoter:
        promoter = Promoter(
            PromotionConfig.model_validate({"drain_s": 0.5, **config}),
            gates or make_small_gates(),
            replicas=ReplicaSet([vllm_server.base_url]),
            proxy=ProxyAdmin(proxy.url, ADMIN_KEY),
            audit=AuditLog(proxy.state_dir / "audit" / "audit.jsonl"),
            state_dir=proxy.state_dir,
            base_name=vllm_server.model_name,
            gate_runner=gate_runner,
        )
        made.append(promoter)
        return promoter

    yield make
    for promoter in made:
        promoter.close()
