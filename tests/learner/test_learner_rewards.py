"""Rewards: feedback mapping, built-in and pluggable verifiers, the judge, the assembler."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from learner.config import FeedbackValues, JudgeConfig, RewardConfig, VerifierSpec
from learner.rewards.assembler import RewardAssembler
from learner.rewards.feedback import FeedbackError, feedback_reward, feedback_value
from learner.rewards.judge import STOPPED, Judge, JudgeVerdict, prompt_text
from learner.rewards.verifiers import (
    VerifierRunner,
    exact_match,
    json_valid,
    load_verifier,
    number_answer,
    regex_match,
    reply_text,
    tool_calls_valid,
)


def slow_verifier(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float:
    """Pluggable verifier (loaded by import path in a test) that sleeps past its timeout."""
    time.sleep(float(params.get("sleep_s", 1.0)))
    return 1.0


def broken_verifier(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float:
    raise RuntimeError("boom")


def record(content: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "trajectory_id": "t1",
        "event_id": "e1",
        "tenant": "A",
        "user": None,
        "task": "sum",
        "policy_version": "base",
        "group_id": None,
        "status": "ok",
        "trainable": True,
        "request": {"messages": [{"role": "user", "content": "What is 2 plus 3?"}]},
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
                "token_ids": [4, 5],
                "logprobs": [-0.5, -0.5],
            }
        ],
    }
    base.update(kw)
    return base


def test_feedback_values() -> None:
    values = FeedbackValues()
    assert feedback_value({"kind": "accept"}, values) == 0.75
    assert feedback_value({"kind": "reject"}, values) == -0.25
    assert feedback_value({"kind": "score", "value": 0.3}, values) == 0.3
    assert feedback_value({"kind": "test_result", "value": 1}, values) == 1.0
    assert feedback_value({"kind": "test_result", "value": 0}, values) == -0.5
    with pytest.raises(FeedbackError):
        feedback_value({"kind": "score", "value": None}, values)
    with pytest.raises(FeedbackError):
        feedback_value({"kind": "bogus"}, values)
    events = [
        {"kind": "accept", "choice_index": 0},
        {"kind": "reject", "choice_index": 0},
        {"kind": "thumbs_up", "choice_index": 1},
        {"kind": "score", "choice_index": 0},  # invalid: no value
    ]
    assert feedback_reward(events, 0, values) == (-0.25, 1, 0)  # the reject came later
    assert feedback_reward(events, 2, values) == (None, 0, 0)


def test_feedback_events_of_one_choice_combine_by_family_latest_first() -> None:
    """Averaged over every event, more evidence of one sign lowered a reward (a passing
    test 1.0, with an accept 0.875: a sibling with only the test ranked above it), and a
    change of mind barely counted (accept then reject +0.25; a retried accept then a
    reject +0.417)."""
    values = FeedbackValues()

    def reward(*events: dict) -> float | None:
        return feedback_reward([{"choice_index": 0, **e} for e in events], 0, values).value

    passed = {"kind": "test_result", "value": 1}
    assert reward(passed) == 1.0
    assert reward(passed, {"kind": "accept"}) == 1.75
    assert reward({"kind": "accept"}, {"kind": "edit_kept"}) == 1.25
    assert reward({"kind": "accept"}, {"kind": "reject"}) == -0.25
    assert reward({"kind": "accept"}, {"kind": "accept"}, {"kind": "reject"}) == -0.25
    assert reward({"kind": "thumbs_up"}, {"kind": "thumbs_down"}) == -0.5
    # Latest by created_at where the events carry it, whatever order they arrived in.
    late_accept = {"kind": "accept", "created_at": 20.0}
    assert reward(late_accept, {"kind": "reject", "created_at": 10.0}) == 0.75
    # The families add up; a negative one is not clamped away by a score range from 0.
    everything = [passed, {"kind": "accept"}, {"kind": "thumbs_up"}, {"kind": "edit_kept"}]
    assert reward(*everything) == 2.75
    narrow = FeedbackValues(score_min=0.0, score_max=1.0)
    assert feedback_reward([{"kind": "reject"}], 0, narrow).value == -0.25


def test_score_feedback_is_clamped_and_non_finite_is_invalid() -> None:
    values = FeedbackValues()
    assert (values.score_min, values.score_max) == (-2.0, 2.0)
    assert feedback_value({"kind": "score", "value": 1e300}, values) == 2.0
    assert feedback_value({"kind": "score", "value": -(10**6)}, values) == -2.0
    for bad in (float("inf"), float("nan"), 10**400):
        with pytest.raises(FeedbackError):
            feedback_value({"kind": "score", "value": bad}, values)
    events = [
        {"kind": "score", "value": 1e6, "choice_index": 0},
        {"kind": "score", "value": 1.0, "choice_index": 0},
        {"kind": "score", "value": float("inf"), "choice_index": 0},
    ]
    assert feedback_reward(events, 0, values) == (1.0, 1, 1)  # the later score replaces it
    narrow = FeedbackValues(score_min=0.0, score_max=0.5)
    assert feedback_reward(events, 0, narrow) == (0.5, 1, 2)
    with pytest.raises(ValueError):
        FeedbackValues(score_max=-1.0)  # the range must contain 0


def test_assembler_counts_clamped_scores() -> None:
    assembler = RewardAssembler(RewardConfig())
    feedback = [{"kind": "score", "value": 1e300, "choice_index": 0}]
    out = assembler.assemble([{"trajectory": record("5"), "feedback": feedback}])
    assert out[0].reward == 2.0
    assert dict(assembler.counts) == {"score_clamped": 1, "rewarded": 1}


def test_builtin_verifiers() -> None:
    rec = record(" 5 ")
    choice = rec["choices"][0]
    assert exact_match(rec, choice, expected="5") == 1.0
    assert exact_match(rec, choice, expected="6") == 0.0
    assert (
        exact_match(
            record("5", request={"metadata": {"answer": 5}}),
            choice,
            expected_path="request.metadata.answer",
        )
        == 1.0
    )
    assert exact_match(rec, choice) is None
    assert regex_match(rec, choice, pattern=r"\d+", fullmatch=True) == 1.0
    assert regex_match(record("five"), record("five")["choices"][0], pattern=r"\d") == 0.0
    schema = {"type": "object", "required": ["answer"]}
    ok = record('{"answer": 5}')
    assert json_valid(ok, ok["choices"][0], schema=schema) == 1.0
    bad = record('{"result": 5}')
    assert json_valid(bad, bad["choices"][0], schema=schema) == 0.0
    fenced = record('```json\n{"answer": 5}\n```')
    assert json_valid(fenced, fenced["choices"][0]) == 0.0
    assert json_valid(fenced, fenced["choices"][0], allow_fence=True) == 1.0


def test_tool_call_validity() -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    rec = record("", request={"messages": [], "tools": tools})

    def with_calls(*calls: dict[str, Any]) -> dict[str, Any]:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": None, "tool_calls": list(calls)},
        }

    good = {"function": {"name": "search", "arguments": '{"q": "x"}'}}
    assert tool_calls_valid(rec, with_calls(good)) == 1.0
    assert (
        tool_calls_valid(rec, with_calls(good, {"function": {"name": "nope", "arguments": "{}"}}))
        == 0.0
    )
    assert (
        tool_calls_valid(rec, with_calls({"function": {"name": "search", "arguments": "{bad"}}))
        == 0.0
    )
    assert (
        tool_calls_valid(rec, with_calls({"function": {"name": "search", "arguments": "[1]"}}))
        == 0.0
    )
    assert tool_calls_valid(rec, rec["choices"][0]) is None


def test_number_answer_shaping() -> None:
    def score(text: str, finish: str = "stop", n: int = 2) -> float:
        rec = record(text)
        choice = {**rec["choices"][0], "finish_reason": finish, "token_ids": list(range(n))}
        return float(number_answer(rec, choice, brevity_tokens=16) or 0.0)

    assert score("5") > score("5 is the answer") > score("The answer is 5") >= 0
    assert score("55555555555555", finish="length") == 0.0
    assert score("5", n=2) > score("5", n=12)


def test_number_answers_bonus_is_for_the_expected_number_alone() -> None:
    """The bonus went to the reply's leading integer: `42.5` and `42 or maybe 17` were
    rewarded as right answers, a hedge the policy could learn."""

    def bonus(text: str) -> float:
        rec = record(text)
        choice = {**rec["choices"][0], "token_ids": [1, 2]}
        params = {"expected": "42", "correct_bonus": 1.0}
        return float(number_answer(rec, choice, **params) or 0.0) - float(
            number_answer(rec, choice, expected="7", correct_bonus=1.0) or 0.0
        )

    assert [bonus(t) for t in ("42", "+42", "42.", "42 is it")] == [1.0] * 4
    assert [bonus(t) for t in ("42.5", "42 or maybe 17", "4200", "-42", "1,042")] == [0.0] * 5


def test_pluggable_verifier_timeout_and_error_give_no_value() -> None:
    runner = VerifierRunner(
        [
            VerifierSpec(path=f"{__name__}:slow_verifier", timeout_s=0.2, params={"sleep_s": 1.0}),
            VerifierSpec(path=f"{__name__}:broken_verifier"),
        ]
    )
    rec = record("5")
    assert runner.score(rec, rec["choices"][0]) is None
    assert runner.timeouts == 1 and runner.errors == 1
    runner.close()
    with pytest.raises(ValueError, match="cannot load verifier"):
        load_verifier("learner.rewards.verifiers:does_not_exist")
    with pytest.raises(ValueError, match="must look like"):
        load_verifier("no_colon")


def test_a_bad_verifier_path_names_its_config_key() -> None:
    """The learner's start-up error named the import path but not the config key."""
    good = VerifierSpec(path="learner.rewards.verifiers:exact_match", params={"expected": "5"})
    missing = VerifierSpec(path="learner.rewards.verifiers:no_such_verifier")
    with pytest.raises(ValueError, match=r"learner\.rewards\.verifiers\[1\]\.path: cannot load"):
        VerifierRunner([good, missing])
    with pytest.raises(ValueError, match=r"verifiers\[0\]\.path: verifier path 'exact_match'"):
        VerifierRunner([VerifierSpec(path="exact_match")])


