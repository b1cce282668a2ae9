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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch

from learner.adapter_store import AdapterStore

log = structlog.get_logger(__name__)

Offsets = dict[str, dict[int, int]]


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


def normalize_offsets(offsets: dict[Any, Any] | None) -> Offsets:
    """JSON round-trips turn partition numbers into strings; turn them back."""
    return {
        str(topic): {int(p): int(o) for p, o in parts.items()}
        for topic, parts in (offsets or {}).items()
    }


class CheckpointStore:
    """`<state_dir>/learner/checkpoint.pt` plus the tiny `announced.json` marker."""

    def __init__(self, state_dir: str | Path) -> None:
        self.dir = Path(state_dir) / "learner"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "checkpoint.pt"
        self.announced_path = self.dir / "announced.json"

    def save(self, checkpoint: Checkpoint) -> None:
        tmp = self.path.with_suffix(f".tmp-{os.getpid()}")
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

    def load(self) -> Checkpoint | None:
        if not self.path.exists():
            return None
        payload = torch.load(self.path, map_location="cpu", weights_only=False)
        payload["offsets"] = normalize_offsets(payload["offsets"])
        return Checkpoint(**payload)

    def announced(self) -> int:
        if not self.announced_path.exists():
            return 0
        return int(json.loads(self.announced_path.read_text())["version"])

    def mark_announced(self, version: int) -> None:
        tmp = self.announced_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": version}))
        os.replace(tmp, self.announced_path)


@dataclass
class ResumePlan:
    """What the learner does at start-up, decided from the checkpoint and the store."""

    version: int
    offsets: Offsets | None  # None: start of the stream
    weights_from: str  # "fresh" | "checkpoint" | "adapter"
    republish: bool  # the checkpoint's version is missing from the store
    keep_optimizer: bool


def resume_plan(checkpoint: Checkpoint | None, store: AdapterStore) -> ResumePlan:
    """Reconcile checkpoint and adapter store after any crash.

    - no checkpoint, no adapters: fresh start from the stream's beginning;
    - checkpoint at v, store lacks v (crash between checkpoint and publish): republish v;
    - store holds a version newer than the checkpoint that descends from it (a checkpoint
      lost or restored from backup): roll forward to that adapter and its recorded
      consumed offsets, so its batches are not trained twice;
    - otherwise: continue from the checkpoint.
    """
    versions = store.versions()
    base_version = checkpoint.version if checkpoint else 0
    newer = [v for v in versions if v > base_version]
    for candidate in reversed(newer):
        lineage = store.lineage(candidate)
        meta = store.read_meta(lineage[-1])
        root_parent = meta.get("parent_version") or 0
        if base_version in lineage or root_parent == base_version:
            offsets = normalize_offsets(store.read_meta(candidate).get("consumed_offsets"))
            log.warning(
                "learner_roll_forward",
                checkpoint_version=base_version,
                adapter_version=candidate,
            )
            return ResumePlan(
                version=candidate,
                offsets=offsets,
                weights_from="adapter",
                republish=False,
                keep_optimizer=checkpoint is not None,
            )
    if newer:
        raise RuntimeError(
            f"adapter store holds versions {newer} that do not descend from checkpoint "
            f"version {base_version}; refusing to guess (move them aside or fix the state)"
        )
    if checkpoint is None:
        return ResumePlan(0, None, "fresh", republish=False, keep_optimizer=False)
    return ResumePlan(
        version=checkpoint.version,
        offsets=checkpoint.offsets,
        weights_from="checkpoint",
        republish=checkpoint.version > 0 and checkpoint.version not in versions,
        keep_optimizer=True,
    )
