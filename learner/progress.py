"""Periodic structured progress line: step, trajectories consumed, reward trend, KL, tokens/s,
and what the learner did not train on."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

# The learner's counters (docs/learner.md, "The update") of trajectories and samples it read
# and did not train on. A learner that cannot keep up, or traffic whose rewards never arrive,
# shows here and not only in one warning per batch.
DROPPED = (
    "overflow",
    "stale",
    "no_reward",
    "bad_reward",
    "bad_tokens",
    "bad_logprobs",
    "bad_version",
    "capped",
    "reward_untrainable",
    "reward_incomplete",  # a verifier or the judge failed on it (within no_reward)
    "reward_duplicate_choice_index",
    "reward_no_choices",
    "reward_feedback_unmatched",  # feedback events (not samples) that rewarded no choice
    "nonfinite_gradient",
    "step_failed",  # the training step raised (single process): weights put back
)


class Progress:
    def __init__(self, interval_s: float, window: int = 10) -> None:
        self.interval_s = interval_s
        self.started = time.monotonic()
        self.last_logged = 0.0
        self.step = 0
        self.version = 0
        self.consumed = 0
        self.trained_tokens = 0.0
        self.rewards: deque[float] = deque(maxlen=window)
        self.kl = float("nan")
        self.frozen = False
        self.counts: Mapping[str, int] = {}  # the learner's cumulative counters
        # The counters as a checkpoint restored them: `dropped` is since this start, as
        # `consumed` is (a line right after a restart read `consumed: 0` beside an earlier
        # run's overflow, as if it had dropped more than it read).
        self.counts_at_start: Mapping[str, int] = {}
        # Where the last snapshot left off: tokens/s is over the time since then (over the
        # whole uptime, a learner that trained at once after a long frozen or idle start
        # showed a fraction of its rate, and a stalled one kept showing its old rate).
        self._rate_from = (self.started, 0.0)

    def record_step(self, version: int, metrics: dict[str, float]) -> None:
        self.step += 1
        self.version = version
        self.trained_tokens += metrics.get("tokens", 0.0)
        self.rewards.append(metrics.get("reward_mean", float("nan")))
        self.kl = metrics.get("kl", float("nan"))

    def record_untrained_reward(self, reward_mean: float) -> None:
        """A batch's reward when nothing of it trained (every group's replies scored alike):
        a policy that got everything right is the trend's best point, not a gap in it."""
        self.rewards.append(reward_mean)

    def snapshot(self) -> dict[str, float | int | bool | list[float]]:
        """The progress line's fields; `tokens_per_s` is over the time since the previous
        snapshot (the previous line), `trained_tokens` since start."""
        now = time.monotonic()
        since, tokens_then = self._rate_from
        elapsed = max(now - since, 1e-9)
        rate = (self.trained_tokens - tokens_then) / elapsed
        self._rate_from = (now, self.trained_tokens)
        trend = list(self.rewards)
        return {
            "step": self.step,
            "version": self.version,
            "consumed": self.consumed,
            "reward_recent": [round(r, 4) for r in trend],
            "reward_trend": round(trend[-1] - trend[0], 4) if len(trend) > 1 else 0.0,
            "kl": self.kl,
            "tokens_per_s": round(rate, 2),
            "trained_tokens": int(self.trained_tokens),
            "frozen": self.frozen,
            "dropped": {
                name: dropped
                for name in DROPPED
                if (dropped := self.counts.get(name, 0) - self.counts_at_start.get(name, 0))
            },
        }

    def maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_logged >= self.interval_s:
            self.last_logged = now
            log.info("learner_progress", **self.snapshot())