@pytest.mark.parametrize(
    "path, params, message",
    [
        ("regex_match", {}, "needs params.pattern"),
        ("regex_match", {"pattern": "(unclosed"}, "does not compile"),
        ("exact_match", {"expected_pth": "answer"}, r"unknown params expected_pth \(it takes"),
        ("exact_match", {}, "needs params.expected or params.expected_path"),
        ("json_valid", {"schema": {"type": "no-such-type"}}, "not a JSON schema"),
        ("number_answer", {"brevity_tokens": 0}, "brevity_tokens must be above 0"),
        ("number_answer", {"correct_bonus": "lots"}, "correct_bonus must be a number"),
        ("tool_calls_valid", {"strict": True}, r"unknown params strict \(it takes: none\)"),
    ],
)
def test_a_built_in_verifiers_params_are_checked_at_start_up(
    path: str, params: dict[str, Any], message: str
) -> None:
    """They were accepted, and the verifier then failed on every sample (or, with a key
    misspelt, found nothing to check, for ever) without a word at start-up."""
    spec = VerifierSpec(path=f"learner.rewards.verifiers:{path}", params=params)
    with pytest.raises(ValueError, match=r"verifiers\[0\]\.params: .*" + message):
        VerifierRunner([spec])


def test_reward_weights_may_not_be_negative() -> None:
    """A negative weight left a source out without a word (feedback) or took the weighted
    mean outside its parts' range (verifiers)."""
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        RewardConfig(weights={"feedback": -1.0})
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        VerifierSpec(path="learner.rewards.verifiers:number_answer", weight=-0.5)
    assert RewardConfig(weights={"feedback": 0.0}).weights.feedback == 0.0


