"""Run every enabled gate on a candidate adapter against the incumbent, concurrently, and
collect one GateReport. A gate that cannot reach a verdict is recorded as failed with its
reason (fail closed); the report passes only when every gate ran and passed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Awaitable, Callable

import structlog

from safety.config import GatesConfig
from safety.gates.classifier import SafetyClassifier, build_classifier
from safety.gates.client import UpstreamUnavailable, VllmClient
from safety.gates.context import SuiteContext
from safety.gates.kl import NAME as KL_NAME
from safety.gates.kl import kl_gate
from safety.gates.monitors import PREFIX as MONITOR_PREFIX
from safety.gates.monitors import monitor_gates
from safety.gates.poisoning import NAME as POISONING_NAME
from safety.gates.poisoning import poisoning_gate
from safety.gates.regression import NAME as REGRESSION_NAME
from safety.gates.regression import regression_gate
from safety.gates.safety_probes import NAME as SAFETY_NAME
from safety.gates.safety_probes import safety_probe_gate
from safety.gates.types import GateError, GateInterrupted, GateReport, GateResult

log = structlog.get_logger(__name__)

# How often a running suite looks at its `stop` event: a learner asked to stop gets its
# answer within this, not after the minutes a suite takes on a busy CPU server.
STOP_POLL_S = 0.2


async def _guarded(
    name: str, run: Callable[[], Awaitable[GateResult | list[GateResult]]]
) -> list[GateResult]:
    try:
        outcome = await run()
    except GateError as exc:
        unanswered = isinstance(exc, UpstreamUnavailable)
        log.warning("gate_failed_closed", gate=name, reason=str(exc), unreachable=unanswered)
        return [GateResult.failed_closed(name, f"{type(exc).__name__}: {exc}", unanswered)]
    except Exception as exc:
        # A bug in one gate fails that gate (closed) instead of the whole suite, so the
        # report still says what every other gate found.
        log.exception("gate_crashed", gate=name)
        return [GateResult.failed_closed(name, f"{type(exc).__name__}: {exc}")]
    return outcome if isinstance(outcome, list) else [outcome]


async def _unless_stopped(
    work: asyncio.Future[list[list[GateResult]]], stop: threading.Event | None
) -> list[list[GateResult]]:
    """`work`'s result, or GateInterrupted (with `work` cancelled) once `stop` is set."""
    while stop is not None and not stop.is_set():
        done, _ = await asyncio.wait({work}, timeout=STOP_POLL_S)
        if done:
            return work.result()
    if stop is None:
        return await work
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise GateInterrupted("asked to stop before the gates reached a verdict")


async def run_gate_suite(
    config: GatesConfig,
    *,
    base_url: str,
    candidate: str,
    incumbent: str,
    base: str,
    api_key: str | None = None,
    classifier: SafetyClassifier | None = None,
    stop: threading.Event | None = None,
) -> GateReport:
    """Gate `candidate` (a served adapter name) against `incumbent` (a served name, `base`
    when nothing was promoted yet) on the vLLM endpoint at `base_url` (no /v1 suffix).

    Setting `stop` cancels the probes in flight and raises GateInterrupted: no report."""
    started = time.time()
    for role, name in (("incumbent", incumbent), ("base", base)):
        if candidate == name:
            # Every gate compares the candidate with the incumbent or the base: against
            # itself each comparison holds trivially and the suite would pass on no evidence.
            reason = f"the candidate {candidate!r} is also the {role}: nothing to compare"
            log.error("gate_suite_refused", candidate=candidate, reason=reason)
            return GateReport(
                passed=False,
                results=[GateResult.failed_closed("suite", reason)],
                candidate=candidate,
                incumbent=incumbent,
                base=base,
                started_at=started,
            )
    sampling = config.sampling
    client = VllmClient(
        base_url,
        max_concurrency=sampling.max_concurrency,
        timeout_s=sampling.request_timeout_s,
        api_key=api_key,
    )
    ctx = SuiteContext(client, sampling, candidate=candidate, incumbent=incumbent, base=base)
    owned_classifier = classifier is None
    jobs: list[Awaitable[list[GateResult]]] = []
    try:
        if config.regression.enabled:
            jobs.append(_guarded(REGRESSION_NAME, lambda: regression_gate(ctx, config.regression)))
        if config.kl.enabled:
            jobs.append(_guarded(KL_NAME, lambda: kl_gate(ctx, config.kl)))
        if config.safety_probes.enabled:

            async def safety() -> GateResult:
                chosen = classifier or build_classifier(config.safety_probes.classifier)
                try:
                    return await safety_probe_gate(ctx, config.safety_probes, chosen)
                finally:
                    if owned_classifier:
                        await chosen.aclose()

            jobs.append(_guarded(SAFETY_NAME, safety))
        if config.monitors.enabled:
            jobs.append(
                _guarded(
                    MONITOR_PREFIX.rstrip("."),
                    lambda: monitor_gates(ctx, config.monitors, config.regression),
                )
            )
        if config.poisoning.enabled:
            jobs.append(_guarded(POISONING_NAME, lambda: poisoning_gate(ctx, config.poisoning)))
        groups = await _unless_stopped(asyncio.gather(*jobs), stop)
        results = [result for group in groups for result in group]
        if not jobs:
            # Failed closed as ever, now with a reason: the report and the rejection said
            # nothing (`failed_gates: []`), and the operator had no way to tell why.
            reason = "no gate is enabled (safety.gates.*.enabled): nothing was checked"
            results = [GateResult.failed_closed("suite", reason)]
    except GateInterrupted:
        log.info(
            "gate_suite_interrupted",
            candidate=candidate,
            incumbent=incumbent,
            after_s=round(time.time() - started, 2),
        )
        raise
    finally:
        await ctx.close()
        await client.aclose()
    report = GateReport(
        passed=bool(results) and all(result.passed for result in results),
        results=results,
        candidate=candidate,
        incumbent=incumbent,
        base=base,
        started_at=started,
        duration_s=time.time() - started,
    )
    log.info(
        "gate_suite_done",
        candidate=candidate,
        incumbent=incumbent,
        passed=report.passed,
        failed=report.failed_gates,
        duration_s=round(report.duration_s, 2),
    )
    return report


def run_gate_suite_sync(
    config: GatesConfig,
    *,
    base_url: str,
    candidate: str,
    incumbent: str,
    base: str,
    api_key: str | None = None,
    stop: threading.Event | None = None,
) -> GateReport:
    """For synchronous callers (e.g. a promotion step outside any event loop)."""
    return asyncio.run(
        run_gate_suite(
            config,
            base_url=base_url,
            candidate=candidate,
            incumbent=incumbent,
            base=base,
            api_key=api_key,
            stop=stop,
        )
    )
