"""On-policy sanity through the real stack: vLLM samples with an adapter, HF+PEFT recomputes."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from learner.config import LearnerConfig
from learner.objective import Sample
from learner.trainer import Trainer
from tests.learner.learner_sampling import (
    load_adapter,
    number_prompts,
    sample_record,
    unload_adapter,
)


def test_importance_ratio_near_one_and_gradient_finite(
    vllm_server: Any, model_dir: Path, make_lora_adapter: Callable[..., Path], tmp_path: Path
) -> None:
    adapter = make_lora_adapter(tmp_path / "adapter", seed=3, rank=16, scale=0.5)
    name = load_adapter(vllm_server.base_url, adapter)
    client = openai.OpenAI(base_url=f"{vllm_server.base_url}/v1", api_key="EMPTY")
    try:
        records = [
            sample_record(client, name, prompt, n=4, max_tokens=12, policy_version="policy-v5")
            for prompt, _ in number_prompts(2, seed=11)
        ]
    finally:
        unload_adapter(vllm_server.base_url, name)
        client.close()
    samples = []
    for record in records:
        for i, choice in enumerate(record["choices"]):
            samples.append(
                Sample(
                    key=f"{record['trajectory_id']}:{i}",
                    event_id=record["event_id"],
                    prompt_ids=record["prompt_token_ids"],
                    completion_ids=choice["token_ids"],
                    sampling_logprobs=choice["logprobs"],
                    reward=float(i % 2),
                    group=record["trajectory_id"],
                    task="number",
                    tenant="A",
                    user=None,
                    policy_version=5,
                    advantage=1.0 if i % 2 else -1.0,
                )
            )
    config = LearnerConfig(lora_rank=16, lora_alpha=32, kl_coef=0.02, grad_clip=None)
    trainer = Trainer(config, model_dir)
    trainer.load_adapter_dir(adapter)
    metrics = trainer.step(samples, current_version=5)
    print(
        f"on-policy ratio mean {metrics['onpolicy_ratio_mean']:.4f} "
        f"std {metrics['onpolicy_ratio_std']:.4f} over {metrics['onpolicy_tokens']:.0f} tokens; "
        f"mean |Δlogprob| {metrics['onpolicy_abs_logprob_diff']:.4f} "
        f"max {metrics['onpolicy_max_abs_logprob_diff']:.4f}; grad norm {metrics['grad_norm']:.4f}"
    )
    assert metrics["onpolicy_tokens"] == sum(len(s.completion_ids) for s in samples)
    assert metrics["onpolicy_ratio_mean"] == pytest.approx(1.0, abs=0.05)
    assert metrics["onpolicy_ratio_std"] < 0.2
    assert metrics["onpolicy_abs_logprob_diff"] < 0.1
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert metrics["kl"] > 0  # a random adapter differs from the base
    assert metrics["clipped_fraction"] < 0.05
