"""`olp learner`: the learner loop wired to the stream, the proxy's controls and promotion."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from deploy.admin_client import learner_admin_key
from deploy.config import OlpConfig
from deploy.ports import local_http_url
from deploy.runtime import resolve_model_dir
from deploy.state_lock import LockHeld, StateDirLock
from learner.promotion import (
    Promoter,
    ProxyAdmin,
    ReplicaSet,
    kept_targets_in_order,
    named_versions,
)
from learner.reload import AdapterReloader
from replay.config import STREAM_ID_ENV  # offsets saved in another stream are not resumed
from safety.audit import AuditLog
from safety.redaction import Redactor

if TYPE_CHECKING:
    from learner.service import LearnerSummary

log = structlog.get_logger(__name__)


# How long start-up waits for the policy servers to list their adapters (a deployment may
# start the learner before vLLM answers).
SERVED_WAIT_S = 60.0


def _wait_or_stop(stop: threading.Event | None, waiting_for: str) -> None:
    """Two seconds between start-up's asks, cut short by a stop: the loops slept through
    SIGINT and SIGTERM for up to two minutes, then exited 1 as if they had failed."""
    if stop is None:
        time.sleep(2.0)
    elif stop.wait(2.0):
        log.info("learner_stopped_before_start", waiting_for=waiting_for)
        raise SystemExit(0)


def served_versions(
    replicas: ReplicaSet, wait_s: float = SERVED_WAIT_S, stop: threading.Event | None = None
) -> set[str]:
    """The `policy-v<N>` names the replicas serve now, for the learner's version floor.

    Without them a learner on a wiped state dir would name its next candidate after one
    vLLM still serves (old weights under the new name), so not knowing is fatal."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return replicas.loaded_versions()
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"olp learner: cannot list the adapters vLLM serves at "
                    f"{', '.join(replicas.base_urls)} ({exc}); the learner needs them to "
                    "name new versions; start the policy server first (olp policy)"
                ) from None
            log.warning("policy_servers_not_answering", error=str(exc))
            _wait_or_stop(stop, "the policy servers")


def proxy_versions(
    proxy: ProxyAdmin, wait_s: float = SERVED_WAIT_S, stop: threading.Event | None = None
) -> set[str]:
    """The `policy-v<N>` names the proxy's status holds (alias, canary and rollback targets,
    the history), for the version floor too.

    Under `olp up` vLLM starts empty, so its listing alone let a learner whose newer
    directories were gone (moved aside) reuse the name the alias targets, and the reloader
    then served the new, ungated weights behind the alias. Not knowing is fatal here too."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return named_versions(proxy.status())
        except Exception as exc:
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"olp learner: cannot read the proxy's status ({exc}); the learner needs "
                    "the versions it names to name new versions; start the proxy first "
                    "(olp proxy)"
                ) from None
            log.warning("proxy_not_answering", error=str(exc))
            _wait_or_stop(stop, "the proxy")


FREEZE_ASK_TIMEOUT_S = 3.0


class FreezeFlag:
    """The proxy's learning-frozen switch, asked at most every `ttl_s` seconds.

    Until the proxy has answered once, learning counts as frozen: an operator's freeze is
    kept in the proxy's state, and a learner started while the proxy is down (or
    restarting) must not train through it. Later, a proxy that does not answer keeps the
    last value it gave."""

    def __init__(self, proxy: ProxyAdmin, ttl_s: float = 5.0) -> None:
        self.proxy = proxy
        self.ttl_s = ttl_s
        self._value: bool | None = None
        self._at = 0.0

    def __call__(self) -> bool:
        now = time.monotonic()
        # Not known yet: asked again every second, so a learner started just before its
        # proxy waits no longer than that.
        ttl_s = self.ttl_s if self._value is not None else min(self.ttl_s, 1.0)
        if now - self._at >= ttl_s:
            try:
                self._value = bool(self.proxy.status().get("learning_frozen"))
            except Exception as exc:  # proxy restarting: keep the last known value, say so
                log.warning(
                    "freeze_flag_unavailable",
                    error=str(exc),
                    learning_frozen=True if self._value is None else self._value,
                    known=self._value is not None,
                )
            self._at = now
        return True if self._value is None else self._value


class LearnerAlreadyRunning(RuntimeError):
    pass


def run(cfg: OlpConfig) -> int:
    """The learner; under torchrun rank 0 alone promotes, watches the canary and reloads
    adapters onto restarted replicas (it alone writes adapters), fed every rank's evidence."""
    from learner.distributed import broadcast_object, init_distributed
    from learner.service import run_learner
    from learner.source import replay_consumer_factory

    ctx = init_distributed()
    state_dir = Path(cfg.state_dir)
    # Taken by rank 0 (the ranks of one torchrun are one learner) and held for the process's
    # life (the kernel drops it when the process ends, however it ends); every rank learns
    # whether it was refused, so that none goes on to load the model beside the other.
    lock = StateDirLock(state_dir, "learner")
    holder = None
    if ctx.is_main:
        try:
            lock.acquire()
        except LockHeld as held:
            holder = held.holder
    holder = broadcast_object(ctx, holder)
    if holder is not None:
        raise LearnerAlreadyRunning(
            f"another learner is running on state dir {state_dir} (pid {holder}): two "
            "would train, publish adapters and promote over each other; stop it first "
            "(under olp up, stop olp up)"
        )
    model_dir = resolve_model_dir(cfg.policy)
    replicas = cfg.policy.base_urls()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    def learn(**main_only: Any) -> LearnerSummary:
        return run_learner(
            cfg.learner,
            state_dir,
            replay_consumer_factory(cfg.stream),
            model_dir=model_dir,
            caps=cfg.safety.caps,
            base_name=cfg.policy.served_model_name,
            judge_base_url=replicas[0],
            judge_api_key=cfg.policy.api_key_value(),
            stop=stop,
            ctx=ctx,
            stream_id=os.environ.get(STREAM_ID_ENV) or None,
            **main_only,
        )

    # Ranks 1.. run no promoter, canary or reloader: their audit records and adapter loads
    # would come once per rank, and a canary there would see that rank's share only.
    summary = _run_main(cfg, state_dir, replicas, learn, stop) if ctx.is_main else learn()
    log.info(
        "learner_stopped",
        version=summary.version,
        steps=summary.steps,
        consumed=summary.consumed,
        rank=ctx.rank,
    )
    return 0


