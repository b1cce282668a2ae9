"""PEFT LoRA policy and its update step (reference logprobs, forward, backward, optimizer)."""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from learner.config import LearnerConfig
from learner.distributed import DistContext, all_reduce_max, all_reduce_sum
from learner.objective import Sample, policy_loss

log = structlog.get_logger(__name__)


def padding_id(config: Any) -> int:
    """The id padding positions hold (masked out, so any id of the vocabulary does): the
    pad token, else the end-of-sequence token, the first one where a model lists several
    (Llama 3's `eos_token_id` is a list, which `int()` refused at start-up)."""
    for value in (config.pad_token_id, config.eos_token_id):
        if isinstance(value, list | tuple):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


class StepInterrupted(RuntimeError):
    """`stop` was set during a step: no version comes of it, and since offsets are only
    saved with a version, its batch is read again after the next start."""


@dataclass
class Batch:
    """Right-padded token batch aligned on next-token positions ([B, L-1] for per-token data)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor  # 1 where the position predicts a completion token
    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    on_policy: torch.Tensor  # 1 on the completion tokens of on-policy samples
    start: int  # first position that predicts a completion token (earlier ones are sliced off)


def build_batch(
    samples: list[Sample], current_version: int, pad_id: int, device: torch.device
) -> Batch:
    """Concatenate the exact recorded prompt and completion ids (never re-tokenised)."""
    length = max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    size = len(samples)
    input_ids = torch.full((size, length), pad_id, dtype=torch.long)
    attention = torch.zeros((size, length), dtype=torch.long)
    mask = torch.zeros((size, length - 1))
    mu = torch.zeros((size, length - 1))
    adv = torch.zeros((size, length - 1))
    on_policy = torch.zeros((size, length - 1))
    for row, sample in enumerate(samples):
        ids = sample.prompt_ids + sample.completion_ids
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention[row, : len(ids)] = 1
        start = len(sample.prompt_ids) - 1
        stop = start + len(sample.completion_ids)
        mask[row, start:stop] = 1
        mu[row, start:stop] = torch.tensor(sample.sampling_logprobs)
        adv[row, start:stop] = sample.advantage
        if sample.policy_version == current_version:
            on_policy[row, start:stop] = 1
    start = min(len(s.prompt_ids) for s in samples) - 1
    return Batch(
        input_ids.to(device),
        attention.to(device),
        mask[:, start:].to(device),
        mu[:, start:].to(device),
        adv[:, start:].to(device),
        on_policy[:, start:].to(device),
        start,
    )


class _TargetLogprob(torch.autograd.Function):
    """log_softmax(logits)[target] in fp32, row chunk by row chunk.

    Same value and gradient as `logits.float().gather(target) - logsumexp(logits.float())`
    but never holds an fp32 copy of the whole [N, V] logits, nor its softmax: the softmax is
    recomputed per chunk in the backward (g·(onehot − softmax)), so the vocabulary-sized
    tensors stay cache-sized and, in bf16, the only full-size tensors are bf16.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for i in range(0, logits.shape[0], chunk):
            lse[i : i + chunk] = torch.logsumexp(logits[i : i + chunk].float(), dim=-1)
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk = chunk
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets, lse = ctx.saved_tensors
        chunk = ctx.chunk
        out = torch.empty_like(logits)
        for i in range(0, logits.shape[0], chunk):
            g = grad[i : i + chunk].float().unsqueeze(-1)
            part = torch.exp(logits[i : i + chunk].float() - lse[i : i + chunk].unsqueeze(-1))
            part.mul_(-g)
            part.scatter_add_(-1, targets[i : i + chunk].unsqueeze(-1), g)
            out[i : i + chunk] = part
        return out, None, None


