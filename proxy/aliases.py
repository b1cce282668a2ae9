"""Public model names → upstream served names, swapped atomically at run time.

The hot-swap protocol flips `policy` from `policy-v<N>` to `policy-v<N+1>` only after the new
adapter is loaded on every replica. Readers take one immutable snapshot per request, so a
request never sees half of a change.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType


class AliasTable:
    """Holds an immutable mapping; every change installs a new one in a single assignment."""

    def __init__(self, aliases: Mapping[str, str]) -> None:
        self._check(aliases)
        self._current: Mapping[str, str] = MappingProxyType(dict(aliases))

    @staticmethod
    def _check(aliases: Mapping[str, str]) -> None:
        for alias, target in aliases.items():
            if not isinstance(alias, str) or not alias:
                raise ValueError(f"alias names must be non-empty strings, got {alias!r}")
            if not isinstance(target, str) or not target:
                raise ValueError(f"alias {alias!r} needs a non-empty target, got {target!r}")

    def snapshot(self) -> Mapping[str, str]:
        """The table as one consistent, read-only mapping."""
        return self._current

    def resolve(self, alias: str) -> str | None:
        return self._current.get(alias)

    def public_names(self) -> list[str]:
        return sorted(self._current)

    def set(self, alias: str, target: str) -> str | None:
        """Point `alias` at `target`; returns the previous target (None if the alias is new)."""
        self._check({alias: target})
        previous = self._current.get(alias)
        updated = dict(self._current)
        updated[alias] = target
        self._current = MappingProxyType(updated)
        return previous

    def replace(self, aliases: Mapping[str, str]) -> None:
        self._check(aliases)
        self._current = MappingProxyType(dict(aliases))
