import uuid
from pathlib import Path

import httpx
import openai


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
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert out.choices[0].message.content
        assert out.model == name
    finally:
        httpx.post(
            f"{vllm_server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30
        )