# Rows of the logits per chunk of `_TargetLogprob`. On a CPU, 16 rows (3 MB in fp32 for a
# 49k vocabulary) stay in cache. On a GPU a chunk that small is a few microseconds of work
# behind each of ~10 kernel launches: an update of 16x512 tokens launched ~18,000 kernels,
# 443 ms of CPU for 99 ms of GPU work, at 0.44x a bare PEFT loop (H200, bench_learner.py).
# There the chunk is bounded by memory instead: about 256 MiB of fp32 per chunk.
CPU_CHUNK_ROWS = 16
GPU_CHUNK_BYTES = 256 * 1024 * 1024


def chunk_rows(logits: torch.Tensor) -> int:
    """Rows per chunk for `_TargetLogprob` on `logits`' device."""
    if logits.device.type == "cpu":
        return CPU_CHUNK_ROWS
    return max(CPU_CHUNK_ROWS, GPU_CHUNK_BYTES // (4 * logits.shape[-1]))


def token_logprobs(model: Any, batch: Batch, chunk: int | None = None) -> torch.Tensor:
    """log π(token_{t+1} | tokens_≤t) in fp32 for positions ≥ batch.start, [B, L-1-start];
    0 where `batch.mask` is 0.

    Only the positions that predict a recorded completion token go through the LM head, each
    row's own: a hook on the output embeddings picks them out of the hidden states the model
    hands it (after `logits_to_keep` cut the positions before the first completion token of
    the micro-batch and the last, which predicts nothing recorded). The model's own
    post-processing of the logits (a scale, a soft cap) still applies. With only the
    micro-batch's range cut, a 16-token prompt beside a 1500-token one sent 3032 positions
    through the head for 64 completion tokens: 4.3 GB more memory and three times the time
    on SmolLM2, and an 8k-token agent prompt made ~13 GB of logits.
    """
    length = batch.input_ids.shape[1]
    keep = torch.arange(batch.start, length - 1, device=batch.input_ids.device)
    picked = batch.mask.nonzero(as_tuple=True)  # (row, column) of each completion token
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("the model has no output embeddings (LM head) to score tokens with")
    seen: list[tuple[int, ...]] = []

    def completion_positions(_: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]  # [B, L-1-start, H]: the positions `keep` names
        seen.append(tuple(hidden.shape[:2]))
        return (hidden[picked].unsqueeze(0), *args[1:])

    hook = head.register_forward_pre_hook(completion_positions)
    try:
        logits = model(
            input_ids=batch.input_ids, attention_mask=batch.attention_mask, logits_to_keep=keep
        ).logits
    finally:
        hook.remove()
    targets = batch.input_ids[:, batch.start + 1 :][picked]
    # A model that scores its logits otherwise (the head called twice, not at all, or on
    # other positions) would give logprobs of the wrong positions, in silence.
    if seen != [tuple(batch.mask.shape)] or logits.shape[-2] != targets.shape[0]:
        raise ValueError(
            "the model does not compute its logits with one call of its output embeddings on "
            f"the positions asked for (calls on {seen}, expected {[tuple(batch.mask.shape)]})"
        )
    flat_logits = logits.reshape(targets.shape[0], -1)
    chunk = chunk or chunk_rows(flat_logits)
    flat = _TargetLogprob.apply(flat_logits, targets, chunk)
    return flat.new_zeros(batch.mask.shape).index_put(picked, flat)


def store_frozen_linears_bf16(model: torch.nn.Module) -> None:
    """Keep every frozen Linear weight in bf16 (for the bf16 autocast path).

    Autocast casts a weight on every call unless it is a leaf that requires grad, so frozen
    base weights would be re-cast (fp32 read, bf16 write) in each forward. Casting them once
    gives the same numbers: autocast rounds to bf16 the same way. Norms and the embedding
    stay fp32; a tied LM head gets its own bf16 copy, so the embedding lookup stays fp32.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not module.weight.requires_grad:
            module.weight = torch.nn.Parameter(
                module.weight.detach().to(torch.bfloat16), requires_grad=False
            )


def reward_stats(count: float, total: float, squares: float) -> tuple[float, float]:
    """(mean, population std) of `count` rewards from their sum and sum of squares (sums
    that add up over ranks); (0, 0) for none."""
    n = max(count, 1.0)
    mean = total / n
    return mean, math.sqrt(max(squares / n - mean**2, 0.0))


class AdapterMismatch(ValueError):
    """Adapter weights (a checkpoint's, a stored version's) of another LoRA shape."""


def _to_cpu(value: Any) -> Any:
    """A state dict's tensors on the CPU (an optimizer's moments, before they are copied)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(v) for v in value)
    return value


