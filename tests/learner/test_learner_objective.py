"""Pure-logic tests of the objective: exact counts for staleness, caps, advantages, loss."""

from __future__ import annotations

import math

import pytest
import torch

from learner.distributed import DistContext
from learner.objective import (
    MAX_BASELINE_TASKS,
    REWARD_LIMIT,
    RunningBaseline,
    Sample,
    apply_share_caps,
    assign_advantages,
    assign_advantages_for_rank,
    drop_stale,
    parse_version,
    policy_loss,
    samples_from_rewarded,
    select_capped,
    select_trained,
)
from learner.rewards.assembler import RewardedChoice
from safety.config import CapsConfig


def make_sample(i: int, **kw: object) -> Sample:
    base = dict(
        key=f"t{i}:0",
        event_id=f"e{i}",
        prompt_ids=[1, 2],
        completion_ids=[3],
        sampling_logprobs=[-1.0],
        reward=float(i),
        group=None,
        task="t",
        tenant="A",
        user=None,
        policy_version=0,
    )
    base.update(kw)
    return Sample(**base)  # type: ignore[arg-type]


def test_parse_version() -> None:
    assert parse_version("base") == 0
    assert parse_version("policy-v12") == 12
    with pytest.raises(ValueError):
        parse_version("policy-12")


def test_staleness_drops_exactly_older_than_k() -> None:
    samples = [make_sample(i, policy_version=v) for i, v in enumerate([0, 1, 2, 3, 4, 5, 6])]
    kept, dropped = drop_stale(samples, current_version=6, max_staleness=2)
    assert [s.policy_version for s in kept] == [4, 5, 6]
    assert dropped == 4
    kept, dropped = drop_stale(samples, current_version=6, max_staleness=0)
    assert [s.policy_version for s in kept] == [6] and dropped == 6


def test_tenant_and_user_caps_exact_counts() -> None:
    # Tenant A has 7 of 10, B 3; max share 0.5 of what is kept → A keeps 3, B 3.
    samples = [make_sample(i, tenant="A" if i < 7 else "B") for i in range(10)]
    caps = CapsConfig(max_tenant_share=0.5, max_user_share=None)
    kept, counts = apply_share_caps(samples, caps)
    assert counts == {"capped": 4}
    assert [s.key for s in kept] == [f"t{i}:0" for i in (0, 1, 2, 7, 8, 9)]
    # One tenant; users u1 6, u2 2, unknown 2 (each a user of its own: four groups, so 0.3
    # stands). u1 and u2 keep 1 each: 2 of 4 kept would be 0.5, over 0.3; unknown are kept.
    users = ["u1"] * 6 + ["u2"] * 2 + [None] * 2
    samples = [make_sample(i, user=u) for i, u in enumerate(users)]
    kept, counts = apply_share_caps(samples, CapsConfig(max_user_share=0.3))
    assert counts == {"capped": 6}
    assert [s.user for s in kept] == ["u1", "u2", None, None]
    # The same user name under two tenants is two users.
    samples = [make_sample(i, tenant=t, user="u") for i, t in enumerate("AAAB")]
    kept, counts = apply_share_caps(samples, CapsConfig(max_tenant_share=None, max_user_share=0.5))
    assert counts == {"capped": 2} and [s.tenant for s in kept] == ["A", "B"]


def test_caps_count_completion_tokens_as_the_loss_does() -> None:
    """4 samples each, within a 0.5 share of samples: B's 50-token completions held 200 of
    220 tokens, 91 % of the gradient. In tokens, B keeps what A's tokens allow."""
    short = [make_sample(i, tenant="A", completion_ids=[3] * 5) for i in range(20)]
    long = [make_sample(100 + i, tenant="B", completion_ids=[3] * 50) for i in range(4)]
    caps = CapsConfig(max_tenant_share=0.5, max_user_share=None)
    kept, counts = apply_share_caps(short + long, caps)
    tokens = {t: sum(len(s.completion_ids) for s in kept if s.tenant == t) for t in "AB"}
    assert tokens == {"A": 100, "B": 100} and counts == {"capped": 2}
    # The same decision over ranks.
    sources = [[(s.tenant, s.user, len(s.completion_ids)) for s in part] for part in (short, long)]
    keep = select_capped(sources, caps)
    assert (sum(keep[0]), sum(keep[1])) == (20, 2)
    # A tenant with nothing but one sample over its share of the whole batch (50 of 70
    # tokens) keeps none: one huge sample must not hold most of a step (safety/caps.py).
    kept, _ = apply_share_caps(short[:4] + long[:1], caps)
    assert [s.tenant for s in kept] == ["A"] * 4
    # One within its share of the whole batch (50 of 120 tokens) is kept, though it is over
    # A's 20 kept tokens: a share cap does not empty a tenant for one short sample of another.
    kept, _ = apply_share_caps(short[:4] + long[:1] + short[4:14], caps)
    assert sorted({s.tenant for s in kept}) == ["A", "B"]


