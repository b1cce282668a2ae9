"""Canary evidence and verdict rule (pure logic; the real-stack run is in tests/promotion)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from learner import promotion
from learner.adapter_store import AdapterStore
from learner.canary import (
    ArmStats,
    CanaryMonitor,
    CanaryVerdict,
    CanaryWindow,
    canary_evidence,
    guard_flags,
    judge_canary,
    share_canary_evidence,
)
from learner.config import CanaryConfig, PromotionConfig
from learner.distributed import DistContext
from learner.promotion import CANARY_STATUS_ATTEMPTS, Promoter, PromotionError, PromotionOutcome
from learner.rewards.assembler import RewardedChoice
from safety.config import GatesConfig
from safety.gates.types import GateReport
from tests.learner.promotion_fakes import FakeAudit

CONFIG = CanaryConfig(enabled=True, min_samples=4, reward_margin=0.1, guard_margin=0.2)


def rewarded(
    version: str,
    text: str,
    reward: float | None,
    created_at: float = 10.0,
    tool_call: dict | None = None,
    model_alias: str = "policy",
) -> RewardedChoice:
    message: dict = {"role": "assistant", "content": text}
    if tool_call is not None:
        message["tool_calls"] = [{"type": "function", "function": tool_call}]
    trajectory = {
        "model_alias": model_alias,
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


def test_the_clarifying_guard_reads_the_users_question():
    """A reply that restates what the user asked and then answers it (small models often
    do) is not a question put back to the user: the guard compares it with the last user
    message, as the gate's monitor compares it with its probe."""
    restated = rewarded("policy-v2", "What do you call a baby cat? A kitten.", 1.0)
    restated.trajectory["request"]["messages"] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "What do you call a baby cat?"}],
        },
    ]
    assert guard_flags(restated)["clarifying_question"] is False
    put_back = rewarded("policy-v2", "Which river do you mean? There are several.", 1.0)
    put_back.trajectory["request"]["messages"] = [{"role": "user", "content": "Is it long?"}]
    assert guard_flags(put_back)["clarifying_question"] is True


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


def test_replies_to_another_alias_are_no_evidence_of_the_canary():
    """While the stable arm is the base model, the base alias's clients (who pinned it to
    stay off the policy, a population the canary never split) filled the stable arm."""
    monitor = CanaryMonitor()
    monitor.begin(["base", "policy-v1"], since=0.0, alias="policy")
    pinned = [rewarded("base", "The answer is four.", 1.0, model_alias="base")] * 4
    split = [rewarded("base", "Four.", 0.5), rewarded("policy-v1", "Four!", 0.5)]
    monitor.observe(pinned + split)
    assert (monitor.arm("base").samples, monitor.arm("policy-v1").samples) == (1, 1)


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


def test_invalid_tool_calls_are_judged_on_enough_calls_against_no_evidence_as_zero():
    """The rate was compared over any number of calls (one invalid call of one rolled a
    candidate back) and not at all when the stable arm made none (a candidate whose every
    call was invalid was promoted)."""
    config = CanaryConfig(enabled=True, min_samples=30, guard_margin=0.1)

    def calls(samples: int, tool_calls: int, invalid: int) -> ArmStats:
        stats = arm(samples, samples, 0.5, invalid_tool_call=invalid)
        stats.tool_call_samples = tool_calls
        return stats

    all_invalid = judge_canary(config, calls(40, 0, 0), calls(40, 30, 30), 10)
    assert all_invalid.decision == "rollback"
    assert all_invalid.reasons == ["invalid_tool_call rate 1.000 > stable 0.000 + 0.1"]
    one_of_one = judge_canary(config, calls(40, 20, 0), calls(40, 1, 1), 10)
    assert one_of_one.decision == "promote"
    # With calls enough on both arms, the stable arm's own rate is the baseline.
    both_bad = judge_canary(config, calls(40, 20, 10), calls(40, 20, 11), 10)
    assert both_bad.decision == "promote"


def test_verdict_at_the_deadline_follows_on_timeout():
    short = (arm(2, 1, 0.9), arm(1, 0, 0.0))
    assert judge_canary(CONFIG, *short, CONFIG.max_duration_s - 1).decision == "wait"
    assert judge_canary(CONFIG, *short, CONFIG.max_duration_s).decision == "rollback"
    lenient = CONFIG.model_copy(update={"on_timeout": "promote"})
    verdict = judge_canary(lenient, *short, lenient.max_duration_s)
    assert verdict.decision == "promote" and "evidence still short" in verdict.reasons[0]


