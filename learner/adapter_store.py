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
# No leading zero, ASCII digits, nothing after: `policy-v01` (an operator's copy) is not
# version 1, whose `path()` is `policy-v1`.
_NAME = re.compile(r"policy-v([1-9][0-9]*)", re.ASCII)
ANCESTOR_RUNS = "ancestor_runs"  # olp_meta.json: the versions it descends from, as runs
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
            match = _NAME.fullmatch(entry.name)
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

    def ancestors(self, version: int) -> set[int] | None:
        """Every version `version` was trained from (0 excluded), by its `ancestor_runs`,
        whether or not their directories are still there; None for a version published
        without them (before they were recorded)."""
        runs = self.read_meta(version).get(ANCESTOR_RUNS)
        if not isinstance(runs, list):
            return None
        found: set[int] = set()
        for run in runs:
            high, low = int(run[0]), int(run[1])
            found.update(range(low, high + 1))
        return found

    def _ancestor_runs(self, parent: int) -> list[list[int]] | None:
        """`parent` and its ancestors as [high, low] runs, newest first: one run for a
        learner that never branched, however long it ran (a list of every version would
        grow with each one). None when the lineage is not known to its start (the parent's
        directory is gone, or it predates the runs and its parent links stop at a gap)."""
        if parent <= 0:
            return []
        if parent not in self.versions():
            return None
        recorded = self.read_meta(parent).get(ANCESTOR_RUNS)
        if isinstance(recorded, list):
            older = [[int(run[0]), int(run[1])] for run in recorded]
        else:  # published before runs were recorded: its parent links, if they reach 0
            chain = self.lineage(parent)
            if int(self.read_meta(chain[-1]).get("parent_version") or 0) != 0:
                return None
            older = [[v, v] for v in chain[1:]]
        runs: list[list[int]] = [[parent, parent]]
        for high, low in older:
            if runs[-1][1] == high + 1:
                runs[-1][1] = low
            else:
                runs.append([high, low])
        return runs

    def publish(self, version: int, files_dir: Path, meta: dict[str, Any]) -> Path:
        """Copy the PEFT files in `files_dir` into a new version directory atomically."""
        final = self.path(version)
        if final.exists():
            raise AdapterExistsError(f"{final} exists; adapter versions are never overwritten")
        parent = meta.get("parent_version")
        # Pruning removes the oldest directories but keeps the ones that serve, so walking
        # parent links stopped at the first gap: a resume then called a still-serving
        # ancestor "not on the lineage" and refused to start. The runs keep the lineage.
        runs = self._ancestor_runs(int(parent)) if isinstance(parent, int) else None
        tmp = self.root / f".tmp-{self.name(version)}-{uuid.uuid4().hex}"
        shutil.copytree(files_dir, tmp)
        weights, config = tmp / WEIGHTS_FILE, tmp / CONFIG_FILE
        meta = {
            **meta,
            **({} if runs is None else {ANCESTOR_RUNS: runs}),
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
