"""Per-tenant / per-user contribution caps on a training batch (data-poisoning defence).

A pure function: the learner hands in a batch and gets back the items to train on. Within a
group the earliest items are kept (batch order is preserved), so the result is repeatable."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from safety.config import CapsConfig

T = TypeVar("T")


def _tenant(item: Any) -> Hashable:
    return item["tenant"]


def _user(item: Any) -> Hashable | None:
    user = item.get("user")
    return None if user is None else (item["tenant"], user)


@dataclass
class CapResult(Generic[T]):
    kept: list[T]
    dropped: list[T]
    stats: dict[str, Any] = field(default_factory=dict)


def _group_limit(
    counts: Counter[Hashable], share: float | None, absolute: int | None, groups: int
) -> int:
    """Largest per-group count c with c <= share * sum(min(n, c)), and c <= absolute.

    A share below an equal split is impossible to honour without dropping everything, so
    the effective share is max(share, 1/groups), `groups` being the level's groups in the
    batch handed in (not the ones still kept: see `apply_contribution_caps`)."""
    if not counts:
        return 0
    limit = max(counts.values())
    if absolute is not None:
        limit = min(limit, absolute)
    if share is None:
        return limit
    share = max(share, 1.0 / max(groups, 1))
    best = 0
    for c in range(1, limit + 1):
        if c <= share * sum(min(n, c) for n in counts.values()) + 1e-9:
            best = c
    return best


def _weight_limit(totals: Sequence[float], share: float | None, groups: int) -> float:
    """Largest per-group weight L with L <= share * sum(min(W, L)) over the groups' weights W.

    `_group_limit` for weighted items, in closed form: the constraint is concave in L and
    holds at 0, so it holds up to one crossing, found interval by interval between the
    sorted weights. With every weight 1 it allows what `_group_limit` allows."""
    if not totals:
        return 0.0
    weights = sorted(totals)
    if share is None:
        return weights[-1]
    share = max(share, 1.0 / max(groups, 1))
    below = 0.0  # the weights of the groups under the interval's lower end
    for k, high in enumerate(weights):
        low = weights[k - 1] if k else 0.0
        # For L in [low, high]: sum(min(W, L)) = below + (n - k) * L.
        slack = 1.0 - share * (len(weights) - k)
        if slack > 0:
            bound = share * below / slack
            if bound < high:
                return max(bound, low)
        below += high
    return weights[-1]


def _group_of(key_of: Callable[[Any], Hashable | None], item: Any, index: int) -> Hashable:
    """The item's group; an item without one (no user) is a group of its own."""
    key = key_of(item)
    return ("item", index) if key is None else key


def _round_robin_order(
    batch: Sequence[T],
    tenant_of: Callable[[T], Hashable],
    user_of: Callable[[T], Hashable | None],
) -> list[int]:
    """Indices ordered by (rank of the item among its user's items, batch position)."""
    rank: Counter[Hashable] = Counter()
    keyed = []
    for index, item in enumerate(batch):
        user = user_of(item)
        key = ("user", user) if user is not None else ("item", index)
        keyed.append((rank[key], index))
        rank[key] += 1
    return [index for _, index in sorted(keyed)]


@dataclass(frozen=True)
class AloneLimitBase:
    """The batch an item's own weight is measured against ("too big alone"): its total
    weight and its tenants. A cap taken again on what an earlier one kept (on the learner's
    path: until GRPO groups stop splitting, and once more after advantages) must measure
    against the batch the caps were first taken on. Measured against what was kept, the
    shortest sample a tenant kept under "never empty a group" was over half of that and
    dropped: one 30-token sample of a second tenant was then the whole step, every batch."""

    total_weight: float
    tenants: int


def _within_a_tenants_share(
    weights: Sequence[float], base: AloneLimitBase, share: float | None
) -> list[bool]:
    """Which items weigh at most the tenant share (raised to an equal split) of the whole
    batch: one that alone weighs more breaks its tenant's share whatever else is kept."""
    if share is None or not weights:
        return [True] * len(weights)
    limit = base.total_weight * max(share, 1.0 / max(base.tenants, 1)) + 1e-9
    return [weight <= limit for weight in weights]


