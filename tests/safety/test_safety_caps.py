"""Contribution caps: no tenant or user dominates a training batch."""

from __future__ import annotations

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
