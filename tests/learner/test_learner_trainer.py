"""Trainer and start-up behaviour on a tiny random Llama (seconds, no prepared model): LoRA
settings that do not fit a checkpoint, non-finite gradients, progress inside a long step,
leftovers of interrupted checkpoint saves, a damaged checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from structlog.testing import capture_logs

from learner.adapter_store import AdapterStore
from learner.checkpoint import CheckpointStore, ResumeRefused
from learner.config import LearnerConfig
from learner.objective import Sample
from learner.service import Learner
from learner.trainer import AdapterMismatch, Trainer
from tests.learner.learner_sources import ListSource, synthetic_scored

RECORDS = [synthetic_scored(i) for i in range(8)]


def config(**changes: Any) -> LearnerConfig:
    settings: dict[str, Any] = dict(
        batch_size=4,
        min_batch=1,
        micro_batch_size=2,
        lr=1e-3,
        kl_coef=0.05,
        max_staleness=100,
        progress_interval_s=60,
        lora_rank=4,
        lora_alpha=8,
    )
    return LearnerConfig(**{**settings, **changes})


def samples(n: int = 4, advantage: float = 1.0) -> list[Sample]:
    return [
        Sample(
            key=f"t{i}:0",
            event_id=f"e{i}",
            prompt_ids=[10 + i, 11, 12],
            completion_ids=[20 + i, 21],
            sampling_logprobs=[-6.0, -6.0],
            reward=float(i % 2),
            group=None,
            task="t",
            tenant="A",
            user=None,
            policy_version=0,
            advantage=advantage if i % 2 else -advantage,
        )
        for i in range(n)
    ]


def learner(state: Path, model: Path, **changes: Any) -> Learner:
    return Learner(
        config(**changes),
        state,
        lambda offsets, rank, world: ListSource({0: RECORDS}, offsets),
        model_dir=model,
    )


# -- LoRA settings that do not fit the weights resumed from -----------------------------------


def test_an_adapter_of_another_lora_shape_is_refused_naming_the_settings(tiny_model: Path):
    """A changed lora_rank failed with PEFT's bare size mismatch; a changed target_modules
    loaded what matched and left the new modules untrained without a word."""
    state = Trainer(config(lora_rank=4), tiny_model).adapter_state()
    with pytest.raises(AdapterMismatch, match=r"learner\.lora_rank=8.*another shape"):
        Trainer(config(lora_rank=8), tiny_model).load_adapter_state(state, "checkpoint X")
    wider = Trainer(
        config(target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]), tiny_model
    )
    with pytest.raises(AdapterMismatch, match=r"checkpoint X .*tensors missing.*up_proj"):
        wider.load_adapter_state(state, "checkpoint X")
    Trainer(config(lora_rank=4), tiny_model).load_adapter_state(state)  # same settings: fine


def test_resume_with_another_lora_rank_names_the_setting(tiny_model: Path, tmp_path: Path):
    """Before, start-up died in the optimizer's load_state_dict ("loaded state dict
    contains a parameter group that doesn't match the size of optimizer's group")."""
    learner(tmp_path, tiny_model).run(max_steps=1)
    with pytest.raises(AdapterMismatch, match=r"checkpoint .*checkpoint\.pt.*lora_rank=8"):
        learner(tmp_path, tiny_model, lora_rank=8)


def test_a_resume_takes_lr_and_weight_decay_from_the_config(tiny_model: Path, tmp_path: Path):
    """The checkpoint's optimizer state carried the lr and weight decay it was made with: a
    learner restarted with a lower lr (a diverging run) trained on at the old one."""
    learner(tmp_path, tiny_model, lr=5e-4, weight_decay=0.0, warmup_steps=4).run(max_steps=1)
    with capture_logs() as logs:
        resumed = learner(tmp_path, tiny_model, lr=1e-6, weight_decay=0.1, warmup_steps=4)
    trainer = resumed.trainer
    assert trainer.scheduler.last_epoch == 1  # the warm-up goes on where it was
    assert trainer.optimizer.state_dict()["state"] != {}  # the moments are kept
    for group in trainer.optimizer.param_groups:
        assert group["lr"] == pytest.approx(1e-6 * 2 / 4)
        assert group["weight_decay"] == 0.1
    trainer.scheduler.step()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-6 * 3 / 4)
    changed = {
        e["setting"]: (e["was"], e["now"])
        for e in logs
        if e["event"] == "learner_optimizer_setting_changed"
    }
    assert changed == {"lr": (5e-4, 1e-6), "weight_decay": (0.0, 0.1)}
    config_changed = [e for e in logs if e["event"] == "learner_config_changed"]
    assert [e["now"] for e in config_changed] == [resumed.config.config_hash()]
    assert config_changed[0]["was"] != config_changed[0]["now"]
    with capture_logs() as logs:  # the same settings again: nothing to say
        learner(tmp_path, tiny_model, lr=5e-4, weight_decay=0.0, warmup_steps=4)
    assert not [e for e in logs if e["event"].endswith("changed")]