def test_the_cap_holds_on_what_is_trained_after_advantages() -> None:
    """Capped 4 and 4, then A's first sample of its task (sets the baseline) and one equal
    to it carry no advantage: B trained 4 against A's 2, 67 % of the batch.

    B's 4 are two groups of 2 (one group of 4 could not be cut to 2 without splitting it:
    see the next test)."""
    a = [make_sample(i, tenant="A", reward=r) for i, r in enumerate([0.5, 0.5, 1.0, 0.0])]
    b = [make_sample(10 + i, tenant="B", group=f"gb{i // 2}", reward=i % 2) for i in range(4)]
    caps = CapsConfig(max_tenant_share=0.5, max_user_share=None)
    trained, parts = select_trained(DistContext(), a + b, RunningBaseline(decay=0.5), caps)
    assert sorted(s.key for s in trained) == sorted(s.key for s in a[2:] + b[:2])
    capped = sum(part.get("capped", 0) for part in parts)
    assert capped == 2 and parts[1]["zero_advantage_samples"] == 2


def test_the_second_cap_keeps_or_drops_groups_whole() -> None:
    """After advantages, A's group of 4 (rewards 1, 1, 0, 0) against B's 2: the cap kept
    A's earliest 2, both +1, so A trained its group's good replies alone, a group mean of
    +1 instead of 0. A whole group that does not fit is dropped."""
    a = [make_sample(i, tenant="A", group="ga", reward=r) for i, r in enumerate([1, 1, 0, 0])]
    b = [make_sample(10 + i, tenant="B", group="gb", reward=float(i)) for i in range(2)]
    b += [make_sample(20 + i, tenant="B", group="gb2", reward=1.0) for i in range(2)]
    caps = CapsConfig(max_tenant_share=0.5, max_user_share=None)
    trained, parts = select_trained(DistContext(), a + b, RunningBaseline(decay=0.5), caps)
    assert [s.key for s in trained] == ["t10:0", "t11:0"]
    assert sum(s.advantage for s in trained) == pytest.approx(0.0)
    assert parts[2] == {"capped": 4}
    # Two groups of A: the first fits next to B's 2 and is kept whole, the second dropped.
    a = [make_sample(i, tenant="A", group=f"ga{i // 2}", reward=i % 2) for i in range(4)]
    trained, parts = select_trained(DistContext(), a + b, RunningBaseline(decay=0.5), caps)
    assert [s.key for s in trained] == ["t0:0", "t1:0", "t10:0", "t11:0"]
    assert parts[2] == {"capped": 2}
    # Over ranks: a group split between them is one group, and the shares still hold.
    sources = [[("A", None, 1)] * 3, [("A", None, 1), ("B", None, 1), ("B", None, 1)]]
    groups: list[list[str | None]] = [["ga"] * 3, ["ga", "gb", "gb"]]
    assert select_capped(sources, caps, groups) == [[False] * 3, [False, True, True]]
    assert select_capped(sources, caps) == [[True, True, False], [False, True, True]]


def test_single_source_is_not_capped() -> None:
    samples = [make_sample(i, tenant="A", user="u") for i in range(8)]
    caps = CapsConfig(max_tenant_share=0.25, max_user_share=0.25)
    kept, counts = apply_share_caps(samples, caps)
    assert len(kept) == 8 and counts == {"capped": 0}


