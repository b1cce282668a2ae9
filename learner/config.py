"""Typed configuration of the learner (the `learner` section of the olp config).

Every field has a default so the embedded stack runs with no edits.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from safety.config import url_without_userinfo


class VerifierSpec(BaseModel):
    """One pluggable reward function, selected by import path (`module:function`)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    path: str = "learner.rewards.verifiers:exact_match"
    # A weighted mean of the parts: a negative weight took it outside the parts' range.
    weight: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    # Bounded: infinity, or past threading's TIMEOUT_MAX (~9.2e9 s), made every wait raise
    # OverflowError, which stopped the learner on the batch at each restart.
    timeout_s: float = Field(default=2.0, gt=0, le=86_400)
    params: dict[str, Any] = Field(default_factory=dict)
    tasks: list[str] | None = None  # only run on trajectories whose `task` is listed


class JudgeConfig(BaseModel):
    """The generative reward model: an LLM judge behind an OpenAI-compatible endpoint."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = False
    base_url: str | None = None  # None: the policy server the learner is told about
    # A SecretStr, so that `olp config show`, reprs and validation errors never print it.
    api_key: SecretStr = SecretStr("EMPTY")
    # On the policy's own vLLM (no base_url), "base" is the base model by whatever name
    # that server gives it (policy.served_model_name).
    model: str = Field(
        default="base",
        description="the judge's model; without base_url, `base` is the policy server's base "
        "model under its served name",
    )
    rubric: str = "The reply is correct, follows the user's instructions exactly, and is concise."
    timeout_s: float = Field(default=20.0, gt=0, le=86_400)  # see VerifierSpec.timeout_s
    retries: int = Field(default=1, ge=0)
    cache_size: int = Field(default=4096, ge=0)
    max_chars: int = Field(default=2000, gt=0)  # prompt/reply text shown to the judge
    rank_groups: bool = True  # ask for a relative ranking when a group has several replies
    concurrency: int = Field(default=4, ge=1)

    _no_credentials_in_url = url_without_userinfo(
        "base_url",
        "learner.rewards.judge.base_url",
        "`olp config show` and the learner's log would show",
        "the judge's key as learner.rewards.judge.api_key",
    )


class FeedbackValues(BaseModel):
    """Reward value of each explicit feedback kind (`score` passes its value through, clamped
    to [`score_min`, `score_max`])."""

    # NaN or infinity as a feedback value rewarded samples that were then dropped as
    # bad_reward, counted as rewarded.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    accept: float = 0.75
    reject: float = -0.25
    thumbs_up: float = 0.5
    thumbs_down: float = -0.5
    edit_kept: float = 0.5
    test_pass: float = 1.0
    test_fail: float = -0.5
    # One client's `score` must not outweigh everyone else's rewards: the bounds contain 0,
    # so they are ordered without a cross-field check.
    score_min: float = Field(
        -2.0, ge=-1e6, le=0, description="a lower `score` value counts as this (score_clamped)"
    )
    score_max: float = Field(
        2.0, ge=0, le=1e6, description="a higher `score` value counts as this (score_clamped)"
    )


class RewardWeights(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # 0 leaves a source out; a negative weight did the same without a word (the assembler
    # takes a source whose weight is above 0), so it is refused.
    feedback: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    verifiers: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    judge: float = Field(default=0.5, ge=0, allow_inf_nan=False)


class RewardConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    weights: RewardWeights = Field(default_factory=RewardWeights)
    feedback_values: FeedbackValues = Field(default_factory=FeedbackValues)
    verifiers: list[VerifierSpec] = Field(default_factory=list)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)


class CanaryConfig(BaseModel):
    """Live trial of a gated candidate on a share of training-enabled traffic (optional)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = Field(False, description="trial every gated candidate before full rollout")
    share: float = Field(
        0.1, gt=0, lt=1, description="share of training-enabled sessions sent to the candidate"
    )
    min_samples: int = Field(
        30,
        ge=1,
        description="replies (one per choice: n=2 gives two; and rewarded ones) needed on "
        "each arm to decide",
    )
    max_duration_s: float = Field(
        1800.0, gt=0, description="decide by `on_timeout` if the evidence is still short then"
    )
    reward_margin: float = Field(
        0.05, ge=0, description="roll back when the candidate's mean reward is lower by more"
    )
    guard_margin: float = Field(
        0.1,
        ge=0,
        description="roll back when a guard rate (degenerate, refusal, clarifying question, "
        "invalid tool call, unfinished: stopped or failed) is higher by more",
    )
    on_timeout: Literal["rollback", "promote"] = Field(
        "rollback", description="decision when max_duration_s passes without enough evidence"
    )
    poll_s: float = Field(2.0, gt=0, description="how often the evidence is re-checked")