def test_olp_meta_is_strict_json_with_null_for_what_was_not_measured(
    tiny_model: Path, tmp_path: Path
):
    """NaN (on-policy ratios of a batch with no on-policy token, the usual case) made
    olp_meta.json a file no strict JSON reader takes; and without a KL term the KL was
    reported as 0.0 however far the adapter had moved."""
    # Version 2 trains on records the base served: none of its tokens is on-policy.
    assert learner(tmp_path, tiny_model, kl_coef=0.0).run(max_steps=2).version == 2

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} in olp_meta.json")

    text = (AdapterStore(tmp_path).path(2) / "olp_meta.json").read_text()
    metrics = json.loads(text, parse_constant=refuse)["step_metrics"]
    assert metrics["kl"] is None and metrics["kl_loss"] == 0.0
    assert metrics["onpolicy_tokens"] == 0.0 and metrics["onpolicy_ratio_mean"] is None
    assert isinstance(metrics["loss"], float) and isinstance(metrics["grad_norm"], float)


# -- non-finite gradients ----------------------------------------------------------------------


def test_the_loss_is_the_first_updates_like_the_other_figures(tiny_model: Path):
    """With several updates per batch, `loss` was the last update's while pg_loss, kl and
    the rest were the first's: they did not add up."""
    # PPO mode: its pg_loss is the loss term itself (the default importance-weighted
    # surrogate reports -ρ·A, not the -ρ·A·log π it differentiates).
    trainer = Trainer(config(updates_per_batch=3, lr=0.05, ppo_clip_eps=0.2), tiny_model)
    metrics = trainer.step(samples(), current_version=0)
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] + metrics["kl_loss"], rel=1e-6)
    assert metrics["loss_last_update"] != pytest.approx(metrics["loss"], rel=1e-6)
    single = Trainer(config(updates_per_batch=1), tiny_model).step(samples(), current_version=0)
    assert single["loss_last_update"] == single["loss"]


def test_a_non_finite_gradient_skips_the_update_instead_of_raising(tiny_model: Path):
    trainer = Trainer(config(updates_per_batch=2), tiny_model)
    before = trainer.adapter_state()
    metrics = trainer.step(samples(advantage=math.inf), current_version=0)
    assert metrics["skipped_updates"] == 2
    after = trainer.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing applied
    assert trainer.optimizer.state_dict()["state"] == {}  # moments untouched
    assert trainer.step(samples(), current_version=0)["skipped_updates"] == 0


def test_a_batch_with_non_finite_gradients_is_consumed_not_retried_for_ever(
    tiny_model: Path, tmp_path: Path
):
    """The step raised before the checkpoint: every restart read the same batch again."""
    first = learner(tmp_path, tiny_model)
    real_step = first.trainer.step

    def poisoned(batch: list[Sample], version: int, stop: object = None) -> dict[str, float]:
        for sample in batch:
            sample.advantage = math.inf
        return real_step(batch, version, stop)

    first.trainer.step = poisoned  # type: ignore[method-assign]
    summary = first.run(max_steps=1)
    assert summary.version == 0 and summary.steps == 0
    assert summary.counts["nonfinite_gradient"] == summary.counts["trained_samples"] > 0
    assert AdapterStore(tmp_path).versions() == []
    resumed = learner(tmp_path, tiny_model)
    assert resumed.offsets == {"mem.trajectories": {0: 4}}  # past the poisoned batch
    assert resumed.run(max_steps=1).version == 1