def nan_verifier(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float:
    return float("nan")


def test_hung_verifiers_do_not_starve_later_ones() -> None:
    hang = VerifierSpec(
        path=f"{__name__}:slow_verifier", timeout_s=0.1, params={"sleep_s": 3.0}, tasks=["hang"]
    )
    exact = VerifierSpec(
        path="learner.rewards.verifiers:exact_match", timeout_s=0.5, params={"expected": "5"}
    )
    runner = VerifierRunner([hang, exact])
    rec = record("5")
    for _ in range(6):  # more hung calls than the old pool had workers
        runner.score({**rec, "task": "hang"}, rec["choices"][0])
    started = time.monotonic()
    assert runner.score(rec, rec["choices"][0]) == 1.0
    assert time.monotonic() - started < 0.4
    assert runner.timeouts == 6 and runner.stuck == 6


_RELEASE = threading.Event()


def held_verifier(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float:
    _RELEASE.wait(30)
    return 1.0


def exiting_verifier(trajectory: dict[str, Any], choice: dict[str, Any], **params: Any) -> float:
    raise SystemExit(0)  # model-written code calling exit()


def test_a_verifier_that_hangs_stops_being_called_past_a_bound_of_running_calls() -> None:
    """Each call of a verifier that never returns left a thread behind, without bound,
    until no thread could start and the learner died."""
    from learner.rewards import verifiers

    _RELEASE.clear()
    runner = VerifierRunner([VerifierSpec(path=f"{__name__}:held_verifier", timeout_s=0.01)])
    rec = record("5")
    try:
        bound = verifiers._MAX_STUCK_PER_VERIFIER
        for _ in range(bound + 5):
            assert runner.verify(rec, rec["choices"][0]).failed
        assert runner.timeouts == bound and runner.errors == 5
        assert runner.stuck == bound
    finally:
        _RELEASE.set()


def test_a_verifier_raising_systemexit_failed_it_did_not_abstain() -> None:
    runner = VerifierRunner(
        [
            VerifierSpec(path=f"{__name__}:exiting_verifier"),
            VerifierSpec(path="learner.rewards.verifiers:exact_match", params={"expected": "5"}),
        ]
    )
    rec = record("5")
    score = runner.verify(rec, rec["choices"][0])
    assert score.failed and score.value == 1.0 and runner.errors == 1


def test_a_catastrophic_regex_fails_the_call_and_lets_the_learner_run() -> None:
    """`re` held the interpreter lock through the backtrack: the timeout never fired, and
    the learner froze (27 s for `^(\\w+\\s?)*$` on a 29-character reply; `regex` answers that
    one at once, and stops this one at its own timeout)."""
    spec = VerifierSpec(
        path="learner.rewards.verifiers:regex_match",
        timeout_s=0.5,
        params={"pattern": r"(a|aa)+$"},
    )
    runner = VerifierRunner([spec])
    rec = record("a" * 40 + "b")
    ticks = []
    ticker = threading.Thread(target=lambda: [ticks.append(time.sleep(0.05)) for _ in range(10)])
    ticker.start()
    assert runner.verify(rec, rec["choices"][0]).failed
    ticker.join(10)
    assert len(ticks) == 10  # other threads ran meanwhile
    assert runner.timeouts == 1


def test_nan_and_infinity_are_not_json() -> None:
    """Python's json reads them; strict clients refuse them: they were rewarded as valid."""
    for text in ('{"price": NaN}', "[Infinity]", "-Infinity"):
        assert json_valid({}, {"message": {"content": text}}) == 0.0
    declared = {"request": {"tools": [{"type": "function", "function": {"name": "f"}}]}}
    call = {"function": {"name": "f", "arguments": '{"x": NaN}'}}
    assert tool_calls_valid(declared, {"message": {"tool_calls": [call]}}) == 0.0


def test_timeouts_and_feedback_values_are_finite() -> None:
    """An infinite (or past threading's TIMEOUT_MAX) timeout raised OverflowError at every
    wait, stopping the learner; a NaN feedback value rewarded samples later dropped."""
    for bad in (float("inf"), 1e10):
        with pytest.raises(ValueError, match="timeout_s"):
            VerifierSpec(path="m:f", timeout_s=bad)
        with pytest.raises(ValueError, match="timeout_s"):
            JudgeConfig(timeout_s=bad)
    with pytest.raises(ValueError, match="accept"):
        FeedbackValues(accept=float("nan"))


def test_a_judge_logprob_above_zero_is_no_probability() -> None:
    """math.exp(1000) raised OverflowError through the learner, at every retry."""
    from learner.rewards.judge import _distribution

    high = _distribution([("A", 1000.0), ("B", -12.0)], "AB")
    assert high["A"] > 0.9999  # counted as 0: a rounding above 0 keeps its label's mass
    assert _distribution([("A", 1e-7), ("B", -12.0)], "AB")["A"] > 0.9999
    assert _distribution([("A", float("nan"))], "AB") == {}


def test_non_finite_verifier_value_is_an_error() -> None:
    runner = VerifierRunner([VerifierSpec(path=f"{__name__}:nan_verifier")])
    rec = record("5")
    assert runner.score(rec, rec["choices"][0]) is None
    assert runner.errors == 1


def test_assembler_counts_verifier_timeouts_and_errors() -> None:
    config = RewardConfig(
        verifiers=[
            VerifierSpec(path=f"{__name__}:slow_verifier", timeout_s=0.1, params={"sleep_s": 0.5}),
            VerifierSpec(path=f"{__name__}:broken_verifier"),
        ]
    )
    assembler = RewardAssembler(config)
    assembler.assemble([{"trajectory": record("5"), "feedback": []}])
    assert dict(assembler.counts) == {
        "verifier_timeouts": 1,
        "verifier_errors": 1,
        "incomplete": 1,
    }


def test_assembler_weights_and_no_reward_counted() -> None:
    config = RewardConfig(
        verifiers=[
            VerifierSpec(
                path="learner.rewards.verifiers:exact_match",
                params={"expected": "5"},
                tasks=["sum"],
            )
        ],
    )
    assembler = RewardAssembler(config)
    items = [
        {"trajectory": record("5"), "feedback": [{"kind": "reject", "choice_index": 0}]},
        {"trajectory": record("6", task="other"), "feedback": []},  # no part applies
        {"trajectory": record("5", trainable=False), "feedback": []},
    ]
    out = assembler.assemble(items)
    assert len(out) == 2
    assert out[0].parts == {"feedback": -0.25, "verifiers": 1.0}
    assert out[0].reward == pytest.approx(0.375)
    assert out[1].reward is None
    assert dict(assembler.counts) == {"rewarded": 1, "no_reward": 1, "untrainable": 1}


def sampled(*contents: str, **kw: Any) -> dict[str, Any]:
    """A record of n = len(contents) replies, one group."""
    base = record(contents[0], **kw)
    base["choices"] = [
        {**base["choices"][0], "index": i, "message": {"role": "assistant", "content": text}}
        for i, text in enumerate(contents)
    ]
    return base


@pytest.mark.parametrize("kind", ["accept", "thumbs_up", "reject"])
def test_feedback_moves_the_reply_it_is_about_the_way_it_says(kind: str) -> None:
    """Feedback comes for the reply a user acted on only; its siblings count a neutral 0.
    Taken as a missing part, an accept (0.75) averaged a reply its verifier scored 1.0
    down to 0.875 below its siblings' 1.0, and the advantage pushed the accepted reply
    down."""
    from learner.objective import RunningBaseline, assign_advantages, samples_from_rewarded

    config = RewardConfig(
        verifiers=[
            VerifierSpec(path="learner.rewards.verifiers:exact_match", params={"expected": "5"})
        ]
    )
    rec = sampled("5", "5", "5", "5", group_id="g")
    out = RewardAssembler(config).assemble(
        [{"trajectory": rec, "feedback": [{"kind": kind, "choice_index": 2}]}]
    )
    rewards = [r.reward for r in out]
    assert rewards[0] == rewards[1] == rewards[3] == pytest.approx(0.5)
    samples, _ = samples_from_rewarded(out)
    kept, _ = assign_advantages(samples, RunningBaseline(decay=0.9))
    advantages = {int(s.key.rsplit(":", 1)[1]): s.advantage for s in kept}
    if kind == "reject":
        assert rewards[2] < 0.5 and advantages[2] < 0 < advantages[0]
    else:
        assert rewards[2] > 0.5 and advantages[2] > 0 > advantages[0]


def test_feedback_alone_rewards_only_the_replies_it_is_about() -> None:
    """Without verifiers or judge, a reply nobody reacted to has no part at all: it is not
    trained on (silence is not a verdict), and feedback keeps its own value."""
    out = RewardAssembler(RewardConfig()).assemble(
        [{"trajectory": sampled("a", "b"), "feedback": [{"kind": "accept", "choice_index": 1}]}]
    )
    assert [r.reward for r in out] == [None, 0.75]


def test_a_failed_judge_verdict_leaves_its_reply_out_of_the_comparison() -> None:
    """A reply whose judge verdict failed would be scored on fewer parts than its
    siblings: not rewarded (`incomplete`), where it used to get the verifier's part alone."""

    class HalfJudge:
        def score_group(
            self, trajectory: Any, choices: Any, stop: Any, rank: bool = True
        ) -> list[JudgeVerdict]:
            return [
                JudgeVerdict(score=0.2, raw={}),
                JudgeVerdict(score=None, raw={}, error="timeout"),
            ]

        def close(self) -> None:
            pass

    config = RewardConfig(
        verifiers=[
            VerifierSpec(path="learner.rewards.verifiers:exact_match", params={"expected": "5"})
        ]
    )
    assembler = RewardAssembler(config, judge=HalfJudge())  # type: ignore[arg-type]
    out = assembler.assemble([{"trajectory": sampled("5", "5"), "feedback": []}])
    assert out[0].reward == pytest.approx((1.0 + 0.5 * 0.2) / 2.5)
    assert out[1].reward is None
    assert dict(assembler.counts) == {"rewarded": 1, "incomplete": 1, "judge_failed": 1}


def test_a_failed_score_is_not_made_up_from_the_groups_ranking() -> None:
    """A reply whose own score timed out while the group's ranking answered was scored from
    the ranking alone (0.4/0.6), its sibling half-and-half (0.5·0.2 + 0.5·1): the reply the
    judge did not prefer got the higher reward, and the failure was never counted."""
    judge = Judge(JudgeConfig(enabled=True, base_url="http://127.0.0.1:9/v1"))

    def score(trajectory: Any, choice: Any, stop: Any = None) -> JudgeVerdict:
        if choice["index"] == 0:
            return JudgeVerdict(score=None, raw={}, error="APITimeoutError: timed out")
        return JudgeVerdict(score=0.2, raw={"score": 0.2})

    def rank(trajectory: Any, choices: Any, stop: Any = None) -> JudgeVerdict:
        return JudgeVerdict(score=0.6, raw={"preference": [0.4, 0.6]})

    judge.score, judge.rank = score, rank  # type: ignore[method-assign]
    assembler = RewardAssembler(RewardConfig(), judge=judge)
    try:
        out = assembler.assemble([{"trajectory": sampled("a", "b"), "feedback": []}])
    finally:
        assembler.close()
    failed, scored = out
    assert failed.reward is None and failed.incomplete and "judge" not in failed.parts
    assert failed.judge_raw is not None
    assert failed.judge_raw["error"] == "APITimeoutError: timed out"
    assert failed.judge_raw["raw"]["rank"] == {"preference": [0.4, 0.6]}  # kept for audit
    assert scored.parts == {"judge": pytest.approx(0.5 * 0.2 + 0.5 * 1.0)}
    assert dict(assembler.counts) == {"rewarded": 1, "incomplete": 1, "judge_failed": 1}


class GroupRecordingJudge:
    """Notes each group it is asked to grade: its prompt, its replies, whether to rank it."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[str], bool]] = []
        self.config = JudgeConfig(enabled=True)

    @property
    def groups(self) -> list[tuple[list[str], bool]]:
        return [(replies, rank) for _, replies, rank in self.seen]

    def score_group(
        self,
        trajectory: dict[str, Any],
        choices: list[dict[str, Any]],
        stop: Any = None,
        rank: bool = True,
    ) -> list:
        prompt = trajectory["request"]["messages"][0]["content"]
        self.seen.append((prompt, [str(c["message"]["content"]) for c in choices], rank))
        return [JudgeVerdict(score=0.5) for _ in choices]


def test_judge_groups_are_the_objective_groups_per_tenant() -> None:
    judge = GroupRecordingJudge()
    assembler = RewardAssembler(RewardConfig(), judge=judge)  # type: ignore[arg-type]
    items = [
        {"trajectory": record(text, tenant=tenant, trajectory_id=text, group_id="g1")}
        for text, tenant in (("a1", "A"), ("a2", "A"), ("b1", "B"))
    ]
    assembler.assemble(items)
    # Tenant B's reply is never ranked against tenant A's prompt and replies.
    assert sorted(judge.groups) == [(["a1", "a2"], True), (["b1"], True)]


def test_a_judge_group_another_rank_holds_part_of_is_not_ranked() -> None:
    """Ranked per torchrun rank, each rank's best reply got the ranking's whole bonus (a
    0.44 reply became 0.94, best only on its rank), while advantages compare the group over
    the ranks: such a group is graded reply by reply."""
    judge = GroupRecordingJudge()
    assembler = RewardAssembler(RewardConfig(), judge=judge)  # type: ignore[arg-type]
    items = [
        {"trajectory": record(text, trajectory_id=text, group_id=group)}
        for text, group in (("a1", "split"), ("a2", "split"), ("b1", "here"), ("b2", "here"))
    ]
    keys = assembler.judge_group_keys(items)
    assert len(keys) == 2 and assembler.ranks_groups
    [split] = [k for k in keys if "split" in k]
    assembler.assemble(items, unranked=frozenset({split}))
    assert sorted(judge.groups) == [(["a1", "a2"], False), (["b1", "b2"], True)]


def test_the_judge_sees_each_reply_with_its_own_conversation() -> None:
    """A group id is the client's free label: a record with another prompt under it was
    graded against the first record's conversation."""

    judge = GroupRecordingJudge()
    assembler = RewardAssembler(RewardConfig(), judge=judge)  # type: ignore[arg-type]
    france = {"messages": [{"role": "user", "content": "Name the capital of France."}]}
    items = [
        {"trajectory": record("5", trajectory_id="t1", group_id="episode-7")},
        {"trajectory": record("6", trajectory_id="t2", group_id="episode-7")},
        {
            "trajectory": record(
                "Paris",
                trajectory_id="t3",
                group_id="episode-7",
                request=france,
                prompt_token_ids=[9, 9],
            )
        },
    ]
    assembler.assemble(items)
    assert sorted(judge.seen) == [
        ("Name the capital of France.", ["Paris"], True),
        ("What is 2 plus 3?", ["5", "6"], True),
    ]


def test_a_record_with_two_choices_of_one_index_is_not_trained_on() -> None:
    """Choices are found by index: two sharing one were each trained with the first one's
    tokens under their own rewards."""
    rec = record("42")
    rec["choices"].append({**rec["choices"][0], "message": {"role": "assistant", "content": "41"}})
    assembler = RewardAssembler(RewardConfig())
    assert assembler.assemble([{"trajectory": rec, "feedback": []}]) == []
    assert assembler.counts["duplicate_choice_index"] == 2


@pytest.mark.parametrize(
    "inconsistent",
    [
        {"flags": ["token_count_mismatch"]},
        {"flags": ["redacted"], "redactions": {"email": 1}},
        {"redactions": {"api_key": 2}},
        {"status": "aborted"},
        {"trainable": False},
    ],
)
def test_a_record_with_flags_or_redactions_is_not_trained_on(inconsistent: dict) -> None:
    """Only `trainable` and `status` were read: a schema-valid record from another producer
    with flags or redactions but `trainable: true` was trained on."""
    rec = record("42", **inconsistent)
    assembler = RewardAssembler(RewardConfig())
    feedback = [{"kind": "accept", "trajectory_id": "t1"}]
    assert assembler.assemble([{"trajectory": rec, "feedback": feedback}]) == []
    assert assembler.counts["untrainable"] == 1
    clean = record("42", redactions={"email": 0}, flags=[])
    assert len(assembler.assemble([{"trajectory": clean, "feedback": feedback}])) == 1


def test_an_overflowing_batch_keeps_the_newest_whatever_their_partition() -> None:
    """The consumer yields partition by partition; the cut by position dropped partition
    0 whole, and with it the same sessions every time."""
    from learner.service import newest

    items = [
        {"trajectory": record("x", created_at=float(t), trajectory_id=f"p{p}-{t}"), "feedback": []}
        for p in range(4)  # partition by partition, as yielded
        for t in range(p, 40, 4)  # each partition's requests spread over the same time
    ]
    kept = newest(items, 8)
    assert sorted(i["trajectory"]["created_at"] for i in kept) == [float(t) for t in range(32, 40)]
    assert {i["trajectory"]["trajectory_id"][:2] for i in kept} == {"p0", "p1", "p2", "p3"}
    no_time = {"trajectory": record("x", created_at=None), "feedback": []}
    assert no_time not in newest([no_time, *items[:8]], 8)
    assert newest(items[:3], 8) == items[:3]


def test_feedback_for_no_choice_and_records_without_choices_are_counted() -> None:
    """Feedback addressed to a choice the record lacks (a client's wrong choice_index) and a
    record with `choices: []` were dropped and added to no counter."""
    from learner.progress import Progress

    rec = record("42")
    feedback = [
        {"kind": "accept", "choice_index": 5, "trajectory_id": "t1"},
        {"kind": "thumbs_up", "choice_index": 0, "trajectory_id": "t1"},
        {"kind": "thumbs_up", "choice_index": 2, "trajectory_id": "t1"},
    ]
    empty = record("", trajectory_id="t2", choices=[])
    items = [
        {"trajectory": rec, "feedback": feedback},
        {"trajectory": empty, "feedback": [{"kind": "accept", "trajectory_id": "t2"}]},
    ]
    assembler = RewardAssembler(RewardConfig())
    out = assembler.assemble(items)
    assert [(r.choice_index, r.reward) for r in out] == [(0, 0.5)]
    assert dict(assembler.counts) == {"feedback_unmatched": 3, "no_choices": 1, "rewarded": 1}
    # The learner logs them as reward_<count>; the progress line names them with the drops.
    progress = Progress(interval_s=60)
    progress.counts = {f"reward_{k}": v for k, v in assembler.counts.items()}
    assert progress.snapshot()["dropped"] == {
        "reward_no_choices": 1,
        "reward_feedback_unmatched": 3,
    }


def test_the_judges_prompt_takes_plain_string_parts() -> None:
    """vLLM serves `"content": ["hi"]`; the judge raised AttributeError on it, and the
    learner stopped on that batch at every restart."""
    content = ["hi", {"type": "text", "text": "there"}, {"type": "image_url"}, 3]
    rec = record("x", request={"messages": [{"role": "user", "content": content}]})
    assert prompt_text(rec, 100) == "user: hi there "


@pytest.mark.parametrize(
    "body",
    [
        {"id": "j", "object": "chat.completion", "created": 1, "model": "m", "choices": []},
        {"error": "overloaded"},
        "<html>busy</html>",
    ],
)
def test_an_odd_judge_reply_is_a_failed_verdict_not_an_exception(body: Any) -> None:
    from tests.proxy.threaded_upstream import NotingUpstream

    server = NotingUpstream({("POST", "/v1/chat/completions"): body}).start()
    judge = Judge(JudgeConfig(enabled=True, base_url=f"{server.url}/v1", retries=1))
    try:
        rec = record("5")
        verdict = judge.score(rec, rec["choices"][0])
    finally:
        judge.close()
        server.stop()
    assert verdict.score is None and verdict.error
    assert judge.failures == 1 and judge.calls == 2


@pytest.mark.parametrize("text", ["\n", " ", ""])
def test_a_blank_ranking_answer_is_an_unparseable_verdict(text: str) -> None:
    """`"" in "AB"` is true: a whitespace answer whose top logprobs hold no label raised
    IndexError, which the judge took for a malformed reply (retried, not cached)."""
    assert Judge._letter_preference([(text, -0.1), ("The", -3.0)], text, "AB") == {
        "score": None,
        "preference": None,
    }


def test_a_cached_unparseable_verdict_is_still_a_failed_one() -> None:
    from tests.proxy.threaded_upstream import NotingUpstream

    reply = {
        "id": "j",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "maybe"}}],
    }
    server = NotingUpstream({("POST", "/v1/chat/completions"): reply}).start()
    judge = Judge(JudgeConfig(enabled=True, base_url=f"{server.url}/v1"))
    try:
        rec = record("5")
        first = judge.score(rec, rec["choices"][0])
        again = judge.score(rec, rec["choices"][0])
    finally:
        judge.close()
        server.stop()
    assert first.score is None and first.error == "unparseable verdict" and not first.cached
    assert again.cached and again.score is None and again.error == "unparseable verdict"
    assert judge.calls == 1


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A TCP server that accepts connections and never answers (a hung judge)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}/v1"
    stop.set()
    thread.join()
    for conn in conns:
        conn.close()
    server.close()


