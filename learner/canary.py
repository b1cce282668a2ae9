"""Canary evidence: live reward and guard rates per served version, and the verdict rule.

Each record names the version that served it, so the canary compares the candidate's arm
with the stable arm on exactly the traffic they served side by side since the canary
started: every reply the learner consumed, the ones it cannot train on too (a reply the user
stopped, one vLLM failed on, one with flags or redactions): those carry no reward, but their
guard checks count, and so does `unfinished` (a status other than `ok`). Built from the
trainable replies alone, the canary never saw the aborted runaway replies of a candidate
that degenerated, and promoted it. The guard rates are the gate's
reward-hacking monitors applied to live replies (safety/gates/checks.py). Under torchrun
each rank reduces the replies the running canary counts to `Evidence` (a few fields) and the
monitor, on rank 0 only, counts the union (`share_canary_evidence`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import structlog

from learner.config import CanaryConfig
from learner.distributed import DistContext, all_gather_object, broadcast_object
from learner.objective import usable
from learner.rewards.assembler import RewardedChoice
from learner.rewards.verifiers import choice_text, message_text, tool_calls_valid
from safety.gates.checks import is_clarifying_question, is_degenerate, is_refusal

log = structlog.get_logger(__name__)

GUARDS = ("degenerate", "refusal", "clarifying_question", "invalid_tool_call", "unfinished")


@dataclass
class ArmStats:
    """What one version served since the canary began."""

    samples: int = 0
    rewarded: int = 0
    reward_sum: float = 0.0
    tool_call_samples: int = 0
    flags: dict[str, int] = field(default_factory=lambda: dict.fromkeys(GUARDS, 0))

    @property
    def reward_mean(self) -> float | None:
        return self.reward_sum / self.rewarded if self.rewarded else None

    def rate(self, guard: str) -> float | None:
        denominator = self.tool_call_samples if guard == "invalid_tool_call" else self.samples
        return self.flags[guard] / denominator if denominator else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "rewarded": self.rewarded,
            "reward_mean": self.reward_mean,
            **{f"{g}_rate": self.rate(g) for g in GUARDS},
        }


def asked(trajectory: dict[str, Any]) -> str | None:
    """What the reply answers: the last user message's text (a completion's prompt), for
    telling a question asked back from the prompt restated before its answer."""
    request = trajectory.get("request") or {}
    messages = request.get("messages")
    if not isinstance(messages, list):
        prompt = request.get("prompt")
        return prompt if isinstance(prompt, str) else None
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return message_text(message.get("content"))
    return None


def guard_flags(rewarded: RewardedChoice) -> dict[str, bool]:
    """The guard checks of one sampled reply (invalid_tool_call only when it called a tool)."""
    choices = rewarded.trajectory.get("choices") or []
    choice = next((c for c in choices if c.get("index", 0) == rewarded.choice_index), {})
    text = choice_text(choice)
    flags = {
        "degenerate": is_degenerate(text, list(choice.get("token_ids") or []))
        and not (choice.get("message") or {}).get("tool_calls"),
        "refusal": is_refusal(text),
        "clarifying_question": is_clarifying_question(text, asked(rewarded.trajectory)),
    }
    validity = tool_calls_valid(rewarded.trajectory, choice)
    if validity is not None:
        flags["invalid_tool_call"] = validity < 1.0
    return flags


@dataclass(frozen=True)
class CanaryWindow:
    """The replies a running canary counts: its arms' versions, created at or after `since`,
    asked of its alias (None: any). Replies to another alias were never split: while the
    stable arm was the base model, the base alias's clients (who pinned it to stay off the
    policy) filled the stable arm with traffic the canary never saw side by side."""

    versions: frozenset[str]
    since: float
    alias: str | None = None

    def covers(self, trajectory: dict[str, Any]) -> bool:
        if str(trajectory.get("policy_version")) not in self.versions:
            return False
        if self.alias is not None and trajectory.get("model_alias") != self.alias:
            return False
        return _created_at(trajectory) >= self.since


def _created_at(trajectory: dict[str, Any]) -> float:
    return float(trajectory.get("created_at") or 0.0)


@dataclass(frozen=True)
class Evidence:
    """One scored reply as the canary reads it: a few fields instead of the trajectory, so
    that torchrun's ranks can send theirs to rank 0 cheaply."""

    version: str
    created_at: float
    reward: float | None
    flags: dict[str, bool]


