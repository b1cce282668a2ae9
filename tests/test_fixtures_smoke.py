from pathlib import Path

import openai


def test_lora_adapter_loads_and_serves(vllm_server, make_lora_adapter, tmp_path: Path) -> None:
    import uuid

    path = make_lora_adapter(tmp_path / "a", seed=1)
    assert (path / "adapter_model.safetensors").is_file()
    name = f"smoke-{uuid.uuid4().hex[:8]}"
    import httpx

    r = httpx.post(
        f"{vllm_server.base_url}/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    try:
        client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="x")
        out = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert out.choices[0].message.content is not None
    finally:
        httpx.post(
            f"{vllm_server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30
        )