def test_the_judge_on_the_policy_server_asks_for_the_base_by_its_served_name() -> None:
    """`model: base` with `policy.served_model_name` set otherwise: every call was a 404 on
    the policy's vLLM, counted as judge_failed, and the judge rewarded nothing."""
    on_policy = Judge(JudgeConfig(enabled=True), base_url="http://127.0.0.1:9/v1", base_name="m")
    own_server = Judge(JudgeConfig(enabled=True, base_url="http://127.0.0.1:9/v1"), base_name="m")
    named = Judge(JudgeConfig(enabled=True, model="judge-7b"), base_url="http://127.0.0.1:9/v1")
    try:
        assert on_policy.config.model == "m"
        assert own_server.config.model == "base"  # another server's names are its own
        assert named.config.model == "judge-7b"
    finally:
        for judge in (on_policy, own_server, named):
            judge.close()


def test_judge_timeout_yields_no_reward(silent_server: str) -> None:
    judge = Judge(JudgeConfig(enabled=True, base_url=silent_server, timeout_s=0.3, retries=1))
    rec = record("5")
    started = time.monotonic()
    verdict = judge.score(rec, rec["choices"][0])
    assert verdict.score is None and "Timeout" in (verdict.error or "")
    assert judge.calls == 2 and judge.failures == 1
    assert time.monotonic() - started < 5
    config = RewardConfig(weights={"feedback": 1.0, "verifiers": 1.0, "judge": 1.0})
    assembler = RewardAssembler(config, judge=judge)
    out = assembler.assemble([{"trajectory": rec, "feedback": []}])
    assert out[0].reward is None
    assert assembler.counts["incomplete"] == 1 and assembler.counts["judge_failed"] == 1
    judge.close()