def test_timeout_promote_is_refused_when_the_short_evidence_is_worse():
    lenient = CONFIG.model_copy(update={"min_samples": 30, "on_timeout": "promote"})
    deadline = lenient.max_duration_s
    # 10 rewarded each (short of 30) and clearly worse: the deadline does not promote it.
    worse = judge_canary(lenient, arm(10, 10, 0.8), arm(10, 10, 0.2), deadline)
    assert worse.decision == "rollback"
    assert "evidence still short" in worse.reasons[0]
    assert worse.reasons[1].startswith("reward 0.200 < stable 0.800")
    guard = judge_canary(lenient, arm(10, 0, 0.0), arm(10, 0, 0.0, refusal=5), deadline)
    assert guard.decision == "rollback" and "refusal rate" in guard.reasons[1]
    # Not worse, or too little evidence to say (below the floor): on_timeout applies.
    assert judge_canary(lenient, arm(10, 10, 0.5), arm(10, 10, 0.5), deadline).decision == (
        "promote"
    )
    assert judge_canary(lenient, arm(4, 4, 0.8), arm(4, 4, 0.2), deadline).decision == "promote"


def test_monitor_ignores_non_finite_rewards():
    monitor = CanaryMonitor()
    monitor.begin(["base"], since=0.0)
    monitor.observe([rewarded("base", "ok", float("nan")), rewarded("base", "ok", 1.0)])
    stats = monitor.arm("base")
    assert (stats.samples, stats.rewarded, stats.reward_mean) == (2, 1, 1.0)


def test_monitor_ignores_rewards_the_learner_calls_corrupt():
    """A finite but absurd reward (a verifier's 1e300) is `bad_reward` to the learner; the
    canary counted it, so one such reply decided the arm's mean."""
    monitor = CanaryMonitor()
    monitor.begin(["base"], since=0.0)
    monitor.observe([rewarded("base", "ok", 1e300), rewarded("base", "ok", 1.0)])
    stats = monitor.arm("base")
    assert (stats.samples, stats.rewarded, stats.reward_mean) == (2, 1, 1.0)


def canary_batch() -> list[RewardedChoice]:
    good = json.dumps({"city": "Paris"})
    return [
        rewarded("base", "The answer is four.", 1.0),
        rewarded("base", "I'm sorry, I cannot help with that.", None),
        rewarded("base", "old", 1.0, created_at=1.0),
        rewarded("policy-v1", "other version", 1.0),
        rewarded("policy-v2", "zxcvbnm qwrtypsdf ghjklzxcv bnmqwrt", float("nan")),
        rewarded("policy-v2", "", 0.5, tool_call={"name": "get_weather", "arguments": good}),
        rewarded("policy-v2", "", 0.5, tool_call={"name": "rm_rf", "arguments": good}),
    ]


def test_evidence_is_what_the_monitor_counts_of_a_batch():
    """Under torchrun ranks send `Evidence`, not trajectories: it must count the same."""
    direct, gathered = CanaryMonitor(), CanaryMonitor()
    assert direct.window() is None
    for monitor in (direct, gathered):
        monitor.begin(["base", "policy-v2"], since=5.0)
    window = gathered.window()
    assert window == CanaryWindow(frozenset({"base", "policy-v2"}), 5.0)
    evidence = canary_evidence(canary_batch(), window)
    assert [e.version for e in evidence] == ["base", "base", "policy-v2", "policy-v2", "policy-v2"]
    direct.observe(canary_batch())
    gathered.observe_evidence(evidence)
    for version in ("base", "policy-v2"):
        assert gathered.arm(version) == direct.arm(version)
        assert gathered.arm(version).samples > 0
    # Evidence selected under a canary that has ended meanwhile is not counted.
    gathered.end()
    gathered.observe_evidence(evidence)
    assert gathered.arm("base").samples == 0


