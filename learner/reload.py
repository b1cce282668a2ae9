"""Keeps every vLLM replica serving the versions the proxy routes to or would roll back to.

A vLLM that restarts (a crash, a rescheduled pod) comes back serving only the base model.
The proxy hands a request for an adapter that replica lacks to a replica that has it, or,
with none left, relays vLLM's 404 for every request on the alias. The hot swap loaded each
version once; this puts it back, from the same immutable directory, checked against the
weights' recorded sha256, on each replica that lost it.

The versions wanted are the alias and canary targets and each alias's rollback target
(`kept_targets`): without the last, `olp rollback` after a vLLM restart was refused (its
target not loaded), although the learner keeps it loaded otherwise.

Runs without the promotion lock, which a canary holds for its whole window: it only ever
loads versions the proxy routes to or would roll back to, which no cleanup unloads, so the
two cannot undo each other (a version dropped meanwhile is loaded once more and unloaded by
the next cleanup).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import httpx
import structlog

from learner.promotion import (
    ACTOR,
    PromotionError,
    ReplicaSet,
    is_version_name,
    verify_adapter,
)
from safety.audit import AuditLog

log = structlog.get_logger(__name__)

DOWN_RECHECK_S = 2.0
# A replica's model listing: at the client's 60 s (a load may take that long), one hung
# replica held every other replica's reload back by a minute at each check.
LISTING_TIMEOUT_S = 5.0


class AdapterReloader:
    """`check()` once; `start(interval_s)` runs it on a thread until `close()`."""

    def __init__(
        self,
        replicas: ReplicaSet,
        routed: Callable[[], Iterable[str]],
        audit: AuditLog,
        adapters_dir: Path,
    ) -> None:
        """`routed`: the versions to keep loaded, the ones that serve first (loaded first:
        a rollback target can wait, the alias's target has requests failing meanwhile)."""
        self.replicas = replicas
        self.routed = routed
        self.audit = audit
        self.adapters_dir = Path(adapters_dir)
        # (replica, version) whose reload failed: audited once, not on every check.
        self._failing: dict[tuple[str, str], str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # A replica did not answer the last check: it may be restarting, so the next check
        # comes sooner (its adapters are missing from the moment it answers).
        self.replica_down = False

    def check(self) -> list[tuple[str, str]]:
        """Load every wanted version a reachable replica lacks; returns (replica, version)
        for each one loaded again."""
        try:
            wanted = [name for name in dict.fromkeys(self.routed()) if is_version_name(name)]
        except (httpx.HTTPError, PromotionError, ValueError) as exc:
            log.warning("adapter_reload_check_skipped", reason=f"proxy status: {exc}")
            return []
        reloaded: list[tuple[str, str]] = []
        self.replica_down = False
        for url in self.replicas.base_urls:
            if not wanted:
                break
            try:
                served = self.replicas.served(url, timeout_s=LISTING_TIMEOUT_S)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                # Down or still starting: the next check finds it up.
                log.info("adapter_reload_replica_unreachable", replica=url, error=str(exc))
                self.replica_down = True
                continue
            for name in wanted:
                if name not in served and self._reload(url, name):
                    reloaded.append((url, name))
        return reloaded

    def _reload(self, url: str, name: str) -> bool:
        path = self.adapters_dir / name
        try:
            if not path.is_dir():
                raise PromotionError(f"{path} does not exist (pruned or never written here)")
            verify_adapter(path)
            self.replicas.load_on(url, name, path)
            if name not in self.replicas.served(url):
                raise PromotionError(f"{name} not listed by {url} after loading")
        except Exception as exc:
            # Whatever it is (a meta file that is JSON but not an object raised
            # AttributeError, which ended the check: the versions after it, the alias's
            # target among them, were never loaded), it is this version's failure.
            error = f"{type(exc).__name__}: {exc}"
            log.error("adapter_reload_failed", replica=url, version=name, error=error)
            if self._failing.get((url, name)) != error and self._audited(
                "adapter_reload_failed", {"version": name, "replica": url, "error": error}
            ):
                # Only once written: marked before, one failed write kept it unrecorded.
                self._failing[(url, name)] = error
            return False
        self._failing.pop((url, name), None)
        log.warning("adapter_reloaded", replica=url, version=name)
        self._audited("adapter_reloaded", {"version": name, "replica": url})
        return True

    def _audited(self, event: str, payload: dict[str, str]) -> bool:
        """Append to the audit log; a failure is logged (the next check tries a failed
        reload's record again), never the end of the check."""
        try:
            self.audit.append(ACTOR, event, payload)
        except Exception as exc:
            log.error(
                "adapter_reload_not_audited", audit_event=event, record=payload, error=repr(exc)
            )
            return False
        return True

    def start(self, interval_s: float) -> None:
        if interval_s <= 0 or self._thread is not None:
            return

        def loop() -> None:
            # The first check at once: after `olp up` starts again, vLLM is new and serves
            # only the base, and until the adapter the alias routes to is back every
            # request for it fails (an interval's wait was 15 s of 404s).
            while True:
                try:
                    self.check()
                except Exception:  # one bad check must not end the checks
                    log.exception("adapter_reload_check_crashed")
                if self._stop.wait(
                    min(interval_s, DOWN_RECHECK_S) if self.replica_down else interval_s
                ):
                    return

        self._thread = threading.Thread(target=loop, name="adapter-reload", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
