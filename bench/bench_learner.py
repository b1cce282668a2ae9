"""Learner update-step throughput vs a bare PEFT loop, fp32 and bf16; adapter save cost.

Run: `python bench/bench_learner.py [--model-dir DIR] [--batch 8 --seq 256 --reps 5]
[--device auto|cpu|cuda]` (without --model-dir it uses the prepared model, as the tests do;
`auto` trains on the GPU where torch sees one, as the learner does).
All loops use the same model, LoRA config and batch shape (B sequences of L tokens; the
learner's samples are a 64-token prompt plus an (L-64)-token completion). The learner step
is end to end: batch assembly, reference logprobs (adapter disabled), forward, backward,
optimizer. The bare loop is a causal-LM loss over all tokens, forward + backward + AdamW,
with autocast over the fp32 model in bf16. A third loop is the learner step with
`kl_coef=0` (no reference pass), to show what the reference forward costs. The loops'
steps are interleaved (bare, learner, learner-no-KL, bare, ...) so load from other
processes on a shared machine hits all of them alike; figures are medians.
Tokens/s counts all B·L tokens for every loop. FLOP fractions use 4·N·tokens (forward plus
the input-gradient backward through frozen weights: the bare loop's work; the learner
does more, see the docs) against a measured matmul peak.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from generated_block import write_generated
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from deploy.model_prep import prepare_model
from learner.config import LearnerConfig
from learner.distributed import DistContext
from learner.objective import Sample
from learner.trainer import Trainer

SHIPPED_UPDATES = 2  # learner.updates_per_batch in deploy/default_config.yaml


def synchronize(device: torch.device) -> None:
    """A GPU runs its kernels after the call that queued them returns: wait for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(
    dtype: torch.dtype, shape: tuple[int, int, int], device: torch.device, reps: int = 20
) -> float:
    """Best-of-`reps` FLOP/s of one [m,k]@[k,n] matmul."""
    m, k, n = shape
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        times.append(time.perf_counter() - start)
    return 2 * m * k * n / min(times)