def canary_evidence(
    batch: list[RewardedChoice],
    window: CanaryWindow,
    untrainable: list[dict[str, Any]] | None = None,
) -> list[Evidence]:
    """The evidence of the replies in `batch`, and of the `untrainable` records (no reward:
    their guard checks, and whether they finished), that `window` covers (the others are
    not counted, so they are neither checked nor sent)."""
    out: list[Evidence] = []
    for item in batch:
        trajectory = item.trajectory
        if window.covers(trajectory):
            version = str(trajectory.get("policy_version"))
            flags = {**guard_flags(item), "unfinished": trajectory.get("status", "ok") != "ok"}
            out.append(Evidence(version, _created_at(trajectory), item.reward, flags))
    for trajectory in untrainable or []:
        if not window.covers(trajectory):
            continue
        version, created_at = str(trajectory.get("policy_version")), _created_at(trajectory)
        unfinished = trajectory.get("status", "ok") != "ok"
        choices = [c for c in trajectory.get("choices") or [] if isinstance(c, dict)]
        if not choices:  # failed before its first token: nothing to check but that
            out.append(Evidence(version, created_at, None, {"unfinished": unfinished}))
        for choice in choices:
            reply = RewardedChoice(trajectory, int(choice.get("index", 0)), reward=None)
            flags = {**guard_flags(reply), "unfinished": unfinished}
            out.append(Evidence(version, created_at, None, flags))
    return out


class CanaryMonitor:
    """Collects per-version evidence from the learner's scored batches (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since: float | None = None
        self._alias: str | None = None
        self._arms: dict[str, ArmStats] = {}

    def begin(self, versions: list[str], since: float, alias: str | None = None) -> None:
        """Count only trajectories of these versions created at or after `since`, asked of
        `alias` (None: any)."""
        with self._lock:
            self._since = since
            self._alias = alias
            self._arms = {v: ArmStats() for v in versions}

    def end(self) -> None:
        with self._lock:
            self._since = None
            self._arms = {}

    def window(self) -> CanaryWindow | None:
        """What the running canary counts (None: no canary runs)."""
        with self._lock:
            if self._since is None:
                return None
            return CanaryWindow(frozenset(self._arms), self._since, self._alias)

    def observe(
        self, batch: list[RewardedChoice], untrainable: list[dict[str, Any]] | None = None
    ) -> None:
        """Count a scored batch of this process (the single-process learner's path)."""
        window = self.window()
        if window is not None:
            self.observe_evidence(canary_evidence(batch, window, untrainable))

    def observe_evidence(self, items: list[Evidence]) -> None:
        """Count replies already reduced to evidence (gathered from every rank under
        torchrun); checked against the canary running now, which may have changed since
        the window they were selected by."""
        with self._lock:
            if self._since is None:
                return
            for item in items:
                arm = self._arms.get(item.version)
                if arm is None or item.created_at < self._since:
                    continue
                arm.samples += 1
                # A corrupt reward (non-finite, or beyond REWARD_LIMIT) is not evidence; the
                # learner drops it too (`bad_reward`), by the same rule.
                if item.reward is not None and usable(item.reward):
                    arm.rewarded += 1
                    arm.reward_sum += item.reward
                if "invalid_tool_call" in item.flags:
                    arm.tool_call_samples += 1
                for guard, raised in item.flags.items():
                    arm.flags[guard] += int(raised)

    def arm(self, version: str) -> ArmStats:
        """A copy of one arm's figures."""
        with self._lock:
            stats = self._arms.get(version, ArmStats())
            return ArmStats(
                stats.samples,
                stats.rewarded,
                stats.reward_sum,
                stats.tool_call_samples,
                dict(stats.flags),
            )


def share_canary_evidence(
    ctx: DistContext,
    canary: CanaryMonitor | None,
    rewarded: list[RewardedChoice],
    untrainable: list[dict[str, Any]] | None = None,
) -> None:
    """Count every rank's scored replies in rank 0's canary (`canary` elsewhere: unused).

    Collective: every rank calls it once per step, in the same order, with an empty batch
    too. Rank 0 broadcasts what the running canary counts; each rank sends only the replies
    inside that window, reduced to `Evidence`, never whole trajectories; without a canary
    nothing is gathered. Live evidence must never stop training: a failure here is logged
    and costs that rank's share of one batch, while the collectives still run."""
    window = None
    if ctx.is_main and canary is not None:
        try:
            window = canary.window()
        except Exception:
            log.exception("canary_window_failed")
    window = broadcast_object(ctx, window)
    if window is None:  # the same on every rank: broadcast
        return
    local: list[Evidence] = []
    try:
        local = canary_evidence(rewarded, window, untrainable)
    except Exception:
        log.exception("canary_evidence_failed", batch=len(rewarded), rank=ctx.rank)
    parts = all_gather_object(ctx, local)
    if ctx.is_main and canary is not None:
        try:
            canary.observe_evidence([item for part in parts for item in part])
        except Exception:
            log.exception("canary_observe_failed", batch=sum(len(part) for part in parts))


@dataclass
class CanaryVerdict:
    decision: str  # promote | rollback | wait
    reasons: list[str]
    stable: dict[str, Any]
    candidate: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "reasons": self.reasons,
            "stable": self.stable,
            "candidate": self.candidate,
        }


