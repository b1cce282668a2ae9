"""Every probe set the gate suite will read, read once when the learner starts.

A gate that cannot read its probes fails closed, so a bad or empty probe file (a typo in a
path, a trigger file written for an older format) used to surface only at the first
candidate's gate, minutes or hours later, and then failed every candidate. Read here, it
stops the learner at once, naming the file and line. So does a guard-model classifier whose
key variable (`api_key_env`) is not set, which failed every candidate's safety gate the
same way, and a monitor set without a benign probe (`monitor.refusal` fails closed on it)."""

from __future__ import annotations

import math

from safety.config import GatesConfig
from safety.gates.classifier import RULES_MIN_WORDS, guard_api_key
from safety.gates.kl import kl_prompts
from safety.gates.monitors import monitor_probes
from safety.gates.poisoning import trigger_probes
from safety.gates.probes import BUILTIN, MonitorProbe, load_probes
from safety.gates.regression import regression_probes
from safety.gates.safety_probes import red_team_probes
from safety.gates.types import GateError


def check_probe_sets(config: GatesConfig) -> dict[str, int]:
    """How many probes each enabled gate will ask; GateError for the first set it cannot use
    (or a guard classifier without its key, or monitors without a benign probe)."""
    counts: dict[str, int] = {}
    if config.regression.enabled:
        counts["regression"] = len(regression_probes(config.regression))
    if config.kl.enabled:
        counts["kl"] = len(kl_prompts(config.kl))
    if config.safety_probes.enabled:
        counts["safety_probes"] = len(red_team_probes(config.safety_probes))
        guard_api_key(config.safety_probes.classifier)
    if config.monitors.enabled:
        probes = monitor_probes(config.monitors, config.regression)
        if not any(getattr(probe, "kind", "benign") == "benign" for probe in probes):
            # `monitor.refusal` measures refusals on benign prompts only: without one it
            # fails closed, and so did every candidate's gate, found only at the first one.
            raise GateError(
                "monitor.refusal has no benign probe to measure refusals on: the monitor file "
                f"{config.monitors.probe_file or BUILTIN['monitors']} keeps none within "
                f"monitors.max_probes ({config.monitors.max_probes}) and regression is off "
                "(add a probe of kind 'benign' or turn regression on)"
            )
        counts["monitors"] = len(probes)
    if config.poisoning.enabled:
        counts["poisoning"] = len(trigger_probes(config.poisoning))
    return counts


def gates_that_cannot_fail(config: GatesConfig) -> list[str]:
    """What in these settings no candidate could fail: a rate gate whose margin plus noise
    allowance (`noise_probes` of its probes) reaches the largest change there is, a KL cap,
    length band or poisoning bound at or past the largest value its metric can take, and a
    monitor left with no probe to measure. Mostly legal settings (small probe counts make
    quick test runs; validation refuses `.inf` and a bound of 1, but `model_copy(update=...)`
    skips validation), said at start-up instead of found in a gate report that always
    passes."""
    noise = config.sampling.noise_probes
    found: list[str] = []
    if config.kl.enabled and not math.isfinite(config.kl.cap):
        found.append(f"kl_cap cannot fail: cap {config.kl.cap:g} is not finite")
    if config.poisoning.enabled and not config.poisoning.bound < 1.0:
        found.append(
            f"poisoning cannot fail: bound {config.poisoning.bound:g} >= 1, the largest "
            "shared payload there is"
        )

    def check(name: str, margin: float, probes: int, what: str) -> None:
        if probes and margin + noise / probes >= 1.0:
            found.append(
                f"{name} cannot fail: {what} {margin:g} + noise {noise}/{probes} probes "
                f"= {margin + noise / probes:g} >= 1 (raise max_probes or lower noise_probes)"
            )

    if config.regression.enabled:
        count = len(regression_probes(config.regression))
        check("regression", config.regression.epsilon, count, "epsilon")
    if config.safety_probes.enabled:
        red_team = red_team_probes(config.safety_probes)
        check("safety_probes", config.safety_probes.margin, len(red_team), "margin")
        longest = max(
            (probe.max_tokens or config.sampling.max_tokens for probe in red_team), default=0
        )
        if config.safety_probes.classifier.kind == "rules" and 0 < longest < RULES_MIN_WORDS:
            found.append(
                f"safety_probes cannot fail: replies of at most {longest} tokens hold fewer "
                f"than the {RULES_MIN_WORDS} words the rules classifier needs to call one "
                "unsafe (raise sampling.max_tokens or the probes' max_tokens)"
            )
    if config.monitors.enabled:
        monitors = config.monitors
        probes = monitor_probes(monitors, config.regression)
        kinds = [getattr(probe, "kind", "benign") for probe in probes]
        for name, band in (
            ("length_cap", monitors.length_cap_band),
            ("repetition", monitors.repetition_band),
            ("clarifying_questions", monitors.clarifying_band),
        ):
            check(f"monitor.{name}", band, len(probes), "band")
        check("monitor.refusal", monitors.refusal_band, kinds.count("benign"), "band")
        # Mean tokens lie between 0 and the largest token cap, and the drift is divided by at
        # least 1: it can never exceed that cap.
        most = max(probe.max_tokens or config.sampling.max_tokens for probe in probes)
        if not monitors.length_drift_band < most:
            found.append(
                f"monitor.length_drift cannot fail: band {monitors.length_drift_band:g} >= "
                f"{most}, the largest drift answers of at most {most} tokens can show"
            )
        tools = kinds.count("tool")
        check("monitor.tool_call_validity", monitors.tool_call_validity_band, tools, "band")
        in_file = load_probes(monitors.probe_file or BUILTIN["monitors"], MonitorProbe)
        if not tools and any(probe.kind == "tool" for probe in in_file):
            found.append(
                "monitor.tool_call_validity is not measured: monitors.max_probes "
                f"({monitors.max_probes}) keeps none of the monitor file's tool probes"
            )
    return found
