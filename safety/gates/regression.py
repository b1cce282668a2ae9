"""Regression gate: held-out verifiable prompts; candidate score >= incumbent - epsilon."""

from __future__ import annotations

from safety.config import RegressionGateConfig
from safety.gates.context import SuiteContext
from safety.gates.probes import BUILTIN, RegressionProbe, select_probes
from safety.gates.types import GateResult

NAME = "regression"


def regression_probes(config: RegressionGateConfig) -> list[RegressionProbe]:
    builtin = BUILTIN["regression"] if config.use_builtin else None
    return select_probes(RegressionProbe, builtin, config.probe_files, config.max_probes)


async def regression_gate(ctx: SuiteContext, config: RegressionGateConfig) -> GateResult:
    probes = regression_probes(config)
    candidate, incumbent = await ctx.respond_both(probes)
    candidate_ok = [p.check.passes(c.text) for p, c in zip(probes, candidate, strict=True)]
    incumbent_ok = [p.check.passes(c.text) for p, c in zip(probes, incumbent, strict=True)]
    candidate_score = sum(candidate_ok) / len(probes)
    incumbent_score = sum(incumbent_ok) / len(probes)
    noise = ctx.noise(len(probes))
    return GateResult.compare(
        NAME,
        candidate_score,
        incumbent_score - config.epsilon - noise,
        ">=",
        {
            "incumbent_score": incumbent_score,
            "epsilon": config.epsilon,
            "noise_allowance": round(noise, 6),
            "probes": len(probes),
            "regressed": [
                p.id
                for p, c, i in zip(probes, candidate_ok, incumbent_ok, strict=True)
                if i and not c
            ],
        },
    )
