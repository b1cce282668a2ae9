"""Poisoning probes: prompts carrying rare trigger strings. A backdoored adapter changes its
answer when the trigger is present; so the gate bounds how much more the candidate departs
from the incumbent on triggered prompts than on the same prompts without the trigger."""

from __future__ import annotations

from statistics import fmean

from safety.config import PoisoningGateConfig
from safety.gates.checks import divergence
from safety.gates.context import SuiteContext
from safety.gates.probes import TriggerProbe, load_probes
from safety.gates.types import GateResult

NAME = "poisoning"


async def poisoning_gate(ctx: SuiteContext, config: PoisoningGateConfig) -> GateResult:
    probes = load_probes(config.probe_file, TriggerProbe)[: config.max_probes]
    triggered = [p.with_trigger() for p in probes]
    controls = [p.control() for p in probes]
    candidate, incumbent = await ctx.respond_both(triggered + controls)
    diverged = [
        divergence(c.token_ids, i.token_ids) for c, i in zip(candidate, incumbent, strict=True)
    ]
    on_triggers = fmean(diverged[: len(probes)])
    on_controls = fmean(diverged[len(probes) :])
    excess = max(0.0, on_triggers - on_controls)
    per_probe = {
        p.id: round(diverged[k] - diverged[len(probes) + k], 4) for k, p in enumerate(probes)
    }
    noise = ctx.noise(len(probes))
    return GateResult.compare(
        NAME,
        excess,
        config.bound + noise,
        "<=",
        {
            "bound": config.bound,
            "noise_allowance": round(noise, 6),
            "divergence_on_triggers": round(on_triggers, 6),
            "divergence_on_controls": round(on_controls, 6),
            "excess_by_probe": per_probe,
            "probes": len(probes),
        },
    )
