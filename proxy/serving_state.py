"""Serving state the operator changes at run time, persisted so a restart keeps it.

`<state_dir>/control/serving.json` holds the alias table, running canaries, the history of
alias changes, the frozen flags and per-tenant training overrides. It is written to a
temporary file, fsynced and renamed, so a crash leaves either the old or the new state,
never half of one.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_VERSION = 1
# History entries kept in full: past twice this, the older ones are folded into one
# `compacted` entry. Kept whole, each admin change copied, rewrote and fsynced all of it
# on the event loop (50k entries, 9 MB: a flip stalled every request for 0.9 s), and
# /admin/status, which the learner reads every few seconds, carried it all.
HISTORY_KEEP = 1000
_VERSION_NAME = re.compile(r"policy-v[0-9]+")


@dataclass
class ServingState:
    aliases: dict[str, str]
    history: list[dict[str, Any]] = field(default_factory=list)
    frozen: bool = False
    learning_frozen: bool = False
    # Run-time training switches: {tenant: {"enabled": bool, "config_enabled": bool | None}},
    # with the config's own value when the switch was set (None: a file from before it was
    # kept), so that a config changed since then wins at the next start (TenantRegistry).
    tenant_training: dict[str, dict[str, bool | None]] = field(default_factory=dict)
    canaries: dict[str, dict[str, Any]] = field(default_factory=dict)  # alias -> Canary JSON

    def record(self, kind: str, actor: str, **details: Any) -> dict[str, Any]:
        entry = {"kind": kind, "actor": actor, "at": time.time(), **details}
        self.history.append(entry)
        return entry

    def to_json(self) -> dict[str, Any]:
        return {"state_version": STATE_VERSION, **asdict(self)}

    def compact_history(self, base: str, keep: int = HISTORY_KEEP) -> bool:
        """Past `2 * keep` entries, fold all but the newest `keep` into one `compacted`
        entry: what the folded ones decide is kept (each alias's lineage, which rollbacks
        read, and every version name they held, which the learner never reuses), not each
        change. `base`: the base model's served name now. Whether it folded any."""
        if len(self.history) <= 2 * keep:
            return False
        folded, kept = self.history[:-keep], self.history[-keep:]
        aliases = sorted(
            {str(e["alias"]) for e in folded if isinstance(e, dict) and "alias" in e}
            | {str(a) for e in folded if _is_compacted(e) for a in e.get("lineages") or {}}
        )
        previous = [e for e in folded if _is_compacted(e)]
        self.history = [
            {
                "kind": "compacted",
                "actor": "olp-proxy",
                "at": time.time(),
                "entries": len(folded) + sum(int(e.get("entries") or 0) - 1 for e in previous),
                "lineages": {a: alias_lineage(folded, a, base)[1:] for a in aliases},
                "versions": sorted(_version_names(folded), key=_version_number),
            },
            *kept,
        ]
        return True


def alias_lineage(history: list[Any], alias: str, base: str) -> list[str]:
    """The versions the alias served, oldest first, from `base`, without those rolled back
    past: a flip adds its target, a rollback drops every version after the one it returns
    to (marking only each rollback's `previous` as rolled back let a rollback that skipped
    several versions leave the skipped ones eligible again); a `compacted` entry sets the
    lineage as it was there.

    A target that is no `policy-v<N>` is the base model, under the name it was served by
    then: after `policy.served_model_name` changed, a rollback to the old name counted as a
    version, and a plain rollback went to a name nothing serves (409 `not_loaded`)."""
    lineage = [base]
    for entry in history:
        if not isinstance(entry, dict):
            continue
        if _is_compacted(entry):
            seeded = (entry.get("lineages") or {}).get(alias)
            if isinstance(seeded, list):
                lineage = [base]
                for version in seeded:
                    if isinstance(version, str) and lineage[-1] != (v := _named(version, base)):
                        lineage.append(v)
            continue
        if entry.get("alias") != alias or entry.get("kind") not in ("flip", "rollback"):
            continue
        target = entry.get("target")
        if not isinstance(target, str):
            continue
        target = _named(target, base)
        if entry["kind"] == "rollback" and target in lineage:
            del lineage[len(lineage) - lineage[::-1].index(target) :]
        elif lineage[-1] != target:
            lineage.append(target)
    return lineage


def _named(target: str, base: str) -> str:
    """`target` as served now: a version keeps its name, anything else is the base model."""
    return target if _VERSION_NAME.fullmatch(target) else base