def apply_contribution_caps(
    batch: Sequence[T],
    config: CapsConfig,
    *,
    tenant_of: Callable[[T], Hashable] = _tenant,
    user_of: Callable[[T], Hashable | None] = _user,
    weight_of: Callable[[T], float] | None = None,
    alone_base: AloneLimitBase | None = None,
) -> CapResult[T]:
    """Keep at most each tenant's and each user's capped share of the batch.

    Shares are of the items' total `weight_of` (1 each by default); the learner weighs a
    sample by its completion tokens, since its loss sums tokens: counted in samples, a
    tenant with long completions held most of the gradient within its share of samples.
    `max_per_tenant` / `max_per_user` count items.

    An item whose user is None counts as a user of its own (one item, never over a cap), so
    it is part of the batch every user's share is measured against: otherwise one tagged
    user among anonymous traffic would be the only "user" and keep all its items, and a
    small tagged user would be cut to an equal split with the other tagged ones. Caps are
    re-applied until stable, since dropping one tenant's excess raises every other group's
    share.

    First, an item that alone is over its tenant's share of the whole batch is dropped:
    one huge sample must not hold most of a step's gradient (`alone_base`: the batch that
    whole is measured by, when this batch is what an earlier cap kept; see AloneLimitBase).
    Then a share cap never
    empties a group: when every item a group still holds is over its limit, it keeps the
    shortest of them (the earliest of equals). Otherwise one short sample made the limit
    of a tenant of long samples smaller than each of them, so all were dropped and the
    short sample was the whole batch. The equal-split floor counts the level's groups left
    after the first step, not those still kept, for the same reason."""
    weights = [1.0 if weight_of is None else float(weight_of(item)) for item in batch]
    if alone_base is None:
        alone_base = AloneLimitBase(sum(weights), len({tenant_of(item) for item in batch}))
    keep = _within_a_tenants_share(weights, alone_base, config.max_tenant_share)
    groups_in_batch = {
        "user": len(
            {_group_of(user_of, item, index) for index, item in enumerate(batch) if keep[index]}
        ),
        "tenant": len({tenant_of(item) for index, item in enumerate(batch) if keep[index]}),
    }
    # Within a tenant, the kept items are spread round-robin over its users, so capping a
    # tenant does not wipe out its small users (which would shrink the batch further).
    order = _round_robin_order(batch, tenant_of, user_of)
    for _ in range(len(batch) + 1):
        changed = False
        for level, key_of, share, absolute, visit in (
            ("user", user_of, config.max_user_share, config.max_per_user, range(len(batch))),
            ("tenant", tenant_of, config.max_tenant_share, config.max_per_tenant, order),
        ):
            groups = groups_in_batch[level]
            counts: Counter[Hashable] = Counter()
            totals: dict[Hashable, float] = {}
            for index, item in enumerate(batch):
                if keep[index]:
                    group = _group_of(key_of, item, index)
                    counts[group] += 1
                    totals[group] = totals.get(group, 0.0) + weights[index]
            if weight_of is None:
                limit, weight_limit = _group_limit(counts, share, absolute, groups), float("inf")
            else:
                limit = _group_limit(counts, None, absolute, groups)
                weight_limit = _weight_limit(list(totals.values()), share, groups) + 1e-9
            seen: Counter[Hashable] = Counter()
            held: dict[Hashable, float] = {}
            members: dict[Hashable, list[int]] = {}
            over: dict[Hashable, list[int]] = {}
            for index in visit:
                key = key_of(batch[index])
                if not keep[index] or key is None:  # a group of one is never over a limit
                    continue
                seen[key] += 1
                held[key] = held.get(key, 0.0) + weights[index]
                members.setdefault(key, []).append(index)
                if seen[key] > limit or held[key] > weight_limit:
                    over.setdefault(key, []).append(index)
            for key, indices in over.items():
                if len(indices) == len(members[key]):  # never empty a group: keep its shortest
                    shortest = min(indices, key=lambda index: (weights[index], index))
                    indices = [index for index in indices if index != shortest]
                for index in indices:
                    keep[index] = False
                    changed = True
        if not changed:
            break
    kept = [item for item, k in zip(batch, keep, strict=True) if k]
    dropped = [item for item, k in zip(batch, keep, strict=True) if not k]
    tenants_kept = Counter(tenant_of(item) for item in kept)
    return CapResult(
        kept=kept,
        dropped=dropped,
        stats={
            "input": len(batch),
            "kept": len(kept),
            "dropped": len(dropped),
            "tenants": len(tenants_kept),
            "max_tenant_share": (max(tenants_kept.values()) / len(kept) if kept else 0.0),
        },
    )
