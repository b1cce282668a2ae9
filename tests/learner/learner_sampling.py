"""Test helpers: sample trajectory records from the real vLLM server, manage LoRA names."""

from __future__ import annotations

import hashlib
import json
import random
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import openai

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")
NUMBER_PROMPT = "What is {a} plus {b}? Reply with only the number."


def _post(base_url: str, path: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(
        f"{base_url}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200, resp.read()


def load_adapter(base_url: str, path: Path, prefix: str = "olp-test") -> str:
    """Load `path` into vLLM under a fresh unique name and return the name."""
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    _post(base_url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    return name


def unload_adapter(base_url: str, name: str) -> None:
    _post(base_url, "/v1/unload_lora_adapter", {"lora_name": name})


def number_prompts(count: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        out.append((NUMBER_PROMPT.format(a=a, b=b), a + b))
    return out


def sample_record(
    client: openai.OpenAI,
    model: str,
    prompt: str,
    n: int,
    max_tokens: int,
    policy_version: str,
    temperature: float = 1.0,
    task: str = "number",
    tenant: str = hashlib.sha256(b"tenant-a").hexdigest(),
    answer: int | None = None,
    seed: int | None = None,
    system: str | None = "Be brief.",
) -> dict[str, Any]:
    """One trajectory record (docs/interfaces.md) with `n` sampled choices from vLLM.

    A short system message replaces the chat template's long default one: every prompt
    token costs ~10 ms through a LoRA on this CPU, and the learner recomputes them all.
    """
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": prompt})
    sampling = {"temperature": temperature, "max_tokens": max_tokens, "n": n, "seed": seed}
    response = client.chat.completions.create(
        model=model,
        messages=messages,
        logprobs=True,
        extra_body={"return_token_ids": True},
        **{k: v for k, v in sampling.items() if v is not None},
    )
    body = response.model_dump()
    choices = []
    for choice in body["choices"]:
        choices.append(
            {
                "index": choice["index"],
                "message": {
                    "role": "assistant",
                    "content": choice["message"]["content"],
                    "tool_calls": None,
                },
                "finish_reason": choice["finish_reason"],
                "token_ids": list(choice["token_ids"]),
                "logprobs": [t["logprob"] for t in choice["logprobs"]["content"]],
            }
        )
    trajectory_id = uuid.uuid4().hex
    return {
        "schema_version": 1,
        "event_id": uuid.uuid4().hex,
        "trajectory_id": trajectory_id,
        "request_id": trajectory_id,
        "session_id": trajectory_id,
        "tenant": tenant,
        "user": None,
        "created_at": 0.0,
        "endpoint": "chat.completions",
        "model_alias": model,
        "policy_version": policy_version,
        "group_id": None,
        "task": task,
        "request": {
            "model": model,
            "messages": messages,
            "metadata": {"answer": answer} if answer is not None else {},
        },
        "sampling": sampling,
        "prompt_token_ids": list(body["prompt_token_ids"]),
        "choices": choices,
        "usage": {
            k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
        },
        "timings": {"ttft_s": 0.0, "total_s": 0.0},
        "status": "ok",
        "trainable": True,
        "flags": [],
        "redactions": {},
    }