def _is_compacted(entry: Any) -> bool:
    return isinstance(entry, dict) and entry.get("kind") == "compacted"


def _version_names(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value} if _VERSION_NAME.fullmatch(value) else set()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(*(_version_names(item) for item in value))
    return set()


def _version_number(name: str) -> int:
    return int(name.removeprefix("policy-v"))


class ServingStateError(ValueError):
    """The serving state file is there but unusable (damaged or hand-edited wrong): the
    proxy must not guess what serves, nor start from the configured aliases over it."""


def load_state(path: Path, default_aliases: dict[str, str]) -> ServingState:
    """The persisted state, or a fresh one from the configured aliases.

    Configured aliases that the file does not know yet are added, so a new base alias in the
    config takes effect without hand-editing the file. ServingStateError when it is unusable.
    """
    if not path.exists():
        return ServingState(aliases=dict(default_aliases))
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:  # JSONDecodeError, or bytes that are not UTF-8
        raise ServingStateError(f"serving state {path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("state_version") != STATE_VERSION:
        raise ServingStateError(f"serving state {path} has an unknown format")
    try:
        return _parsed_state(path, raw, default_aliases)
    except ServingStateError:
        raise
    except (TypeError, ValueError, AttributeError) as exc:  # a list where a mapping goes
        raise ServingStateError(f"serving state {path} has an unknown format: {exc}") from exc


def _parsed_state(path: Path, raw: dict[str, Any], default_aliases: dict[str, str]) -> ServingState:
    stored = raw.get("aliases") or {}
    if not isinstance(stored, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in stored.items()
    ):
        raise ServingStateError(f"serving state {path}: aliases must map names to names")
    history = raw.get("history") or []
    if not isinstance(history, list) or not all(isinstance(e, dict) for e in history):
        raise ServingStateError(f"serving state {path}: history must be a list of objects")
    aliases = {**default_aliases, **stored}
    return ServingState(
        aliases=aliases,
        history=list(history),
        frozen=_flag(path, raw, "frozen"),
        learning_frozen=_flag(path, raw, "learning_frozen"),
        tenant_training={
            str(name): _training_switch(path, str(name), value)
            for name, value in (raw.get("tenant_training") or {}).items()
        },
        canaries={
            str(alias): _canary(path, str(alias), value)
            for alias, value in (raw.get("canaries") or {}).items()
        },
    )


def _canary(path: Path, alias: str, value: Any) -> dict[str, Any]:
    """A running canary as `Canary.from_json` reads it: one without its share, or with a
    share of text, ended the proxy's start-up in a traceback (read after this file's
    checks)."""

    def number(key: str) -> bool:
        item = value.get(key)
        return isinstance(item, int | float) and not isinstance(item, bool) and math.isfinite(item)

    if (
        isinstance(value, dict)
        and isinstance(value.get("target"), str)
        and number("share")
        and 0.0 < value["share"] < 1.0
        and number("started_at")
    ):
        return dict(value)
    raise ServingStateError(
        f"serving state {path}: canaries[{alias!r}] must be "
        f'{{"target": name, "share": 0 < number < 1, "started_at": number}}, not {value!r}'
    )


def switch_applies(switch: dict[str, bool | None], config_enabled: bool) -> bool:
    """Whether a run-time training switch still decides: not once the config's
    `training_enabled` changed since the switch was set (the config's newer word wins)."""
    basis = switch.get("config_enabled")
    return basis is None or basis == config_enabled


def _flag(path: Path, raw: dict[str, Any], key: str) -> bool:
    """A JSON boolean, never a coerced value: `bool("false")` is True, and a hand-edited
    `"frozen": "false"` froze serving, `"tenant_training": {"a": "0"}` trained on a tenant."""
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ServingStateError(f"serving state {path}: {key} must be true or false, not {value!r}")
    return value


def _training_switch(path: Path, name: str, value: Any) -> dict[str, bool | None]:
    if isinstance(value, bool):  # the format before the config's value was kept with it
        return {"enabled": value, "config_enabled": None}
    if (
        isinstance(value, dict)
        and isinstance(value.get("enabled"), bool)
        and (value.get("config_enabled") is None or isinstance(value["config_enabled"], bool))
    ):
        return {"enabled": value["enabled"], "config_enabled": value.get("config_enabled")}
    raise ServingStateError(
        f"serving state {path}: tenant_training[{name!r}] must be "
        f'{{"enabled": true|false, "config_enabled": true|false}}, not {value!r}'
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
