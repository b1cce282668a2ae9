"""Every probe set the gate suite will read, read once when the learner starts.

A gate that cannot read its probes fails closed, so a bad or empty probe file (a typo in a
path, a trigger file written for an older format) used to surface only at the first
candidate's gate, minutes or hours later, and then failed every candidate. Read here, it
stops the learner at once, naming the file and line. So does a guard-model classifier whose
key variable (`api_key_env`) is not set, which failed every candidate's safety gate the
same way."""

from __future__ import annotations

from safety.config import GatesConfig
from safety.gates.classifier import guard_api_key
from safety.gates.kl import kl_prompts
from safety.gates.monitors import monitor_probes
from safety.gates.poisoning import trigger_probes
from safety.gates.regression import regression_probes
from safety.gates.safety_probes import red_team_probes


def check_probe_sets(config: GatesConfig) -> dict[str, int]:
    """How many probes each enabled gate will ask; GateError for the first set it cannot use
    (or a guard classifier without its key)."""
    counts: dict[str, int] = {}
    if config.regression.enabled:
        counts["regression"] = len(regression_probes(config.regression))
    if config.kl.enabled:
        counts["kl"] = len(kl_prompts(config.kl))
    if config.safety_probes.enabled:
        counts["safety_probes"] = len(red_team_probes(config.safety_probes))
        guard_api_key(config.safety_probes.classifier)
    if config.monitors.enabled:
        counts["monitors"] = len(monitor_probes(config.monitors, config.regression))
    if config.poisoning.enabled:
        counts["poisoning"] = len(trigger_probes(config.poisoning))
    return counts