def test_group_advantages_and_zero_groups_dropped() -> None:
    samples = [make_sample(i, group="g1", reward=r) for i, r in enumerate([1.0, 0.0, 1.0, 0.0])]
    samples += [make_sample(10 + i, group="g2", reward=0.5) for i in range(3)]
    samples += [make_sample(20, group="g3", reward=0.7)]  # group of one → baseline
    baseline = RunningBaseline(decay=0.5)
    kept, counts = assign_advantages(samples, baseline, normalize=True)
    assert counts["zero_advantage_groups"] == 1
    assert counts["zero_advantage_samples"] == 3 + 1  # g2, and the first sample of a task
    assert counts["grouped"] == 4 and counts["baseline"] == 0
    assert [round(s.advantage, 4) for s in kept] == [1.0, -1.0, 1.0, -1.0]
    assert baseline.values["A:t"] == 0.7  # per tenant and task


def test_running_baseline_advantages() -> None:
    baseline = RunningBaseline(decay=0.5)
    samples = [make_sample(i, reward=r) for i, r in enumerate([1.0, 0.0, 1.0])]
    kept, counts = assign_advantages(samples, baseline)
    # baseline: 1.0 (first, dropped) → adv 0-1 = -1, b=0.5 → adv 1-0.5 = 0.5, b=0.75
    assert [s.advantage for s in kept] == [-1.0, 0.5]
    assert counts["baseline"] == 2 and counts["zero_advantage_samples"] == 1
    assert baseline.values["A:t"] == 0.75


def test_each_tenant_has_its_own_baseline_for_a_task() -> None:
    """Tenant B's high rewards on the shared label `t` used to lift A's baseline and turn
    A's good samples into negative advantages."""
    baseline = RunningBaseline(decay=0.5)
    a = [make_sample(i, tenant="A", reward=r) for i, r in enumerate([0.5, 0.6])]
    b = [make_sample(10 + i, tenant="B", reward=r) for i, r in enumerate([100.0, 100.0])]
    kept, _ = assign_advantages([a[0], *b, a[1]], baseline, normalize=False)
    assert [(s.tenant, round(s.advantage, 6)) for s in kept] == [("A", 0.1)]
    assert baseline.values == {"A:t": pytest.approx(0.55), "B:t": 100.0}


def test_samples_from_rewarded_counts() -> None:
    record = {
        "trajectory_id": "t",
        "event_id": "e",
        "tenant": "A",
        "user": None,
        "task": "x",
        "policy_version": "policy-v3",
        "group_id": None,
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 0, "token_ids": [5, 6], "logprobs": [-0.1, -0.2]},
            {"index": 1, "token_ids": [5], "logprobs": [-0.1, -0.2]},  # length mismatch
            {"index": 2, "token_ids": [7], "logprobs": [-0.3]},
        ],
    }
    rewarded = [
        RewardedChoice(record, 0, 1.0),
        RewardedChoice(record, 1, 1.0),
        RewardedChoice(record, 2, None),
    ]
    samples, dropped = samples_from_rewarded(rewarded)
    assert [s.key for s in samples] == ["t:0"]
    assert samples[0].group == "t:t" and samples[0].policy_version == 3
    assert dropped == {"bad_tokens": 1, "no_reward": 1}


def test_a_token_id_outside_the_vocabulary_drops_its_sample() -> None:
    """The schema takes any id >= 0: one past the embedding raised IndexError in the step
    (a device-side assert on a GPU), on the same batch at every restart."""
    record = {
        "trajectory_id": "t",
        "tenant": "A",
        "prompt_token_ids": [1, 2],
        "policy_version": "base",
        "choices": [
            {"index": 0, "token_ids": [5, 99], "logprobs": [-0.1, -0.1]},
            {"index": 1, "token_ids": [100], "logprobs": [-0.1]},
        ],
    }
    rewarded = [RewardedChoice(record, 0, 1.0), RewardedChoice(record, 1, 1.0)]
    samples, dropped = samples_from_rewarded(rewarded, vocab_size=100)
    assert [s.key for s in samples] == ["t:0"] and dropped == {"bad_tokens": 1}
    prompt_out = {**record, "prompt_token_ids": [1, 100]}
    samples, dropped = samples_from_rewarded([RewardedChoice(prompt_out, 0, 1.0)], vocab_size=100)
    assert samples == [] and dropped == {"bad_tokens": 1}


def test_the_base_models_served_name_is_version_zero() -> None:
    """With `policy.served_model_name: smollm` the proxy records `smollm` for the base; the
    learner used to drop every such sample as `bad_version`."""
    record = {
        "trajectory_id": "t",
        "tenant": "A",
        "prompt_token_ids": [1, 2],
        "policy_version": "smollm",
        "choices": [{"index": 0, "token_ids": [5], "logprobs": [-0.1]}],
    }
    samples, dropped = samples_from_rewarded([RewardedChoice(record, 0, 1.0)], "smollm")
    assert [s.policy_version for s in samples] == [0] and not dropped
    _, dropped = samples_from_rewarded([RewardedChoice(record, 0, 1.0)])  # another base name
    assert dropped == {"bad_version": 1}


