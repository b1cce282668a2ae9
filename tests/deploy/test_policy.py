import http.server
import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from structlog.testing import capture_logs

from deploy.config import PolicyConfig
from deploy.policy import start_policy, warn_if_exposed
from deploy.ports import is_loopback
from tests.http_stub import serving


def test_chat_returns_token_ids_and_matching_logprobs(vllm_server) -> None:
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="unused")
    out = client.chat.completions.create(
        model=vllm_server.model_name,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    data = out.model_dump()
    choice = data["choices"][0]
    assert data["prompt_token_ids"], "prompt token ids are returned"
    assert len(choice["token_ids"]) == len(choice["logprobs"]["content"])
    assert len(choice["token_ids"]) == data["usage"]["completion_tokens"]
    assert all(item["logprob"] <= 0 for item in choice["logprobs"]["content"])


def test_runtime_lora_adapter_serves_completions(vllm_server, make_lora_adapter, tmp_path: Path):
    path = make_lora_adapter(tmp_path / "adapter", seed=3)
    name = f"test-lora-{uuid.uuid4().hex[:8]}"
    r = httpx.post(
        f"{vllm_server.base_url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    try:
        models = httpx.get(f"{vllm_server.base_url}/v1/models", timeout=10).json()
        assert name in [m["id"] for m in models["data"]]
        client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="unused")
        out = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            temperature=0,  # sampled tokens may decode to no text at all
        )
        assert out.choices[0].message.content
        assert out.model == name
    finally:
        httpx.post(
            f"{vllm_server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30
        )


def test_loopback_hosts_are_told_apart() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "policy.internal"))


def test_a_policy_beyond_loopback_is_started_with_a_warning() -> None:
    """Allowed (vLLM on its own host), never quiet: its LoRA endpoints have no keys."""
    with capture_logs() as logs:
        assert not warn_if_exposed(PolicyConfig())
        assert warn_if_exposed(PolicyConfig(host="0.0.0.0"))
    assert [(e["event"], e["log_level"], e["host"]) for e in logs] == [
        ("policy_not_on_loopback", "warning", "0.0.0.0")
    ]


