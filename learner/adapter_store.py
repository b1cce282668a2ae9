"""Immutable, versioned adapter directories: `<state_dir>/adapters/policy-v<N>/`.

Each version holds the PEFT files plus `olp_meta.json` (version, parent_version,
consumed_offsets, config_hash, step_metrics, data_stats, weights_sha256, gate). A version
is written under a temporary name in the same folder and renamed atomically; an existing
version is never overwritten.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

META_FILE = "olp_meta.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"^policy-v(\d+)$")


class AdapterExistsError(FileExistsError):
    """A version directory already exists; versions are never overwritten."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class AdapterStore:
    """List, read and publish adapter versions under `<state_dir>/adapters`."""

    def __init__(self, state_dir: str | Path) -> None:
        self.root = Path(state_dir) / "adapters"
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def name(version: int) -> str:
        return f"policy-v{version}"

    def path(self, version: int) -> Path:
        return self.root / self.name(version)

    def versions(self) -> list[int]:
        """Complete versions, ascending (temporary directories are ignored)."""
        found = []
        for entry in self.root.iterdir():
            match = _NAME.match(entry.name)
            if match and entry.is_dir() and (entry / META_FILE).is_file():
                found.append(int(match.group(1)))
        return sorted(found)

    def latest(self) -> int | None:
        versions = self.versions()
        return versions[-1] if versions else None

    def read_meta(self, version: int) -> dict[str, Any]:
        return json.loads((self.path(version) / META_FILE).read_text())

    def lineage(self, version: int) -> list[int]:
        """[version, parent, grandparent, ...] down to the base (0) or a missing parent."""
        chain = [version]
        while True:
            parent = self.read_meta(chain[-1]).get("parent_version")
            if parent is None or parent == 0 or parent not in self.versions():
                return chain
            chain.append(int(parent))

    def publish(self, version: int, files_dir: Path, meta: dict[str, Any]) -> Path:
        """Copy the PEFT files in `files_dir` into a new version directory atomically."""
        final = self.path(version)
        if final.exists():
            raise AdapterExistsError(f"{final} exists; adapter versions are never overwritten")
        tmp = self.root / f".tmp-{self.name(version)}-{uuid.uuid4().hex}"
        shutil.copytree(files_dir, tmp)
        weights = tmp / WEIGHTS_FILE
        meta = {
            **meta,
            "version": version,
            "weights_sha256": sha256_file(weights) if weights.exists() else None,
            "gate": meta.get("gate"),
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        for child in tmp.iterdir():
            with child.open("rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(tmp)
        try:
            os.rename(tmp, final)  # fails if `final` appeared meanwhile and is non-empty
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise AdapterExistsError(f"{final} exists; not overwritten") from exc
        _fsync_dir(self.root)
        log.info("adapter_published", version=version, path=str(final))
        return final

    def cleanup_temporary(self) -> int:
        """Remove leftovers of interrupted publishes; returns how many."""
        removed = 0
        for entry in self.root.glob(".tmp-policy-v*"):
            shutil.rmtree(entry, ignore_errors=True)
            removed += 1
        return removed