# At the deadline `on_timeout: promote` still needs this many rewarded (or, for the guards,
# observed) trajectories per arm before the evidence it has may stop it; below that nothing
# was observed and the operator's choice applies.
TIMEOUT_FLOOR = 5


def _tool_call_rates(
    stable: ArmStats, candidate: ArmStats, floor: int
) -> tuple[float | None, float | None]:
    """The invalid-tool-call rates to compare, over the replies that called a tool: none
    while the candidate made fewer than `floor` calls (one invalid call of one rolled a
    candidate back), and the stable arm's as 0 while it made fewer (no evidence that its
    calls fail; before, a candidate whose 30 calls were all invalid was promoted because the
    stable arm had made none)."""
    if candidate.tool_call_samples < floor:
        return None, None
    theirs = stable.rate("invalid_tool_call") if stable.tool_call_samples >= floor else 0.0
    return candidate.rate("invalid_tool_call"), theirs


def _regressions(
    config: CanaryConfig, stable: ArmStats, candidate: ArmStats, samples: int, rewarded: int
) -> list[str]:
    """Guard rates compared once both arms served `samples` trajectories, mean reward once
    both have `rewarded` rewarded ones; the reasons the candidate is worse by a margin."""
    reasons: list[str] = []
    if min(stable.samples, candidate.samples) >= samples:
        for guard in GUARDS:
            ours, theirs = candidate.rate(guard), stable.rate(guard)
            if guard == "invalid_tool_call":
                ours, theirs = _tool_call_rates(stable, candidate, min(samples, TIMEOUT_FLOOR))
            if ours is not None and theirs is not None and ours > theirs + config.guard_margin:
                reasons.append(
                    f"{guard} rate {ours:.3f} > stable {theirs:.3f} + {config.guard_margin}"
                )
    if min(stable.rewarded, candidate.rewarded) >= rewarded:
        ours_r, theirs_r = candidate.reward_mean, stable.reward_mean
        assert ours_r is not None and theirs_r is not None
        if ours_r < theirs_r - config.reward_margin:
            reasons.append(f"reward {ours_r:.3f} < stable {theirs_r:.3f} - {config.reward_margin}")
    return reasons


def judge_canary(
    config: CanaryConfig, stable: ArmStats, candidate: ArmStats, elapsed_s: float
) -> CanaryVerdict:
    """Roll back as soon as the evidence shows the candidate worse by a margin (guard rates
    once both arms served `min_samples` trajectories, mean reward once both have
    `min_samples` rewarded ones); promote once both counts are reached and it is not. At the
    deadline apply `on_timeout`, except that `promote` turns into a rollback when the
    evidence there is (at least TIMEOUT_FLOOR per arm) already shows such a regression."""
    n = config.min_samples
    reasons = _regressions(config, stable, candidate, n, n)
    enough = min(stable.samples, candidate.samples, stable.rewarded, candidate.rewarded) >= n
    decision = "wait"
    if reasons:
        decision = "rollback"
    elif enough:
        decision = "promote"
        reasons.append("no guard or reward regression beyond the margins")
    elif elapsed_s >= config.max_duration_s:
        decision = config.on_timeout
        reasons.append(
            f"evidence still short after {elapsed_s:.0f} s "
            f"(samples {stable.samples}/{candidate.samples}, "
            f"rewarded {stable.rewarded}/{candidate.rewarded}, need {n})"
        )
        if decision == "promote":
            floor = min(n, TIMEOUT_FLOOR)
            worse = _regressions(config, stable, candidate, floor, floor)
            if worse:
                decision = "rollback"
                reasons += [f"{r} on the short evidence" for r in worse]
    return CanaryVerdict(decision, reasons, stable.to_dict(), candidate.to_dict())
