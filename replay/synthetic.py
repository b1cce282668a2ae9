"""Realistic, schema-valid synthetic records for tests, benchmarks and demos."""

from __future__ import annotations

import hashlib
import random
import time
from typing import Any

from replay.schemas import SCHEMA_VERSION, new_event_id


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def make_trajectory(
    *,
    session_id: str | None = None,
    trajectory_id: str | None = None,
    created_at: float | None = None,
    prompt: str = "What is 17 plus 25? Reply with only the number.",
    completion_tokens: int = 8,
    prompt_tokens: int = 16,
    tenant: str = "tenant-a",
    model_alias: str = "policy",
    rng: random.Random | None = None,
) -> dict[str, Any]:
    """A chat trajectory as the proxy records it; ~4 KB with 300 prompt and 100 completion
    tokens (token ids and logprobs dominate the size of real records)."""
    rng = rng or random.Random()
    request_id = new_event_id()
    token_ids = [rng.randrange(49152) for _ in range(completion_tokens)]
    return {
        "schema_version": SCHEMA_VERSION,
        "event_id": new_event_id(),
        "trajectory_id": trajectory_id or new_event_id(),
        "request_id": request_id,
        "session_id": session_id or request_id,
        "tenant": sha256_hex(tenant),
        "user": None,
        "created_at": time.time() if created_at is None else created_at,
        "endpoint": "chat.completions",
        "model_alias": model_alias,
        "policy_version": "base",
        "group_id": None,
        "task": "arith",
        "request": {
            "model": model_alias,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": completion_tokens,
            "temperature": 1.0,
        },
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": completion_tokens, "n": 1},
        "prompt_token_ids": [rng.randrange(49152) for _ in range(prompt_tokens)],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "42", "tool_calls": None},
                "finish_reason": "stop",
                "token_ids": token_ids,
                "logprobs": [round(-rng.random() * 3, 6) for _ in token_ids],
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
        "timings": {"ttft_s": 0.12, "total_s": 0.9},
        "status": "ok",
        "trainable": True,
        "flags": [],
        "redactions": {},
    }


def make_feedback(
    trajectory: dict[str, Any],
    *,
    kind: str = "accept",
    value: float | None = None,
    created_at: float | None = None,
) -> dict[str, Any]:
    """A feedback event on `trajectory`, as the proxy's feedback endpoint records it."""
    return {
        "schema_version": SCHEMA_VERSION,
        "event_id": new_event_id(),
        "trajectory_id": trajectory["trajectory_id"],
        "session_id": trajectory["session_id"],
        "tenant": trajectory["tenant"],
        "kind": kind,
        "value": value,
        "choice_index": 0,
        "metadata": {},
        "created_at": time.time() if created_at is None else created_at,
    }
