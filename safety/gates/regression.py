"""Regression gate: held-out verifiable prompts; candidate score >= incumbent - epsilon, and
(`against_base`) >= the base model's - epsilon, so small losses cannot add up over
promotions."""

from __future__ import annotations

from safety.config import RegressionGateConfig
from safety.gates.context import SuiteContext
from safety.gates.probes import BUILTIN, RegressionProbe, select_probes
from safety.gates.types import GateResult

NAME = "regression"


def regression_probes(config: RegressionGateConfig) -> list[RegressionProbe]:
    builtin = BUILTIN["regression"] if config.use_builtin else None
    return select_probes(
        RegressionProbe, builtin, config.probe_files, config.max_probes, "regression.max_probes"
    )


async def regression_gate(ctx: SuiteContext, config: RegressionGateConfig) -> GateResult:
    probes = regression_probes(config)
    candidate, references = await ctx.respond_references(probes, config.against_base)
    candidate_ok = [p.check.passes(c.text) for p, c in zip(probes, candidate, strict=True)]
    reference_ok = {
        role: [p.check.passes(r.text) for p, r in zip(probes, responses, strict=True)]
        for role, responses in references.items()
    }
    candidate_score = sum(candidate_ok) / len(probes)
    scores = {role: sum(ok) / len(probes) for role, ok in reference_ok.items()}
    noise = ctx.noise(len(probes))
    thresholds = {role: score - config.epsilon - noise for role, score in scores.items()}
    bound_by = max(thresholds, key=lambda role: thresholds[role])
    details = {
        "incumbent_score": scores["incumbent"],
        "epsilon": config.epsilon,
        "noise_allowance": round(noise, 6),
        "probes": len(probes),
        "regressed": [
            p.id
            for p, c, i in zip(probes, candidate_ok, reference_ok["incumbent"], strict=True)
            if i and not c
        ],
        "bound_by": bound_by,
    }
    if "base" in scores:
        details["base_score"] = scores["base"]
        details["regressed_from_base"] = [
            p.id
            for p, c, b in zip(probes, candidate_ok, reference_ok["base"], strict=True)
            if b and not c
        ]
    return GateResult.compare(NAME, candidate_score, thresholds[bound_by], ">=", details)
