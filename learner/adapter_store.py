"""Immutable, versioned adapter directories: `<state_dir>/adapters/policy-v<N>/`.

Each version holds the PEFT files plus `olp_meta.json` (version, parent_version,
consumed_offsets, config_hash, step_metrics, data_stats, weights_sha256, config_sha256,
gate). A version is written under a temporary name in the same folder and renamed
atomically; an existing version is never overwritten.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger(__name__)

META_FILE = "olp_meta.json"
WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"  # lora_alpha, target modules: as decisive as the weights
_NAME = re.compile(r"^policy-v(\d+)$")
BUILD_PREFIX = ".build-"  # Learner._publish's scratch folders (see `building`)


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
        self._building: set[Path] = set()

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
        """[version, parent, grandparent, ...] down to the base (0) or a missing parent.

        A parent is always older than its child; metadata saying otherwise (hand-edited or
        damaged: a version its own parent) ends the chain there, logged, instead of looping
        for ever."""
        versions = set(self.versions())
        chain = [version]
        while True:
            parent = self.read_meta(chain[-1]).get("parent_version")
            if parent is None or parent == 0 or parent not in versions:
                return chain
            if int(parent) >= chain[-1]:
                log.error("adapter_lineage_broken", version=chain[-1], parent_version=parent)
                return chain
            chain.append(int(parent))

    def publish(self, version: int, files_dir: Path, meta: dict[str, Any]) -> Path:
        """Copy the PEFT files in `files_dir` into a new version directory atomically."""
        final = self.path(version)
        if final.exists():
            raise AdapterExistsError(f"{final} exists; adapter versions are never overwritten")
        tmp = self.root / f".tmp-{self.name(version)}-{uuid.uuid4().hex}"
        shutil.copytree(files_dir, tmp)
        weights, config = tmp / WEIGHTS_FILE, tmp / CONFIG_FILE
        meta = {
            **meta,
            "version": version,
            "weights_sha256": sha256_file(weights) if weights.exists() else None,
            "config_sha256": sha256_file(config) if config.exists() else None,
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

    @contextlib.contextmanager
    def building(self) -> Iterator[Path]:
        """A scratch folder (`.build-*`) beside the versions, removed on exit.

        It is registered while in use, so `cleanup_temporary` never removes a build this
        process is still writing."""
        path = Path(tempfile.mkdtemp(dir=self.root, prefix=BUILD_PREFIX))
        self._building.add(path)
        try:
            yield path
        finally:
            self._building.discard(path)
            _remove(path)

    def cleanup_temporary(self) -> int:
        """Remove leftovers of interrupted publishes and builds; returns how many.

        Run at start-up (rank 0, before any build); a crash mid-step leaves an adapter-sized
        `.build-*` or `.tmp-policy-v*` folder that nothing else would ever remove."""
        leftovers = [*self.root.glob(".tmp-policy-v*"), *self.root.glob(f"{BUILD_PREFIX}*")]
        removed = 0
        for entry in leftovers:
            if entry in self._building:
                continue
            if _remove(entry):
                removed += 1
        if removed:
            log.info("adapter_leftovers_removed", count=removed, root=str(self.root))
        return removed


def _remove(path: Path) -> bool:
    """rmtree that logs a failure instead of hiding it; True when the path is gone."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("adapter_leftover_not_removed", path=str(path), error=repr(exc))
        return False
    return True