class BareLoop:
    """The floor: PEFT LoRA on the same base, causal-LM loss, AdamW, nothing else."""

    def __init__(
        self, model_dir: str, cfg: LearnerConfig, batch: int, seq: int, device: torch.device
    ) -> None:
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model = get_peft_model(
            base,
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                target_modules=list(cfg.target_modules),
                task_type="CAUSAL_LM",
            ),
        ).to(device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr)
        self.ids = torch.randint(10, 40000, (batch, seq)).to(device)
        self.bf16 = cfg.dtype == "bf16"
        self.device = device

    def step(self) -> None:
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.bf16
            else contextlib.nullcontext()
        )
        self.optimizer.zero_grad()
        with autocast:
            loss = self.model(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()


def make_samples(batch: int, seq: int, prompt: int = 64) -> list[Sample]:
    gen = torch.Generator().manual_seed(0)
    return [
        Sample(
            key=f"s{i}",
            event_id=f"e{i}",
            prompt_ids=torch.randint(10, 40000, (prompt,), generator=gen).tolist(),
            completion_ids=torch.randint(10, 40000, (seq - prompt,), generator=gen).tolist(),
            sampling_logprobs=[-3.0] * (seq - prompt),
            reward=float(i % 2),
            group="g",
            task="t",
            tenant="A",
            user=None,
            policy_version=0,
            advantage=1.0 if i % 2 else -1.0,
        )
        for i in range(batch)
    ]


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def run_dtype(model_dir: str, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    cfg = LearnerConfig(dtype=dtype, micro_batch_size=args.batch, num_threads=args.threads)
    load_before = os.getloadavg()[0]
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    device = args.device
    peak = matmul_peak(torch_dtype, (2048, 2048, 2048), device)
    peak_model = matmul_peak(torch_dtype, (args.batch * args.seq, 576, 1536), device)
    bare = BareLoop(model_dir, cfg, args.batch, args.seq, device)
    ctx = DistContext(0, 1, device)
    learner = Trainer(cfg, model_dir, ctx)
    no_kl = Trainer(cfg.model_copy(update={"kl_coef": 0.0}), model_dir, ctx)
    # The shipped config (deploy/default_config.yaml) takes 2 optimizer steps per batch,
    # which share one reference pass: its tokens/s counts each token once per update.
    two = Trainer(cfg.model_copy(update={"updates_per_batch": SHIPPED_UPDATES}), model_dir, ctx)
    samples = make_samples(args.batch, args.seq)
    loops: dict[str, Callable[[], object]] = {
        "bare": bare.step,
        "learner": lambda: learner.step(samples, current_version=0),
        "learner_no_kl": lambda: no_kl.step(samples, current_version=0),
        "learner_shipped": lambda: two.step(samples, current_version=0),
    }
    trained = {"learner_shipped": SHIPPED_UPDATES}
    times: dict[str, list[float]] = {name: [] for name in loops}
    for rep in range(args.reps + 1):
        for name, fn in loops.items():
            elapsed = timed(fn, device)
            if rep:  # the first round is warm-up
                times[name].append(elapsed)
        if rep:
            print(
                f"{dtype} round {rep}: " + ", ".join(f"{n} {t[-1]:.2f}s" for n, t in times.items()),
                flush=True,
            )
    saves = []
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            saves.append(timed(lambda tmp=tmp: learner.save_adapter_files(Path(tmp)), device))
            size = sum(f.stat().st_size for f in Path(tmp).iterdir())
    tokens = args.batch * args.seq
    return {
        "dtype": dtype,
        "peak": peak,
        "peak_model": peak_model,
        "tok_s": {n: trained.get(n, 1) * tokens / statistics.median(t) for n, t in times.items()},
        "spread": {
            n: (trained.get(n, 1) * tokens / max(t), trained.get(n, 1) * tokens / min(t))
            for n, t in times.items()
        },
        # learner/bare within each round (paired): steadier than a ratio of medians when
        # other processes' load changes between rounds
        "paired": statistics.median(
            b / a for a, b in zip(times["learner"], times["bare"], strict=True)
        ),
        "paired_shipped": statistics.median(
            SHIPPED_UPDATES * b / a
            for a, b in zip(times["learner_shipped"], times["bare"], strict=True)
        ),
        "save_s": statistics.median(saves),
        "size": size,
        "load": (load_before, os.getloadavg()[0]),
    }


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"the CPU ({torch.get_num_threads()} threads)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="docs/perf/learner.md")
    args = parser.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU here")
    args.device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    # Trainer.step flushes denormals; set the flag for the bare loop too, so every loop
    # runs under the same floating-point mode whatever order they run in.
    torch.set_flush_denormal(True)
    model_dir = args.model_dir or str(prepare_model().path)
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    flops_per_token = 4 * n_params
    cfg = LearnerConfig()
    rows = []
    for dtype in ("fp32", "bf16"):
        row = run_dtype(model_dir, dtype, args)
        rows.append(row)
        tok = row["tok_s"]
        print(
            f"{dtype}: bare {tok['bare']:.1f} tok/s, learner {tok['learner']:.1f} "
            f"({tok['learner'] / tok['bare']:.2f}x, paired {row['paired']:.2f}x), "
            f"no-KL {tok['learner_no_kl']:.1f}, "
            f"{SHIPPED_UPDATES} updates/batch {tok['learner_shipped']:.1f} "
            f"({tok['learner_shipped'] / tok['bare']:.2f}x), "
            f"peak {row['peak'] / 1e9:.0f} GFLOP/s, save {row['save_s']:.3f} s "
            f"{row['size'] / 1e6:.1f} MB, load {row['load'][0]:.2f}->{row['load'][1]:.2f}",
            flush=True,
        )
    lines = [
        "## Learner update step (bench/bench_learner.py)",
        "",
        f"`python bench/bench_learner.py --batch {args.batch} --seq {args.seq} "
        f"--reps {args.reps} --threads {args.threads} --device {args.device.type}` on "
        f"{device_name(args.device)}: {args.batch}×{args.seq} tokens per "
        "step (learner samples: 64-token prompt + completion), default LoRA config "
        f"(r{cfg.lora_rank}/α{cfg.lora_alpha:g} on {','.join(cfg.target_modules)}), "
        f"KL coefficient {cfg.kl_coef:g}; medians of "
        f"{args.reps} interleaved steps per loop after one warm-up round; tokens/s over all "
        f"tokens; % of peak = 4·N·tokens/s (N = {n_params / 1e6:.1f} M) over the "
        "2048³ matmul peak.",
        "",
        "| dtype | bare PEFT tok/s | learner tok/s | learner/bare (paired) "
        "| learner no-KL tok/s "
        f"| learner, {SHIPPED_UPDATES} updates/batch (shipped config) tok/s "
        "| its /bare (paired) "
        "| bare % of peak | learner % of peak | matmul peak GFLOP/s (2048³ / model shape) "
        "| adapter save s | adapter MB | load avg before→after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        tok = row["tok_s"]
        peak = row["peak"]
        lines.append(
            f"| {row['dtype']} | {tok['bare']:.1f} | {tok['learner']:.1f} "
            f"| {tok['learner'] / tok['bare']:.2f} ({row['paired']:.2f}) "
            f"| {tok['learner_no_kl']:.1f} "
            f"| {tok['learner_shipped']:.1f} "
            f"| {tok['learner_shipped'] / tok['bare']:.2f} ({row['paired_shipped']:.2f}) "
            f"| {tok['bare'] * flops_per_token / peak:.1%} "
            f"| {tok['learner'] * flops_per_token / peak:.1%} "
            f"| {peak / 1e9:.0f} / {row['peak_model'] / 1e9:.0f} | {row['save_s']:.3f} "
            f"| {row['size'] / 1e6:.1f} | {row['load'][0]:.2f}→{row['load'][1]:.2f} |"
        )
    lines.append("")
    lines.append(
        "Per-step range (slowest–fastest tok/s): "
        + "; ".join(
            f"{row['dtype']} "
            + ", ".join(f"{n} {lo:.0f}–{hi:.0f}" for n, (lo, hi) in row["spread"].items())
            for row in rows
        )
        + "."
    )
    out = Path(args.out)
    write_generated(out, "\n".join(lines) + "\n", "bench_learner.py")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