def test_shared_evidence_in_one_process_counts_like_observe_and_never_raises():
    shared, direct = CanaryMonitor(), CanaryMonitor()
    for monitor in (shared, direct):
        monitor.begin(["base", "policy-v2"], since=5.0)
    share_canary_evidence(DistContext(), shared, canary_batch())
    direct.observe(canary_batch())
    assert shared.arm("policy-v2") == direct.arm("policy-v2")
    # A record that cannot be read, or a monitor that fails: logged, training goes on.
    unreadable = rewarded("base", "ok", 1.0, created_at="soon")  # type: ignore[arg-type]
    share_canary_evidence(DistContext(), shared, [unreadable])
    assert shared.arm("base") == direct.arm("base")

    class Broken(CanaryMonitor):
        def observe_evidence(self, items: list) -> None:
            raise RuntimeError("broken")

    broken = Broken()
    broken.begin(["base"], since=0.0)
    share_canary_evidence(DistContext(), broken, canary_batch())
    share_canary_evidence(DistContext(), None, canary_batch())  # no canary: nothing to do


def test_replies_the_learner_cannot_train_on_still_count_for_the_canary():
    """The canary read the assembler's output, which holds trainable replies only: a
    candidate whose runaway replies users stopped (status `aborted`), or that vLLM failed
    on, showed none of them, and was promoted on its clean half."""
    from learner.config import RewardConfig
    from learner.rewards.assembler import RewardAssembler, untrainable_records

    good = "Recursion is when a function calls itself on a smaller input until a base case."
    loop = "the " * 300

    def item(version: str, i: int, text: str, status: str = "ok") -> dict:
        trajectory = rewarded(version, text, None, created_at=10.0 + i).trajectory
        trajectory.update(status=status, trainable=status == "ok", trajectory_id=f"{version}-{i}")
        if text == loop:
            trajectory["choices"][0]["token_ids"] = [262] * 300
        if status == "error":
            trajectory["choices"] = []
        return {"trajectory": trajectory, "feedback": [{"kind": "accept", "choice_index": 0}]}

    batch = [item("base", i, good) for i in range(8)]
    batch += [item("policy-v2", i, good if i % 2 else loop, "ok" if i % 2 else "aborted")
              for i in range(8)]  # fmt: skip
    batch.append(item("policy-v2", 9, "", "error"))
    monitor = CanaryMonitor()
    monitor.begin(["base", "policy-v2"], since=5.0)
    scored = RewardAssembler(RewardConfig()).assemble(batch)
    share_canary_evidence(DistContext(), monitor, scored, untrainable_records(batch))
    stable, candidate = monitor.arm("base"), monitor.arm("policy-v2")
    assert (stable.samples, candidate.samples) == (8, 9)
    assert (stable.rewarded, candidate.rewarded) == (8, 4)  # no reward for the unfinished
    assert candidate.flags["degenerate"] == 4 and candidate.flags["unfinished"] == 5
    assert candidate.rate("unfinished") == pytest.approx(5 / 9) and stable.rate("unfinished") == 0
    verdict = judge_canary(CanaryConfig(enabled=True, min_samples=4), stable, candidate, 60)
    assert verdict.decision == "rollback"
    assert any(r.startswith("degenerate rate") for r in verdict.reasons)
    assert any(r.startswith("unfinished rate") for r in verdict.reasons)


# -- the promoter's canary loop, against fakes of the proxy admin API and the replicas --------


class FakeReplicas:
    def __init__(self) -> None:
        self.base_urls = ["http://replica"]
        self.api_key: str | None = None
        self.loaded: set[str] = set()

    def load(self, name: str, path: Path) -> None:
        self.loaded.add(name)

    def unload(self, name: str) -> None:
        self.loaded.discard(name)

    def loaded_versions(self) -> set[str]:
        # The promoter's cleanup (a timer, drain_s after a promotion) lists them; without this
        # a cleanup that ran late logged an AttributeError traceback (a CI run, 23:35 UTC).
        return {name for name in self.loaded if name.startswith("policy-v")}

    def close(self) -> None:
        pass