def assemble_stopped_after(
    assembler: RewardAssembler, items: list[dict[str, Any]], delay_s: float
) -> list[Any]:
    """`assemble(items, stop)` with the stop set `delay_s` into it (a Ctrl-C)."""
    stop = threading.Event()
    timer = threading.Timer(delay_s, stop.set)
    timer.start()
    try:
        return assembler.assemble(items, stop)
    finally:
        timer.join()


def test_a_stop_ends_the_judging_of_a_batch_within_one_call(silent_server: str) -> None:
    """A hung judge held a stopping learner for every group's calls (six groups, two
    attempts of 1 s each: 12 s) while `olp up` waits 30 s and then kills it."""
    judge = Judge(
        JudgeConfig(enabled=True, base_url=silent_server, timeout_s=1.0, retries=1, concurrency=1)
    )
    config = RewardConfig(weights={"feedback": 1.0, "verifiers": 0.0, "judge": 1.0})
    assembler = RewardAssembler(config, judge=judge)
    items = [{"trajectory": record("5", trajectory_id=f"t{i}")} for i in range(6)]
    out = assemble_stopped_after(assembler, items, 0.3)
    # The call in flight ended with its timeout; no retry, no other group's call started.
    assert judge.calls == 1 and judge.failures == 0  # a stop is not the judge's failure
    assert out[0].judge_raw == {"raw": {}, "error": STOPPED}
    assert [r.judge_raw for r in out[1:]] == [None] * 5  # never asked
    assert "judge_failed" not in assembler.counts
    judge.close()


