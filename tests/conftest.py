"""Session-wide real components: the prepared model, a vLLM server, a Kafka-protocol broker.

Each is started once per test session (the model preparation is cached across sessions
by content hash). For development, OLP_TEST_VLLM_URL / OLP_TEST_BOOTSTRAP point the
fixtures at servers that are already running instead.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deploy.broker import start_broker
from deploy.config import PolicyConfig
from deploy.model_prep import prepare_model
from deploy.policy import start_policy
from deploy.ports import free_port

SERVED_NAME = "base"
# How long the test process may take to exit once pytest is done.
EXIT_GRACE_S = 300


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """A process that does not exit after the summary (a child process it joins, a thread
    that never ends) held a CI run until the CI's own limit, 55 minutes later, with nothing
    printed: after EXIT_GRACE_S, print every thread's stack and exit with status 1."""
    faulthandler.dump_traceback_later(EXIT_GRACE_S, exit=True, file=sys.__stderr__)


@dataclass(frozen=True)
class VllmServer:
    base_url: str  # without /v1
    model_name: str
    model_dir: Path
    # Its log (an external server's: OLP_TEST_VLLM_LOG, where the one who started it has it).
    log_file: Path | None = None


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_model().path


def _warm_up(base_url: str, model: str) -> None:
    """vLLM's first request pays a ~20 s warm-up; pay it here, not inside a test."""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    ).encode()
    req = urllib.request.Request(
        f"{base_url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        assert resp.status == 200


@pytest.fixture(scope="session")
def vllm_server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    external = os.environ.get("OLP_TEST_VLLM_URL")
    if external:
        log = os.environ.get("OLP_TEST_VLLM_LOG")
        yield VllmServer(external.rstrip("/"), SERVED_NAME, model_dir, Path(log) if log else None)
        return
    cfg = PolicyConfig(port=free_port(), served_model_name=SERVED_NAME)
    log_file = tmp_path_factory.mktemp("vllm") / "vllm.log"
    server = start_policy(cfg, model_dir, log_file)
    try:
        _warm_up(server.base_url, SERVED_NAME)
        yield VllmServer(server.base_url, SERVED_NAME, model_dir, log_file)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    external = os.environ.get("OLP_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    broker = start_broker(
        "127.0.0.1", free_port(), tmp_path_factory.mktemp("broker") / "broker.log"
    )
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


@pytest.fixture(scope="session")
def make_lora_adapter(model_dir: Path) -> Callable[..., Path]:
    """Write fresh PEFT LoRA adapters (random, non-zero B) for the real model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

    def make(path: Path, seed: int = 0, rank: int = 8, scale: float = 1.0) -> Path:
        torch.manual_seed(seed)
        config = LoraConfig(
            r=rank,
            lora_alpha=2 * rank,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            init_lora_weights=False,  # random B: the adapter really changes outputs
            task_type="CAUSAL_LM",
        )
        peft_model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(scale)
        peft_model.save_pretrained(path)
        # Unwrap so the shared base can take the next adapter.
        peft_model.unload()
        return path

    return make