class FakeProxy:
    """Admin API whose status() fails on the calls listed in `fail_on` (1-based)."""

    def __init__(self, fail_on: set[int], end_fails: bool = False) -> None:
        self.fail_on, self.end_fails = fail_on, end_fails
        self.calls = 0
        self.canary: dict | None = None
        self.ended: list[tuple[str, str]] = []

    def status(self) -> dict:
        self.calls += 1
        if self.calls in self.fail_on:
            raise httpx.ReadTimeout("timed out")
        canaries = {"policy": self.canary} if self.canary else {}
        return {"aliases": {"policy": "base"}, "frozen": False, "canaries": canaries}

    def start_canary(
        self, alias: str, target: str, share: float, expected: str | None = None
    ) -> dict:
        self.canary = {"target": target, "share": share}
        return self.canary

    def end_canary(self, alias: str, decision: str, reason: str, target: str | None = None) -> dict:
        if self.end_fails:
            raise PromotionError("proxy POST /admin/canary/end → 503")
        self.ended.append((decision, reason))
        self.canary = None
        return {}

    def set_alias(self, alias: str, target: str, expected: str | None = None) -> dict:
        return {}

    def close(self) -> None:
        pass


def run_canary(
    tmp_path: Path, proxy: FakeProxy, **canary: object
) -> tuple[PromotionOutcome, FakeAudit, FakeReplicas]:
    promoter, path, audit, replicas = canary_promoter(tmp_path, proxy, **canary)
    return promoter.promote(path), audit, replicas


def canary_promoter(
    tmp_path: Path, proxy: FakeProxy, drain_s: float = 30.0, **canary: object
) -> tuple[Promoter, Path, FakeAudit, FakeReplicas]:
    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"weights")
    path = AdapterStore(tmp_path).publish(1, files, {"parent_version": 0})
    settings = {"enabled": True, "poll_s": 0.01, "min_samples": 1, **canary}
    config = PromotionConfig(drain_s=drain_s, canary=CanaryConfig(**settings))
    audit, replicas = FakeAudit(), FakeReplicas()
    promoter = Promoter(
        config,
        GatesConfig(),
        replicas=replicas,  # type: ignore[arg-type]
        proxy=proxy,  # type: ignore[arg-type]
        audit=audit,  # type: ignore[arg-type]
        state_dir=tmp_path,
        base_name="base",
        gate_runner=lambda candidate, incumbent: GateReport(True, []),
    )
    return promoter, path, audit, replicas


def test_a_transient_status_error_is_retried(tmp_path: Path):
    # Call 1 is the promotion's own status; call 2 fails once inside the canary loop. With
    # no evidence and a short deadline the canary then decides by on_timeout.
    proxy = FakeProxy(fail_on={2})
    outcome, audit, replicas = run_canary(tmp_path, proxy, max_duration_s=0.05)
    assert outcome.decision == "canary_rolled_back"
    assert "evidence still short" in outcome.reason
    assert proxy.ended == [("rollback", outcome.reason)] and not replicas.loaded
    assert audit.names() == ["gate_result", "canary_result"]  # the proxy audits the rollback


def test_a_watch_that_keeps_failing_rolls_the_canary_back(tmp_path: Path):
    proxy = FakeProxy(fail_on=set(range(2, 100)))
    outcome, audit, replicas = run_canary(tmp_path, proxy)
    assert outcome.decision == "canary_rolled_back"
    assert "canary watch failed" in outcome.reason and "ReadTimeout" in outcome.reason
    # bounded retries, then one more just before the unload
    assert proxy.calls == 2 + CANARY_STATUS_ATTEMPTS
    assert proxy.canary is None and proxy.ended[0][0] == "rollback"
    # The proxy's status still does not answer: whether an operator routed to the candidate
    # meanwhile is unknown, so it is left loaded (a later cleanup unloads it), and said so.
    assert replicas.loaded == {"policy-v1"}
    name, payload = audit.events[-1]
    assert name == "canary_rolled_back" and payload["reason"] == outcome.reason
    assert payload["cleanup_failed"] == [
        "unload: skipped, the proxy's status could not be read "
        "(ReadTimeout('timed out')); left loaded"
    ]