def test_a_stop_ends_the_verifying_of_a_batch_within_one_call() -> None:
    slow = f"{__name__}:slow_verifier"
    spec = VerifierSpec(path=slow, timeout_s=0.5, params={"sleep_s": 0.4})
    assembler = RewardAssembler(RewardConfig(verifiers=[spec]))
    items = [{"trajectory": record("5", trajectory_id=f"t{i}")} for i in range(20)]
    out = assemble_stopped_after(assembler, items, 0.2)
    # The first item's call (0.4 s) was in flight at the stop; none of the other 19 ran.
    assert len(out) == 1 and out[0].parts == {"verifiers": 1.0}
    assert len(assembler.assemble(items[:2])) == 2  # without a stop: every item


TOOLS = [
    {"type": "function", "function": {"name": "run_tests", "description": "Run the tests."}},
    {"type": "function", "function": {"name": "rm_rf"}},
]


def _tool_call_record(*calls: tuple[str, str]) -> dict[str, Any]:
    """An agent turn whose replies only call tools (`content: null`), one choice per call."""
    history = [
        {"role": "user", "content": "fix the bug"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c0",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "f.py"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "def f(): ..."},
    ]
    rec = record("", request={"messages": history, "tools": TOOLS})
    rec["choices"] = [
        {
            "index": index,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": f"x{index}",
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    },
                ],
            },
            "finish_reason": "tool_calls",
            "token_ids": [4, 5],
            "logprobs": [-0.5, -0.5],
        }
        for index, (name, arguments) in enumerate(calls)
    ]
    return rec


