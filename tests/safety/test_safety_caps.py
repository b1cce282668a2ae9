"""Contribution caps: no tenant or user dominates a training batch."""

from __future__ import annotations

import random
from collections import Counter

from safety.caps import apply_contribution_caps
from safety.config import CapsConfig


def _batch(spec: list[tuple[str, str | None, int]]) -> list[dict]:
    items = []
    for tenant, user, count in spec:
        items += [{"tenant": tenant, "user": user, "i": len(items) + k} for k in range(count)]
    return items


def test_dominant_tenant_is_capped_to_its_share_of_the_kept_batch() -> None:
    batch = _batch([("a", None, 90), ("b", None, 6), ("c", None, 4)])
    result = apply_contribution_caps(batch, CapsConfig(max_tenant_share=0.5, max_user_share=None))
    tenants = Counter(item["tenant"] for item in result.kept)
    assert tenants == {"a": 10, "b": 6, "c": 4}
    assert tenants["a"] / len(result.kept) <= 0.5
    assert len(result.kept) + len(result.dropped) == 100
    assert [item["i"] for item in result.kept][:10] == list(range(10))  # earliest kept
    assert result.stats["max_tenant_share"] == 0.5


def test_user_cap_applies_within_and_across_tenants() -> None:
    batch = _batch([("a", "u1", 20), ("a", "u2", 5), ("b", "u3", 5), ("b", None, 10)])
    result = apply_contribution_caps(batch, CapsConfig(max_tenant_share=None, max_user_share=0.25))
    users = Counter(item["user"] for item in result.kept)
    assert users["u1"] <= 0.25 * len(result.kept) + 1e-9
    assert users[None] == 10  # no user id: only the tenant cap applies


def test_anonymous_items_count_in_every_users_share() -> None:
    # One tagged user among anonymous traffic: before, it was the only "user" and kept all
    # 50 (half the batch, against a 0.25 cap).
    batch = _batch([("a", "evil", 50), ("a", None, 50)])
    kept = apply_contribution_caps(batch, CapsConfig(max_user_share=0.25)).kept
    users = Counter(item["user"] for item in kept)
    assert users == {"evil": 16, None: 50}
    assert users["evil"] / len(kept) <= 0.25
    # A small tagged user (10 %) keeps everything: before, it was cut to an equal split
    # with the only other tagged user (2 of its 10).
    batch = _batch([("a", "u1", 10), ("a", "u2", 2), ("a", None, 88)])
    kept = apply_contribution_caps(batch, CapsConfig(max_user_share=0.25)).kept
    assert len(kept) == 100


def test_both_caps_reach_a_fixed_point() -> None:
    batch = _batch([("a", "u1", 50), ("a", "u2", 10), ("b", "u3", 10), ("c", "u4", 10)])
    config = CapsConfig(max_tenant_share=0.4, max_user_share=0.3)
    kept = apply_contribution_caps(batch, config).kept
    tenants = Counter(item["tenant"] for item in kept)
    users = Counter(item["user"] for item in kept)
    assert max(tenants.values()) <= 0.4 * len(kept) + 1e-9
    assert max(users.values()) <= 0.3 * len(kept) + 1e-9
    assert len(kept) >= 28
    assert {"u1", "u2", "u3", "u4"} == set(users)


def test_single_tenant_and_absolute_caps() -> None:
    batch = _batch([("only", "u1", 8)])
    assert len(apply_contribution_caps(batch, CapsConfig()).kept) == 8  # equal split = all
    config = CapsConfig(max_per_tenant=3, max_tenant_share=None, max_user_share=None)
    assert len(apply_contribution_caps(batch, config).kept) == 3
    assert apply_contribution_caps([], CapsConfig()).kept == []


def test_custom_key_functions_for_non_dict_items() -> None:
    batch = [("t1", i) for i in range(6)] + [("t2", i) for i in range(2)]
    result = apply_contribution_caps(
        batch,
        CapsConfig(max_tenant_share=0.5, max_user_share=None),
        tenant_of=lambda item: item[0],
        user_of=lambda item: None,
    )
    assert Counter(t for t, _ in result.kept) == {"t1": 2, "t2": 2}


def _tokens(items: list[dict]) -> Counter:
    totals: Counter = Counter()
    for item in items:
        totals[item["tenant"]] += item["w"]
    return totals


