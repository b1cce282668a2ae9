"""Worker for the 2-rank torchrun test: trains on this rank's partitions, dumps its weights."""

from __future__ import annotations

import sys
from pathlib import Path

from learner_sources import ListSource, synthetic_scored
from safetensors.torch import save_file

from learner.config import LearnerConfig
from learner.service import Learner


def main(state_dir: str, model_dir: str, out_dir: str) -> None:
    partitions = {p: [synthetic_scored(p * 100 + i) for i in range(8)] for p in range(2)}
    config = LearnerConfig(
        batch_size=8,
        min_batch=1,
        micro_batch_size=4,
        lr=1e-3,
        kl_coef=0.05,
        num_threads=1,
        progress_interval_s=60,
    )
    learner = Learner(
        config,
        state_dir,
        lambda offsets, rank, world: ListSource(partitions, offsets, rank, world),
        model_dir=model_dir,
    )
    summary = learner.run(max_steps=2)
    rank = learner.ctx.rank
    save_file(learner.trainer.adapter_state(), str(Path(out_dir) / f"rank{rank}.safetensors"))
    print(f"rank {rank}/{learner.ctx.world}: version {summary.version} steps {summary.steps}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
