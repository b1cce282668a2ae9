"""Result types of the gate suite; plain data so they serialise into olp_meta.json and the
audit log unchanged."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Verdict = Literal["pass", "fail"]
Comparison = Literal["<=", ">="]


class GateError(RuntimeError):
    """A gate could not reach a verdict (upstream error, classifier error, bad probe file).

    The suite records it as a failed gate with the reason: promotion fails closed."""


class GateInterrupted(RuntimeError):
    """The suite was asked to stop (its caller is shutting down) before it had a verdict.

    Not a failed gate: nothing was measured, so the candidate is neither passed nor
    rejected, and its caller decides what happens to it."""


@dataclass
class GateResult:
    name: str
    metric: float | None  # None when the gate could not measure (it then fails)
    threshold: float | None
    verdict: Verdict
    details: dict[str, Any] = field(default_factory=dict)
    comparison: Comparison = "<="  # pass iff `metric <comparison> threshold`

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @classmethod
    def compare(
        cls,
        name: str,
        metric: float,
        threshold: float,
        comparison: Comparison,
        details: dict[str, Any],
    ) -> GateResult:
        # Compared as recorded: thresholds are sums of rates (0.8 - 0.1 - 0.1 is
        # 0.6000000000000001), and a metric exactly at its threshold must pass, not show
        # `0.6 >= 0.6: fail` in the report.
        metric, threshold = round(metric, 6), round(threshold, 6)
        ok = metric <= threshold if comparison == "<=" else metric >= threshold
        return cls(
            name=name,
            metric=metric,
            threshold=threshold,
            verdict="pass" if ok else "fail",
            details=details,
            comparison=comparison,
        )

    @classmethod
    def failed_closed(cls, name: str, reason: str, unreachable: bool = False) -> GateResult:
        """A gate that reached no verdict; `unreachable`: because a server did not answer."""
        details: dict[str, Any] = {"reason": reason}
        if unreachable:
            details["unreachable"] = True
        return cls(name=name, metric=None, threshold=None, verdict="fail", details=details)

    @property
    def unreachable(self) -> bool:
        return not self.passed and self.details.get("unreachable") is True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class GateReport:
    passed: bool
    results: list[GateResult]
    candidate: str = ""
    incumbent: str = ""
    base: str = ""
    started_at: float = 0.0
    duration_s: float = 0.0

    @property
    def failed_gates(self) -> list[str]:
        return [result.name for result in self.results if not result.passed]

    @property
    def unanswered(self) -> bool:
        """Failed only because a server did not answer: no verdict on the candidate."""
        failed = [result for result in self.results if not result.passed]
        return bool(failed) and all(result.unreachable for result in failed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "candidate": self.candidate,
            "incumbent": self.incumbent,
            "base": self.base,
            "started_at": self.started_at,
            "duration_s": round(self.duration_s, 3),
            "failed_gates": self.failed_gates,
            "results": [result.to_dict() for result in self.results],
        }
