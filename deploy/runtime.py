"""Resolve what the configuration names into things on disk."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from deploy.config import BUILTIN_MODEL, ConfigError, PolicyConfig
from deploy.model_prep import prepare_model


def resolve_model_dir(cfg: PolicyConfig, progress: Callable[[str], None] | None = None) -> Path:
    """The built-in model is prepared (once, cached); anything else must be a local HF dir."""
    if cfg.model == BUILTIN_MODEL:
        if progress:
            progress("preparing the built-in model (cached after the first run)")
        return prepare_model().path
    path = Path(cfg.model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"policy.model: {cfg.model!r} is neither {BUILTIN_MODEL!r} nor a local Hugging Face "
            "model directory (no config.json there); olp never downloads from model hubs"
        )
    return path
