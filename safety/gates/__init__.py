"""Gate suite: regression, KL cap, safety probes, reward-hacking monitors, poisoning probes."""

from safety.gates.classifier import (
    ClassifierError,
    GuardModelClassifier,
    RuleClassifier,
    SafetyClassifier,
    build_classifier,
)
from safety.gates.client import Completion, UpstreamError, VllmClient
from safety.gates.suite import run_gate_suite, run_gate_suite_sync
from safety.gates.types import GateError, GateInterrupted, GateReport, GateResult

__all__ = [
    "ClassifierError",
    "Completion",
    "GateError",
    "GateInterrupted",
    "GateReport",
    "GateResult",
    "GuardModelClassifier",
    "RuleClassifier",
    "SafetyClassifier",
    "UpstreamError",
    "VllmClient",
    "build_classifier",
    "run_gate_suite",
    "run_gate_suite_sync",
]