def test_a_non_finite_update_is_not_run_again_on_the_same_weights(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
):
    """A skipped update leaves the weights as they were and dropout is off: every further
    update of the batch recomputed the very same non-finite gradient (4 updates: 4 full
    forward and backward passes for nothing)."""
    import learner.trainer as trainer_module

    real_loss = trainer_module.policy_loss
    calls: list[int] = []
    poisoned_from = 0  # the first policy_loss call whose loss is not finite

    def counted(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        calls.append(1)
        loss, stats = real_loss(*args, **kwargs)
        return (loss * math.inf if len(calls) > poisoned_from else loss), stats

    monkeypatch.setattr(trainer_module, "policy_loss", counted)
    trainer = Trainer(config(updates_per_batch=4, micro_batch_size=2), tiny_model)
    before = trainer.adapter_state()
    metrics = trainer.step(samples(4), current_version=0)  # 2 micro-batches an update
    assert len(calls) == 2 and metrics["skipped_updates"] == 4
    after = trainer.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # The first update applied, the second not finite: the third and fourth are not run.
    calls.clear()
    poisoned_from = 2
    metrics = trainer.step(samples(4), current_version=0)
    assert len(calls) == 4 and metrics["skipped_updates"] == 3
    assert trainer.scheduler.last_epoch == 1  # one optimizer step, the first update's


def _dropout_model(path: Path) -> Path:
    """The tiny Llama with attention dropout in its config (GPT-2- or OPT-style models
    ship with some)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=1, attention_dropout=0.3,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _on_policy(trainer: Trainer, batch: list[Sample]) -> list[Sample]:
    """`batch` with the sampling logprobs the current policy gives, without dropout (what
    vLLM records for the version it serves)."""
    from learner.trainer import build_batch, token_logprobs

    trainer.model.eval()
    with torch.no_grad():
        for sample in batch:
            b = build_batch([sample], 0, trainer.pad_id, torch.device("cpu"))
            sample.sampling_logprobs = token_logprobs(trainer.model, b)[0][b.mask[0] > 0].tolist()
    return batch


def test_both_passes_run_without_dropout(tmp_path: Path):
    """In train mode dropout (`lora_dropout`, a base model's own) was on in the policy and
    the reference passes: on-policy tokens, recorded by the very policy trained, got ρ ≠ 1,
    and the KL to a reference equal to the policy was not 0."""
    model = _dropout_model(tmp_path / "model")
    settings = dict(lora_dropout=0.3, kl_coef=0.1, lr=1e-30, micro_batch_size=4)
    trainer = Trainer(config(**settings), model)
    # A fresh adapter (lora_B = 0) is the reference itself: the KL is 0 but for dropout.
    metrics = trainer.step(_on_policy(trainer, samples(4)), current_version=0)
    assert metrics["kl"] == pytest.approx(0.0, abs=1e-9)
    assert metrics["onpolicy_max_abs_logprob_diff"] == pytest.approx(0.0, abs=1e-5)
    # A trained adapter: LoRA's own dropout acts too.
    with torch.no_grad():
        for name, parameter in trainer.model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.3)
    metrics = trainer.step(_on_policy(trainer, samples(4)), current_version=0)
    assert metrics["onpolicy_tokens"] == 8
    assert metrics["onpolicy_max_abs_logprob_diff"] == pytest.approx(0.0, abs=1e-5)
    assert metrics["onpolicy_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clipped_fraction"] == 0.0


# -- the batch's reward ------------------------------------------------------------------------


def _scored(index: int, scores: tuple[float, float]) -> dict[str, Any]:
    """A record of two replies (a GRPO group) with these scores."""
    item = synthetic_scored(index)
    for event, score in zip(item["feedback"], scores, strict=True):
        event["value"] = score
    return item


@pytest.mark.parametrize(
    ("others", "expected"), [((1.0, 1.0), 7 / 8), ((0.0, 0.0), 1 / 8)], ids=["up", "down"]
)
def test_reward_mean_is_the_batchs_not_only_the_trained_samples(
    tiny_model: Path, tmp_path: Path, others: tuple[float, float], expected: float
):
    """The reward was averaged over the trained samples: groups all correct (an improving
    policy) or all wrong (a collapsing one) carry no advantage and are not trained, so both
    reported the one mixed group's 0.5, in the progress line's trend and the operator
    page's chart alike."""
    records = [_scored(0, (1.0, 0.0))] + [_scored(i, others) for i in range(1, 4)]
    run = Learner(
        config(kl_coef=0.0),
        tmp_path,
        lambda offsets, rank, world: ListSource({0: records}, offsets),
        model_dir=tiny_model,
    )
    summary = run.run(max_steps=1)
    [metrics] = summary.history
    assert metrics["reward_mean"] == pytest.approx(expected)
    assert metrics["samples"] == 2 and metrics["reward_samples"] == 8
    assert metrics["reward_std"] == pytest.approx(math.sqrt(expected - expected**2))
    assert metrics["trained_reward_mean"] == pytest.approx(0.5)
    assert metrics["trained_reward_std"] == pytest.approx(0.5)
    assert list(run.progress.rewards) == [pytest.approx(expected)]
    meta = AdapterStore(tmp_path).read_meta(1)["step_metrics"]
    assert meta["reward_mean"] == pytest.approx(expected)


def test_a_batch_whose_groups_all_scored_alike_still_puts_its_reward_in_the_trend(
    tiny_model: Path, tmp_path: Path
):
    """Every group all correct: no advantage, nothing trains, no step. Its reward never
    reached the progress line's trend, so a policy that got everything right was a gap
    there instead of its best point."""
    records = [_scored(i, (1.0, 1.0)) for i in range(4)]
    run = Learner(
        config(kl_coef=0.0),
        tmp_path,
        lambda offsets, rank, world: ListSource({0: records}, offsets),
        model_dir=tiny_model,
    )
    with capture_logs() as logs:
        summary = run.run(max_steps=1)
    assert summary.history == [] and AdapterStore(tmp_path).versions() == []
    assert list(run.progress.rewards) == [pytest.approx(1.0)]
    [skipped] = [entry for entry in logs if entry["event"] == "learner_batch_skipped"]
    assert skipped["reward_mean"] == pytest.approx(1.0)


# -- progress inside a long step ---------------------------------------------------------------


def test_a_long_step_reports_its_progress(tiny_model: Path):
    trainer = Trainer(config(progress_interval_s=1e-9, updates_per_batch=2), tiny_model)
    with capture_logs() as logs:
        trainer.step(samples(6), current_version=0)
    progress = [e for e in logs if e["event"] == "learner_step_progress"]
    assert [(e["update"], e["micro_batch"]) for e in progress] == [
        (u, m) for u in (1, 2) for m in (1, 2, 3)
    ]
    assert progress[0]["micro_batches"] == 3 and progress[0]["tokens"] == 12


# -- checkpoint files --------------------------------------------------------------------------


def test_leftovers_of_interrupted_checkpoint_saves_are_removed(tiny_model: Path, tmp_path: Path):
    store = CheckpointStore(tmp_path)
    leftovers = [store.dir / "checkpoint.tmp-999999", store.dir / "announced.tmp"]
    for path in leftovers:
        path.write_bytes(b"x" * 1024)
    keep = store.dir / "notes.txt"
    keep.write_text("operator's")
    learner(tmp_path, tiny_model)
    assert not any(path.exists() for path in leftovers) and keep.exists()


def test_a_damaged_checkpoint_is_refused_with_what_to_do(tmp_path: Path):
    store = CheckpointStore(tmp_path)
    store.path.write_bytes(b"not a checkpoint")
    with pytest.raises(ResumeRefused, match=r"cannot read the learner checkpoint .*Move it"):
        store.load()


def test_padding_id_takes_the_first_of_several_end_tokens() -> None:
    from types import SimpleNamespace

    from learner.trainer import padding_id

    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=[128001, 128009])) == 128001
    assert padding_id(SimpleNamespace(pad_token_id=7, eos_token_id=2)) == 7
    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=2)) == 2
    assert padding_id(SimpleNamespace(pad_token_id=None, eos_token_id=[])) == 0


