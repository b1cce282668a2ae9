"""Combines feedback, verifier and judge rewards per sample with the configured weights."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from learner.config import RewardConfig
from learner.objective import group_key
from learner.rewards.feedback import feedback_reward, unmatched
from learner.rewards.judge import STOPPED, Judge
from learner.rewards.verifiers import VerifierRunner


@dataclass
class RewardedChoice:
    """One sampled choice of a trajectory with its reward (None: not trained on)."""

    trajectory: dict[str, Any]
    choice_index: int
    reward: float | None
    parts: dict[str, float] = field(default_factory=dict)
    judge_raw: dict[str, Any] | None = None
    # A verifier call or the judge's verdict failed on it: no reward (`incomplete`).
    incomplete: bool = False


def as_pair(item: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Accept a ScoredTrajectory or a {'trajectory', 'feedback'} dict."""
    if isinstance(item, dict):
        return item["trajectory"], list(item.get("feedback") or [])
    return item.trajectory, list(item.feedback or [])


def trainable(trajectory: dict[str, Any]) -> bool:
    """A record the proxy found consistent and left unredacted. `trainable` alone was
    trusted: a schema-valid record from another producer with flags (a token count that
    disagrees) or redactions (ids of text that was removed) but `trainable: true` trained."""
    redactions = trajectory.get("redactions") or {}
    return (
        bool(trajectory.get("trainable", True))
        and trajectory.get("status", "ok") == "ok"
        and not trajectory.get("flags")
        and not (isinstance(redactions, dict) and any(redactions.values()))
    )


def untrainable_records(items: list[Any]) -> list[dict[str, Any]]:
    """The trajectories of `items` that `trainable` leaves out (the canary still counts
    their guard checks)."""
    return [t for t, _ in map(as_pair, items) if not trainable(t)]