def test_one_short_sample_cannot_take_the_batch() -> None:
    # Token weights: a tenant's limit came out as the other tenant's total (5 tokens), every
    # 50-token sample of acme was over it and dropped, and the equal split was recomputed
    # over the one group left, so mallory's single sample was the whole batch.
    def weight(item: dict) -> float:
        return item["w"]

    acme = [{"tenant": "acme", "user": f"u{i % 4}", "w": 50, "i": i} for i in range(20)]
    mallory = [{"tenant": "mallory", "user": "m", "w": 5, "i": 99}]
    kept = apply_contribution_caps(acme + mallory, CapsConfig(), weight_of=weight).kept
    assert _tokens(kept) == {"acme": 50, "mallory": 5}  # acme keeps its shortest sample
    # The same inside one tenant: three users of 5 x 50 tokens and one 5-token user.
    users = [{"tenant": "acme", "user": f"u{i % 3}", "w": 50, "i": i} for i in range(15)]
    small = [{"tenant": "acme", "user": "m", "w": 5, "i": 99}]
    kept = apply_contribution_caps(users + small, CapsConfig(), weight_of=weight).kept
    assert Counter(item["user"] for item in kept) == {"u0": 1, "u1": 1, "u2": 1, "m": 1}
    # But a group whose every sample alone is over its share of the whole batch is still
    # dropped: one 4000-token sample beside 10 x 50 tokens would hold 89 % of the step.
    huge = [{"tenant": "mallory", "user": "m", "w": 4000, "i": 98}]
    honest = [{"tenant": "acme", "user": f"u{i % 4}", "w": 50, "i": i} for i in range(10)]
    kept = apply_contribution_caps(honest + huge, CapsConfig(), weight_of=weight).kept
    assert "mallory" not in _tokens(kept)
    # Unweighted, a group is not emptied either: the shortest (here the earliest) stays.
    batch = _batch([("a", "u1", 6), ("a", "u2", 1), ("b", "u3", 1)])
    kept = apply_contribution_caps(batch, CapsConfig(max_tenant_share=0.1)).kept
    assert Counter(item["tenant"] for item in kept) == {"a": 1, "b": 1}


def test_shares_hold_against_the_input_batchs_groups() -> None:
    """Property: an item over its tenant's share of the whole batch by itself is dropped;
    of the rest, each group keeps at most max(share, 1 / its level's groups among them) of
    the kept weight, or exactly one item, its shortest; no tenant is emptied."""
    rng = random.Random(7)
    for _ in range(2000):
        batch = [
            {
                "tenant": rng.choice("ABC"),
                "user": rng.choice([None, "u1", "u2", "u3"]),
                "w": rng.choice([1, 2, 5, 17, 40]),
                "i": i,
            }
            for i in range(rng.randint(1, 14))
        ]
        config = CapsConfig(
            max_tenant_share=rng.choice([None, 0.3, 0.5, 0.8]),
            max_user_share=rng.choice([None, 0.1, 0.25, 0.5]),
            max_per_tenant=rng.choice([None, 1, 3]),
            max_per_user=rng.choice([None, 1, 2]),
        )
        weighted = rng.random() < 0.5
        result = apply_contribution_caps(
            batch, config, weight_of=(lambda item: item["w"]) if weighted else None
        )

        weights = {item["i"]: item["w"] if weighted else 1.0 for item in batch}
        total = sum(weights[item["i"]] for item in result.kept)
        # First, an item over its tenant's share of the whole batch by itself is dropped.
        tenant_share = config.max_tenant_share
        alone = float("inf")
        if tenant_share is not None:
            tenants = len({item["tenant"] for item in batch})
            alone = sum(weights.values()) * max(tenant_share, 1 / tenants)
        light = [item for item in batch if weights[item["i"]] <= alone + 1e-9]
        assert {item["i"] for item in result.kept} <= {item["i"] for item in light}
        for level, key_of, share, absolute in (
            ("tenant", _tenant_key, config.max_tenant_share, config.max_per_tenant),
            ("user", _user_key, config.max_user_share, config.max_per_user),
        ):
            groups = {key_of(item) or ("item", item["i"]) for item in light}
            mine: dict = {}
            for item in result.kept:
                if key_of(item) is not None:
                    mine.setdefault(key_of(item), []).append(item)
            if level == "tenant":
                assert set(mine) == groups  # then no tenant is emptied
            for key, items in mine.items():
                if absolute is not None:
                    assert len(items) <= absolute
                if share is None or len(items) == 1:
                    continue
                held = sum(weights[item["i"]] for item in items)
                assert held <= max(share, 1 / len(groups)) * total + 1e-6, (batch, config, key)


def _tenant_key(item: dict) -> str:
    return item["tenant"]


def _user_key(item: dict) -> tuple[str, str] | None:
    return None if item["user"] is None else (item["tenant"], item["user"])