def test_a_learner_ahead_of_what_serves_says_so_once(tiny_model: Path, tmp_path: Path) -> None:
    """Served by the base (promotion off, candidates rejected, a rollback): once the learner
    is more than max_staleness versions ahead, every batch is stale and nothing trains
    again, and the only sign was a growing `stale` count. It says so, once per version."""
    records = [synthetic_scored(i) for i in range(20)]
    config = LearnerConfig(
        batch_size=4, min_batch=1, micro_batch_size=4, max_staleness=1,
        lora_rank=4, lora_alpha=8, kl_coef=0.0, progress_interval_s=600,
    )  # fmt: skip
    learner = Learner(
        config, tmp_path, lambda o, r, w: ListSource({0: records}, o), model_dir=tiny_model
    )
    try:
        with capture_logs() as logs:
            for _ in range(5):
                learner._step(learner.consumer.poll(0))
    finally:
        learner.close()
    assert learner.version == 2 and learner.counts["stale"] > 0
    [warning] = [e for e in logs if e["event"] == "learner_ahead_of_serving"]
    assert warning["log_level"] == "error" and warning["version"] == 2
    assert warning["newest_served"] == 0 and "max_staleness" in warning["remedy"]


@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
def test_chunked_target_logprob_matches_the_plain_formula(chunk: int) -> None:
    """The chunked log-softmax-gather gives the value and gradient of the plain one whatever
    the chunk (the GPU's chunks are far larger than the CPU's)."""
    from learner.trainer import _TargetLogprob

    torch.manual_seed(0)
    logits = torch.randn(37, 50, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    weights = torch.randn(37, dtype=torch.float64)
    plain = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)
    (expected,) = torch.autograd.grad((plain * weights).sum(), logits)
    chunked = _TargetLogprob.apply(logits, targets, chunk)
    (got,) = torch.autograd.grad((chunked * weights.float()).sum(), logits)
    assert torch.allclose(chunked.double(), plain, atol=1e-5)
    assert torch.allclose(got, expected, atol=1e-5)


