"""torch.distributed plumbing: works unchanged in one process or under `torchrun`.

Ranks train on disjoint partitions; LoRA gradients are summed with one all-reduce per
update (the same collective DDP issues, done explicitly because ranks may hold different
numbers of micro-batches); rank 0 writes adapters and checkpoints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


# On GPU the group holds two backends, one per tensor device: NCCL carries the LoRA
# gradients (CUDA tensors), gloo the learner's flags and counts (CPU float64 tensors, built on
# every rank whatever the device) and the object collectives. NCCL alone is registered for
# CUDA only, so the first CPU all-reduce of the loop raised "No backend type associated with
# device type cpu" on every rank.
GPU_BACKEND = "cpu:gloo,cuda:nccl"


def init_distributed() -> DistContext:
    """Join the process group torchrun describes (gloo on CPU; on GPU, NCCL for CUDA
    tensors and gloo for CPU ones), if any."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world <= 1:
        return DistContext(0, 1, device)
    if not dist.is_initialized():
        dist.init_process_group(backend=GPU_BACKEND if device.type == "cuda" else "gloo")
    return DistContext(dist.get_rank(), dist.get_world_size(), device)


def all_reduce_sum(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    if ctx.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_reduce_max(ctx: DistContext, tensor: torch.Tensor) -> torch.Tensor:
    if ctx.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def broadcast_object(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's object on every rank."""
    if not ctx.enabled:
        return obj
    box = [obj if ctx.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(ctx: DistContext, obj: Any) -> list[Any]:
    if not ctx.enabled:
        return [obj]
    out: list[Any] = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def held_elsewhere(ctx: DistContext, keys: set[str]) -> frozenset[str]:
    """Collective: the `keys` of this rank that another rank holds too."""
    if not ctx.enabled:
        return frozenset()
    others: set[str] = set()
    for rank, theirs in enumerate(all_gather_object(ctx, sorted(keys))):
        if rank != ctx.rank:
            others.update(theirs)
    return frozenset(keys & others)


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()