class PromotionConfig(BaseModel):
    """How candidates reach users: gate, hot swap, what stays loaded (learner/promotion.py)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    alias: str = Field(
        "policy",
        description="the public alias a promotion flips; one of the proxy's aliases, else "
        "every candidate is skipped before its gate (`unknown_alias`)",
    )
    drain_s: float = Field(30.0, ge=0, description="wait before unloading a replaced version")
    keep_loaded: int = Field(
        2,
        ge=1,
        description="newest versions kept loaded in vLLM; routed versions and the proxy's "
        "rollback target stay loaded besides",
    )
    retain_dirs: int = Field(10, ge=1, description="adapter directories kept on disk")
    request_timeout_s: float = Field(60.0, gt=0)
    reload_check_s: float = Field(
        15.0,
        ge=0,
        description="how often every replica is checked for the versions the proxy routes to, "
        "and a missing one loaded again (a restarted vLLM serves only the base); 0 = never",
    )
    max_unanswered_gates: int | None = Field(
        8,
        ge=1,
        description="gate runs of one candidate in a row that vLLM (or the guard model) did "
        "not answer (5xx, timeouts) while the proxy and the adapter's load did, after which "
        "the candidate is rejected: its own requests may be what fails; each run before is "
        "deferred and retried after a backoff (10 s doubling to 300 s); null = retry for ever",
    )
    canary: CanaryConfig = Field(default_factory=CanaryConfig)


class LearnerConfig(BaseModel):
    """LoRA, objective, batching, checkpointing and reward settings of the learner."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enabled: bool = True
    base_model_dir: str | None = Field(
        default=None,
        description="the base model of a Learner embedded in Python (tests, notebooks); "
        "`olp` refuses it: `olp learner` and `olp up` train on `policy.model`, the model "
        "vLLM serves",
    )
    # LoRA
    lora_rank: int = Field(default=16, gt=0)
    lora_alpha: float = Field(
        default=32.0,
        gt=0,
        description="LoRA scaling (alpha / rank); fixed for a state dir once a version was "
        "trained: a change is refused at start-up, as one of lora_rank",
    )
    # Dropout of the LoRA layers while training. The learner computes π_θ and the reference
    # with dropout off (eval mode; gradients flow all the same): under dropout on-policy
    # tokens got ρ ≠ 1 and a KL to a reference equal to the policy. So this setting, like a
    # base model's own dropout, has no effect on the update; it stays for config files
    # that set it, and for the PEFT adapter_config.json it is written into.
    lora_dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    # optimisation
    lr: float = Field(default=5e-4, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    warmup_steps: int = Field(default=0, ge=0)
    dtype: Literal["fp32", "bf16"] = "fp32"
    grad_clip: float | None = Field(default=1.0, gt=0)
    micro_batch_size: int = Field(default=8, gt=0)
    updates_per_batch: int = Field(default=1, ge=1)  # optimizer steps on each batch
    seed: int = 0
    num_threads: int | None = Field(default=None, gt=0)  # torch CPU threads; None: default
    # batch trigger: a step when N ready, or T seconds passed with at least M
    batch_size: int = Field(default=32, gt=0)
    batch_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="train a batch of at least min_batch this long after its first "
        "trajectory arrived",
    )
    min_batch: int = Field(default=8, gt=0)
    # A learner slower than the traffic trains on the newest trajectories of what piled up
    # during its last step and counts the rest as `overflow` (never silently).
    max_batch: int = Field(default=128, gt=0)
    # objective
    # C in min(ρ, C): below 1 it would scale down on-policy tokens (ρ = 1) too, and with PPO
    # zero the gradient of every negative-advantage token at ρ = 1.
    importance_cap: float = Field(default=2.0, ge=1.0)
    ppo_clip_eps: float | None = Field(default=None, gt=0, lt=1)
    kl_coef: float = Field(default=0.02, ge=0)
    max_staleness: int = Field(default=4, ge=0)
    normalize_advantages: bool = True  # divide group advantages by the group's std
    baseline_decay: float = Field(default=0.9, ge=0, lt=1)
    # per-tenant / per-user shares of a batch: `safety.caps` (safety/config.py)
    # progress / bookkeeping
    progress_interval_s: float = Field(default=5.0, gt=0)
    max_event_ids_in_meta: int = Field(default=2048, ge=0)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    promotion: PromotionConfig = Field(default_factory=PromotionConfig)

    @model_validator(mode="after")
    def _min_batch_fits(self) -> LearnerConfig:
        if self.min_batch > self.batch_size:
            raise ValueError("min_batch must not exceed batch_size")
        if self.max_batch < self.batch_size:
            raise ValueError("max_batch must not be below batch_size")
        if self.ppo_clip_eps is not None and self.importance_cap <= 1 + self.ppo_clip_eps:
            # PPO's dual clip bounds a negative advantage's term at C·A: at C within the
            # clip range, a negative-advantage token above ρ = C had no gradient, inside
            # PPO's own trust region (at C = 1, about half the on-policy tokens).
            raise ValueError(
                f"importance_cap ({self.importance_cap:g}) must be above 1 + ppo_clip_eps "
                f"({1 + self.ppo_clip_eps:g}) when ppo_clip_eps is set"
            )
        return self

    def config_hash(self) -> str:
        """Stable hash of the settings that shape the weights (recorded in adapter metadata)."""
        payload = json.dumps(self.model_dump(mode="json"), sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()
