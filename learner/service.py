"""The learner loop: consume → reward → train → checkpoint → publish → announce.

`run_learner` runs in one process or under `torchrun` unchanged. Each rank reads its own
partitions through the consumer factory; rank 0 writes checkpoints and adapters, and feeds
the canary the live evidence of every rank.
"""

from __future__ import annotations

import contextlib
import json
import math
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog
import torch

from learner.adapter_store import AdapterStore
from learner.base_model import base_model_identity
from learner.canary import CanaryMonitor, share_canary_evidence
from learner.checkpoint import (
    Checkpoint,
    CheckpointStore,
    Offsets,
    ResumePlan,
    raise_version_floor,
    resume_plan,
)
from learner.config import LearnerConfig
from learner.distributed import (
    DistContext,
    all_gather_object,
    all_reduce_max,
    all_reduce_sum,
    barrier,
    broadcast_object,
    held_elsewhere,
    init_distributed,
)
from learner.objective import (
    RunningBaseline,
    Sample,
    drop_stale,
    samples_from_rewarded,
    select_trained,
)
from learner.progress import Progress
from learner.rewards.assembler import RewardAssembler, as_pair, untrainable_records
from learner.rewards.judge import Judge
from learner.rewards.verifiers import VerifierRunner
from learner.trainer import AdapterMismatch, StepInterrupted, Trainer, reward_stats
from replay.schemas import is_finite_number
from safety.config import CapsConfig

log = structlog.get_logger(__name__)


def _created_at(item: Any) -> float:
    created = as_pair(item)[0].get("created_at")
    usable = isinstance(created, int | float) and not isinstance(created, bool)
    return float(created) if usable and is_finite_number(created) else -math.inf


def newest(batch: list[Any], count: int) -> list[Any]:
    """The `count` items of `batch` whose requests were served last (a record without a
    usable time counts as oldest). The consumer yields partition by partition, so a cut by
    position dropped whole partitions: the same sessions (a hash picks the partition), and
    so the same users and tenants, were never trained under load."""
    if len(batch) <= count:
        return batch
    return sorted(batch, key=_created_at)[len(batch) - count :]


class TrajectorySource(Protocol):
    """What the learner needs from replay's TrajectoryConsumer."""

    def poll(self, timeout_s: float) -> list[Any]: ...
    def processed_offsets(self) -> dict[str, dict[int, int]]: ...
    def close(self) -> None: ...


# (offsets to resume from or None, rank, world size) → a source over this rank's partitions
ConsumerFactory = Callable[[Offsets | None, int, int], TrajectorySource]
FaultHook = Callable[[str], None]


def _json_metrics(metrics: dict[str, float]) -> dict[str, float | None]:
    """A step's metrics as olp_meta.json holds them: null for what was not measured (the
    on-policy ratios of a batch with no on-policy token, the KL without a KL term) or
    overflowed (a ratio's mean), where NaN and Infinity made the file JSON no strict reader
    takes."""
    return {name: value if math.isfinite(value) else None for name, value in metrics.items()}


@dataclass
class LearnerSummary:
    version: int
    steps: int
    consumed: int
    counts: dict[str, int] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)


def merge_offsets(parts: list[Offsets]) -> Offsets:
    merged: Offsets = {}
    for part in parts:
        for topic, partitions in part.items():
            merged.setdefault(topic, {}).update(partitions)
    return merged


def _log_candidate(path: Path) -> None:
    log.info("candidate_adapter", path=str(path))


