"""The RL objective: sample selection, advantages and the token-level policy-gradient loss.

Pure functions over `Sample`s and tensors so each rule can be unit-tested with exact counts
(`apply_share_caps_across_ranks` adds one gather to the pure `select_capped`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from learner.distributed import DistContext, all_gather_object
from replay.schemas import is_finite_number
from safety.caps import AloneLimitBase, apply_contribution_caps
from safety.config import CapsConfig

log = structlog.get_logger(__name__)

_VERSION = re.compile(r"^policy-v(\d+)$")

# Rewards and advantages beyond this are corrupt, not evidence: every reward part is O(1)
# (`score` feedback is clamped to at most this), and the float32 loss overflows long before
# a float64 reward does. Such samples are dropped and counted (`bad_reward`), never trained.
REWARD_LIMIT = 1e6


def usable(value: float | None) -> bool:
    """A reward or advantage that can be trained on: finite and within REWARD_LIMIT."""
    return value is not None and math.isfinite(value) and abs(value) <= REWARD_LIMIT


@dataclass
class Sample:
    """One trainable completion: exact recorded token ids and sampling logprobs."""

    key: str  # "<trajectory_id>:<choice_index>"
    event_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    sampling_logprobs: list[float]
    reward: float
    group: str | None
    task: str
    tenant: str
    user: str | None
    policy_version: int
    advantage: float = 0.0


def parse_version(name: str | None, base_name: str = "base") -> int:
    """'base' (or the base model's served name, `policy.served_model_name`) → 0,
    'policy-v<N>' → N; anything else raises ValueError."""
    if name is None or name in ("base", base_name):
        return 0
    match = _VERSION.match(str(name))
    if not match:
        raise ValueError(f"unknown policy version {name!r}")
    return int(match.group(1))


def group_key(record: dict[str, Any]) -> str:
    """A GRPO group's key: the client's `group_id` within its tenant, narrowed to one prompt.

    The id is the client's own label (X-OLP-Group-Id, copied verbatim), so two tenants
    running the same harness reuse ids for different prompts; their samples must not be
    compared with each other. Nor may one tenant's samples of different prompts under one
    id (an evaluation run's label): normalised together, prompt difficulty became the
    advantage, and the better reply to a hard prompt was pushed down."""
    prompt = json.dumps(record.get("prompt_token_ids"), separators=(",", ":"))
    digest = hashlib.sha256(prompt.encode()).hexdigest()[:16]
    return f"g:{record.get('tenant') or ''}:{record['group_id']}:{digest}"


def _ids_within(prompt_ids: list[Any], completion_ids: list[Any], vocab_size: int) -> bool:
    return all(0 <= int(i) < vocab_size for part in (prompt_ids, completion_ids) for i in part)


def samples_from_rewarded(
    rewarded: Iterable[Any], base_name: str = "base", vocab_size: int | None = None
) -> tuple[list[Sample], Counter[str]]:
    """Turn rewarded choices (see rewards.assembler) into Samples; count what was left out.
    `base_name`: the base model's served name, which the proxy records for it.
    `vocab_size`: the model's embedding rows; a token id at or above it (a foreign producer,
    records of a base model since replaced) would raise in the embedding lookup on every
    retry of the batch (on a GPU: a device-side assert), so its sample is `bad_tokens`."""
    samples: list[Sample] = []
    dropped: Counter[str] = Counter()
    for item in rewarded:
        if item.reward is None:
            dropped["no_reward"] += 1
            continue
        if not usable(item.reward):
            dropped["bad_reward"] += 1
            continue
        record = item.trajectory
        choice = next(c for c in record["choices"] if int(c.get("index", 0)) == item.choice_index)
        ids = list(choice.get("token_ids") or [])
        logprobs = list(choice.get("logprobs") or [])
        if not ids or len(ids) != len(logprobs) or not record.get("prompt_token_ids"):
            dropped["bad_tokens"] += 1
            continue
        if vocab_size is not None and not _ids_within(record["prompt_token_ids"], ids, vocab_size):
            dropped["bad_tokens"] += 1
            continue
        if not all(isinstance(x, int | float) and is_finite_number(x) for x in logprobs):
            # A NaN μ makes the whole step's gradient NaN (the step raises, the learner
            # restarts on the same batch, forever); the schema lets NaN through as a number.
            # So does a JSON integer too large for a float, on which `math.isfinite` raised
            # OverflowError: the same loop.
            dropped["bad_logprobs"] += 1
            continue
        try:
            version = parse_version(record.get("policy_version"), base_name)
        except ValueError:
            dropped["bad_version"] += 1
            continue
        n_choices = len(record["choices"])
        if record.get("group_id"):
            group: str | None = group_key(record)
        elif n_choices > 1:
            group = f"t:{record['trajectory_id']}"
        else:
            group = None
        samples.append(
            Sample(
                key=f"{record['trajectory_id']}:{item.choice_index}",
                event_id=str(record.get("event_id", record["trajectory_id"])),
                prompt_ids=list(record["prompt_token_ids"]),
                completion_ids=ids,
                sampling_logprobs=[float(x) for x in logprobs],
                reward=float(item.reward),
                group=group,
                task=str(record.get("task") or "default"),
                tenant=str(record.get("tenant") or ""),
                user=record.get("user"),
                policy_version=version,
            )
        )
    return samples, dropped


def drop_stale(
    samples: list[Sample], current_version: int, max_staleness: int, floor: int = 0
) -> tuple[list[Sample], int]:
    """Keep samples at most `max_staleness` versions behind `current_version`.

    `floor` is the learner's version floor (`ResumePlan.version_floor`): versions numbered
    at or below it (the base, another lineage's) count as the floor itself, the generation
    just before this lineage's first version above it, so the jump in numbers does not make
    base-served samples look `floor` versions old."""
    kept = [s for s in samples if current_version - max(s.policy_version, floor) <= max_staleness]
    return kept, len(samples) - len(kept)


def apply_share_caps(
    samples: list[Sample], caps: CapsConfig
) -> tuple[list[Sample], dict[str, int]]:
    """The `safety.caps` contribution caps on a batch's samples (data-poisoning defence):
    no tenant, and no user of a tenant, keeps more than its configured share of what is
    kept, in completion tokens: the loss sums tokens, so a share of samples let one with
    long completions hold most of the gradient. Samples without a user are only
    tenant-capped."""
    result = apply_contribution_caps(
        samples,
        caps,
        tenant_of=lambda sample: sample.tenant,
        user_of=lambda sample: None if sample.user is None else (sample.tenant, sample.user),
        weight_of=lambda sample: len(sample.completion_ids),
    )
    return result.kept, {"capped": len(result.dropped)}


Source = tuple[str, str | None, int]  # (tenant, user, completion tokens) of one sample


def alone_base_of(per_rank: list[list[Source]]) -> AloneLimitBase:
    """The union's total completion tokens and tenants: what a cap measures one sample's
    own weight against (`safety.caps.AloneLimitBase`)."""
    union = [source for part in per_rank for source in part]
    return AloneLimitBase(float(sum(s[2] for s in union)), len({s[0] for s in union}))


def select_capped(
    per_rank: list[list[Source]],
    caps: CapsConfig,
    groups: list[list[str | None]] | None = None,
    alone_base: AloneLimitBase | None = None,
) -> list[list[bool]]:
    """Keep-flags per rank from one cap over the union of every rank's samples.

    The union in rank order is the batch that is trained, so this is what `apply_share_caps`
    decides for it in one process; every rank computes the same flags from the same lists.

    `groups` (each sample's GRPO group, parallel to `per_rank`): groups are kept or dropped
    whole. Advantages are set per group (zero mean), so a cap that kept a tenant's earliest
    samples could train a group's positive members alone; here a group the cap cuts into
    loses its other members too, and the cap is taken again on what is left, until it
    drops nothing: the shares hold on what is kept, and no kept group is split. Each pass
    measures a sample's own weight against `alone_base` (default: this union's), not
    against what the pass before kept.
    """
    union = [
        (rank, index, source)
        for rank, part in enumerate(per_rank)
        for index, source in enumerate(part)
    ]
    group_of = [None] * len(union) if groups is None else [g for part in groups for g in part]
    if len(group_of) != len(union):
        raise ValueError(f"{len(group_of)} groups for {len(union)} samples")
    alive = list(range(len(union)))
    base = alone_base if alone_base is not None else alone_base_of(per_rank)
    while True:
        result = apply_contribution_caps(
            alive,
            caps,
            tenant_of=lambda i: union[i][2][0],
            user_of=lambda i: None if union[i][2][1] is None else union[i][2][:2],
            weight_of=lambda i: union[i][2][2],
            alone_base=base,
        )
        split = {group_of[i] for i in result.dropped} - {None}
        kept = [i for i in result.kept if group_of[i] not in split]
        if len(kept) == len(alive):
            break
        alive = kept
    keep = [[False] * len(part) for part in per_rank]
    for i in alive:
        rank, index, _ = union[i]
        keep[rank][index] = True
    return keep


def apply_share_caps_across_ranks(
    ctx: DistContext, samples: list[Sample], caps: CapsConfig, whole_groups: bool = False
) -> tuple[list[Sample], dict[str, int]]:
    """`apply_share_caps` on the union of all ranks' samples (collective: every rank calls it).

    Each rank's (tenant, user, tokens) list is gathered, the kept set is decided once for
    the whole batch, and each rank keeps its own part of it; `capped` counts this rank's
    drops. `whole_groups`: keep or drop each GRPO group whole (see `select_capped`; the
    groups are gathered too, since a group may span ranks).
    """
    kept, counts, _ = _capped_across_ranks(ctx, samples, caps, whole_groups)
    return kept, counts


def _capped_across_ranks(
    ctx: DistContext,
    samples: list[Sample],
    caps: CapsConfig,
    whole_groups: bool,
    alone_base: AloneLimitBase | None = None,
) -> tuple[list[Sample], dict[str, int], AloneLimitBase]:
    """`apply_share_caps_across_ranks`, measuring one sample's own weight against
    `alone_base` (default: the union's, returned for a later cap to measure against)."""
    sources: list[Source] = [(s.tenant, s.user, len(s.completion_ids)) for s in samples]
    groups = [s.group for s in samples] if whole_groups else None
    gathered = all_gather_object(ctx, (sources, groups))
    per_rank = [part[0] for part in gathered]
    per_rank_groups = [part[1] for part in gathered] if whole_groups else None
    base = alone_base if alone_base is not None else alone_base_of(per_rank)
    keep = select_capped(per_rank, caps, per_rank_groups, base)[ctx.rank]
    kept = [sample for sample, flag in zip(samples, keep, strict=True) if flag]
    return kept, {"capped": len(samples) - len(kept)}, base


def baseline_key(sample: Sample) -> str:
    """A running baseline's key: the client's `task` label within its tenant. Shared across
    tenants (every unlabelled request is task `default`), one tenant's rewards moved every
    other's advantages: high ones pushed the others' good samples negative."""
    return f"{sample.tenant}:{sample.task}"


# Running baselines kept at most: task labels are the client's (X-OLP-Task, any string up to
# 256 characters), so a client sending a fresh label per request grew the map, and every
# checkpoint, by one entry a request (100k requests: 32 MB). 10k entries of the longest
# labels are about 3 MB; the least recently used are evicted, and an evicted task that comes
# back starts a new baseline (its first sample sets it, as for any new task).
MAX_BASELINE_TASKS = 10_000


class RunningBaseline:
    """Exponential moving average of the reward per tenant and task, for ungrouped samples.

    At most `max_tasks` baselines are kept, the most recently updated (`values` is in
    order of last update, oldest first, and so is the checkpoint's copy)."""

    def __init__(self, decay: float, max_tasks: int = MAX_BASELINE_TASKS) -> None:
        if max_tasks < 1:
            raise ValueError("max_tasks must be at least 1")
        self.decay = decay
        self.max_tasks = max_tasks
        self.values: OrderedDict[str, float] = OrderedDict()
        self.evicted = 0  # baselines evicted by this process (the checkpoint does not keep it)

    def advantage(self, task: str, reward: float) -> float:
        """reward − baseline, then update; the first reward of a task sets the baseline.

        An unusable reward (see `usable`) returns NaN and leaves the baseline alone, so one
        corrupt value cannot shift every later advantage of its task."""
        if not usable(reward):
            return math.nan
        base = self.values.get(task)
        if base is None:
            self.values[task] = reward
            self._evict()
            return 0.0
        self.values[task] = self.decay * base + (1 - self.decay) * reward
        self.values.move_to_end(task)  # the most recently used
        return reward - base

    def _evict(self) -> None:
        """Drop the least recently updated baselines beyond `max_tasks`."""
        excess = len(self.values) - self.max_tasks
        if excess <= 0:
            return
        for _ in range(excess):
            self.values.popitem(last=False)
        if not self.evicted:
            log.warning(
                "baseline_tasks_evicted",
                max_tasks=self.max_tasks,
                note="more (tenant, task) labels than baselines kept; the least recently "
                "used are evicted (logged once per process)",
            )
        self.evicted += excess

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "values": dict(self.values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = dict(state.get("values", {}))
        # A checkpoint written before rewards were bounded may hold a corrupt baseline.
        self.values = OrderedDict((task, float(v)) for task, v in values.items() if usable(v))
        if len(self.values) < len(values):
            log.warning("baseline_values_dropped", tasks=sorted(set(values) - set(self.values)))
        # One written before the map was bounded may hold any number, in first-seen order:
        # the last `max_tasks` are kept.
        self._evict()


def _assign(
    samples: list[Sample], baseline: RunningBaseline, normalize: bool, eps: float
) -> tuple[list[int], list[str], set[int]]:
    """Set every sample's advantage (see `assign_advantages`). Returns the indexes of the
    kept samples in training order, each sample's outcome (`grouped`, `baseline`,
    `zero_advantage_samples`, `bad_reward`) and the index of the first member of each
    zero-advantage group (one count per group)."""
    groups: dict[str, list[int]] = {}
    singles: list[int] = []
    for index, sample in enumerate(samples):
        if sample.group is not None:
            groups.setdefault(sample.group, []).append(index)
        else:
            singles.append(index)
    for members in list(groups.values()):
        if len(members) == 1:
            singles.extend(members)
    kept: list[int] = []
    outcomes = [""] * len(samples)
    zero_groups: set[int] = set()
    for members in groups.values():
        if len(members) < 2:
            continue
        rewards = [samples[m].reward for m in members]
        if not all(usable(r) for r in rewards):
            for m in members:
                outcomes[m] = "bad_reward"
            continue
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
        if std < eps:
            zero_groups.add(members[0])
            for m in members:
                outcomes[m] = "zero_advantage_samples"
            continue
        scale = std + eps if normalize else 1.0
        advantages = [(samples[m].reward - mean) / scale for m in members]
        if not all(usable(a) for a in advantages):  # usable rewards 2e6 apart, unnormalized
            for m in members:
                outcomes[m] = "bad_reward"
            continue
        for m, advantage in zip(members, advantages, strict=True):
            samples[m].advantage = advantage
            kept.append(m)
            outcomes[m] = "grouped"
    for index in singles:
        sample = samples[index]
        sample.advantage = baseline.advantage(baseline_key(sample), sample.reward)
        if not usable(sample.advantage):  # NaN: the reward itself was unusable
            outcomes[index] = "bad_reward"
        elif abs(sample.advantage) < eps:
            outcomes[index] = "zero_advantage_samples"
        else:
            kept.append(index)
            outcomes[index] = "baseline"
    return kept, outcomes, zero_groups


def _advantage_counts(
    outcomes: list[str], zero_groups: set[int], indexes: Iterable[int]
) -> dict[str, int]:
    counts = {
        "zero_advantage_groups": 0,
        "zero_advantage_samples": 0,
        "grouped": 0,
        "baseline": 0,
        "bad_reward": 0,
    }
    for index in indexes:
        counts[outcomes[index]] += 1
        counts["zero_advantage_groups"] += int(index in zero_groups)
    return counts


def assign_advantages(
    samples: list[Sample],
    baseline: RunningBaseline,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[list[Sample], dict[str, int]]:
    """Group-relative advantages for groups of ≥2, running baseline for the rest.

    Groups whose rewards are all equal, and ungrouped samples with zero advantage, are
    dropped (they carry no gradient); so are samples whose reward or advantage is not usable
    (`bad_reward`: a whole group, since its mean and spread are meaningless then). Returns
    the kept samples and counts.
    """
    kept, outcomes, zero_groups = _assign(samples, baseline, normalize, eps)
    return [samples[i] for i in kept], _advantage_counts(outcomes, zero_groups, range(len(samples)))


Scored = tuple[str | None, str, str, float]  # (group, tenant, task, reward) of one sample


def assign_advantages_for_rank(
    per_rank: list[list[Scored]],
    rank: int,
    samples: list[Sample],
    baseline: RunningBaseline,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[list[Sample], dict[str, int]]:
    """`assign_advantages` on the union of every rank's samples, in rank order; returns
    this rank's kept samples (`samples`, whose entry `per_rank[rank]` is) and its counts.

    The trained batch is that union, and DESIGN.md's learning rule has one running baseline
    per task and one mean per group. Decided per rank, each rank's baseline followed only
    the sessions its partitions carry: equal rewards of one task got different advantages
    on different ranks, the first sample of a task was dropped once per rank, a group split
    over ranks was normalised in pieces, and the checkpoint kept only rank 0's baselines
    for every rank to resume from. Here every rank updates its baseline with the same
    sequence, so all ranks hold rank 0's (checkpointed) state, and the result is what one
    process would compute on the whole batch."""
    if len(per_rank[rank]) != len(samples):
        raise ValueError(f"rank {rank}: {len(samples)} samples but {len(per_rank[rank])} gathered")
    union: list[Sample] = []
    mine_start = 0
    for r, part in enumerate(per_rank):
        if r == rank:
            mine_start = len(union)
            union.extend(samples)
            continue
        for group, tenant, task, reward in part:  # stand-ins: only these matter
            union.append(Sample("", "", [], [], [], reward, group, task, tenant, None, 0))
    mine = range(mine_start, mine_start + len(samples))
    kept, outcomes, zero_groups = _assign(union, baseline, normalize, eps)
    return [union[i] for i in kept if i in mine], _advantage_counts(outcomes, zero_groups, mine)


def assign_advantages_across_ranks(
    ctx: DistContext,
    samples: list[Sample],
    baseline: RunningBaseline,
    normalize: bool = True,
    eps: float = 1e-6,
) -> tuple[list[Sample], dict[str, int]]:
    """`assign_advantages_for_rank` after gathering every rank's (group, tenant, task,
    reward) (collective: every rank calls it); the counts summed over ranks are the
    batch's."""
    scored: list[Scored] = [(s.group, s.tenant, s.task, s.reward) for s in samples]
    per_rank = all_gather_object(ctx, scored)
    return assign_advantages_for_rank(per_rank, ctx.rank, samples, baseline, normalize, eps)


def select_trained(
    ctx: DistContext,
    samples: list[Sample],
    baseline: RunningBaseline,
    caps: CapsConfig,
    normalize: bool = True,
) -> tuple[list[Sample], list[dict[str, int]]]:
    """The samples a step trains on: capped, given advantages, capped again (collective).

    The first cap keeps an over-represented source out of the baselines and group means;
    the second holds the cap on what is trained, since advantages drop zero-advantage
    samples unevenly (capped 4 and 4, a tenant whose samples all carried an advantage
    trained 4 against the other's 2). The second keeps or drops GRPO groups whole: their
    advantages are set, and a group cut to its earliest members trained only its positive
    (or only its negative) ones. Returns the samples and the count parts (`capped` sums
    both caps)."""
    samples, capped, base = _capped_across_ranks(ctx, samples, caps, whole_groups=False)
    samples, adv_counts = assign_advantages_across_ranks(ctx, samples, baseline, normalize)
    # A sample's own weight is measured against the batch the caps were first taken on,
    # not against what the first cap kept (see `safety.caps.AloneLimitBase`).
    samples, recapped, _ = _capped_across_ranks(ctx, samples, caps, True, base)
    return samples, [capped, adv_counts, recapped]


def policy_loss(
    logp_new: torch.Tensor,
    logp_sampling: torch.Tensor,
    logp_ref: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    importance_cap: float,
    ppo_clip_eps: float | None,
    kl_coef: float,
    normalizer: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level off-policy policy-gradient loss with a k3 KL penalty.

    All tensors are [batch, tokens]; `advantages` is per token (the sample's advantage
    broadcast); `mask` marks completion tokens. Without PPO the gradient is
    min(ρ, C)·A·∇log π (truncated importance sampling). With `ppo_clip_eps` the PPO
    clipped surrogate is used, with dual clipping at C·A for negative advantages. The sum
    over tokens is divided by `normalizer` (the batch's token count across all ranks).
    Returns the loss and detached sums (tokens, ratio, clipped, kl, pg) for logging.
    """
    mask = mask.to(logp_new.dtype)
    log_ratio = logp_new - logp_sampling
    ratio = torch.exp(log_ratio)
    if ppo_clip_eps is None:
        weight = ratio.detach().clamp(max=importance_cap)
        pg = -(weight * advantages * logp_new)
        surrogate = -(weight * advantages)
        clipped = ratio.detach() > importance_cap
    else:
        # Above max(C, 1+ε) the surrogate is constant in ρ (clipped for A>0, dual-clipped
        # at C·A for A<0), so capping log ρ just above it changes neither value nor
        # gradient; it keeps exp from overflowing float32 (log ρ > 88), whose 0·∞ in the
        # backward would make the whole step's gradient NaN.
        bound = math.log(max(importance_cap, 1 + ppo_clip_eps)) + 1.0
        capped = torch.exp(log_ratio.clamp(max=bound))
        unclipped = capped * advantages
        clipped_obj = capped.clamp(1 - ppo_clip_eps, 1 + ppo_clip_eps) * advantages
        objective = torch.minimum(unclipped, clipped_obj)
        dual = torch.where(
            advantages < 0, torch.maximum(objective, importance_cap * advantages), objective
        )
        pg = -dual
        surrogate = pg.detach()
        clipped = (clipped_obj.detach() < unclipped.detach()) | (
            (advantages < 0) & (importance_cap * advantages > objective.detach())
        )
    if logp_ref is not None:
        # Masked positions (prompt, padding) are zeroed before exp: a large ratio there
        # overflowed to inf, and inf * 0 made the loss and every gradient NaN.
        ref_log_ratio = torch.where(mask > 0, logp_ref - logp_new, torch.zeros_like(logp_new))
        kl = torch.exp(ref_log_ratio) - ref_log_ratio - 1
    else:
        kl = torch.zeros_like(logp_new)
    per_token = pg + kl_coef * kl
    loss = (per_token * mask).sum() / normalizer
    with torch.no_grad():
        stats = {
            "tokens": mask.sum(),
            "ratio_sum": (ratio * mask).sum(),
            "clipped": (clipped.to(mask.dtype) * mask).sum(),
            "kl_sum": (kl * mask).sum(),
            "pg_sum": (surrogate * mask).sum(),
            "abs_logprob_diff_sum": (log_ratio.abs() * mask).sum(),
        }
    return loss, stats