def test_unusable_rewards_are_dropped_and_counted_never_raised() -> None:
    record = {
        "trajectory_id": "t",
        "prompt_token_ids": [1, 2],
        "policy_version": "base",
        "choices": [{"index": i, "token_ids": [5], "logprobs": [-0.1]} for i in range(5)],
    }
    values = [math.inf, math.nan, 1e300, REWARD_LIMIT, 0.5]
    rewarded = [RewardedChoice(record, i, v) for i, v in enumerate(values)]
    samples, dropped = samples_from_rewarded(rewarded)
    assert [s.reward for s in samples] == [REWARD_LIMIT, 0.5]
    assert dropped == {"bad_reward": 3}
    # Samples built elsewhere: a group with a huge reward used to overflow (r - mean) ** 2,
    # a single one to give an advantage the float32 batch cannot hold.
    group = [make_sample(i, group="g", reward=r) for i, r in enumerate([1e300, -1e300, 0.0])]
    baseline = RunningBaseline(decay=0.9)
    singles = [make_sample(10, reward=0.5), make_sample(11, reward=1e300)]
    singles.append(make_sample(12, reward=math.nan))
    singles.append(make_sample(13, reward=1.0))
    kept, counts = assign_advantages(group + singles, baseline)
    assert counts["bad_reward"] == 3 + 2
    assert [s.key for s in kept] == ["t13:0"] and kept[0].advantage == 0.5
    assert baseline.values == {"A:t": pytest.approx(0.55)}  # untouched by the corrupt ones


def test_baseline_from_a_checkpoint_drops_corrupt_values() -> None:
    baseline = RunningBaseline(decay=0.9)
    baseline.load_state_dict({"values": {"a": 0.25, "b": math.inf, "c": 1e300, "d": math.nan}})
    assert baseline.values == {"a": 0.25}


def test_the_running_baselines_are_bounded_least_recently_used_first() -> None:
    """Task labels are the client's: a fresh X-OLP-Task per request added one baseline per
    request, kept for ever and written into every checkpoint (100k requests: 32 MB)."""
    baseline = RunningBaseline(decay=0.9)
    for batch in range(3):  # one fresh label per sample
        fresh = [make_sample(i, task=f"{batch}-{i}", reward=1.0) for i in range(5_000)]
        assign_advantages(fresh, baseline)
    assert len(baseline.values) == 10_000 == MAX_BASELINE_TASKS
    assert next(iter(baseline.values)) == "A:1-0"  # the oldest kept
    # Least recently used first: updating a baseline makes it the newest.
    baseline = RunningBaseline(decay=0.5, max_tasks=3)
    for task, reward in [("a", 1.0), ("b", 1.0), ("c", 1.0), ("a", 0.0), ("d", 1.0)]:
        baseline.advantage(task, reward)
    assert list(baseline.values) == ["c", "a", "d"]  # b: the least recently used
    assert baseline.values["a"] == 0.5 and baseline.evicted == 1
    assert list(baseline.state_dict()["values"]) == ["c", "a", "d"]
    # A checkpoint of an unbounded map (a plain dict) loads, keeping the last entries.
    restored = RunningBaseline(decay=0.5, max_tasks=2)
    restored.load_state_dict({"decay": 0.5, "values": {"x": 0.1, "y": 0.2, "z": 0.3}})
    assert restored.values == {"y": 0.2, "z": 0.3}
    assert restored.advantage("y", 1.0) == pytest.approx(0.8)
    assert list(restored.values) == ["z", "y"]


