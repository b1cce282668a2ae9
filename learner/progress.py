"""Periodic structured progress line: step, trajectories consumed, reward trend, KL, tokens/s."""

from __future__ import annotations

import time
from collections import deque

import structlog

log = structlog.get_logger(__name__)


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

    def record_step(self, version: int, metrics: dict[str, float]) -> None:
        self.step += 1
        self.version = version
        self.trained_tokens += metrics.get("tokens", 0.0)
        self.rewards.append(metrics.get("reward_mean", float("nan")))
        self.kl = metrics.get("kl", float("nan"))

    def snapshot(self) -> dict[str, float | int | bool | list[float]]:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        trend = list(self.rewards)
        return {
            "step": self.step,
            "version": self.version,
            "consumed": self.consumed,
            "reward_recent": [round(r, 4) for r in trend],
            "reward_trend": round(trend[-1] - trend[0], 4) if len(trend) > 1 else 0.0,
            "kl": self.kl,
            "tokens_per_s": round(self.trained_tokens / elapsed, 2),
            "frozen": self.frozen,
        }

    def maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_logged >= self.interval_s:
            self.last_logged = now
            log.info("learner_progress", **self.snapshot())