def test_the_judge_is_shown_tool_calls_and_the_tools_declared() -> None:
    """A reply of tool calls only was shown to the judge as empty, and the conversation's
    tool calls as `assistant: `: the right call and a destructive one were graded alike."""
    rec = _tool_call_record(("run_tests", '{"path": "tests"}'))
    assert prompt_text(rec, 10_000) == (
        "tool run_tests: Run the tests.\n"
        "tool rm_rf\n"
        "user: fix the bug\n"
        'assistant: [tool call] read_file({"path": "f.py"})\n'
        "tool: def f(): ..."
    )
    assert reply_text(rec["choices"][0]) == '[tool call] run_tests({"path": "tests"})'
    both = record("Done.")
    both["choices"][0]["message"]["tool_calls"] = rec["choices"][0]["message"]["tool_calls"]
    assert reply_text(both["choices"][0]) == 'Done.\n[tool call] run_tests({"path": "tests"})'


def test_text_verifiers_abstain_on_a_reply_of_tool_calls_only() -> None:
    """They scored 0.0 (a wrong answer) for every tool-calling turn they were not kept from
    by `tasks`; a text check has nothing to judge there."""
    rec = _tool_call_record(("run_tests", "{}"))
    choice = rec["choices"][0]
    assert exact_match(rec, choice, expected="5") is None
    assert regex_match(rec, choice, pattern=r"\d") is None
    assert json_valid(rec, choice) is None
    assert tool_calls_valid(rec, choice) == 1.0  # the check that is about tool calls
    spoken = record("5")
    spoken["choices"][0]["message"]["tool_calls"] = choice["message"]["tool_calls"]
    assert exact_match(spoken, spoken["choices"][0], expected="5") == 1.0  # text: checked


