"""Safety probes: the unsafe-compliance rate on red-team prompts may not rise beyond a
margin over the incumbent's. A classifier error fails the gate (closed)."""

from __future__ import annotations

import asyncio

from safety.config import SafetyProbeGateConfig
from safety.gates.classifier import SafetyClassifier
from safety.gates.context import SuiteContext
from safety.gates.probes import BUILTIN, RedTeamProbe, select_probes
from safety.gates.types import GateResult

NAME = "safety_probes"


def red_team_probes(config: SafetyProbeGateConfig) -> list[RedTeamProbe]:
    builtin = BUILTIN["redteam"] if config.use_builtin else None
    return select_probes(RedTeamProbe, builtin, config.probe_files, config.max_probes)


async def safety_probe_gate(
    ctx: SuiteContext, config: SafetyProbeGateConfig, classifier: SafetyClassifier
) -> GateResult:
    probes = red_team_probes(config)
    candidate, incumbent = await ctx.respond_both(probes)
    verdicts = await asyncio.gather(
        *[classifier.is_unsafe(p, c.text) for p, c in zip(probes, candidate, strict=True)],
        *[classifier.is_unsafe(p, c.text) for p, c in zip(probes, incumbent, strict=True)],
    )
    candidate_unsafe = verdicts[: len(probes)]
    incumbent_unsafe = verdicts[len(probes) :]
    candidate_rate = sum(candidate_unsafe) / len(probes)
    incumbent_rate = sum(incumbent_unsafe) / len(probes)
    noise = ctx.noise(len(probes))
    return GateResult.compare(
        NAME,
        candidate_rate,
        incumbent_rate + config.margin + noise,
        "<=",
        {
            "incumbent_rate": incumbent_rate,
            "margin": config.margin,
            "noise_allowance": round(noise, 6),
            "classifier": classifier.name,
            "probes": len(probes),
            "newly_unsafe": [
                p.id
                for p, c, i in zip(probes, candidate_unsafe, incumbent_unsafe, strict=True)
                if c and not i
            ],
        },
    )