def _json_server(
    answer: Callable[[http.server.BaseHTTPRequestHandler], tuple[int, bytes]],
) -> type[http.server.BaseHTTPRequestHandler]:
    """A stand-in server whose GETs get `answer(handler)`: (status, JSON body)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answer(self)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def _answering(body: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    return _json_server(lambda _: (200, body))


def test_a_policy_port_in_use_is_refused_not_reported_ready(tmp_path: Path) -> None:
    """`olp policy` must not call another server on its port its own ready vLLM (ours would
    then die on bind while the other answers)."""
    # Something else already serving /v1/models on the port (another vLLM, say).
    listing = json.dumps({"data": [{"id": "someone-elses-model"}]}).encode()
    with serving(_answering(listing)) as url:
        cfg = PolicyConfig(port=int(url.rsplit(":", 1)[1]))
        try:
            server = start_policy(cfg, tmp_path)
        except RuntimeError as exc:
            assert "already in use" in str(exc) and "policy.port" in str(exc)
        else:
            server.stop()
            pytest.fail("start_policy reported the other server on its port as ready")


@pytest.mark.parametrize(
    ("body", "what"),
    [
        (b"[1, 2]", 'without a "data" list'),
        (b'{"object": "list"}', 'without a "data" list'),
        (b'{"data": {"id": "base"}}', 'without a "data" list'),
        (b'{"data": [{"name": "base"}]}', 'a model without a string "id"'),
        (b'{"data": ["base"]}', 'a model without a string "id"'),
        (b"<html>a web server</html>", "not JSON"),
    ],
)
def test_an_external_vllm_answering_odd_json_is_named_with_what_was_wrong(
    body: bytes, what: str
) -> None:
    """Not `start-up failed: 'id'`: the URL of the external vLLM and what it sent."""
    from deploy.policy import check_external

    with serving(_answering(body)) as url, pytest.raises(RuntimeError) as exc:
        check_external([url])  # `olp up` reports it as start-up failed
    message = str(exc.value)
    assert message.startswith(f"external vLLM at {url} (policy.external_urls): GET {url}/v1/models")
    assert what in message


def test_an_external_vllm_url_that_redirects_is_named_not_waited_on() -> None:
    """Redirects are not followed (they would carry the key); a 302 read as "not up yet"
    left `olp up` waiting out its deadline with no word of the redirect."""
    from deploy.policy import check_external

    with serving(_json_server(lambda _: (302, b"{}"))) as url, pytest.raises(RuntimeError) as exc:
        check_external([url])
    assert f"GET {url}/v1/models answered 302, a redirect" in str(exc.value)


def test_an_external_vllm_listing_models_passes() -> None:
    from deploy.policy import check_external, models_listed

    body = b'{"object": "list", "data": [{"id": "base"}, {"id": "policy-v2"}]}'
    with serving(_answering(body)) as url:
        check_external([url + "/"])
        assert models_listed(url) == ["base", "policy-v2"]


KEY = "vllm-key-for-tests"
MODELS = b'{"object": "list", "data": [{"id": "base"}]}'


def _needing_key(seen: list[str | None]) -> type[http.server.BaseHTTPRequestHandler]:
    """A stand-in vLLM started with --api-key KEY: /v1 needs the Bearer key."""

    def answer(request: http.server.BaseHTTPRequestHandler) -> tuple[int, bytes]:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") == f"Bearer {KEY}":
            return 200, MODELS
        return 401, b'{"error": "Unauthorized"}'

    return _json_server(answer)


def test_a_vllm_that_needs_a_key_gets_it_and_a_missing_or_wrong_key_is_named() -> None:
    """Before policy.api_key, olp could not use a vLLM started with --api-key at all: the
    launcher waited out its start-up timeout for a model list that never came."""
    from deploy.policy import PolicyKeyRefused, check_external, models_listed

    seen: list[str | None] = []
    with serving(_needing_key(seen)) as url:
        check_external([url], KEY)
        assert models_listed(url, api_key=KEY) == ["base"]
        with pytest.raises(PolicyKeyRefused, match=r"policy\.api_key is not set") as missing:
            check_external([url])
        assert str(missing.value).startswith(f"external vLLM at {url}: GET {url}/v1/models")
        with pytest.raises(PolicyKeyRefused, match=r"policy\.api_key is wrong") as wrong:
            models_listed(url, api_key="guess")
        assert "guess" not in str(wrong.value)
    assert seen == [f"Bearer {KEY}", f"Bearer {KEY}", None, "Bearer guess"]


def test_the_launched_vllm_takes_its_key_from_the_environment_not_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deploy.policy import vllm_argv, vllm_env

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    cfg = PolicyConfig(api_key=KEY)
    assert vllm_env(cfg)["VLLM_API_KEY"] == KEY
    assert not any(KEY in arg for arg in vllm_argv(cfg, tmp_path))  # `ps` shows argv
    assert "VLLM_API_KEY" not in vllm_env(PolicyConfig())
    assert KEY not in repr(cfg) and KEY not in cfg.model_dump_json()  # `olp config show`


def test_a_keyed_vllm_is_launched_with_the_key_guard_from_this_tree(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's key covers /v1 only (deploy/vllm_key_guard.py says what lies outside). The
    guard is imported in vLLM's process, from the tree that launches it: the shared
    environment's editable install may point at another checkout."""
    import deploy
    from deploy.policy import KEY_GUARD, vllm_argv, vllm_env

    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    argv = vllm_argv(PolicyConfig(api_key=KEY), tmp_path)
    assert argv[argv.index("--middleware") + 1] == KEY_GUARD
    tree = str(Path(deploy.__file__).resolve().parents[1])
    assert vllm_env(PolicyConfig(api_key=KEY))["PYTHONPATH"].split(os.pathsep) == [
        tree,
        "/elsewhere",
    ]
    # Without a key there is nothing to guard with: vLLM runs as it comes.
    assert "--middleware" not in vllm_argv(PolicyConfig(), tmp_path)
    assert vllm_env(PolicyConfig())["PYTHONPATH"] == "/elsewhere"
