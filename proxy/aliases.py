"""Public model names → upstream served names, swapped atomically at run time.

The hot-swap protocol flips `policy` from `policy-v<N>` to `policy-v<N+1>` only after the new
adapter is loaded on every replica. A canary splits one alias: a fixed share of
training-enabled traffic goes to a candidate version, chosen by a hash of the session id so a
session stays on one version. Readers take one immutable snapshot per request, so a request
never sees half of a change.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class Canary:
    """`share` of the eligible traffic of an alias goes to `target` instead of the stable one."""

    target: str
    share: float
    started_at: float

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target, "share": self.share, "started_at": self.started_at}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Canary:
        return cls(str(data["target"]), float(data["share"]), float(data["started_at"]))


def routing_fraction(key: str) -> float:
    """A stable number in [0, 1) for a routing key: the same session lands on the same arm."""
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass(frozen=True)
class _Tables:
    aliases: Mapping[str, str]
    canaries: Mapping[str, Canary]


class AliasTable:
    """Holds immutable mappings; every change installs new ones in a single assignment."""

    def __init__(
        self, aliases: Mapping[str, str], canaries: Mapping[str, Canary] | None = None
    ) -> None:
        self._check(aliases)
        self._tables = _Tables(MappingProxyType(dict(aliases)), MappingProxyType({}))
        for alias, canary in (canaries or {}).items():
            if alias in aliases and canary.target != aliases[alias]:
                self.start_canary(alias, canary)

    @staticmethod
    def _check(aliases: Mapping[str, str]) -> None:
        for alias, target in aliases.items():
            if not isinstance(alias, str) or not alias:
                raise ValueError(f"alias names must be non-empty strings, got {alias!r}")
            if not isinstance(target, str) or not target:
                raise ValueError(f"alias {alias!r} needs a non-empty target, got {target!r}")

    def _install(self, aliases: Mapping[str, str], canaries: Mapping[str, Canary]) -> None:
        self._tables = _Tables(MappingProxyType(dict(aliases)), MappingProxyType(dict(canaries)))

    def saved(self) -> object:
        """The current tables, for `restore` (a change that could not be persisted)."""
        return self._tables

    def restore(self, saved: object) -> None:
        if not isinstance(saved, _Tables):
            raise TypeError("restore takes what saved() returned")
        self._tables = saved

    def snapshot(self) -> Mapping[str, str]:
        """The stable table as one consistent, read-only mapping."""
        return self._tables.aliases

    def canaries(self) -> Mapping[str, Canary]:
        return self._tables.canaries

    def resolve(self, alias: str) -> str | None:
        """The stable target of an alias (what serves traffic outside any canary)."""
        return self._tables.aliases.get(alias)

    def route(self, alias: str, key: str, *, canary_eligible: bool) -> str | None:
        """The target one request goes to: the canary's for its share of eligible keys."""
        tables = self._tables
        target = tables.aliases.get(alias)
        canary = tables.canaries.get(alias)
        if target is None or canary is None or not canary_eligible:
            return target
        return canary.target if routing_fraction(key) < canary.share else target

    def public_names(self) -> list[str]:
        return sorted(self._tables.aliases)

    def set(self, alias: str, target: str) -> str | None:
        """Point `alias` at `target` and end its canary; returns the previous target."""
        self._check({alias: target})
        tables = self._tables
        previous = tables.aliases.get(alias)
        aliases = {**tables.aliases, alias: target}
        canaries = {k: v for k, v in tables.canaries.items() if k != alias}
        self._install(aliases, canaries)
        return previous

    def start_canary(self, alias: str, canary: Canary) -> None:
        tables = self._tables
        if alias not in tables.aliases:
            raise ValueError(f"unknown alias {alias!r}")
        if not 0.0 < canary.share < 1.0:
            raise ValueError(f"a canary share must lie between 0 and 1 (exclusive): {canary.share}")
        self._check({alias: canary.target})
        self._install(tables.aliases, {**tables.canaries, alias: canary})

    def end_canary(self, alias: str) -> Canary | None:
        tables = self._tables
        canary = tables.canaries.get(alias)
        if canary is not None:
            self._install(tables.aliases, {k: v for k, v in tables.canaries.items() if k != alias})
        return canary
