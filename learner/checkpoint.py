"""Learner checkpoint: adapter weights, optimizer, scheduler, baselines and consumer offsets.

Everything that defines "where the learner is" lives in one file written atomically
(temporary file, fsync, rename), so a crash leaves either the old or the new checkpoint.
The write order per step is: train → checkpoint (weights + offsets after the batch) →
publish `policy-v<N>` → announce it. Resume therefore never retrains a batch whose effect
was kept, and re-publishes / re-announces what a crash interrupted (see `resume_plan`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import load_file

from learner.adapter_store import WEIGHTS_FILE, AdapterStore, sha256_file

log = structlog.get_logger(__name__)

Offsets = dict[str, dict[int, int]]
_SERVED = re.compile(r"policy-v([1-9][0-9]*)", re.ASCII)


class ResumeRefused(RuntimeError):
    """The checkpoint and the adapter store disagree in a way start-up will not guess at;
    the message says what to move aside (an operator's problem, not a crash)."""


@dataclass
class Checkpoint:
    version: int  # adapter version these weights are (0: untrained base adapter)
    step: int
    offsets: Offsets  # topic → partition → next offset to read
    adapter_state: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    baseline: dict[str, Any]
    counters: dict[str, int] = field(default_factory=dict)
    config_hash: str = ""
    meta: dict[str, Any] | None = None  # olp_meta.json of `version`, to republish it
    version_floor: int = 0  # see `ResumePlan.version_floor`
    # The adapter version whose training the optimizer's moments (and the scheduler's step)
    # belong to. None: written before this field; see `optimizer_version_of`.
    optimizer_version: int | None = None
    # The stream `offsets` count in (`Learner(stream_id=...)`); None: not known.
    stream_id: str | None = None
    # An optimizer reset (a roll-forward) the next version's olp_meta.json is to record: a
    # restart before that version lost it, and the lineage no longer said the moments were
    # started afresh.
    pending_optimizer_reset: dict[str, Any] | None = None
    # The `lora_alpha` the weights were trained under (None: written before this field): a
    # resume under another alpha is refused, as under another rank.
    lora_alpha: float | None = None
    # `base_model_identity` of the model the weights were trained on (None: not recorded).
    base_model: str | None = None


def normalize_offsets(offsets: dict[Any, Any] | None) -> Offsets:
    """JSON round-trips turn partition numbers into strings; turn them back."""
    return {
        str(topic): {int(p): int(o) for p, o in parts.items()}
        for topic, parts in (offsets or {}).items()
    }


class CheckpointStore:
    """`<state_dir>/learner/checkpoint.pt` plus the tiny `announced.json` (handed to
    `on_candidate`) and `decided.json` (the promoter reached a decision) markers."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir) / "learner"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "checkpoint.pt"
        self.announced_path = self.dir / "announced.json"
        self.decided_path = self.dir / "decided.json"

    def _tmp_path(self) -> Path:
        return self.path.with_suffix(f".tmp-{os.getpid()}")

    def save(self, checkpoint: Checkpoint) -> None:
        tmp = self._tmp_path()
        payload = dict(checkpoint.__dict__)
        with tmp.open("wb") as handle:
            torch.save(payload, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def cleanup_temporary(self) -> int:
        """Remove the temporary files of interrupted saves; returns how many.

        Run at start-up (rank 0, before any save): a crash or kill during `save` leaves a
        `checkpoint.tmp-<pid>` (adapter plus optimizer sized) under a pid no later run uses,
        so each such crash left another one behind for good."""
        removed = 0
        ours = self._tmp_path()
        for entry in [*self.dir.glob(f"{self.path.stem}.tmp-*"), *self.dir.glob("*.tmp")]:
            if entry == ours or not entry.is_file():
                continue
            try:
                entry.unlink()
                removed += 1
            except OSError as exc:
                log.warning("checkpoint_leftover_not_removed", path=str(entry), error=repr(exc))
        if removed:
            log.info("checkpoint_leftovers_removed", count=removed, dir=str(self.dir))
        return removed

    def load(self) -> Checkpoint | None:
        if not self.path.exists():
            return None
        try:
            payload = torch.load(self.path, map_location="cpu", weights_only=False)
            payload["offsets"] = normalize_offsets(payload["offsets"])
            return Checkpoint(**payload)
        except Exception as exc:
            raise ResumeRefused(
                f"cannot read the learner checkpoint {self.path} ({type(exc).__name__}: "
                f"{exc}); it is damaged or not a checkpoint of this olp version. Move it "
                "aside and the learner resumes from the newest adapter version (its weights "
                "and consumed offsets, a fresh optimizer), or from scratch if there is none"
            ) from exc

    def announced(self) -> int:
        """The newest version handed to `on_candidate` (0: none, or a marker that cannot be
        read: the newest version is announced again, which the hook takes as it is)."""
        version = _read_version(self.announced_path)
        return 0 if version is None else version

    def mark_announced(self, version: int) -> None:
        _write_version(self.announced_path, version)

    def decided(self) -> int | None:
        """The newest version whose promotion reached a decision (None: never recorded, a
        state dir from before decisions were). A newer one was announced but its gate (or
        canary) never decided: the learner stopped or died during it."""
        return _read_version(self.decided_path)  # unreadable: the newest is gated again

    def mark_decided(self, version: int) -> None:
        """Record `version` as decided; never moves back (an older decision, a superseded
        candidate, comes before the newer one's)."""
        decided = self.decided()
        if decided is None or version > decided:
            _write_version(self.decided_path, version)


def _write_version(path: Path, version: int) -> None:
    """Durably, as the checkpoint: renamed without an fsync, a marker could come back empty
    after an OS crash."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        handle.write(json.dumps({"version": version}))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_version(path: Path) -> int | None:
    """A marker's version; None when there is none, or when it cannot be read (torn by a
    crash, edited by hand): logged, and taken as not recorded, the safe direction for both
    markers (an announcement or a gate run again). It stopped the learner at every start
    with a bare JSON traceback."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        version = json.loads(text)["version"]
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version {version!r} is not a version number")
        return version
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("learner_marker_unreadable", path=str(path), error=str(exc))
        return None


@dataclass
class ResumePlan:
    """What the learner does at start-up, decided from the checkpoint and the store."""

    version: int
    offsets: Offsets | None  # None: start of the stream
    weights_from: str  # "fresh" | "checkpoint" | "adapter"
    republish: bool  # the checkpoint's version is missing from the store
    # Load the checkpoint's optimizer and scheduler: only when their moments belong to the
    # weights resumed from; else both start fresh (`optimizer_reason` says why).
    keep_optimizer: bool
    # Version numbers up to here were (or may be) used by another lineage (a wiped state
    # dir whose adapters vLLM still serves): new versions are numbered above it.
    version_floor: int = 0
    optimizer_reason: str = ""
    step: int | None = None  # the learner's step count when not the checkpoint's


def optimizer_version_of(checkpoint: Checkpoint) -> int | None:
    """The adapter version the checkpoint's optimizer state was accumulated for (None:
    unknown). A checkpoint from before `optimizer_version` existed holds the optimizer of its
    own version, except one written by a roll-forward: that one carries the stored version's
    metadata (with its `weights_sha256`) beside the optimizer of the older checkpoint it
    replaced, which no record names."""
    if checkpoint.optimizer_version is not None:
        return checkpoint.optimizer_version
    if (checkpoint.meta or {}).get("weights_sha256") is not None:
        return None
    return checkpoint.version


def resume_plan(checkpoint: Checkpoint | None, store: AdapterStore) -> ResumePlan:
    """Reconcile checkpoint and adapter store after any crash (DESIGN.md's resume table).

    - no checkpoint, no adapters: fresh start from the stream's beginning;
    - checkpoint at v, store lacks v (crash between checkpoint and publish): republish v;
    - store holds versions newer than the checkpoint (a checkpoint lost or restored from
      backup): roll forward to the newest, its weights and its recorded consumed offsets, so
      its batches are not trained twice, provided it descends from the checkpoint and every
      other newer version lies on its lineage; else refuse to start, naming the others;
    - otherwise continue from the checkpoint, once the stored copy of its version is
      verified to be it (weights and parent), else refuse.
    """
    versions = store.versions()
    base_version = checkpoint.version if checkpoint else 0
    newer = [v for v in versions if v > base_version]
    if newer:
        return _roll_forward(checkpoint, store, base_version, newer)
    if checkpoint is None:
        return ResumePlan(0, None, "fresh", republish=False, keep_optimizer=False)
    if checkpoint.version in versions:
        _verify_checkpoint_version(checkpoint, store)
    owner = optimizer_version_of(checkpoint)
    keep = owner == checkpoint.version
    reason = ""
    if not keep:
        reason = (
            f"the checkpoint's optimizer state belongs to "
            f"{'an older adapter' if owner is None else f'policy-v{owner}'}, its weights "
            f"are policy-v{checkpoint.version} (written by a roll-forward)"
        )
    return ResumePlan(
        version=checkpoint.version,
        offsets=checkpoint.offsets,
        weights_from="checkpoint",
        republish=checkpoint.version > 0 and checkpoint.version not in versions,
        keep_optimizer=keep,
        version_floor=checkpoint.version_floor,
        optimizer_reason=reason,
    )


def descends(store: AdapterStore, version: int, base_version: int) -> bool:
    """Whether `version`'s lineage leads to `base_version`.

    Version 0 (the untrained adapter) is the ancestor of every version. A version's
    `ancestor_runs` name its whole lineage. One published before they were recorded is
    walked by its parent links, which pruning may cut: a lineage that stops at a missing
    parent counts as descending when that gap lies above `base_version` and the
    checkpoint's own directory is gone too (pruned with it); a parent below `base_version`
    means another branch.
    """
    recorded = store.ancestors(version)
    if recorded is not None:  # the whole lineage, pruned versions included
        return base_version in (0, version) or base_version in recorded
    lineage = store.lineage(version)
    if base_version in lineage:
        return True
    parent = int(store.read_meta(lineage[-1]).get("parent_version") or 0)
    if parent == base_version:
        return True
    pruned_gap = parent not in store.versions() and base_version not in store.versions()
    return parent > base_version and pruned_gap


def _roll_forward(
    checkpoint: Checkpoint | None, store: AdapterStore, base_version: int, newer: list[int]
) -> ResumePlan:
    candidate = newer[-1]
    lineage = {candidate, *(store.ancestors(candidate) or store.lineage(candidate))}
    if not descends(store, candidate, base_version):
        foreign = [v for v in newer if not descends(store, v, base_version)]
        raise ResumeRefused(
            f"adapter store holds versions {foreign} that do not descend from checkpoint "
            f"version {base_version}; refusing to guess (move them aside or fix the state)"
        )
    foreign = [v for v in newer if v not in lineage]
    if foreign:
        raise ResumeRefused(
            f"adapter store holds versions {foreign} newer than checkpoint version "
            f"{base_version} that are not on the lineage of policy-v{candidate}; they do "
            "not descend from this learner's state, refusing to guess (move them aside)"
        )
    meta = store.read_meta(candidate)
    weights = store.path(candidate) / WEIGHTS_FILE
    # Checked as the checkpoint's own version is: damaged weights loaded here were trained
    # on and published as the next version under a fresh, correct sha256, so no later
    # check could see the damage (and a truncated file failed with a raw traceback).
    if not weights.is_file() or sha256_file(weights) != meta.get("weights_sha256"):
        found = "has no weights file for" if not weights.is_file() else "has weights unlike"
        raise ResumeRefused(
            f"adapter store's policy-v{candidate} {found} its recorded sha256; refusing to "
            "roll forward to it (move it aside, or restore it from a copy)"
        )
    log.warning("learner_roll_forward", checkpoint_version=base_version, adapter_version=candidate)
    # The checkpoint's Adam moments and scheduler step were accumulated on the weights of
    # its own (older) version; the store keeps no optimizer state for `candidate`. Moments
    # of other weights would scale the next updates by stale gradient statistics, so the
    # optimizer starts fresh on the rolled-forward weights.
    reason = f"rolled forward to policy-v{candidate}; the store holds no optimizer state for it"
    if checkpoint is not None:
        owner = optimizer_version_of(checkpoint)
        reason += (
            f" and the checkpoint's belongs to "
            f"{'an older adapter' if owner is None else f'policy-v{owner}'}"
        )
    step = meta.get("step")
    return ResumePlan(
        version=candidate,
        offsets=normalize_offsets(meta.get("consumed_offsets")),
        weights_from="adapter",
        republish=False,
        keep_optimizer=False,
        version_floor=max(
            int(meta.get("version_floor") or 0), checkpoint.version_floor if checkpoint else 0
        ),
        optimizer_reason=reason,
        step=int(step) if isinstance(step, int) else None,
    )


def raise_version_floor(floor: int, current: int, served: Iterable[str]) -> int:
    """The floor above which new versions are numbered, given the names in use: what vLLM
    serves now and what the proxy names (its aliases, canaries, rollback targets, history).

    Such a `policy-v<N>` newer than this learner's own version `current` is not ours (we
    publish before anything loads a version, and resume picks up what we published): it
    survives from a wiped or older state dir, or one whose newer directories were moved
    aside. Reusing its name would make vLLM answer "already loaded" and keep serving the old
    weights under it, or (vLLM restarted empty) let the reloader serve new, ungated weights
    behind an alias that targets the name, so numbering continues above the highest one.
    Names at or below `current` cannot clash."""
    foreign = [int(m.group(1)) for name in served if (m := _SERVED.fullmatch(name))]
    return max([floor, *(n for n in foreign if n > current)])


def _verify_checkpoint_version(checkpoint: Checkpoint, store: AdapterStore) -> None:
    """Refuse to continue when the stored `policy-v<N>` is not the checkpoint's version N
    (another learner's, or a damaged copy): it would be announced as ours."""
    version = checkpoint.version
    path = store.path(version)
    meta = store.read_meta(version)
    problems: list[str] = []
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        problems.append("no weights file")
    else:
        digest = sha256_file(weights)
        if digest != meta.get("weights_sha256"):
            problems.append("weights do not match their recorded sha256")
        # A rolled-forward checkpoint records the stored sha256; a trained one holds the
        # very tensors that were published.
        expected = (checkpoint.meta or {}).get("weights_sha256")
        if expected is not None:
            if digest != expected:
                problems.append("weights sha256 differs from the checkpoint's")
        elif not _same_tensors(weights, checkpoint.adapter_state):
            problems.append("weights differ from the checkpoint's")
    if checkpoint.meta is not None:
        ours, theirs = checkpoint.meta.get("parent_version"), meta.get("parent_version")
        if ours != theirs:
            problems.append(f"parent_version {theirs} != checkpoint's {ours}")
    if problems:
        raise ResumeRefused(
            f"adapter store's policy-v{version} is not the checkpoint's version {version} "
            f"({'; '.join(problems)}); refusing to start (move it aside or fix the state)"
        )


def _same_tensors(weights: Path, state: dict[str, torch.Tensor]) -> bool:
    try:
        stored = load_file(str(weights))
    except Exception as exc:  # unreadable: reported as a mismatch by the caller
        log.warning("adapter_weights_unreadable", path=str(weights), error=repr(exc))
        return False
    if stored.keys() != state.keys():
        return False
    return all(torch.equal(stored[k], state[k].to(stored[k].dtype)) for k in stored)