class Trainer:
    """Owns the PEFT model, the optimizer and the scheduler; one `step` per batch."""

    def __init__(
        self, config: LearnerConfig, model_dir: str | Path, ctx: DistContext | None = None
    ) -> None:
        self.config = config
        self.ctx = ctx or DistContext()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        base.config.use_cache = False
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            bias="none",
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(base, lora).to(self.ctx.device)
        if config.dtype == "bf16":
            store_frozen_linears_bf16(self.model)
        self.pad_id = padding_id(base.config)
        # Token ids at or above this index no embedding row (samples_from_rewarded drops them).
        self.vocab_size: int = base.get_input_embeddings().num_embeddings
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params, lr=config.lr, weight_decay=config.weight_decay
        )
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

    # -- weights ----------------------------------------------------------------------------
    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.model).items()
        }

    def check_adapter_state(self, state: dict[str, torch.Tensor], source: str) -> None:
        """Raise AdapterMismatch, naming the settings, when `state` (from `source`) does not
        fit this model's LoRA: PEFT loads non-strictly, so a changed `target_modules` left
        the new modules untrained without a word, and a changed `lora_rank` failed with a
        bare size mismatch (or, first, the optimizer's "parameter group" error)."""
        ours = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(self.model).items()}
        theirs = {k: tuple(v.shape) for k, v in state.items()}
        missing = sorted(ours.keys() - theirs.keys())
        unexpected = sorted(theirs.keys() - ours.keys())
        resized = sorted(k for k in ours.keys() & theirs.keys() if ours[k] != theirs[k])
        if not (missing or unexpected or resized):
            return
        problems = []
        if resized:
            key = resized[0]
            problems.append(
                f"{len(resized)} tensors of another shape (e.g. {key}: {list(theirs[key])} "
                f"there, {list(ours[key])} here)"
            )
        if missing:
            problems.append(f"{len(missing)} tensors missing (e.g. {missing[0]})")
        if unexpected:
            problems.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[0]})")
        raise AdapterMismatch(
            f"{source} does not fit the configured LoRA adapter (learner.lora_rank="
            f"{self.config.lora_rank}, learner.target_modules={list(self.config.target_modules)}"
            f"): {'; '.join(problems)}. It was trained with other LoRA settings (set them "
            "back) or on another base model (policy.model), or start from an empty state_dir"
        )

    def restore_optimizer(
        self, optimizer_state: dict[str, Any], scheduler_state: dict[str, Any]
    ) -> dict[str, tuple[float, float]]:
        """Load a checkpoint's optimizer and scheduler, keeping their moments and step but
        taking `lr` and `weight_decay` from the config: the saved state carries the values
        it was made with, and an operator who lowered the learning rate of a diverging
        learner kept training at the old one. Returns what changed, {name: (was, now)}."""
        self.optimizer.load_state_dict(optimizer_state)
        self.scheduler.load_state_dict(scheduler_state)
        config = self.config
        changed: dict[str, tuple[float, float]] = {}
        for group, lr_lambda in zip(
            self.optimizer.param_groups, self.scheduler.lr_lambdas, strict=True
        ):
            for name, was, now in (
                ("lr", group.get("initial_lr", config.lr), config.lr),
                ("weight_decay", group["weight_decay"], config.weight_decay),
            ):
                if was != now:
                    changed[name] = (float(was), float(now))
            group["initial_lr"] = config.lr
            group["weight_decay"] = config.weight_decay
            group["lr"] = config.lr * lr_lambda(self.scheduler.last_epoch)
        self.scheduler.base_lrs = [config.lr] * len(self.optimizer.param_groups)
        return changed

    def snapshot(self) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """The weights, optimizer and scheduler as they are, copied to the CPU: what
        `rollback` puts back after a step that failed part way (an update may have been
        applied)."""
        optimizer = copy.deepcopy(_to_cpu(self.optimizer.state_dict()))
        return self.adapter_state(), optimizer, copy.deepcopy(self.scheduler.state_dict())

    def rollback(
        self, snapshot: tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]
    ) -> None:
        weights, optimizer, scheduler = snapshot
        set_peft_model_state_dict(self.model, weights)
        self.optimizer.load_state_dict(optimizer)
        self.scheduler.load_state_dict(scheduler)
        self.optimizer.zero_grad(set_to_none=True)

    def load_adapter_state(
        self, state: dict[str, torch.Tensor], source: str = "the adapter state"
    ) -> None:
        self.check_adapter_state(state, source)
        set_peft_model_state_dict(self.model, state)

    def load_adapter_dir(self, path: Path) -> None:
        self.load_adapter_state(load_file(str(path / "adapter_model.safetensors")), str(path))

    def save_adapter_files(self, path: Path) -> None:
        self.model.save_pretrained(str(path))

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.dtype == "bf16":
            return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # -- the update -------------------------------------------------------------------------
    def _raise_if_stopped(
        self, stop: threading.Event | None, update: int, *, collective: bool
    ) -> None:
        """Under torchrun every rank must leave at the same point (the gradient all-reduce
        waits for all of them): a collective check is one every rank makes, the same number
        of times (see `step`); a check that is not collective is skipped there."""
        if stop is None:
            return
        if self.ctx.enabled:
            if not collective:
                return
            flag = torch.tensor([float(stop.is_set())], dtype=torch.float64)
            stopped = bool(all_reduce_max(self.ctx, flag)[0] > 0)
        else:
            stopped = stop.is_set()
        if stopped:
            raise StepInterrupted(
                f"stopped in update {update + 1} of {self.config.updates_per_batch}"
            )

    def step(
        self,
        samples: list[Sample],
        current_version: int,
        stop: threading.Event | None = None,
    ) -> dict[str, float]:
        """Run `updates_per_batch` optimizer steps on this rank's samples (may be empty).

        Every rank must call it (the gradient all-reduce is collective). Returns metrics
        summed over ranks: loss parts, ratio, clipped fraction, KL, the trained samples'
        rewards (`trained_reward_mean`/`std`; the batch's `reward_mean` is the learner's),
        tokens, and `skipped_updates` (updates with no optimizer step: the first whose
        gradient was not finite, and every later one of the batch, which is not run: with
        the weights unchanged and no dropout it would compute the same gradient).
        Raises StepInterrupted once `stop` is set: a step runs for about a minute on a CPU,
        longer than a supervisor waits for a stopping learner before it kills it.
        """
        cfg = self.config
        if cfg.num_threads is not None:
            # OpenMP thread counts are per calling thread: set it where the step runs.
            torch.set_num_threads(cfg.num_threads)
        torch.set_flush_denormal(True)  # per-thread CPU flag; denormals stall fp32 math
        started = time.perf_counter()
        # Cut from the samples ordered by length: each micro-batch is padded to its longest
        # sample, and a short sample beside an 1,500-token one took that one's whole forward
        # (two such samples: 6.8 GB and 16.9 s together, 3.6 GB and 8.1 s apart, on
        # SmolLM2). The loss is a sum over tokens, so the order changes no gradient.
        ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + len(s.completion_ids))
        micro = [
            ordered[i : i + cfg.micro_batch_size]
            for i in range(0, len(ordered), cfg.micro_batch_size)
        ]
        batches = [build_batch(m, current_version, self.pad_id, self.ctx.device) for m in micro]
        local_tokens = sum(float(b.mask.sum()) for b in batches)
        totals = torch.tensor([local_tokens, float(len(samples))], dtype=torch.float64)
        all_reduce_sum(self.ctx, totals)
        global_tokens = float(totals[0])
        # Every rank checks for a stop between micro-batches as often as the rank with the
        # most: checked only at each update's start, a stop during the one update (the
        # default) let the step finish and publish a version after the stop, past the
        # 30 s torchrun and Kubernetes wait before they kill.
        micro_batches = torch.tensor([float(len(batches))], dtype=torch.float64)
        micro_batches = int(all_reduce_max(self.ctx, micro_batches)[0])
        # Dropout off in both passes (autograd works the same in eval mode): π_θ under
        # dropout (`lora_dropout`, or a base model's own) is not the policy that sampled μ
        # nor the one the reference is, so on-policy tokens got ρ ≠ 1, clipping and a KL
        # to a reference equal to the policy. No dropout also makes an update's gradient a
        # function of the weights alone (see the skipped updates below).
        self.model.eval()
        references: list[torch.Tensor | None] = []
        if cfg.kl_coef > 0:
            with torch.inference_mode(), self.model.disable_adapter(), self._autocast():
                refs = []
                for index, b in enumerate(batches):
                    if index:
                        self._raise_if_stopped(stop, 0, collective=False)
                    refs.append(token_logprobs(self.model, b))
            references = [r.clone() for r in refs]  # inference tensors → normal ones
        else:
            references = [None] * len(batches)
        keys = ["tokens", "ratio_sum", "clipped", "kl_sum", "pg_sum", "abs_logprob_diff_sum"]
        first: dict[str, float] = {}
        onpolicy = torch.zeros(5, dtype=torch.float64)  # tokens, Σratio, Σratio², Σ|Δ|, max|Δ|
        grad_norm = 0.0
        first_loss = last_loss = 0.0
        skipped = 0
        updates_run = 0
        reported = started
        for update in range(cfg.updates_per_batch):
            self._raise_if_stopped(stop, update, collective=True)
            updates_run += 1
            self.optimizer.zero_grad(set_to_none=False)
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            sums = torch.zeros(len(keys) + 1, dtype=torch.float64)
            for index in range(micro_batches):
                if index:
                    self._raise_if_stopped(stop, update, collective=True)
                if index >= len(batches):
                    continue  # this rank has fewer; it still joins every rank's stop check
                batch, ref = batches[index], references[index]
                now = time.perf_counter()
                if self.ctx.is_main and now - reported >= cfg.progress_interval_s:
                    # A step over a large batch runs for minutes on a CPU: say where it is.
                    reported = now
                    log.info(
                        "learner_step_progress",
                        update=update + 1,
                        updates=cfg.updates_per_batch,
                        micro_batch=index + 1,
                        micro_batches=len(batches),
                        tokens=int(global_tokens),
                        elapsed_s=round(now - started, 1),
                    )
                with self._autocast():
                    logp = token_logprobs(self.model, batch)
                loss, stats = policy_loss(
                    logp,
                    batch.sampling_logprobs,
                    ref,
                    batch.advantages,
                    batch.mask,
                    cfg.importance_cap,
                    cfg.ppo_clip_eps,
                    cfg.kl_coef,
                    max(global_tokens, 1.0),
                )
                loss.backward()
                sums[: len(keys)] += torch.tensor(
                    [float(stats[k]) for k in keys], dtype=torch.float64
                )
                sums[-1] += float(loss.detach())
                if update == 0:
                    with torch.no_grad():
                        delta = (logp.detach() - batch.sampling_logprobs) * batch.on_policy
                        ratio = torch.exp(delta) * batch.on_policy
                        onpolicy[0] += float(batch.on_policy.sum())
                        onpolicy[1] += float(ratio.sum())
                        onpolicy[2] += float((ratio**2).sum())
                        onpolicy[3] += float(delta.abs().sum())
                        onpolicy[4] = max(float(onpolicy[4]), float(delta.abs().max()))
            if self.ctx.enabled:
                flat = torch.cat([p.grad.reshape(-1) for p in self.params])
                all_reduce_sum(self.ctx, flat)
                offset = 0
                for p in self.params:
                    n = p.grad.numel()
                    p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                    offset += n
            all_reduce_sum(self.ctx, sums)
            if cfg.grad_clip is not None:
                norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            else:
                norm = float(torch.norm(torch.stack([p.grad.norm() for p in self.params])))
            last_loss = float(sums[-1])
            if update == 0:
                first = dict(zip(keys, sums[: len(keys)].tolist(), strict=True))
                first_loss = last_loss
            if not math.isfinite(norm):
                # Raising here stopped the learner before its checkpoint, so a restart read
                # the same batch and raised again, for ever. The norm is of the summed
                # gradient, the same on every rank, so every rank skips this update alike;
                # the optimizer's moments never see the non-finite values.
                # The weights, optimizer and scheduler are as they were, and dropout is off:
                # every later update would recompute this very gradient, so none is run
                # (each counts as skipped). The norm is global, so every rank stops here.
                skipped = cfg.updates_per_batch - update
                log.error(
                    "learner_nonfinite_gradient",
                    update=update + 1,
                    grad_norm=norm,
                    updates_not_run=cfg.updates_per_batch - update - 1,
                )
                self.optimizer.zero_grad(set_to_none=False)
                break
            grad_norm = norm  # of the last applied update (metadata stays valid JSON)
            self.optimizer.step()
            self.scheduler.step()
        all_reduce_sum(self.ctx, onpolicy[:4])
        all_reduce_max(self.ctx, onpolicy[4:])  # the largest |Δ| over every rank, not rank 0's
        rewards = torch.tensor(
            [sum(s.reward for s in samples), sum(s.reward**2 for s in samples)],
            dtype=torch.float64,
        )
        all_reduce_sum(self.ctx, rewards)
        tokens = max(first.get("tokens", 0.0), 1.0)
        trained_reward = reward_stats(float(totals[1]), float(rewards[0]), float(rewards[1]))
        on_tokens = float(onpolicy[0])
        on_mean = float(onpolicy[1]) / on_tokens if on_tokens else float("nan")
        elapsed = time.perf_counter() - started
        return {
            "samples": float(totals[1]),
            "tokens": first.get("tokens", 0.0),
            # Of the first update, as pg_loss and kl are (the batch as it was sampled); it
            # was the last update's, beside the others' first-update figures.
            "loss": first_loss,
            "loss_last_update": last_loss,  # the same as `loss` with updates_per_batch 1
            "pg_loss": first.get("pg_sum", 0.0) / tokens,
            # Not measured without a KL term (no reference pass): NaN, not a zero drift.
            "kl": first.get("kl_sum", 0.0) / tokens if cfg.kl_coef > 0 else float("nan"),
            "kl_loss": cfg.kl_coef * first.get("kl_sum", 0.0) / tokens,
            "ratio_mean": first.get("ratio_sum", 0.0) / tokens,
            "clipped_fraction": first.get("clipped", 0.0) / tokens,
            # Of the samples trained on only (after zero-advantage groups, first samples of
            # a task and caps were dropped): not the batch's reward, which the learner adds.
            "trained_reward_mean": trained_reward[0],
            "trained_reward_std": trained_reward[1],
            "grad_norm": grad_norm,
            "onpolicy_tokens": on_tokens,
            "onpolicy_ratio_mean": on_mean,
            "onpolicy_ratio_std": (
                math.sqrt(max(float(onpolicy[2]) / on_tokens - on_mean**2, 0.0))
                if on_tokens
                else float("nan")
            ),
            "onpolicy_abs_logprob_diff": float(onpolicy[3]) / on_tokens
            if on_tokens
            else float("nan"),
            "onpolicy_max_abs_logprob_diff": float(onpolicy[4]),
            "skipped_updates": float(skipped),  # non-finite gradient: no optimizer step
            "seconds": elapsed,
            "tokens_per_s": global_tokens * updates_run / elapsed if elapsed else 0.0,
        }
