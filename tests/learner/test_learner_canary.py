"""Canary evidence and verdict rule (pure logic; the real-stack run is in tests/promotion)."""

from __future__ import annotations

import json

from learner.canary import ArmStats, CanaryMonitor, judge_canary
from learner.config import CanaryConfig
from learner.rewards.assembler import RewardedChoice

CONFIG = CanaryConfig(enabled=True, min_samples=4, reward_margin=0.1, guard_margin=0.2)


def rewarded(
    version: str,
    text: str,
    reward: float | None,
    created_at: float = 10.0,
    tool_call: dict | None = None,
) -> RewardedChoice:
    message: dict = {"role": "assistant", "content": text}
    if tool_call is not None:
        message["tool_calls"] = [{"type": "function", "function": tool_call}]
    trajectory = {
        "policy_version": version,
        "created_at": created_at,
        "request": {"tools": [{"type": "function", "function": {"name": "get_weather"}}]},
        "choices": [{"index": 0, "message": message, "token_ids": list(range(12))}],
    }
    return RewardedChoice(trajectory=trajectory, choice_index=0, reward=reward)


def arm(samples: int, rewarded_n: int, reward_mean: float, **flags: int) -> ArmStats:
    stats = ArmStats(samples=samples, rewarded=rewarded_n, reward_sum=reward_mean * rewarded_n)
    stats.flags.update(flags)
    return stats


def test_monitor_counts_only_the_two_arms_since_the_start():
    monitor = CanaryMonitor()
    monitor.observe([rewarded("base", "The answer is four.", 1.0)])  # before begin: ignored
    monitor.begin(["base", "policy-v2"], since=5.0)
    good = json.dumps({"city": "Paris"})
    monitor.observe(
        [
            rewarded("base", "The answer is four.", 1.0),
            rewarded("base", "I'm sorry, I cannot help with that.", None),
            rewarded("base", "old", 1.0, created_at=1.0),  # served before the canary
            rewarded("policy-v1", "other version", 1.0),
            rewarded("policy-v2", "zxcvbnm qwrtypsdf ghjklzxcv bnmqwrt", 0.0),
            rewarded("policy-v2", "", 0.5, tool_call={"name": "get_weather", "arguments": good}),
            rewarded("policy-v2", "", 0.5, tool_call={"name": "rm_rf", "arguments": good}),
        ]
    )
    stable, candidate = monitor.arm("base"), monitor.arm("policy-v2")
    assert (stable.samples, stable.rewarded, stable.reward_mean) == (2, 1, 1.0)
    assert stable.rate("refusal") == 0.5 and stable.rate("invalid_tool_call") is None
    assert (candidate.samples, candidate.rewarded) == (3, 3)
    assert candidate.reward_mean == (0.0 + 0.5 + 0.5) / 3
    assert candidate.flags["degenerate"] == 1  # tool-call-only replies are not degenerate
    assert candidate.tool_call_samples == 2 and candidate.rate("invalid_tool_call") == 0.5
    monitor.end()
    monitor.observe([rewarded("base", "after the end", 1.0)])
    assert monitor.arm("base").samples == 0


def test_verdict_waits_then_promotes_when_not_worse():
    assert judge_canary(CONFIG, arm(3, 3, 0.5), arm(9, 9, 0.5), 10).decision == "wait"
    verdict = judge_canary(CONFIG, arm(5, 5, 0.50), arm(4, 4, 0.45), 10)
    assert verdict.decision == "promote"
    assert verdict.candidate["reward_mean"] == 0.45


def test_verdict_rolls_back_on_reward_or_guard_regression():
    lower = judge_canary(CONFIG, arm(5, 5, 0.5), arm(5, 5, 0.35), 10)
    assert lower.decision == "rollback" and lower.reasons[0].startswith("reward 0.350")
    # Guards decide as soon as both arms have samples, before rewards are in.
    guard = judge_canary(CONFIG, arm(5, 0, 0.0), arm(5, 0, 0.0, degenerate=2), 10)
    assert guard.decision == "rollback"
    assert guard.reasons == ["degenerate rate 0.400 > stable 0.000 + 0.2"]
    within = judge_canary(CONFIG, arm(5, 5, 0.5), arm(5, 5, 0.5, refusal=1), 10)
    assert within.decision == "promote"


def test_verdict_at_the_deadline_follows_on_timeout():
    short = (arm(2, 1, 0.9), arm(1, 0, 0.0))
    assert judge_canary(CONFIG, *short, CONFIG.max_duration_s - 1).decision == "wait"
    assert judge_canary(CONFIG, *short, CONFIG.max_duration_s).decision == "rollback"
    lenient = CONFIG.model_copy(update={"on_timeout": "promote"})
    verdict = judge_canary(lenient, *short, lenient.max_duration_s)
    assert verdict.decision == "promote" and "evidence still short" in verdict.reasons[0]