def test_caps_are_decided_once_over_all_ranks() -> None:
    # Tenant A's sessions all landed on rank 0: capped per rank, A would keep 24 of 32.
    caps = CapsConfig()  # max_tenant_share 0.5, max_user_share 0.25
    rank0 = [("A", f"a{i % 4}", 1) for i in range(24)]
    rank1 = [("B", f"b{i % 4}", 1) for i in range(8)]
    keep = select_capped([rank0, rank1], caps)
    assert (sum(keep[0]), sum(keep[1])) == (8, 8)
    union = [make_sample(i, tenant=t, user=u) for i, (t, u, _) in enumerate(rank0 + rank1)]
    kept, _ = apply_share_caps(union, caps)  # what one process decides for the same batch
    flags = keep[0] + keep[1]
    assert [s.key for s in kept] == [s.key for s, k in zip(union, flags, strict=True) if k]
    # One user alone on a rank is capped against the users of the other rank.
    keep = select_capped([[("A", "mallory", 1)] * 20, [("A", f"u{i}", 1) for i in range(12)]], caps)
    assert sum(keep[0]) < 20 and sum(keep[0]) <= 0.25 * (sum(keep[0]) + sum(keep[1]))


def test_a_second_tenants_short_sample_never_takes_the_whole_step() -> None:
    """One honest tenant (20 replies of 40-60 tokens, 4 users) and a second with one
    30-token reply. The caps keep the honest tenant's shortest reply ("never empty a
    tenant"), but taken again on what they kept (until GRPO groups stop splitting, and
    after advantages) they measured that reply against the kept 72 tokens, found it over
    half of them alone, and dropped it: the 30-token reply trained alone, every batch."""
    honest = [
        make_sample(i, tenant="acme", user=f"u{i % 4}", completion_ids=[3] * (40 + i % 21))
        for i in range(20)
    ]
    attack = make_sample(99, tenant="mallory", user="m", completion_ids=[3] * 30)
    baseline = RunningBaseline(decay=0.9)
    baseline.values.update({"acme:t": -100.0, "mallory:t": -100.0})  # every advantage > 0
    trained, parts = select_trained(DistContext(), [*honest, attack], baseline, CapsConfig())
    tokens = {
        tenant: sum(len(s.completion_ids) for s in trained if s.tenant == tenant)
        for tenant in ("acme", "mallory")
    }
    assert tokens == {"acme": 40, "mallory": 30}  # acme's shortest, within the 0.5 share
    assert [part.get("capped") for part in parts] == [19, None, 0]
    # The same through select_capped's own passes: one pass's answer.
    sources = [[(s.tenant, s.user, len(s.completion_ids)) for s in [*honest, attack]]]
    once, _ = apply_share_caps([*honest, attack], CapsConfig())
    assert sum(select_capped(sources, CapsConfig())[0]) == len(once) == 2


def _loss_inputs() -> tuple[torch.Tensor, ...]:
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mu = torch.tensor([[-1.0, -3.0, -0.5]])  # ratios 1, e, 1
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    return logp, mu, adv, mask


def test_truncated_importance_gradient() -> None:
    logp, mu, adv, mask = _loss_inputs()
    loss, stats = policy_loss(logp, mu, None, adv, mask, 2.0, None, 0.0, normalizer=2.0)
    loss.backward()
    # d loss / d logp = -min(ρ, C)·A / normalizer on masked tokens
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -1.0, 0.0]]))
    assert float(stats["clipped"]) == 1.0 and float(stats["tokens"]) == 2.0
    assert math.isclose(float(stats["ratio_sum"]), 1.0 + math.e, rel_tol=1e-6)


def test_ppo_clip_and_kl() -> None:
    logp, mu, adv, mask = _loss_inputs()
    ref = torch.tensor([[-1.0, -2.0, -0.5]])  # equal to the policy: KL = 0
    loss, stats = policy_loss(logp, mu, ref, adv, mask, 2.0, 0.2, 0.1, normalizer=2.0)
    loss.backward()
    # token 1: ρ=e > 1.2 with A>0 → clipped, no gradient; token 0: ρ=1 → grad -A·ρ/2
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, 0.0, 0.0]]))
    assert float(stats["clipped"]) == 1.0 and float(stats["kl_sum"]) == 0.0
    # k3 KL is ≥ 0 and its gradient pulls towards the reference
    logp2 = torch.tensor([[-0.5]], requires_grad=True)
    loss2, stats2 = policy_loss(
        logp2,
        torch.tensor([[-0.5]]),
        torch.tensor([[-1.0]]),
        torch.zeros(1, 1),
        torch.ones(1, 1),
        2.0,
        None,
        1.0,
        normalizer=1.0,
    )
    loss2.backward()
    assert float(stats2["kl_sum"]) > 0 and float(logp2.grad) > 0