def _break_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    """The canary's verdict raises: the canary ends with a rollback."""

    def broken(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("no evidence")

    monkeypatch.setattr(promotion, "judge_canary", broken)


def test_a_failing_verdict_rolls_back_and_a_failing_cleanup_is_audited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _break_the_verdict(monkeypatch)
    proxy = FakeProxy(fail_on=set(), end_fails=True)
    promoter, path, audit, replicas = canary_promoter(tmp_path, proxy, drain_s=0.2)
    outcome = promoter.promote(path)
    assert outcome.decision == "canary_rolled_back" and "ZeroDivisionError" in outcome.reason
    name, payload = audit.events[-1]
    assert name == "canary_rolled_back"
    assert payload["cleanup_failed"][0].startswith("end_canary: PromotionError")
    # The canary still routes a share to the candidate: unloaded, that share got 404s, the
    # reloader loaded it back and it served on unjudged. It stays loaded; the end is retried.
    assert "the end retried" in payload["cleanup_failed"][1]
    assert replicas.loaded == {"policy-v1"} and proxy.canary is not None
    time.sleep(0.3)  # a retry, refused too
    assert replicas.loaded == {"policy-v1"} and proxy.canary is not None
    proxy.end_fails = False  # the proxy's disk is back
    deadline = time.monotonic() + 10
    while (proxy.canary is not None or replicas.loaded) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proxy.canary is None and not replicas.loaded
    assert audit.names()[-1] == "canary_ended_late"
    promoter.close()


class OneCanaryProxy(FakeProxy):
    """Refuses a canary while one runs (409 `canary_running`), as the proxy does."""

    def start_canary(
        self, alias: str, target: str, share: float, expected: str | None = None
    ) -> dict:
        if self.canary is not None:
            raise PromotionError("proxy POST /admin/canary → 409: canary_running")
        return super().start_canary(alias, target, share, expected)


def test_a_candidate_blocked_by_a_canary_whose_end_was_refused_is_not_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The learner's own earlier canary, whose rollback the proxy refused, still runs: the
    next candidate's canary was refused (409) and the candidate dropped as decided, never
    gated again."""

    _break_the_verdict(monkeypatch)
    proxy = OneCanaryProxy(fail_on=set(), end_fails=True)
    promoter, path, audit, replicas = canary_promoter(tmp_path, proxy, drain_s=3600)
    assert promoter.promote(path).decision == "canary_rolled_back"
    assert proxy.canary is not None and proxy.canary["target"] == "policy-v1"
    files = tmp_path / "files-2"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"weights 2")
    second = AdapterStore(tmp_path).publish(2, files, {"parent_version": 1})
    outcome = promoter.promote(second)
    assert outcome.decision == "deferred", outcome
    assert "policy-v2" not in replicas.loaded and "policy-v1" in replicas.loaded
    assert audit.names()[-1] == "promotion_deferred"
    promoter.close()


def test_a_late_canary_end_whose_unload_fails_is_still_audited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _break_the_verdict(monkeypatch)
    proxy = FakeProxy(fail_on=set(), end_fails=True)
    promoter, path, audit, replicas = canary_promoter(tmp_path, proxy, drain_s=0.2)
    assert promoter.promote(path).decision == "canary_rolled_back"

    def unreachable(name: str) -> None:
        raise httpx.ConnectError("replica down")

    monkeypatch.setattr(replicas, "unload", unreachable)
    proxy.end_fails = False
    deadline = time.monotonic() + 10
    while audit.names()[-1] != "canary_ended_late" and time.monotonic() < deadline:
        time.sleep(0.01)
    name, payload = audit.events[-1]
    assert name == "canary_ended_late" and payload["unload"].startswith("failed: ConnectError")
    promoter.close()


class OperatorPromotesProxy(FakeProxy):
    """An operator ends the running canary with `promote` (or flips the alias to its target)
    between two polls: the alias then serves the candidate and no canary runs."""

    def __init__(self) -> None:
        super().__init__(fail_on=set())
        self.alias = "base"

    def status(self) -> dict:
        status = super().status()
        if self.canary is not None and self.calls >= 3:
            self.alias, self.canary = self.canary["target"], None
            status["canaries"] = {}
        status["aliases"] = {"policy": self.alias}
        return status


def test_a_canary_promoted_by_the_operator_stays_loaded(tmp_path: Path):
    proxy = OperatorPromotesProxy()
    outcome, audit, replicas = run_canary(tmp_path, proxy, min_samples=1000)
    assert proxy.alias == "policy-v1"  # the operator's promotion went through
    # The alias now serves the candidate: unloading it would break every request on it.
    assert replicas.loaded == {"policy-v1"}
    assert outcome.decision == "promoted" and proxy.ended == []
    assert audit.names()[-1] == "canary_promoted_by_operator"


class BusyProxy(FakeProxy):
    """An operator's own canary already runs on the alias: the proxy refuses another (409)."""

    def __init__(self) -> None:
        super().__init__(fail_on=set())
        self.canary = {"target": "policy-v7", "share": 0.5}

    def start_canary(
        self, alias: str, target: str, share: float, expected: str | None = None
    ) -> dict:
        raise PromotionError("proxy POST /admin/canary → 409: canary_running")


def test_a_canary_that_could_not_start_leaves_the_running_one_alone(tmp_path: Path):
    proxy = BusyProxy()
    outcome, audit, replicas = run_canary(tmp_path, proxy)
    assert outcome.decision == "canary_rolled_back" and "409" in outcome.reason
    # Only our candidate is dropped; the operator's canary keeps running.
    assert proxy.ended == [] and proxy.canary == {"target": "policy-v7", "share": 0.5}
    assert not replicas.loaded
    name, payload = audit.events[-1]
    assert name == "canary_rolled_back" and "cleanup_failed" not in payload


def test_a_canary_started_despite_a_lost_reply_is_rolled_back(tmp_path: Path):
    class LostReplyProxy(FakeProxy):
        def start_canary(
            self, alias: str, target: str, share: float, expected: str | None = None
        ) -> dict:
            super().start_canary(alias, target, share)
            raise httpx.ReadTimeout("timed out")  # the proxy started it; the reply was lost

    proxy = LostReplyProxy(fail_on=set())
    outcome, _, replicas = run_canary(tmp_path, proxy)
    assert outcome.decision == "canary_rolled_back" and "canary start failed" in outcome.reason
    assert proxy.ended == [("rollback", outcome.reason)] and proxy.canary is None
    assert not replicas.loaded


class FlipFailsProxy(FakeProxy):
    """set_alias raises; `flips`: the alias moved anyway (the reply was lost)."""

    def __init__(self, flips: bool) -> None:
        super().__init__(fail_on=set())
        self.flips, self.alias = flips, "base"

    def status(self) -> dict:
        return {**super().status(), "aliases": {"policy": self.alias}}

    def set_alias(self, alias: str, target: str, expected: str | None = None) -> dict:
        if self.flips:
            self.alias = target
        raise PromotionError("proxy POST /admin/aliases → 409: serving is frozen")


def test_a_refused_flip_unloads_the_candidate(tmp_path: Path):
    """Frozen between the learner's status check and its flip: before, the candidate kept
    one of vLLM's LoRA slots and the promotion raised out of the worker."""
    outcome, audit, replicas = run_canary(tmp_path, FlipFailsProxy(flips=False), enabled=False)
    assert outcome.decision == "failed" and "409" in outcome.reason
    assert replicas.loaded == set()
    event, payload = audit.events[-1]
    assert event == "promotion_failed" and payload["stage"] == "flip"


def test_a_flip_whose_reply_was_lost_is_a_promotion(tmp_path: Path):
    outcome, audit, replicas = run_canary(tmp_path, FlipFailsProxy(flips=True), enabled=False)
    assert outcome.decision == "promoted" and replicas.loaded == {"policy-v1"}
    assert audit.names()[-1] == "promotion"


class PromoteEndFailsProxy(FakeProxy):
    """end_canary(promote) raises; `goes_through`: the proxy promoted (the reply was lost)."""

    def __init__(self, goes_through: bool) -> None:
        super().__init__(fail_on=set())
        self.goes_through, self.alias = goes_through, "base"

    def status(self) -> dict:
        return {**super().status(), "aliases": {"policy": self.alias}}

    def end_canary(self, alias: str, decision: str, reason: str, target: str | None = None) -> dict:
        if decision == "promote":
            if self.goes_through:
                self.alias, self.canary = self.canary["target"], None
            raise PromotionError("proxy POST /admin/canary/end → 409: serving is frozen")
        return super().end_canary(alias, decision, reason)


def _promote_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    verdict = CanaryVerdict("promote", ["no regression"], {}, {})
    monkeypatch.setattr(promotion, "judge_canary", lambda *args: verdict)


def test_a_refused_canary_promotion_rolls_back_and_unloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The verdict said promote but the proxy refused to end the canary that way: before,
    the error escaped `promote`, the canary kept serving and the candidate stayed loaded
    with no audit record of how it ended."""
    _promote_verdict(monkeypatch)
    proxy = PromoteEndFailsProxy(goes_through=False)
    outcome, audit, replicas = run_canary(tmp_path, proxy)
    assert outcome.decision == "canary_rolled_back" and "409" in outcome.reason
    assert proxy.canary is None and proxy.ended == [("rollback", outcome.reason)]
    assert proxy.alias == "base" and not replicas.loaded
    assert audit.names() == ["gate_result", "canary_result", "canary_rolled_back"]


def test_a_canary_promotion_whose_reply_was_lost_is_a_promotion(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _promote_verdict(monkeypatch)
    proxy = PromoteEndFailsProxy(goes_through=True)
    outcome, audit, replicas = run_canary(tmp_path, proxy)
    assert outcome.decision == "promoted" and replicas.loaded == {"policy-v1"}
    assert proxy.alias == "policy-v1" and proxy.ended == []
    assert audit.names()[-1] == "promotion"


class UnloadFailsReplicas(FakeReplicas):
    def unload(self, name: str) -> None:
        raise httpx.ConnectError("replica restarting")


def test_a_rejected_candidate_is_audited_even_when_its_unload_fails(tmp_path: Path):
    """The unload raised out of `promote` before `candidate_rejected` was written: the
    audit log showed a failed gate and then a `promotion_failed` about the unload."""
    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"weights")
    path = AdapterStore(tmp_path).publish(1, files, {"parent_version": 0})
    audit = FakeAudit()
    promoter = Promoter(
        PromotionConfig(),
        GatesConfig(),
        replicas=UnloadFailsReplicas(),  # type: ignore[arg-type]
        proxy=FakeProxy(fail_on=set()),  # type: ignore[arg-type]
        audit=audit,  # type: ignore[arg-type]
        state_dir=tmp_path,
        base_name="base",
        gate_runner=lambda candidate, incumbent: GateReport(False, []),
    )
    outcome = promoter.promote(path)
    assert outcome.decision == "rejected"
    event, payload = audit.events[-1]
    assert event == "candidate_rejected"
    assert payload["cleanup_failed"] == ["unload: ConnectError('replica restarting')"]


def test_the_stable_arm_counts_the_base_model_under_its_served_name(tmp_path: Path):
    """With `policy.served_model_name: qwen-0.5b` the alias targets `qwen-0.5b`, but the
    proxy records the base model's replies as `policy_version: base`: the stable arm was
    named after the served name and never got a sample (every canary timed out, or with
    `on_timeout: promote` a worse candidate was promoted on no comparison)."""
    from tests.learner.test_learner_promoter import Proxy, Replicas

    files = tmp_path / "files"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"weights")
    path = AdapterStore(tmp_path).publish(1, files, {"parent_version": 0})
    served = "qwen-0.5b"
    canary = CanaryConfig(enabled=True, min_samples=3, max_duration_s=30, poll_s=0.05)
    p = Promoter(
        PromotionConfig(drain_s=3600, canary=canary),
        GatesConfig(),
        replicas=Replicas(set()),  # type: ignore[arg-type]
        proxy=Proxy(alias=served),  # type: ignore[arg-type]
        audit=FakeAudit(),  # type: ignore[arg-type]
        state_dir=tmp_path,
        base_name=served,
        gate_runner=lambda candidate, incumbent: GateReport(True, []),
    )
    done: list[PromotionOutcome] = []
    thread = threading.Thread(target=lambda: done.append(p.promote(path)))
    thread.start()
    deadline = time.monotonic() + 10
    while p.canary_monitor.window() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    now = time.time() + 1
    good = [rewarded("base", "The answer is four.", 1.0, created_at=now) for _ in range(5)]
    bad = [rewarded("policy-v1", "I'm sorry, I cannot help.", -1.0, created_at=now)] * 5
    p.canary_monitor.observe(good + bad)
    thread.join(10)
    assert done and done[0].decision == "canary_rolled_back"
    assert "reward" in done[0].reason  # compared with the base's replies, not timed out
