"""An identity of the base model the LoRA weights are trained on, recorded with them.

The adapter's files and the checkpoint name no base model: a state dir resumed on another
one (`policy.model` pointed at the base model in place of the instruct one, same shape)
trained on and published versions whose parents belong to another model, in silence. The
identity is read from the files, not the path (a model moved, or its cache rebuilt, is
the same model), and from samples of the weights rather than all of them: hashing a 7B
model's 14 GB at every start would take longer than loading it, and two fine-tunes of
one architecture differ throughout their weights, where the samples fall.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
_SAMPLES = 16  # spread evenly over each weight file
_SAMPLE_BYTES = 64 * 1024


def base_model_identity(model_dir: str | Path) -> str:
    """`sha256:<hex>` of the model's config.json and, per weight file (by name), its size
    and `_SAMPLES` slices of `_SAMPLE_BYTES` spread over it."""
    directory = Path(model_dir)
    digest = hashlib.sha256()
    config = directory / "config.json"
    digest.update(config.read_bytes() if config.is_file() else b"")
    weights = sorted(
        p for p in directory.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES)
    )
    for path in weights:
        size = path.stat().st_size
        digest.update(f"\0{path.name}\0{size}\0".encode())
        with path.open("rb") as handle:
            for i in range(_SAMPLES):
                handle.seek(max(0, (size - _SAMPLE_BYTES) * i // max(_SAMPLES - 1, 1)))
                digest.update(handle.read(_SAMPLE_BYTES))
    return f"sha256:{digest.hexdigest()}"
