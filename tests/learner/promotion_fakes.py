"""Fakes shared by the promoter's logic tests (no proxy, no vLLM)."""

from __future__ import annotations


class FakeAudit:
    """Keeps (event, payload) in order, as AuditLog.append would write them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def append(self, actor: str, event: str, payload: dict | None = None) -> None:
        self.events.append((event, payload or {}))

    def names(self) -> list[str]:
        return [name for name, _ in self.events]