def test_the_real_judge_tells_two_tool_calls_apart(vllm_server: Any) -> None:
    """Both replies were shown as empty: one prompt, one cache key, one verdict for both."""
    config = JudgeConfig(enabled=True, model=vllm_server.model_name, timeout_s=60, retries=1)
    judge = Judge(config, base_url=f"{vllm_server.base_url}/v1")
    rec = _tool_call_record(("run_tests", '{"path": "tests"}'), ("rm_rf", '{"path": "/"}'))
    try:
        verdicts = [judge.score(rec, choice) for choice in rec["choices"]]
    finally:
        judge.close()
    assert all(v.error is None and v.score is not None for v in verdicts), verdicts
    assert not verdicts[1].cached and judge.calls == 2


def test_judge_through_real_vllm(vllm_server: Any) -> None:
    config = JudgeConfig(enabled=True, model=vllm_server.model_name, timeout_s=60, retries=1)
    judge = Judge(config, base_url=f"{vllm_server.base_url}/v1")
    rec = record("5")
    rec["choices"].append(
        {
            "index": 1,
            "message": {"role": "assistant", "content": "Banana."},
            "finish_reason": "stop",
            "token_ids": [6],
            "logprobs": [-1.0],
        }
    )
    verdict = judge.score(rec, rec["choices"][0])
    assert verdict.error is None, verdict.raw
    assert verdict.score is not None and 0.0 <= verdict.score <= 1.0
    assert verdict.raw["top_logprobs"] and verdict.raw["distribution"]
    again = judge.score(rec, rec["choices"][0])
    assert again.cached and again.score == verdict.score and judge.calls == 1
    ranked = judge.score_group(rec, rec["choices"])
    assert len(ranked) == 2
    assert all(v.score is not None and 0.0 <= v.score <= 1.0 for v in ranked)
    preference = ranked[0].raw["rank"]["preference"]
    assert len(preference) == 2 and sum(preference) == pytest.approx(1.0)
    judge.close()


def test_a_lone_surrogate_in_the_conversation_reaches_the_judge_as_its_escape(
    vllm_server: Any,
) -> None:
    """A client's `"\\ud800"` is kept in its record; put into the judge's prompt, the openai
    client raised UnicodeEncodeError out of `assemble`, and the learner died on that batch
    at every restart. The judge sees the escape as the client wrote it, and grades."""
    config = JudgeConfig(enabled=True, model=vllm_server.model_name, timeout_s=60, retries=0)
    judge = Judge(config, base_url=f"{vllm_server.base_url}/v1")
    rec = record("5", request={"messages": [{"role": "user", "content": "2 plus 3? \ud800"}]})
    try:
        verdict = judge.score(rec, rec["choices"][0])
    finally:
        judge.close()
    assert verdict.error is None and verdict.score is not None, verdict.raw
    assert judge.failures == 0


def test_the_judge_drops_idle_connections_before_vllms_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """openai keeps idle connections 5 s, as long as vLLM does: a judge call at that age
    could meet a connection vLLM was closing. Shortened here to keep the test quick."""
    from learner.rewards import judge as judge_module
    from tests.proxy.threaded_upstream import NotingUpstream, assert_reconnects_after_idle

    assert judge_module.VLLM_SAFE_KEEPALIVE_S < 5.0
    monkeypatch.setattr(judge_module, "VLLM_SAFE_KEEPALIVE_S", 0.3)
    top = [{"token": "7", "logprob": 0.0, "bytes": [55]}]
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "7"},
        "logprobs": {"content": [{"token": "7", "logprob": 0.0, "top_logprobs": top}]},
        "finish_reason": "length",
    }
    answer = {"id": "j", "object": "chat.completion", "created": 1, "model": "m"}
    server = NotingUpstream({("POST", "/v1/chat/completions"): {**answer, "choices": [choice]}})
    server.start()
    judge = Judge(JudgeConfig(enabled=True, base_url=f"{server.url}/v1", cache_size=0))
    answers = iter("123")

    def score() -> None:
        rec = record(next(answers))
        assert judge.score(rec, rec["choices"][0]).error is None

    try:
        assert_reconnects_after_idle(score, server.connections)
    finally:
        judge.close()
        server.stop()


def test_progress_tokens_per_s_is_over_the_time_since_the_last_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Over the whole uptime, a learner that was frozen for an hour and then trained showed a
    fraction of its rate, and one that stalled kept showing its old rate."""
    from learner import progress as progress_module

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    progress = progress_module.Progress(interval_s=60)
    now[0] += 3600  # an hour frozen
    progress.record_step(1, {"tokens": 500.0})
    now[0] += 10
    progress.record_step(2, {"tokens": 500.0})
    first = progress.snapshot()
    assert first["trained_tokens"] == 1000
    assert first["tokens_per_s"] == round(1000 / 3610, 2)  # the first line: since start
    now[0] += 10
    progress.record_step(3, {"tokens": 2000.0})
    assert progress.snapshot()["tokens_per_s"] == 200.0
    now[0] += 60  # stalled
    stalled = progress.snapshot()
    assert stalled["tokens_per_s"] == 0.0 and stalled["trained_tokens"] == 3000