class RewardAssembler:
    """reward = Σ_k w_k·part_k / Σ_k w_k over the parts that produced a value, where a
    sample without feedback counts its feedback as 0 (neutral) once it has another part.

    Parts: `feedback` (explicit events), `verifiers`, `judge`. Feedback comes only for the
    reply a user acted on, while verifiers and the judge score every reply; taken as a
    missing part, an `accept` (0.75) averaged down a reply its verifier scored 1.0 below
    its unaccepted siblings, and the advantage pushed the accepted reply down. Counted as 0
    when missing, an accept always raises a reply against its siblings and a reject
    lowers it. A sample with no part is not trained on and is counted under `no_reward`;
    one whose verifier call or judge verdict failed (its siblings are scored on a part it
    lacks) under `incomplete`; a record without choices under `no_choices`, feedback
    events addressed to a choice the record lacks under `feedback_unmatched`.
    """

    def __init__(
        self,
        config: RewardConfig,
        judge: Judge | None = None,
        verifiers: VerifierRunner | None = None,
    ) -> None:
        self.config = config
        self.judge = judge
        self.verifiers = verifiers if verifiers is not None else VerifierRunner(config.verifiers)
        self.counts: Counter[str] = Counter()

    @property
    def ranks_groups(self) -> bool:
        """Whether the judge ranks a group's replies against each other (`rank_groups`)."""
        return (
            self.judge is not None
            and self.config.weights.judge > 0
            and self.judge.config.rank_groups
        )

    def judge_group_keys(self, items: list[Any]) -> set[str]:
        """The judge groups of `items` that span records (a client's group id): the ones
        another torchrun rank may hold part of."""
        keys = set()
        for item in items:
            trajectory, _ = as_pair(item)
            if trajectory.get("group_id"):
                keys.add(_judge_group_key(trajectory))
        return keys

    def assemble(
        self,
        items: list[Any],
        stop: threading.Event | None = None,
        unranked: frozenset[str] = frozenset(),
    ) -> list[RewardedChoice]:
        """The rewarded choices of `items`. Verifiers and the judge may each take up to
        their timeout per call, so `stop` is looked at before each item and each judge
        group: once it is set the rest get no verifier or judge part, and the caller must
        not train on the result (the learner drops the batch and reads it again).

        The judge groups in `unranked` (`judge_group_keys` that another rank holds part of)
        are graded reply by reply, not ranked: ranked per rank, each rank's best reply got
        the ranking's whole bonus (0.44 became 0.94 for a reply best only on its rank),
        while the advantages compare the group across ranks."""
        weights = self.config.weights
        timeouts, errors = self.verifiers.timeouts, self.verifiers.errors
        out: list[RewardedChoice] = []
        judge_groups: dict[str, list[RewardedChoice]] = {}
        for item in items:
            if stop is not None and stop.is_set():
                break
            trajectory, feedback = as_pair(item)
            if not trainable(trajectory):
                self.counts["untrainable"] += len(trajectory.get("choices") or []) or 1
                continue
            indexes = [int(c.get("index", 0)) for c in trajectory.get("choices") or []]
            if len(set(indexes)) != len(indexes):
                # Choices are found by index (feedback, the judge, the sample's tokens): two
                # with one index got each other's tokens under their own rewards.
                self.counts["duplicate_choice_index"] += len(indexes)
                continue
            # Feedback for a choice the record does not have (a client's wrong choice_index)
            # rewards nothing; a record without choices has nothing to train. Both were
            # dropped without a trace.
            if unmatched_events := unmatched(feedback, indexes):
                self.counts["feedback_unmatched"] += unmatched_events
            if not indexes:
                self.counts["no_choices"] += 1
                continue
            for choice in trajectory.get("choices") or []:
                index = int(choice.get("index", 0))
                rewarded = RewardedChoice(trajectory=trajectory, choice_index=index, reward=None)
                found = feedback_reward(feedback, index, self.config.feedback_values)
                if found.invalid:
                    self.counts["invalid_feedback"] += found.invalid
                if found.clamped:
                    self.counts["score_clamped"] += found.clamped
                if found.value is not None and weights.feedback > 0:
                    rewarded.parts["feedback"] = found.value
                if self.verifiers and weights.verifiers > 0:
                    verified = self.verifiers.verify(trajectory, choice)
                    rewarded.incomplete = verified.failed
                    if verified.value is not None:
                        rewarded.parts["verifiers"] = verified.value
                if self.judge is not None and weights.judge > 0:
                    judge_groups.setdefault(_judge_group_key(trajectory), []).append(rewarded)
                out.append(rewarded)
        for key, group in judge_groups.items():
            if stop is not None and stop.is_set():
                break
            self._judge_group(group, stop, rank=key not in unranked)
        # Surfaced with the other reward counts (learner_step log, checkpoint counters).
        if self.verifiers.timeouts > timeouts:
            self.counts["verifier_timeouts"] += self.verifiers.timeouts - timeouts
        if self.verifiers.errors > errors:
            self.counts["verifier_errors"] += self.verifiers.errors - errors
        for rewarded in out:
            if rewarded.incomplete:
                self.counts["incomplete"] += 1
                continue
            parts = rewarded.parts
            total = sum(getattr(weights, name) * v for name, v in parts.items())
            weight = sum(getattr(weights, name) for name in parts)
            if weight > 0:
                if "feedback" not in parts:
                    weight += weights.feedback  # no feedback: a neutral 0
                rewarded.reward = total / weight
                self.counts["rewarded"] += 1
            else:
                self.counts["no_reward"] += 1
        return out

    def close(self) -> None:
        """Release the judge's worker threads and HTTP client (the learner calls it when it
        stops); the verifiers' calls run on daemon threads and hold nothing. Idempotent."""
        try:
            self.verifiers.close()
        finally:
            if self.judge is not None:
                self.judge.close()

    def _judge_group(
        self, group: list[RewardedChoice], stop: threading.Event | None, rank: bool
    ) -> None:
        assert self.judge is not None
        trajectory = group[0].trajectory
        choices = [_choice(r) for r in group]
        verdicts = self.judge.score_group(trajectory, choices, stop, rank=rank)
        for rewarded, verdict in zip(group, verdicts, strict=True):
            rewarded.judge_raw = {"raw": verdict.raw, "error": verdict.error}
            if verdict.error == STOPPED:
                continue  # not a failure: the batch is dropped
            if verdict.score is None:
                self.counts["judge_failed"] += 1
                rewarded.incomplete = True
            else:
                rewarded.parts["judge"] = verdict.score


def _judge_group_key(trajectory: dict[str, Any]) -> str:
    """The replies the judge sees together, against one conversation: the objective's group
    (a tenant's group id and one prompt, else the record's choices). A group id is the
    client's free label: records with other prompts under it were graded against the first
    one's conversation."""
    if not trajectory.get("group_id"):
        return f"t:{trajectory.get('trajectory_id', '')}"
    return group_key(trajectory)


def _choice(rewarded: RewardedChoice) -> dict[str, Any]:
    for choice in rewarded.trajectory.get("choices") or []:
        if int(choice.get("index", 0)) == rewarded.choice_index:
            return choice
    raise KeyError(rewarded.choice_index)
