"""The learner's calls to vLLM (adapter loads, model lists, the gates, the judge) carry
`policy.api_key`: a vLLM started with --api-key refused all of them."""

from __future__ import annotations

import http.server
import json
from pathlib import Path

import httpx
import pytest

from learner.config import JudgeConfig
from learner.promotion import ReplicaSet
from learner.rewards.judge import Judge
from tests.http_stub import serving

KEY = "vllm-key-for-tests"


Seen = list[tuple[str, str | None]]  # (path, Authorization) of each request


def _vllm_needing_key(seen: Seen) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: dict) -> None:
            seen.append((self.path, self.headers.get("Authorization")))
            length = int(self.headers.get("Content-Length") or 0)
            self.rfile.read(length)
            ok = self.headers.get("Authorization") == f"Bearer {KEY}"
            raw = json.dumps(body if ok else {"error": "Unauthorized"}).encode()
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self) -> None:
            self._answer({"object": "list", "data": [{"id": "base"}, {"id": "policy-v1"}]})

        def do_POST(self) -> None:
            self._answer({})

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def test_adapter_loads_and_model_lists_carry_the_key(tmp_path: Path) -> None:
    seen: Seen = []
    with serving(_vllm_needing_key(seen)) as url:
        replicas = ReplicaSet([url], timeout_s=10, api_key=KEY)
        assert replicas.served(url) == {"base", "policy-v1"}
        replicas.load("policy-v1", tmp_path)
        replicas.unload("policy-v1")
        replicas.close()
        keyless = ReplicaSet([url], timeout_s=10)
        with pytest.raises(httpx.HTTPStatusError, match="401"):
            keyless.served(url)
        keyless.close()
    assert {auth for path, auth in seen[:-1]} == {f"Bearer {KEY}"}
    assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= {path for path, _ in seen}
    assert seen[-1] == ("/v1/models", None)


def test_the_judge_on_the_policy_uses_the_policys_key() -> None:
    on_policy = Judge(JudgeConfig(enabled=True), base_url="http://127.0.0.1:1/v1", api_key=KEY)
    assert on_policy._client.api_key == KEY
    own = JudgeConfig(enabled=True, base_url="http://127.0.0.1:2/v1", api_key="judge-key")
    elsewhere = Judge(own, base_url="http://127.0.0.1:1/v1", api_key=KEY)
    assert elsewhere._client.api_key == "judge-key"  # its own server, its own key
    keyless = Judge(JudgeConfig(enabled=True), base_url="http://127.0.0.1:1/v1")
    assert keyless._client.api_key == "EMPTY"
    for judge in (on_policy, elsewhere, keyless):
        judge.close()
