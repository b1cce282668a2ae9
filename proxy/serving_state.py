"""Serving state the operator changes at run time, persisted so a restart keeps it.

`<state_dir>/control/serving.json` holds the alias table, running canaries, the history of
alias changes, the frozen flags and per-tenant training overrides. It is written to a
temporary file, fsynced and renamed, so a crash leaves either the old or the new state,
never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_VERSION = 1


@dataclass
class ServingState:
    aliases: dict[str, str]
    history: list[dict[str, Any]] = field(default_factory=list)
    frozen: bool = False
    learning_frozen: bool = False
    tenant_training: dict[str, bool] = field(default_factory=dict)
    canaries: dict[str, dict[str, Any]] = field(default_factory=dict)  # alias -> Canary JSON

    def record(self, kind: str, actor: str, **details: Any) -> dict[str, Any]:
        entry = {"kind": kind, "actor": actor, "at": time.time(), **details}
        self.history.append(entry)
        return entry

    def to_json(self) -> dict[str, Any]:
        return {"state_version": STATE_VERSION, **asdict(self)}


def load_state(path: Path, default_aliases: dict[str, str]) -> ServingState:
    """The persisted state, or a fresh one from the configured aliases.

    Configured aliases that the file does not know yet are added, so a new base alias in the
    config takes effect without hand-editing the file.
    """
    if not path.exists():
        return ServingState(aliases=dict(default_aliases))
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"serving state {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("state_version") != STATE_VERSION:
        raise ValueError(f"serving state {path} has an unknown format")
    aliases = dict(default_aliases)
    aliases.update(raw.get("aliases") or {})
    return ServingState(
        aliases=aliases,
        history=list(raw.get("history") or []),
        frozen=bool(raw.get("frozen", False)),
        learning_frozen=bool(raw.get("learning_frozen", False)),
        tenant_training={str(k): bool(v) for k, v in (raw.get("tenant_training") or {}).items()},
        canaries={str(k): dict(v) for k, v in (raw.get("canaries") or {}).items()},
    )


def save_state(path: Path, state: ServingState) -> None:
    """Atomically replace the state file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".serving.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(state.to_json(), handle, indent=2, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
