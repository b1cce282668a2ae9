"""KL cap: mean per-token KL(candidate || base) on a fixed prompt set must stay under a cap.

Tokens are sampled from the candidate (temperature 1, top_p 1, top_k -1: untruncated, as
the logprobs vLLM returns are the untempered full distribution's; seeded), and the
same token ids are scored under the base (forced single-token requests, see
`VllmClient.score_tokens`). Per token we use the
non-negative, unbiased estimator k3 = r - 1 - log r with r = p_base / p_candidate."""

from __future__ import annotations

import math

from safety.config import KLGateConfig
from safety.gates.aio import gather_or_cancel
from safety.gates.context import SuiteContext
from safety.gates.probes import KLPrompt, keep_first, load_probes
from safety.gates.types import GateError, GateResult

NAME = "kl_cap"


async def _sample_and_score(
    ctx: SuiteContext, probe: KLPrompt, config: KLGateConfig, seed: int
) -> tuple[list[float], list[float]]:
    sample = await ctx.client.chat(
        ctx.candidate,
        probe.messages(),
        max_tokens=probe.max_tokens or config.max_tokens,
        temperature=config.temperature,
        seed=seed,
        logprobs=True,
        # Untruncated: vLLM's logprobs are the full distribution's, so a `top_k`/`top_p`
        # from the model's generation config would sample from another one (biased low).
        top_p=1.0,
        top_k=-1,
    )
    if sample.logprobs is None or len(sample.logprobs) != len(sample.token_ids):
        raise GateError(f"{probe.id}: candidate returned no per-token logprobs")
    if not sample.prompt_token_ids:
        raise GateError(f"{probe.id}: upstream did not return prompt token ids")
    base = await ctx.client.score_tokens(ctx.base, sample.prompt_token_ids, sample.token_ids)
    return sample.logprobs, base


def kl_prompts(config: KLGateConfig) -> list[KLPrompt]:
    prompts = keep_first(
        load_probes(config.prompt_file, KLPrompt), config.max_prompts, "kl.max_prompts"
    )
    if not prompts:
        raise GateError(f"no KL prompts in {config.prompt_file}")
    return prompts


async def kl_gate(ctx: SuiteContext, config: KLGateConfig) -> GateResult:
    probes = kl_prompts(config)
    # One prompt's failure fails the gate: the others' sampling and scoring stop with it.
    pairs = await gather_or_cancel(
        *[
            _sample_and_score(ctx, probe, config, ctx.sampling.seed + index)
            for index, probe in enumerate(probes)
        ]
    )
    k1: list[float] = []
    k3: list[float] = []
    for candidate_lps, base_lps in pairs:
        for lp_c, lp_b in zip(candidate_lps, base_lps, strict=True):
            log_ratio = lp_b - lp_c
            k1.append(-log_ratio)
            k3.append(math.expm1(log_ratio) - log_ratio)
    if not k3:
        raise GateError("the candidate produced no tokens to measure KL on")
    mean_kl = sum(k3) / len(k3)
    return GateResult.compare(
        NAME,
        mean_kl,
        config.cap,
        "<=",
        {
            "estimator": "k3",
            "mean_k1": round(sum(k1) / len(k1), 6),
            "max_token_kl": round(max(k3), 6),
            "tokens": len(k3),
            "prompts": len(probes),
            "temperature": config.temperature,
        },
    )