def test_kl_at_masked_positions_cannot_make_the_step_nan() -> None:
    """A prompt or padding position the reference finds far likelier than the policy
    (log ratio > 88) overflowed exp to inf, and inf * 0 made the loss and gradient NaN."""
    logp = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-5.0, -1.0]])
    mask = torch.tensor([[0.0, 1.0]])
    loss, stats = policy_loss(
        logp, logp.detach(), ref, torch.ones(1, 2), mask, 2.0, None, 0.1, normalizer=1.0
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert float(logp.grad[0, 0]) == 0.0 and float(stats["kl_sum"]) == 0.0


def test_an_advantage_too_large_to_train_on_drops_its_group() -> None:
    """Each reward within REWARD_LIMIT, yet 2e6 apart: unnormalized, the advantages were
    kept and counted `grouped`; docs/learner.md says a corrupt advantage drops its group."""
    group = [make_sample(i, group="g", reward=r) for i, r in enumerate([1e6, -1e6, -1e6])]
    fine = [make_sample(10 + i, group="h", reward=r) for i, r in enumerate([1.0, 0.0])]
    kept, counts = assign_advantages(group + fine, RunningBaseline(decay=0.9), normalize=False)
    assert [s.key for s in kept] == ["t10:0", "t11:0"]
    assert counts["bad_reward"] == 3 and counts["grouped"] == 2


def test_group_ids_of_different_tenants_are_different_groups() -> None:
    # X-OLP-Group-Id is the client's own label, copied verbatim: two tenants running the same
    # harness reuse the same ids for different prompts, and must not share a GRPO group.
    def record(tenant: str) -> dict:
        return {
            "trajectory_id": f"t-{tenant}",
            "tenant": tenant,
            "policy_version": "base",
            "group_id": "task-1",
            "prompt_token_ids": [1, 2],
            "choices": [{"index": i, "token_ids": [5], "logprobs": [-0.1]} for i in range(2)],
        }

    a, b = record("A"), record("B")
    rewarded = [
        RewardedChoice(a, 0, 1.0),
        RewardedChoice(a, 1, 0.0),
        RewardedChoice(b, 0, 0.2),
        RewardedChoice(b, 1, 0.2),
    ]
    samples, _ = samples_from_rewarded(rewarded)
    assert samples[0].group == samples[1].group != samples[2].group == samples[3].group
    kept, counts = assign_advantages(samples, RunningBaseline(decay=0.9))
    # A's group: ±1; B's group has equal rewards, so it is dropped (not mixed with A's).
    assert [(s.tenant, round(s.advantage, 4)) for s in kept] == [("A", 1.0), ("A", -1.0)]
    assert counts["zero_advantage_groups"] == 1 and counts["grouped"] == 2


def test_a_group_id_over_several_prompts_is_a_group_per_prompt() -> None:
    """One label over an easy and a hard prompt (an evaluation run's id) was one group:
    prompt difficulty became the advantage, and the better reply to the hard prompt (-0.8
    against -1.0) was pushed down as hard as the worse one to the easy prompt."""

    def record(name: str, prompt: list[int]) -> dict:
        return {
            "trajectory_id": name,
            "tenant": "A",
            "policy_version": "base",
            "group_id": "eval-run-17",
            "prompt_token_ids": prompt,
            "choices": [{"index": 0, "token_ids": [5], "logprobs": [-0.1]}],
        }

    rewards = {"a1": 1.0, "a2": 0.8, "b1": -0.8, "b2": -1.0}
    prompts = {"a": [1, 2], "b": [3, 4]}
    rewarded = [RewardedChoice(record(n, prompts[n[0]]), 0, r) for n, r in rewards.items()]
    samples, _ = samples_from_rewarded(rewarded)
    assert samples[0].group == samples[1].group != samples[2].group == samples[3].group
    kept, counts = assign_advantages(samples, RunningBaseline(decay=0.9))
    advantages = {s.key.split(":")[0]: round(s.advantage, 4) for s in kept}
    assert advantages == {"a1": 1.0, "a2": -1.0, "b1": 1.0, "b2": -1.0}
    assert counts["grouped"] == 4


def test_ppo_gradient_stays_finite_when_the_ratio_overflows() -> None:
    # A sample far off-policy: log ρ = 98 overflows float32's exp. Beyond both clip bounds
    # the token has no gradient (A>0: clipped at 1+ε; A<0: dual clip at C·A), and 0·∞ must
    # not turn that into NaN, which would fail the step and, retried, every restart.
    for adv, expected_value in ((1.0, -(1.0 + 1.2)), (-1.0, 1.0 + 2.0)):
        logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
        mu = torch.tensor([[-1.0, -100.0]])
        advantages = torch.tensor([[adv, adv]])
        loss, _ = policy_loss(logp, mu, None, advantages, torch.ones(1, 2), 2.0, 0.2, 0.0, 1.0)
        loss.backward()
        assert math.isclose(float(loss.detach()), expected_value, rel_tol=1e-6)
        assert torch.allclose(logp.grad, torch.tensor([[-adv, 0.0]]))


def test_non_finite_sampling_logprobs_drop_their_sample() -> None:
    """A NaN (or infinite) recorded logprob made the step's loss and gradient NaN: the
    trainer raised, and the restarted learner met the same batch again. Now such a choice
    is dropped and counted; the rest of the record still trains."""
    record = {
        "trajectory_id": "t",
        "prompt_token_ids": [1, 2],
        "policy_version": "base",
        "choices": [
            {"index": 0, "token_ids": [5, 6], "logprobs": [-0.1, math.nan]},
            {"index": 1, "token_ids": [5], "logprobs": [-math.inf]},
            {"index": 2, "token_ids": [5], "logprobs": [None]},
            {"index": 3, "token_ids": [7], "logprobs": [-0.3]},
            # A JSON integer too large for a float (valid JSON, a "number" to the schema):
            # `math.isfinite` raised OverflowError on it, and the learner crash-looped.
            {"index": 4, "token_ids": [8], "logprobs": [-(10**400)]},
        ],
    }
    rewarded = [RewardedChoice(record, i, 1.0) for i in range(5)]
    samples, dropped = samples_from_rewarded(rewarded)
    assert [s.key for s in samples] == ["t:3"]
    assert dropped == {"bad_logprobs": 4}


def _ranks() -> list[list[Sample]]:
    """Task t's sessions on both ranks; group g's replies split over them."""
    rank0 = [make_sample(i, reward=r) for i, r in enumerate([1.0, 0.0, 1.0])]
    rank0 += [make_sample(3, group="g", reward=1.0), make_sample(4, group="g", reward=1.0)]
    rank1 = [make_sample(10 + i, reward=r) for i, r in enumerate([0.0, 1.0])]
    rank1 += [make_sample(13, group="g", reward=0.0)]
    return [rank0, rank1]


def test_advantages_are_decided_once_over_all_ranks() -> None:
    """One running baseline per task and one mean per group over the trained batch (the
    union of the ranks), as in one process: per rank, the two ranks' baselines drifted
    apart, each dropped its own first sample of the task, and g was normalised in pieces."""
    whole = RunningBaseline(decay=0.5)
    union = [s for part in _ranks() for s in part]
    kept_union, counts_union = assign_advantages(union, whole)
    expected = {s.key: s.advantage for s in kept_union}
    parts = _ranks()
    per_rank = [[(s.group, s.tenant, s.task, s.reward) for s in part] for part in parts]
    got: dict[str, float] = {}
    totals: dict[str, int] = {}
    for rank, part in enumerate(parts):
        baseline = RunningBaseline(decay=0.5)
        kept, counts = assign_advantages_for_rank(per_rank, rank, part, baseline)
        assert baseline.values == whole.values  # every rank holds the checkpointed state
        assert all(s in part for s in kept)  # each rank trains only its own samples
        got.update({s.key: s.advantage for s in kept})
        for key, value in counts.items():
            totals[key] = totals.get(key, 0) + value
    assert got == expected and totals == counts_union
    # The group spans both ranks: its mean is 2/3, not 1 on rank 0 (a zero-advantage group
    # there) and 0 alone on rank 1 (a group of one, sent to the baseline).
    assert counts_union["grouped"] == 3 and counts_union["zero_advantage_groups"] == 0
    assert got["t3:0"] == pytest.approx(got["t4:0"]) and got["t3:0"] > 0 > got["t13:0"]
    # Per rank, as before: rank 1's baseline never saw rank 0's rewards.
    separate = [RunningBaseline(decay=0.5), RunningBaseline(decay=0.5)]
    for part, baseline in zip(_ranks(), separate, strict=True):
        assign_advantages(part, baseline)
    assert separate[0].values != separate[1].values