def test_chunks_are_cache_sized_on_a_cpu_and_memory_sized_elsewhere() -> None:
    from learner.trainer import CPU_CHUNK_ROWS, GPU_CHUNK_BYTES, chunk_rows

    assert chunk_rows(torch.empty(4096, 49152)) == CPU_CHUNK_ROWS == 16
    on_gpu = chunk_rows(torch.empty(4096, 49152, device="meta"))  # any device but the CPU
    assert on_gpu == GPU_CHUNK_BYTES // (4 * 49152) == 1365
    assert chunk_rows(torch.empty(8, 10_000_000, device="meta")) == CPU_CHUNK_ROWS


def test_only_each_rows_completion_positions_reach_the_lm_head() -> None:
    """A short prompt beside a long one in a micro-batch sent every position after the
    short prompt through the LM head, the long prompt's included (47x the rows on SmolLM2,
    4.3 GB more memory); each row's completion positions alone give the same logprobs."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.trainer import build_batch, token_logprobs

    config = LlamaConfig(
        vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    short, long = samples(2)
    long.prompt_ids = list(range(100, 160))  # 60 tokens against 3
    long.completion_ids = [30, 31, 32]
    long.sampling_logprobs = [-6.0] * 3
    rows_in: list[int] = []
    model.lm_head.register_forward_hook(lambda _, args, out: rows_in.append(args[0].shape[-2]))
    cpu = torch.device("cpu")
    with torch.no_grad():
        together = build_batch([short, long], 0, 0, cpu)
        both = token_logprobs(model, together)
        alone = [token_logprobs(model, build_batch([s], 0, 0, cpu)) for s in (short, long)]
    assert rows_in[0] == 5  # 2 + 3 completion tokens, not 62 positions per row
    for row, single in enumerate(alone):
        got = both[row][together.mask[row] > 0]
        assert torch.allclose(got, single[0], atol=1e-5), (got, single)
    assert (both[together.mask == 0] == 0).all()


def test_a_model_whose_logits_do_not_come_from_its_output_embeddings_is_refused() -> None:
    """The positions are picked in a hook on the output embeddings: a model that computes
    its logits otherwise would give the logprobs of other positions, in silence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from learner.trainer import build_batch, token_logprobs

    config = LlamaConfig(
        vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    batch = build_batch(samples(2), 0, 0, torch.device("cpu"))
    unused = torch.nn.Linear(32, 600)  # never called by the model's forward
    model.get_output_embeddings = lambda: unused  # type: ignore[method-assign]
    with torch.no_grad(), pytest.raises(ValueError, match="one call of its output embeddings"):
        token_logprobs(model, batch)
    model.get_output_embeddings = lambda: None  # type: ignore[method-assign]
    with torch.no_grad(), pytest.raises(ValueError, match="no output embeddings"):
        token_logprobs(model, batch)


def test_micro_batches_are_cut_from_samples_ordered_by_length(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each micro-batch is padded to its longest sample: a short sample beside a long one
    took the long one's whole forward (6.8 GB and 16.9 s for two such on SmolLM2, 3.6 GB and
    8.1 s apart)."""
    import learner.trainer as trainer_module

    model = _dropout_model(tmp_path / "model")
    trainer = Trainer(config(micro_batch_size=2, kl_coef=0.0), model)
    mixed = samples(4)
    for sample, extra in zip(mixed, (30, 0, 30, 0), strict=True):
        sample.prompt_ids = sample.prompt_ids + [13] * extra
    widths: list[int] = []
    build = trainer_module.build_batch

    def noting(micro: list[Sample], *args: Any) -> Any:
        widths.append(max(len(s.prompt_ids) for s in micro))
        return build(micro, *args)

    monkeypatch.setattr(trainer_module, "build_batch", noting)
    trainer.step(mixed, current_version=0)
    assert widths == [3, 33]  # the two short together, the two long together
