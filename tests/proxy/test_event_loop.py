"""The proxy process's event loop (`proxy.event_loop`): uvloop where installed, else asyncio's."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import uvloop

from deploy.ports import free_port
from proxy.config import ProxyConfig
from proxy.event_loop import loop_factory, run_with_loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_auto_and_uvloop_run_on_uvloop_and_asyncio_on_asyncios_own() -> None:
    assert ProxyConfig().event_loop == "auto"
    assert loop_factory("auto") is uvloop.new_event_loop
    assert run_with_loop("auto", _loop_module()) == "uvloop"
    assert run_with_loop("uvloop", _loop_module()) == "uvloop"
    assert loop_factory("asyncio") is None
    assert run_with_loop("asyncio", _loop_module()) == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert loop_factory("auto") is None
    assert run_with_loop("auto", _loop_module()) == "asyncio"
    main = _loop_module()
    with pytest.raises(ValueError, match=r"proxy\.event_loop is 'uvloop'.*pip install uvloop"):
        run_with_loop("uvloop", main)
    assert main.cr_frame is None  # closed, not left unawaited


def test_an_unknown_event_loop_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="event_loop"):
        ProxyConfig(event_loop="trio")


@pytest.mark.parametrize("choice", ["auto", "asyncio"])
def test_olp_proxy_serves_the_real_model_on_the_configured_loop(
    vllm_server, tmp_path: Path, choice: str
) -> None:
    """`olp proxy` against the real vLLM, through the `openai` SDK, on each loop; its start-up
    line names the loop it runs on."""
    port = free_port()
    config = tmp_path / "olp.yaml"
    config.write_text(
        f"state_dir: {tmp_path / 'state'}\n"
        f"log_format: json\n"
        f"proxy: {{port: {port}, sink: jsonl, event_loop: {choice}}}\n"
        f"policy: {{external_urls: ['{vllm_server.base_url}'], "
        f"served_model_name: {vllm_server.model_name}}}\n"
        "tenants: [{name: acme, api_key: acme-key}]\n"
    )
    log_path = tmp_path / "proxy.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OLP_")}
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "proxy", "--config", str(config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="acme-key", max_retries=0
        )
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                reply = client.chat.completions.create(
                    model="policy",
                    messages=[{"role": "user", "content": "Say hi."}],
                    max_tokens=4,
                    temperature=0,
                )
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.3)
        assert reply.choices[0].message.content
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, log_path.read_text()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    listening = [line for line in lines if line.get("event") == "proxy_listening"]
    assert len(listening) == 1, log_path.read_text()
    assert listening[0]["event_loop"] == ("uvloop" if choice == "auto" else "asyncio")