def _run_main(
    cfg: OlpConfig,
    state_dir: Path,
    replicas: list[str],
    learn: Callable[..., LearnerSummary],
    stop: threading.Event | None = None,
) -> LearnerSummary:
    """Rank 0 (or the only process): the learner with promotion, canary and reloads.

    `stop` (the signal handlers' event) reaches the promoter at once: a gate running when
    the learner is asked to stop ends then, not after the training step in progress."""
    proxy_url = local_http_url(cfg.proxy.host, cfg.proxy.port)
    proxy = ProxyAdmin(proxy_url, learner_admin_key(cfg))
    redactor = Redactor.from_config(cfg.safety.redaction)
    audit = AuditLog.from_config(cfg.safety.audit, state_dir, redactor)
    replica_set = ReplicaSet(replicas, api_key=cfg.policy.api_key_value())
    promoter = Promoter(
        cfg.learner.promotion,
        cfg.safety.gates,
        replicas=replica_set,
        proxy=ProxyAdmin(proxy_url, learner_admin_key(cfg)),
        audit=audit,
        state_dir=state_dir,
        base_name=cfg.policy.served_model_name,
        stop=stop,
    )
    # Its own clients: it runs on its own thread, beside the promoter's. It restores what
    # the cleanup keeps: routed targets and what `olp rollback` would serve.
    reload_proxy = ProxyAdmin(proxy_url, learner_admin_key(cfg))
    reloader = AdapterReloader(
        ReplicaSet(replicas, api_key=cfg.policy.api_key_value()),
        lambda: kept_targets_in_order(reload_proxy.status()),
        audit,
        state_dir / "adapters",
    )
    reloader.start(cfg.learner.promotion.reload_check_s)
    try:
        return learn(
            on_candidate=promoter.submit,
            canary=promoter.canary_monitor,
            # Its own client with a short timeout: it is asked in the learner's loop, where
            # a proxy that accepts and never answers held a stop for the client's 30 s.
            is_frozen=FreezeFlag(
                ProxyAdmin(proxy_url, learner_admin_key(cfg), timeout_s=FREEZE_ASK_TIMEOUT_S)
            ),
            served_versions=lambda: (
                served_versions(replica_set, stop=stop) | proxy_versions(proxy, stop=stop)
            ),
            # Once the learner checked its state (a store it refuses is not gated): a canary
            # a learner that died left running is ended, and the newest candidate whose gate
            # never decided is gated (again).
            on_started=promoter.resume,
        )
    finally:
        reloader.close()
        reloader.replicas.close()
        reload_proxy.close()
        promoter.close()
        proxy.close()
