"""Learner update-step throughput vs a bare PEFT loop, fp32 and bf16; adapter save cost.

Run: `python bench/bench_learner.py --model-dir DIR [--batch 8 --seq 256 --reps 3]`.
Both loops use the same model, LoRA config and batch shape (B sequences of L tokens; the
learner's samples are a 64-token prompt plus an (L-64)-token completion). The learner step
is end to end: batch assembly, reference logprobs (adapter disabled), forward, backward,
optimizer. The bare loop is a causal-LM loss over all tokens, forward + backward + AdamW.
Tokens/s counts all B·L tokens for both. FLOP fractions use 4·N·tokens (forward plus the
input-gradient backward through frozen weights) against a measured matmul peak.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig
from learner.objective import Sample
from learner.trainer import Trainer


def matmul_peak(dtype: torch.dtype, size: int = 2048, reps: int = 10) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    for _ in range(2):
        a @ b
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def bare_loop(model_dir: str, cfg: LearnerConfig, batch: int, seq: int, reps: int) -> list[float]:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(
        base,
        LoraConfig(
            r=cfg.lora_rank,
            lora_alpha=cfg.lora_alpha,
            target_modules=cfg.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr)
    ids = torch.randint(10, 40000, (batch, seq))
    autocast = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if cfg.dtype == "bf16"
        else contextlib.nullcontext()
    )
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
    return [batch * seq / t for t in times[1:]]  # first rep is warm-up


def learner_loop(
    model_dir: str, cfg: LearnerConfig, batch: int, seq: int, reps: int
) -> tuple[list[float], float, int]:
    trainer = Trainer(cfg, model_dir)
    gen = torch.Generator().manual_seed(0)
    prompt = 64
    samples = [
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
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        trainer.step(samples, current_version=0)
        times.append(time.perf_counter() - start)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        trainer.save_adapter_files(Path(tmp))
        save_s = time.perf_counter() - start
        size = sum(f.stat().st_size for f in Path(tmp).iterdir())
    return [batch * seq / t for t in times[1:]], save_s, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="docs/perf/learner.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    n_params = sum(
        p.numel() for p in AutoModelForCausalLM.from_pretrained(args.model_dir).parameters()
    )
    rows = []
    for dtype in ("fp32", "bf16"):
        cfg = LearnerConfig(dtype=dtype, micro_batch_size=args.batch, num_threads=args.threads)
        peak = matmul_peak(torch.float32 if dtype == "fp32" else torch.bfloat16)
        bare = statistics.median(bare_loop(args.model_dir, cfg, args.batch, args.seq, args.reps))
        runs, save_s, size = learner_loop(args.model_dir, cfg, args.batch, args.seq, args.reps)
        learn = statistics.median(runs)
        flops_per_token = 4 * n_params
        rows.append(
            (
                dtype,
                bare,
                learn,
                learn / bare,
                bare * flops_per_token / peak,
                learn * flops_per_token / peak,
                peak,
                save_s,
                size,
            )
        )
        print(
            f"{dtype}: bare {bare:.1f} tok/s, learner {learn:.1f} tok/s "
            f"({learn / bare:.2f}x), peak {peak / 1e9:.0f} GFLOP/s, "
            f"bare {rows[-1][4]:.1%} / learner {rows[-1][5]:.1%} of peak, "
            f"save {save_s:.3f} s {size / 1e6:.1f} MB",
            flush=True,
        )
    lines = [
        "## Learner update step",
        "",
        f"`python bench/bench_learner.py --batch {args.batch} --seq {args.seq} "
        f"--reps {args.reps}` (medians of {args.reps} steps after one warm-up; "
        f"torch threads {torch.get_num_threads()}; LoRA r16/α32 on q,k,v,o).",
        "",
        "| dtype | bare PEFT tok/s | learner step tok/s | learner/bare | bare % of peak "
        "| learner % of peak | matmul peak GFLOP/s | adapter save s | adapter MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dtype, bare, learn, ratio, fb, fl, peak, save_s, size in rows:
        lines.append(
            f"| {dtype} | {bare:.1f} | {learn:.1f} | {ratio:.2f} | {fb:.1%} | {fl:.1%} "
            f"| {peak / 1e9:.0f} | {save_s:.3f} | {size / 1e6:.1f} |"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