class Learner:
    """State of one learner process; `run` is the loop."""

    def __init__(
        self,
        config: LearnerConfig,
        state_dir: str | Path,
        consumer_factory: ConsumerFactory,
        model_dir: str | Path | None = None,
        on_candidate: Callable[[Path], None] | None = None,
        is_frozen: Callable[[], bool] | None = None,
        judge_base_url: str | None = None,
        fault_hook: FaultHook | None = None,
        ctx: DistContext | None = None,
        judge_api_key: str | None = None,
        canary: CanaryMonitor | None = None,
        caps: CapsConfig | None = None,
        base_name: str = "base",
        served_versions: Callable[[], Iterable[str]] | None = None,
        stream_id: str | None = None,
    ) -> None:
        model_dir = model_dir or config.base_model_dir
        if model_dir is None:
            raise ValueError("learner.base_model_dir is not set and no model_dir was given")
        self.config = config
        self.ctx = ctx or init_distributed()
        self.model_dir = Path(model_dir)
        # Recorded with the weights (checkpoint, each version's metadata); compared at resume.
        self.base_model = base_model_identity(model_dir) if self.ctx.is_main else None
        self.store = AdapterStore(state_dir)
        self.checkpoints = CheckpointStore(state_dir)
        self.on_candidate = on_candidate or _log_candidate
        self.is_frozen = is_frozen or (lambda: False)
        self.fault_hook = fault_hook or (lambda stage: None)
        # The promoter's canary (rank 0's only counts): fed every rank's scored replies.
        self.canary = canary
        self.caps = caps or CapsConfig()  # `safety.caps`: per-tenant / per-user shares
        self.base_name = base_name  # the base model's served name (`policy_version` 0)
        # The version names in use elsewhere (what vLLM's /v1/models lists, what the
        # proxy's status names), asked once at start-up so that new versions are numbered
        # above any `policy-v<N>` this learner did not publish.
        self.served_versions = served_versions
        self.version_floor = 0
        self._warned_ahead_at: int | None = None  # learner_ahead_of_serving said at version
        # Which stream the offsets count in, when the caller knows (`olp up` names each
        # start of its in-memory broker): offsets saved in another stream are not resumed.
        self.stream_id = stream_id
        self.baseline = RunningBaseline(config.baseline_decay)
        self.counts: Counter[str] = Counter()
        self.progress = Progress(config.progress_interval_s)
        self.progress.counts = self.counts  # the same counter: the line reads it as it grows
        self.step_count = 0
        self.batches_done = 0  # batches fully handled in this process (after announce)
        self.version = 0
        self.offsets: Offsets | None = None
        self.version_meta: dict[str, Any] | None = None  # olp_meta of `version`, if trained
        # Set when start-up reset the optimizer (`ResumePlan.optimizer_reason`); recorded in
        # the next published version's metadata, then cleared.
        self.optimizer_reset: dict[str, Any] | None = None
        self._closed = False
        # Loaded before the judge exists: a bad verifier path then leaks no judge.
        verifiers = VerifierRunner(config.rewards.verifiers)
        judge = None
        if config.rewards.judge.enabled:
            judge = Judge(
                config.rewards.judge,
                base_url=judge_base_url,
                api_key=judge_api_key,
                base_name=base_name,
            )
        # Owns the judge's threads and HTTP client: `close()` releases them, and so does a
        # start-up that fails from here on, before it raises.
        self.assembler = RewardAssembler(config.rewards, judge=judge, verifiers=verifiers)
        self.consumer: Any = None
        try:
            self.trainer = Trainer(config, model_dir, self.ctx)
            self._resume()
            self.consumer = self._consumer_of_every_rank(consumer_factory)
            # Only once every rank's consumer took its offsets: a start refused there
            # (offsets past the stream's end, exit 3) had handed a pending candidate to the
            # promoter, which loaded it into vLLM and began its gate on the way out.
            self._announce_pending()
        except BaseException:
            self.assembler.close()
            if self.consumer is not None:
                with contextlib.suppress(Exception):
                    self.consumer.close()
            raise

    # -- start-up ---------------------------------------------------------------------------
    def _raised_version_floor(self, plan: ResumePlan) -> int:
        """The plan's version floor, raised above the names this state dir handed out and
        what vLLM or the proxy names (main rank)."""
        floor = int(plan.version_floor)
        if not self.ctx.is_main:
            return floor
        # Resumed below versions it announced (an older checkpoint restored, the newer
        # directories moved aside to train from it): those names were gated, audited and
        # perhaps served. Used again, the promoter took the new `policy-v2` for the decided
        # old one and never gated it, and records named two models alike.
        handed_out = max(self.checkpoints.announced(), self.checkpoints.decided() or 0)
        if handed_out > max(floor, plan.version):
            floor = handed_out
            log.warning(
                "learner_version_floor",
                floor=floor,
                version=plan.version,
                reason="this state dir announced versions the adapter store no longer holds",
            )
        if self.served_versions is None:
            return floor
        raised = raise_version_floor(floor, plan.version, self.served_versions())
        if raised != floor:
            log.warning(
                "learner_version_floor",
                floor=raised,
                version=plan.version,
                reason="vLLM or the proxy names versions this learner did not publish",
            )
        return raised

    def _trained_lora_alpha(self, plan: ResumePlan, checkpoint: Checkpoint | None) -> float | None:
        """The `lora_alpha` the resumed weights were trained under, None when not known (a
        checkpoint from before it was recorded, of a version the store does not hold)."""
        if plan.weights_from == "checkpoint" and checkpoint is not None:
            if checkpoint.lora_alpha is not None:
                return float(checkpoint.lora_alpha)
        elif plan.weights_from != "adapter":
            return None
        config_file = self.store.path(plan.version) / "adapter_config.json"
        try:
            alpha = json.loads(config_file.read_text(encoding="utf-8")).get("lora_alpha")
        except (OSError, ValueError, AttributeError):
            return None
        is_number = isinstance(alpha, int | float) and not isinstance(alpha, bool)
        return float(alpha) if is_number and alpha > 0 else None

    def _check_lora_alpha(self, plan: ResumePlan, checkpoint: Checkpoint | None) -> None:
        """Refuse a changed `lora_alpha`, as a changed rank is: it scales every LoRA output,
        so the resumed weights were another policy than the served version they are (their
        samples' off-policy ratios skewed), and the next version shipped the new scaling.
        Read on rank 0 (the store and checkpoint are read there) and shared."""
        if plan.version == 0:
            return  # untrained: every lora_B is zero, so alpha changes nothing yet
        was = self._trained_lora_alpha(plan, checkpoint) if self.ctx.is_main else None
        was = broadcast_object(self.ctx, was)
        now = float(self.config.lora_alpha)
        if was is not None and was != now:
            raise AdapterMismatch(
                f"policy-v{plan.version} was trained with learner.lora_alpha={was:g}, and "
                f"learner.lora_alpha is {now:g}: resumed under it, its weights would be "
                f"another policy than the one served. Set learner.lora_alpha back to {was:g}, "
                "or start from an empty state_dir"
            )

    def _check_base_model(self, plan: ResumePlan, checkpoint: Checkpoint | None) -> None:
        """Say so when the resumed weights were trained on another base model than
        `policy.model` now (the same shape: another shape is refused by the weights' load).
        Not refused: training goes on from those weights on this model, a warm start, and a
        model re-prepared by a newer olp may differ in its bytes only."""
        was: Any = None
        if plan.weights_from == "checkpoint" and checkpoint is not None:
            was = checkpoint.base_model
        elif plan.weights_from == "adapter":
            with contextlib.suppress(OSError, ValueError, AttributeError):
                was = self.store.read_meta(plan.version).get("base_model")
        if isinstance(was, str) and was != self.base_model:
            log.warning(
                "learner_base_model_changed",
                version=plan.version,
                trained_on=was,
                now=self.base_model,
                model_dir=str(self.model_dir),
                note=f"policy-v{plan.version} was trained on another base model than "
                "policy.model is now; training goes on from its weights on this one",
            )

    def _resume(self) -> None:
        checkpoint = self.checkpoints.load() if self.ctx.is_main else None
        if self.ctx.is_main:
            self.store.cleanup_temporary()
            self.checkpoints.cleanup_temporary()
            plan = resume_plan(checkpoint, self.store)
        else:
            plan = None
        plan, checkpoint = broadcast_object(self.ctx, (plan, checkpoint))
        log.info("learner_resume", version=plan.version, weights_from=plan.weights_from)
        self.version = plan.version
        self.version_floor = plan.version_floor
        self.offsets = plan.offsets
        self._forget_offsets_of_another_stream(plan.weights_from, checkpoint)
        # The weights first: one of another LoRA shape (changed lora_rank / target_modules)
        # stops start-up with a message naming those settings, before the optimizer's own
        # "parameter group" error could.
        if plan.weights_from == "checkpoint":
            assert checkpoint is not None
            self.trainer.load_adapter_state(
                checkpoint.adapter_state, f"checkpoint {self.checkpoints.path}"
            )
        elif plan.weights_from == "adapter":
            path = self.store.path(plan.version)
            weights = None
            if self.ctx.is_main:
                from safetensors.torch import load_file

                weights = load_file(str(path / "adapter_model.safetensors"))
            self.trainer.load_adapter_state(broadcast_object(self.ctx, weights), str(path))
        self._check_lora_alpha(plan, checkpoint)
        if self.ctx.is_main:
            self._check_base_model(plan, checkpoint)
        # After the local checks (the store, the weights' shape): a learner whose state is
        # refused says so at once, not after waiting for the servers to answer.
        self.version_floor = broadcast_object(self.ctx, self._raised_version_floor(plan))
        if checkpoint is not None:
            now_hash = self.config.config_hash()
            if checkpoint.config_hash and checkpoint.config_hash != now_hash:
                # Said once, here: the LoRA shape is checked above, lr and weight decay come
                # from the config below; any other change applies from this step on.
                log.warning(
                    "learner_config_changed",
                    was=checkpoint.config_hash,
                    now=now_hash,
                    note="the learner settings differ from the checkpoint's; they apply "
                    "from the next step",
                )
            self.version_meta = checkpoint.meta
            self.step_count = checkpoint.step
            self.counts.update(checkpoint.counters)
            self.progress.counts_at_start = dict(checkpoint.counters)
            self.baseline.load_state_dict(checkpoint.baseline)
            if plan.keep_optimizer:
                changed = self.trainer.restore_optimizer(checkpoint.optimizer, checkpoint.scheduler)
                for name, (was, now) in changed.items():
                    log.warning("learner_optimizer_setting_changed", setting=name, was=was, now=now)
        if plan.step is not None:
            self.step_count = plan.step
        if plan.optimizer_reason:
            # The moments kept would belong to other weights: the optimizer and the
            # scheduler (its warm-up too) start fresh, and the next version says so.
            self.optimizer_reset = {"at_version": plan.version, "reason": plan.optimizer_reason}
            log.warning(
                "learner_optimizer_reset", version=plan.version, reason=plan.optimizer_reason
            )
        elif checkpoint is not None:
            # A reset from before a restart that no version recorded yet.
            self.optimizer_reset = checkpoint.pending_optimizer_reset
            log.info("learner_optimizer_restored", version=plan.version)
        if plan.weights_from == "adapter" and self.ctx.is_main:
            self._save_checkpoint(meta=self.store.read_meta(plan.version))
        if self.ctx.is_main and plan.republish:
            assert checkpoint is not None
            self._publish(self.version, checkpoint_meta(checkpoint))
        self.progress.version = self.version
        self.progress.step = self.step_count

    def _consumer_of_every_rank(self, consumer_factory: ConsumerFactory) -> Any:
        """This rank's consumer, once every rank made its own: each checks the saved offsets
        of its own partitions, and one refusing them stops every rank with its error (rank
        0 alone went on, and announced)."""
        consumer, refused = None, None
        try:
            consumer = consumer_factory(self.offsets, self.ctx.rank, self.ctx.world)
        except Exception as exc:
            refused = exc
        try:
            errors = all_gather_object(self.ctx, _shareable(refused))
            first = refused or next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        except BaseException:
            if consumer is not None:  # also when the gather failed (a rank that died)
                with contextlib.suppress(Exception):
                    consumer.close()
            raise
        return consumer

    def _announce_pending(self) -> None:
        """Hand the newest stored version to the promoter if it never was (a crash between
        its publish and its announce)."""
        if self.ctx.is_main:
            latest = self.store.latest()
            if latest is not None and latest > self.checkpoints.announced():
                self._announce(latest)

    def _forget_offsets_of_another_stream(
        self, weights_from: str, checkpoint: Checkpoint | None
    ) -> None:
        """Offsets saved while reading another stream mean nothing in this one: `olp up`'s
        embedded broker keeps its data in memory, so each start's stream is new and empty,
        and the saved offsets lay beyond its end (the consumer refused to start). The
        weights, version and optimizer are kept; this stream is read from its start."""
        if self.stream_id is None or not self.offsets:
            return
        if weights_from == "adapter":
            recorded = self.store.read_meta(self.version).get("stream_id")
        else:
            recorded = checkpoint.stream_id if checkpoint is not None else None
        if recorded == self.stream_id:
            return
        log.warning(
            "learner_stream_new",
            stream_id=self.stream_id,
            offsets_of=recorded,
            dropped_offsets=self.offsets,
            version=self.version,
            note="the saved offsets count in an earlier stream; reading this one from its start",
        )
        self.offsets = None

    # -- the loop ---------------------------------------------------------------------------
    def run(
        self,
        stop: threading.Event | None = None,
        max_steps: int | None = None,
        poll_timeout_s: float = 0.5,
    ) -> LearnerSummary:
        stop = stop or threading.Event()
        pending: list[Any] = []
        history: list[dict[str, float]] = []
        # When the batch got its first trajectory (on any rank): `batch_timeout_s` counts
        # from there. Counted from the last step, the first batch after a quiet spell was
        # trained at `min_batch` at once, though the rest of its burst was a moment away.
        batch_started: float | None = None
        steps_here = 0
        try:
            while True:
                if max_steps is not None and steps_here >= max_steps:
                    break  # the same on every rank: steps are taken together
                frozen = bool(
                    broadcast_object(self.ctx, self.is_frozen() if self.ctx.is_main else None)
                )
                self.progress.frozen = frozen
                items: list[Any] = []
                if not frozen:
                    items = self.consumer.poll(poll_timeout_s)
                    pending.extend(items)
                else:
                    time.sleep(poll_timeout_s)
                done = stop.is_set()
                flags = torch.tensor(
                    [float(len(pending)), float(len(items)), float(done)], dtype=torch.float64
                )
                all_reduce_sum(self.ctx, flags[:2])
                all_reduce_max(self.ctx, flags[2:])
                total = int(flags[0])  # the same on every rank
                # What every rank read: rank 0's own count said nothing of the others'
                # partitions (0 under torchrun while another rank read the traffic).
                self.progress.consumed += int(flags[1])
                if total > 0 and batch_started is None:
                    batch_started = time.monotonic()
                waited = broadcast_object(
                    self.ctx, 0.0 if batch_started is None else time.monotonic() - batch_started
                )
                if flags[2] > 0:
                    break
                ready = total >= self.config.batch_size or (
                    waited >= self.config.batch_timeout_s and total >= self.config.min_batch
                )
                if not frozen and ready:
                    try:
                        metrics = self._step(pending, stop)
                    except StepInterrupted as exc:
                        log.warning(
                            "learner_step_interrupted",
                            trajectories=len(pending),
                            reason=str(exc),
                            note="no version; the batch is read again at the next start",
                        )
                        break
                    pending = []
                    batch_started = None
                    steps_here += 1
                    if metrics:
                        history.append(metrics)
                self.progress.maybe_log()
        finally:
            self.close()
        self.progress.maybe_log(force=True)
        return LearnerSummary(
            self.version, self.step_count, self.progress.consumed, dict(self.counts), history
        )

    def _train(self, samples: list[Sample], stop: threading.Event | None) -> dict[str, float]:
        """`trainer.step`; in a single process, a step that raises anything but a stop (an
        out-of-memory on one long sample) puts the weights and optimizer back as they were
        and gives `{"failed": 1}`: the batch is consumed and counted (`step_failed`), as one
        with non-finite gradients is. Raised, the learner died before its checkpoint, and
        the same batch killed it at every restart. Under torchrun it still raises: the
        other ranks are in the step's collectives, and only a restart of all of them
        brings them back together."""
        if self.ctx.enabled:
            return self.trainer.step(samples, self.version, stop)
        snapshot = self.trainer.snapshot()
        try:
            return self.trainer.step(samples, self.version, stop)
        except StepInterrupted:
            raise
        except Exception as exc:
            log.exception(
                "learner_step_failed",
                samples=len(samples),
                error=repr(exc),
                note="weights and optimizer put back; the batch is consumed and counted",
            )
            self.trainer.rollback(snapshot)
            return {"failed": 1.0}

    def _raise_if_stopped(self, stop: threading.Event | None) -> None:
        """StepInterrupted on every rank once any rank's `stop` is set (a collective: ranks
        must leave the step together)."""
        if stop is None:
            return
        flag = torch.tensor([float(stop.is_set())], dtype=torch.float64)
        if all_reduce_max(self.ctx, flag)[0] > 0:
            self.assembler.counts.clear()  # the batch is read again: counted then
            raise StepInterrupted("stopped while the batch's rewards were assembled")

    def _step(
        self, batch: list[Any], stop: threading.Event | None = None
    ) -> dict[str, float] | None:
        """Train on what is pending (the newest `max_batch`); checkpoint, publish, announce."""
        offsets_here = self.consumer.processed_offsets()
        overflow = max(0, len(batch) - self.config.max_batch)
        overflowed: list[dict[str, Any]] = []
        if overflow:
            log.warning("learner_overflow", dropped=overflow, kept=self.config.max_batch)
            kept = newest(batch, self.config.max_batch)
            kept_ids = {id(item) for item in kept}
            overflowed = [as_pair(item)[0] for item in batch if id(item) not in kept_ids]
            batch = kept
        # Collective (with torchrun and group ranking): a judge group split over ranks is
        # graded reply by reply, not ranked on each rank apart.
        unranked = (
            held_elsewhere(self.ctx, self.assembler.judge_group_keys(batch))
            if self.ctx.enabled and self.assembler.ranks_groups
            else frozenset()
        )
        rewarded = self.assembler.assemble(batch, stop, unranked)
        self._raise_if_stopped(stop)
        # Collective: rank 0's canary counts the union of the ranks' replies, those it
        # cannot train on too (their guard checks, and whether they finished).
        # The overflow's replies too (the cut keeps the newest: it dropped the long-running
        # ones first, the runaway replies the canary's guards are there to see).
        share_canary_evidence(
            self.ctx, self.canary, rewarded, untrainable_records(batch) + overflowed
        )
        samples, dropped = samples_from_rewarded(rewarded, self.base_name, self.trainer.vocab_size)
        newest_served = max((s.policy_version for s in samples), default=None)
        samples, stale = drop_stale(
            samples, self.version, self.config.max_staleness, self.version_floor
        )
        # The batch's reward, before advantages and caps drop samples: over the trained
        # ones only, an improving policy (most groups all correct, dropped as zero-
        # advantage) and a collapsing one (most all wrong) reported the same mean.
        rewards_here = (
            float(len(samples)),
            sum(s.reward for s in samples),
            sum(s.reward**2 for s in samples),
        )
        # Collective: the trained batch is the union over ranks, so are the caps, the
        # baselines and the group means.
        samples, parts = select_trained(
            self.ctx, samples, self.baseline, self.caps, self.config.normalize_advantages
        )
        local = Counter(
            {
                "trajectories": len(batch),
                "overflow": overflow,
                "stale": stale,
                "trained_samples": len(samples),
            }
        )
        for part in (dropped, *parts):  # summed: parts share keys (bad_reward, capped)
            local.update(part)
        local.update({f"reward_{k}": v for k, v in self.assembler.counts.items()})
        self.assembler.counts.clear()
        gathered = all_gather_object(
            self.ctx,
            (dict(local), offsets_here, [s.event_id for s in samples], newest_served, rewards_here),
        )
        batch_counts: Counter[str] = Counter()
        for part in gathered:
            batch_counts.update(part[0])
        # Over every rank, as the counts: rank 0's own said "all stale" while another rank
        # had fresh samples, and said nothing while only another rank's were all stale.
        served = [part[3] for part in gathered if part[3] is not None]
        newest_served_all = max(served, default=None)
        batch_rewards = [sum(part[4][i] for part in gathered) for i in range(3)]
        fresh = int(batch_rewards[0])
        offsets = merge_offsets([self.offsets or {}] + [part[1] for part in gathered])
        event_ids = sorted({e for part in gathered for e in part[2]})
        trained = batch_counts["trained_samples"]
        metrics: dict[str, float] | None = None
        if trained > 0:
            metrics = self._train(samples, stop)
            self.fault_hook("after_step")
            if metrics.get("failed"):
                batch_counts["step_failed"] += trained
                metrics = None
            elif metrics["skipped_updates"] >= self.config.updates_per_batch:
                # No update applied (non-finite gradients): the weights are the parent's, so
                # no new version; the batch is consumed and counted, not retried for ever.
                log.error("learner_batch_not_trained", samples=trained, reason="nonfinite_gradient")
                batch_counts["nonfinite_gradient"] += trained
                metrics = None
        if metrics is not None:
            mean, std = reward_stats(*batch_rewards)
            metrics.update(reward_mean=mean, reward_std=std, reward_samples=float(fresh))
            self.step_count += 1
            parent = self.version
            # Above the floor: never a name another lineage left loaded in vLLM.
            self.version = max(self.version, self.version_floor) + 1
        self.counts.update(batch_counts)
        start_offsets = self.offsets or {}
        self.offsets = offsets
        if self.ctx.is_main:
            meta = None
            if metrics is not None:
                meta = {
                    "parent_version": parent,
                    "consumed_offsets": offsets,
                    "start_offsets": start_offsets,
                    "config_hash": self.config.config_hash(),
                    "step_metrics": _json_metrics(metrics),
                    "data_stats": {
                        **dict(batch_counts),
                        "event_ids": event_ids[: self.config.max_event_ids_in_meta],
                    },
                    "gate": None,
                    "created_at": time.time(),
                    "version_floor": self.version_floor,
                    "step": self.step_count,
                    "stream_id": self.stream_id,
                    "base_model": self.base_model,
                }
                if self.optimizer_reset is not None:
                    # From here on the checkpoint's meta carries it (a republish too).
                    meta["optimizer_reset"], self.optimizer_reset = self.optimizer_reset, None
            self._save_checkpoint(meta)
            self.fault_hook("after_checkpoint")
            if meta is not None:
                self._publish(self.version, meta)
                self.fault_hook("after_publish")
                self._announce(self.version)
        barrier(self.ctx)
        if metrics is not None:
            self.progress.record_step(self.version, metrics)
            log.info(
                "learner_step",
                step=self.step_count,
                version=self.version,
                **{k: round(v, 5) for k, v in metrics.items()},
                **dict(batch_counts),
            )
        elif fresh:
            mean, _ = reward_stats(*batch_rewards)
            self.progress.record_untrained_reward(mean)
            log.info("learner_batch_skipped", reward_mean=round(mean, 5), **dict(batch_counts))
        else:
            log.info("learner_batch_skipped", **dict(batch_counts))
            stale_all = batch_counts["stale"]
            if stale_all and self.ctx.is_main:
                self._warn_ahead_of_serving(newest_served_all, stale_all)
        self.batches_done += 1
        return metrics

    def _warn_ahead_of_serving(self, newest_served: int | None, stale: int) -> None:
        """Every sample was stale: what serves is more than `max_staleness` versions behind
        this learner (candidates rejected or not promoted, a rollback, promotion off). New
        traffic comes from that version, so nothing trains until a newer version serves:
        said once per learner version, as an error, with what to do."""
        if self._warned_ahead_at == self.version:
            return
        self._warned_ahead_at = self.version
        log.error(
            "learner_ahead_of_serving",
            version=self.version,
            newest_served=newest_served,
            max_staleness=self.config.max_staleness,
            stale=stale,
            remedy=(
                "promote a newer version (see the gate reports, olp unfreeze), raise "
                "learner.max_staleness, or move the learner's state dir aside to train "
                "from what serves"
            ),
        )

    def close(self) -> None:
        """Release the consumer and the reward assembler's judge (threads, HTTP client);
        `run` calls it when it ends, returning or raising. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.consumer.close()
        finally:
            self.assembler.close()

    # -- persistence (rank 0) ---------------------------------------------------------------
    def _save_checkpoint(self, meta: dict[str, Any] | None) -> None:
        # A batch that trained nothing keeps the version, and so its metadata, which
        # resume_plan checks the stored version against.
        if meta is not None:
            self.version_meta = meta
        meta = self.version_meta
        checkpoint = Checkpoint(
            version=self.version,
            step=self.step_count,
            offsets=self.offsets or {},
            adapter_state=self.trainer.adapter_state(),
            optimizer=self.trainer.optimizer.state_dict(),
            scheduler=self.trainer.scheduler.state_dict(),
            baseline=self.baseline.state_dict(),
            counters=dict(self.counts),
            config_hash=self.config.config_hash(),
            meta=meta,
            version_floor=self.version_floor,
            # Loaded only when it matched the weights (else fresh since start-up), and
            # stepped with them since: the optimizer state is always that of `version`.
            optimizer_version=self.version,
            stream_id=self.stream_id,
            pending_optimizer_reset=self.optimizer_reset,
            lora_alpha=self.config.lora_alpha,
            base_model=self.base_model,
        )
        self.checkpoints.save(checkpoint)

    def _publish(self, version: int, meta: dict[str, Any]) -> Path:
        with self.store.building() as tmp:
            files = tmp / "files"
            self.trainer.save_adapter_files(files)
            return self.store.publish(version, files, meta)

    def _announce(self, version: int) -> None:
        self.on_candidate(self.store.path(version))
        self.checkpoints.mark_announced(version)


def _shareable(error: Exception | None) -> Exception | None:
    """`error` as it can cross to the other ranks (pickled), else its text in a
    RuntimeError."""
    if error is None:
        return None
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def checkpoint_meta(checkpoint: Checkpoint) -> dict[str, Any]:
    meta = checkpoint.meta
    if not meta:
        raise RuntimeError(f"checkpoint for version {checkpoint.version} carries no metadata")
    return meta


def run_learner(
    config: LearnerConfig,
    state_dir: str | Path,
    consumer_factory: ConsumerFactory,
    model_dir: str | Path | None = None,
    on_candidate: Callable[[Path], None] | None = None,
    is_frozen: Callable[[], bool] | None = None,
    judge_base_url: str | None = None,
    judge_api_key: str | None = None,
    stop: threading.Event | None = None,
    max_steps: int | None = None,
    fault_hook: FaultHook | None = None,
    canary: CanaryMonitor | None = None,
    caps: CapsConfig | None = None,
    base_name: str = "base",
    served_versions: Callable[[], Iterable[str]] | None = None,
    ctx: DistContext | None = None,
    stream_id: str | None = None,
    on_started: Callable[[], None] | None = None,
) -> LearnerSummary:
    """Run the learner until `stop` is set or `max_steps` steps ran in this call.

    `on_started` runs on the main rank once the learner resumed its state (checked it, or
    refused it): the promoter's own resume must not gate candidates of a store the learner
    then refuses."""
    learner = Learner(
        config,
        state_dir,
        consumer_factory,
        model_dir,
        on_candidate,
        is_frozen,
        judge_base_url,
        fault_hook,
        ctx=ctx,
        judge_api_key=judge_api_key,
        canary=canary,
        caps=caps,
        base_name=base_name,
        served_versions=served_versions,
        stream_id=stream_id,
    )
    if on_started is not None and learner.ctx.is_main:
        try:
            on_started()
        except BaseException:
            learner.close()  # its consumer and judge: `run` would have closed them
            raise
    return learner.run(stop=stop, max_steps=max_steps)
