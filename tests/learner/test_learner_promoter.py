"""The promoter against fakes of the proxy admin API and the replicas: the deferred cleanup
runs under the promotion lock, and a promotion whose outcome is unknown unloads nothing."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from learner import promotion
from learner.adapter_store import AdapterStore
from learner.canary import CanaryVerdict
from learner.checkpoint import CheckpointStore
from learner.config import CanaryConfig, PromotionConfig
from learner.promotion import Promoter, PromotionError, PromotionOutcome, ReplicaSet
from safety.config import GatesConfig
from safety.gates.types import GateReport
from tests.learner.promotion_fakes import FakeAudit


class Replicas:
    """vLLM replicas: what is loaded; `on_list` runs inside the next listing."""

    def __init__(self, loaded: set[str]) -> None:
        self.base_urls = ["http://replica"]
        self.api_key = "vllm-key"  # vLLM's key, which the gate suite is given too
        self.loaded = set(loaded)
        self.unloaded: list[str] = []
        self.on_list: list = []

    def load(self, name: str, path: Path) -> None:
        self.loaded.add(name)

    def load_on(self, url: str, name: str, path: Path) -> None:
        self.loaded.add(name)

    def served(self, url: str) -> set[str]:
        return set(self.loaded)

    def unload(self, name: str) -> None:
        self.loaded.discard(name)
        self.unloaded.append(name)

    def loaded_versions(self) -> set[str]:
        snapshot = {n for n in self.loaded if n.startswith("policy-v")}
        while self.on_list:  # the listing was taken; something happens before it returns
            self.on_list.pop(0)()
        return snapshot

    def close(self) -> None:
        pass


class Proxy:
    """The admin API: one alias, an optional canary; `down`: every call raises."""

    def __init__(
        self, alias: str = "base", canary: dict | None = None, rollback_to: str | None = None
    ) -> None:
        self.alias, self.canary = alias, canary
        self.rollback_to = rollback_to  # what `olp rollback` would serve
        self.history: list[dict] = []  # as serving.json keeps it: who did what
        self.down = False
        self.flipped = threading.Event()
        self.ended: list[tuple[str, str]] = []

    def status(self) -> dict:
        if self.down:
            raise httpx.ConnectError("proxy restarting")
        canaries = {"policy": dict(self.canary)} if self.canary else {}
        rollback = {"policy": self.rollback_to} if self.rollback_to else {}
        return {
            "aliases": {"policy": self.alias},
            "frozen": False,
            "canaries": canaries,
            "rollback_targets": rollback,
            "history": list(self.history),
        }

    def set_alias(self, alias: str, target: str, expected: str | None = None) -> dict:
        if expected is not None and expected != self.alias:  # the proxy's compare-and-set
            raise PromotionError("proxy POST /admin/aliases → 409: alias_changed")
        self.alias = target
        self.flipped.set()
        return {}

    def start_canary(
        self, alias: str, target: str, share: float, expected: str | None = None
    ) -> dict:
        if expected is not None and expected != self.alias:
            raise PromotionError("proxy POST /admin/canary → 409: alias_changed")
        if self.canary:
            raise PromotionError("proxy POST /admin/canary → 409: canary_running")
        self.canary = {"target": target, "share": share}
        self.history.append(
            {"kind": "canary_start", "actor": promotion.ACTOR, "alias": alias, "target": target}
        )
        return self.canary

    def end_canary(self, alias: str, decision: str, reason: str, target: str | None = None) -> dict:
        if self.down:
            raise httpx.ConnectError("proxy restarting")
        self.ended.append((decision, reason))
        self.canary = None
        return {}

    def close(self) -> None:
        pass


def publish(store: AdapterStore, tmp_path: Path, version: int) -> Path:
    files = tmp_path / f"files-{version}"
    files.mkdir()
    (files / "adapter_model.safetensors").write_bytes(b"weights %d" % version)
    return store.publish(version, files, {"parent_version": version - 1})


def promoter(
    tmp_path: Path,
    replicas: Replicas,
    proxy: Proxy,
    audit: FakeAudit,
    stop: threading.Event | None = None,
    **config: object,
) -> Promoter:
    settings = {"drain_s": 3600.0, **config}  # cleanups are run by hand unless asked
    return Promoter(
        PromotionConfig.model_validate(settings),
        GatesConfig(),
        replicas=replicas,  # type: ignore[arg-type]
        proxy=proxy,  # type: ignore[arg-type]
        audit=audit,  # type: ignore[arg-type]
        state_dir=tmp_path,
        base_name="base",
        gate_runner=lambda candidate, incumbent: GateReport(True, []),
        stop=stop,
    )


def test_an_operator_rollback_during_the_gate_stands(tmp_path: Path) -> None:
    """v4 was gated against v3 while an operator rolled back to v2: the flip used to
    replace v2 with v4 (a child of the version just rolled back) and audit `previous: v3`."""
    store = AdapterStore(tmp_path)
    for version in (2, 3, 4):
        publish(store, tmp_path, version)
    replicas, proxy, audit = (
        Replicas({"policy-v2", "policy-v3"}),
        Proxy("policy-v3"),
        FakeAudit(),
    )
    p = promoter(tmp_path, replicas, proxy, audit)

    def gate_while_rolled_back(candidate: str, incumbent: str) -> GateReport:
        assert incumbent == "policy-v3"
        proxy.alias = "policy-v2"  # olp rollback, through the proxy
        return GateReport(True, [])

    p.gate_runner = gate_while_rolled_back
    outcome = p.promote(store.path(4))
    assert outcome.decision == "failed" and "alias_changed" in (outcome.reason or "")
    assert proxy.alias == "policy-v2"
    assert "policy-v4" not in replicas.loaded  # the candidate gave its LoRA slot back
    assert [name for name, _ in audit.events][-1] == "promotion_failed"


# -- the deferred cleanup ---------------------------------------------------------------------


def test_cleanup_does_not_unload_a_candidate_promoted_while_it_ran(tmp_path: Path) -> None:
    """The drain timer of v5's promotion fires while v6 is promoted. Without the promotion
    lock the cleanup listed the loaded versions, the promotion loaded and flipped to v6, and
    a second listing found v6 outside the `keep` set computed before it existed: the version
    the alias had just been flipped to was unloaded."""
    store = AdapterStore(tmp_path)
    for version in (4, 5, 6):
        publish(store, tmp_path, version)
    replicas, proxy, audit = Replicas({"policy-v4", "policy-v5"}), Proxy("policy-v5"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    outcomes: list[PromotionOutcome] = []
    worker = threading.Thread(target=lambda: outcomes.append(p.promote(store.path(6))))

    def promote_meanwhile() -> None:
        worker.start()
        proxy.flipped.wait(1.0)  # with the lock held by the cleanup, it cannot flip yet

    replicas.on_list.append(promote_meanwhile)
    p._cleanup("policy-v5")
    worker.join(10)
    assert outcomes and outcomes[0].decision == "promoted"
    assert proxy.alias == "policy-v6"
    assert "policy-v6" in replicas.loaded, f"unloaded: {replicas.unloaded}"
    assert store.path(6).is_dir()


def test_cleanup_waits_for_a_running_promotion(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    gate_started, release = threading.Event(), threading.Event()

    def slow_gate(candidate: str, incumbent: str) -> GateReport:
        gate_started.set()
        release.wait(10)
        return GateReport(True, [])

    p = promoter(tmp_path, replicas, proxy, audit)
    p.gate_runner = slow_gate
    worker = threading.Thread(target=p.promote, args=(store.path(2),))
    worker.start()
    assert gate_started.wait(10)
    # keep_loaded=1: run now, the cleanup of v1's promotion would unload the candidate v2
    # (loaded, not yet routed) out from under its gate.
    p.config = p.config.model_copy(update={"keep_loaded": 1})
    cleanup = threading.Thread(target=p._cleanup, args=("policy-v1",))
    cleanup.start()
    cleanup.join(0.3)
    assert cleanup.is_alive()  # blocked on the promotion lock while the gate runs
    assert replicas.unloaded == []
    release.set()
    worker.join(10)
    cleanup.join(10)
    assert not cleanup.is_alive() and proxy.alias == "policy-v2"
    assert replicas.loaded == {"policy-v2"} and replicas.unloaded == ["policy-v1"]


def test_cleanup_keeps_a_version_a_canary_routes_to(tmp_path: Path) -> None:
    """A canary's target (an operator's, on an older version) is served to its share of
    traffic: unloading it turned those requests into 404s."""
    store = AdapterStore(tmp_path)
    for version in (2, 3, 4):
        publish(store, tmp_path, version)
    replicas = Replicas({"policy-v2", "policy-v3", "policy-v4"})
    proxy = Proxy("policy-v4", canary={"target": "policy-v2", "share": 0.2})
    p = promoter(tmp_path, replicas, proxy, FakeAudit(), keep_loaded=1, retain_dirs=1)
    p._cleanup("policy-v4")
    assert replicas.loaded == {"policy-v2", "policy-v4"} and replicas.unloaded == ["policy-v3"]
    assert store.versions() == [2, 4]  # v3's directory pruned; the routed v2 kept


def test_cleanup_keeps_what_a_rollback_would_serve(tmp_path: Path) -> None:
    """v1-v3 promoted, rolled back to v2, then v4 promoted: a rollback now serves v2, which
    the newest two (v3, v4) left out; unloading it made `olp rollback` a 409."""
    store = AdapterStore(tmp_path)
    for version in (1, 2, 3, 4):
        publish(store, tmp_path, version)
    replicas = Replicas({"policy-v1", "policy-v2", "policy-v3", "policy-v4"})
    proxy = Proxy("policy-v4", rollback_to="policy-v2")
    p = promoter(tmp_path, replicas, proxy, FakeAudit(), keep_loaded=2, retain_dirs=1)
    p._cleanup("policy-v4")
    assert replicas.unloaded == ["policy-v1"]
    assert replicas.loaded == {"policy-v2", "policy-v3", "policy-v4"}
    assert store.versions() == [2, 3, 4]  # v2's directory kept with it


def test_cleanup_keeps_a_version_routed_just_before_its_unload(tmp_path: Path) -> None:
    """An operator's rollback goes through the proxy, not the promotion lock: the status is
    asked again before each unload."""
    store = AdapterStore(tmp_path)
    for version in (1, 2, 3):
        publish(store, tmp_path, version)
    replicas, proxy = Replicas({"policy-v1", "policy-v2", "policy-v3"}), Proxy("policy-v3")
    p = promoter(tmp_path, replicas, proxy, FakeAudit(), keep_loaded=1)
    original = proxy.status
    calls = {"n": 0}

    def status() -> dict:
        calls["n"] += 1
        if calls["n"] == 2:  # after the cleanup decided, before its first unload
            proxy.alias = "policy-v1"
        return original()

    proxy.status = status  # type: ignore[method-assign]
    p._cleanup("policy-v3")
    assert "policy-v1" in replicas.loaded and replicas.unloaded == ["policy-v2"]


def test_cleanup_prunes_the_gate_reports_of_pruned_versions(tmp_path: Path) -> None:
    """Version directories were pruned (`retain_dirs`), their gate reports never: the gates
    folder grew by one file per candidate for ever."""
    store = AdapterStore(tmp_path)
    for version in (1, 2, 3, 4, 5):
        publish(store, tmp_path, version)
    replicas = Replicas({"policy-v3", "policy-v4", "policy-v5"})
    p = promoter(tmp_path, replicas, Proxy("policy-v5"), FakeAudit(), keep_loaded=1, retain_dirs=2)
    for version in (1, 2, 3, 4, 5):
        p._write_gate_report(f"policy-v{version}", GateReport(version != 3, []))
    gates = tmp_path / "gates"
    shutil.rmtree(store.path(1))  # pruned by an olp that left its report behind
    (gates / "policy-v2.tmp").write_text("{")  # a write interrupted by a crash
    (gates / "policy-v5.tmp").write_text("{")
    (gates / "notes.txt").write_text("an operator's")  # not a report: left alone
    p._cleanup("policy-v5")
    assert store.versions() == [4, 5]
    assert sorted(f.name for f in gates.iterdir()) == [
        "notes.txt",
        "policy-v4.json",
        "policy-v5.json",
    ]


def test_cleanup_keeps_the_gate_report_of_a_routed_version(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    for version in (2, 3, 4):
        publish(store, tmp_path, version)
    replicas = Replicas({"policy-v2", "policy-v3", "policy-v4"})
    proxy = Proxy("policy-v4", canary={"target": "policy-v2", "share": 0.2})
    p = promoter(tmp_path, replicas, proxy, FakeAudit(), keep_loaded=1, retain_dirs=1)
    for version in (2, 3, 4):
        p._write_gate_report(f"policy-v{version}", GateReport(True, []))
    p._cleanup("policy-v4")
    assert store.versions() == [2, 4]
    assert sorted(f.name for f in (tmp_path / "gates").iterdir()) == [
        "policy-v2.json",
        "policy-v4.json",
    ]


# -- a promotion whose outcome is unknown -----------------------------------------------------


class PromoteLostProxy(Proxy):
    """end_canary(promote) / set_alias raise and the proxy stops answering; `goes_through`:
    the proxy did promote before it went away."""

    def __init__(self, goes_through: bool) -> None:
        super().__init__("base")
        self.goes_through = goes_through

    def _lost(self, target: str) -> None:
        if self.goes_through:
            self.alias, self.canary = target, None
        self.down = True
        raise httpx.ReadTimeout("timed out")

    def set_alias(self, alias: str, target: str, expected: str | None = None) -> dict:
        self._lost(target)
        return {}

    def end_canary(self, alias: str, decision: str, reason: str, target: str | None = None) -> dict:
        if decision == "promote":
            assert self.canary is not None
            self._lost(self.canary["target"])
        return super().end_canary(alias, decision, reason)


def run_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, goes_through: bool, canary: bool
) -> tuple[Promoter, PromotionOutcome, PromoteLostProxy, Replicas, FakeAudit]:
    verdict = CanaryVerdict("promote", ["no regression"], {}, {})
    monkeypatch.setattr(promotion, "judge_canary", lambda *args: verdict)
    monkeypatch.setattr(promotion, "UNRESOLVED_CHECKS", 10_000, raising=False)  # until it answers
    store = AdapterStore(tmp_path)
    path = publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), PromoteLostProxy(goes_through), FakeAudit()
    canary_config = CanaryConfig(enabled=canary, poll_s=0.01, min_samples=1)
    p = promoter(tmp_path, replicas, proxy, audit, drain_s=0.05, canary=canary_config)
    return p, p.promote(path), proxy, replicas, audit


@pytest.mark.parametrize("canary", [True, False], ids=["canary", "flip"])
@pytest.mark.parametrize("goes_through", [True, False], ids=["promoted", "not_promoted"])
def test_an_unknown_promotion_unloads_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, goes_through: bool, canary: bool
) -> None:
    """Both the promote reply and the status queries after it failed. This was taken for a
    refusal: the canary was ended with a rollback and the candidate unloaded; when the proxy
    had in fact promoted, the alias then pointed at an adapter no replica served."""
    p, outcome, proxy, replicas, audit = run_unknown(tmp_path, monkeypatch, goes_through, canary)
    p.close()  # no re-check here: the state as the promotion left it
    assert outcome.decision == "unresolved"
    assert "may serve policy-v1" in outcome.reason
    assert replicas.loaded == {"policy-v1"} and replicas.unloaded == []
    assert proxy.ended == []  # no rollback sent on a guess
    event, payload = audit.events[-1]
    assert event == "promotion_unresolved"
    assert payload["version"] == "policy-v1" and "left loaded" in payload["action"]
    assert payload["stage"] == ("canary_promote" if canary else "flip")


def test_a_learner_that_stops_with_a_promotion_unresolved_says_so(tmp_path: Path) -> None:
    """Its re-check was cancelled in silence; decided.json records it decided, so no later
    start looks at it again: the audit log now ends its story."""
    store = AdapterStore(tmp_path)
    path = publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), PromoteLostProxy(True), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)  # drain_s 3600: the re-check waits
    assert p.promote(path).decision == "unresolved"
    assert audit.names()[-1] == "promotion_unresolved"
    p.close()
    event, payload = audit.events[-1]
    assert event == "promotion_unresolved" and len(audit.events) >= 2
    assert payload["version"] == "policy-v1" and payload["checks"] == 0
    assert "the learner stopped before re-checking" in payload["action"]
    p.close()  # idempotent: nothing more to say
    assert audit.events[-1] == (event, payload)


def wait_for(p: Promoter, count: int) -> list[PromotionOutcome]:
    deadline = time.monotonic() + 10
    while len(p.outcomes) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return p.outcomes


@pytest.mark.parametrize("canary", [True, False], ids=["canary", "flip"])
def test_an_unknown_promotion_that_happened_is_confirmed_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, canary: bool
) -> None:
    p, outcome, proxy, replicas, audit = run_unknown(tmp_path, monkeypatch, True, canary)
    assert outcome.decision == "unresolved"
    time.sleep(0.2)  # re-checks while the proxy is still down leave everything as it is
    assert replicas.loaded == {"policy-v1"} and len(p.outcomes) == 1
    proxy.down = False
    late = wait_for(p, 2)[-1]
    p.close()
    assert late.decision == "promoted" and replicas.loaded == {"policy-v1"}
    _, payload = next(e for e in audit.events if e[0] == "promotion")
    assert payload["resolved_late"] is True and payload["version"] == "policy-v1"


@pytest.mark.parametrize("canary", [True, False], ids=["canary", "flip"])
def test_an_unknown_promotion_that_did_not_happen_is_undone_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, canary: bool
) -> None:
    p, outcome, proxy, replicas, audit = run_unknown(tmp_path, monkeypatch, False, canary)
    assert outcome.decision == "unresolved" and replicas.loaded == {"policy-v1"}
    proxy.down = False
    late = wait_for(p, 2)[-1]
    p.close()
    assert proxy.alias == "base" and not replicas.loaded
    if canary:  # the canary still ran on it: ended with a rollback
        assert late.decision == "canary_rolled_back"
        assert proxy.canary is None and proxy.ended[0][0] == "rollback"
        assert audit.names()[-1] == "canary_rolled_back"
    else:
        assert late.decision == "failed" and audit.names()[-1] == "promotion_failed"


def test_a_refused_canary_promotion_still_rolls_back_when_the_status_answers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal the status confirms (the alias did not move) keeps its old handling."""

    class Refuses(Proxy):
        def end_canary(
            self, alias: str, decision: str, reason: str, target: str | None = None
        ) -> dict:
            if decision == "promote":
                raise PromotionError("proxy POST /admin/canary/end → 409: serving is frozen")
            return super().end_canary(alias, decision, reason)

    verdict = CanaryVerdict("promote", ["no regression"], {}, {})
    monkeypatch.setattr(promotion, "judge_canary", lambda *args: verdict)
    store = AdapterStore(tmp_path)
    path = publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), Refuses("base"), FakeAudit()
    canary_config = CanaryConfig(enabled=True, poll_s=0.01, min_samples=1)
    outcome = promoter(tmp_path, replicas, proxy, audit, canary=canary_config).promote(path)
    assert outcome.decision == "canary_rolled_back" and "409" in outcome.reason
    assert proxy.ended == [("rollback", outcome.reason)] and not replicas.loaded


@pytest.mark.parametrize("decision", ["promote", "rollback"])
def test_a_canary_verdict_that_cannot_be_audited_ends_the_canary_as_a_rollback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, decision: str
) -> None:
    """The `canary_result` append came before the verdict was carried out: when it failed
    (a full disk) the canary ran on unwatched, and refused every later candidate's canary,
    until the learner restarted. Now it ends as a rollback, and the failure goes on."""
    from safety.audit import AuditError

    class FailingResult(FakeAudit):
        def append(self, actor: str, event: str, payload: dict | None = None) -> None:
            if event == "canary_result":
                raise AuditError("simulated: the disk is full")
            super().append(actor, event, payload)

    verdict = CanaryVerdict(decision, ["judged"], {}, {})
    monkeypatch.setattr(promotion, "judge_canary", lambda *args: verdict)
    store = AdapterStore(tmp_path)
    path = publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), Proxy("base"), FailingResult()
    canary_config = CanaryConfig(enabled=True, poll_s=0.01, min_samples=1)
    with pytest.raises(AuditError):
        promoter(tmp_path, replicas, proxy, audit, canary=canary_config).promote(path)
    assert proxy.canary is None and proxy.alias == "base"
    assert proxy.ended == [("rollback", "its result could not be audited")]
    assert not replicas.loaded


class RollbackLostProxy(Proxy):
    """end_canary(rollback) raises and the proxy stops answering; `operator_promotes`: an
    operator had promoted the canary just before (so the rollback found no canary)."""

    def __init__(self, operator_promotes: bool) -> None:
        super().__init__("base")
        self.operator_promotes = operator_promotes
        self.failing_end = True

    def end_canary(self, alias: str, decision: str, reason: str, target: str | None = None) -> dict:
        if self.failing_end:
            self.failing_end = False
            if self.operator_promotes:
                assert self.canary is not None
                self.alias, self.canary = self.canary["target"], None
            self.down = True
            raise httpx.ReadTimeout("timed out")
        return super().end_canary(alias, decision, reason)


@pytest.mark.parametrize("operator_promotes", [False, True], ids=["still_running", "promoted"])
def test_a_canary_rollback_that_could_not_end_unloads_nothing_on_a_guess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operator_promotes: bool
) -> None:
    """The verdict said roll back, ending the canary failed and the status could not be
    read: the candidate was unloaded anyway, though an operator may have promoted it (the
    alias then served an adapter no replica had)."""
    verdict = CanaryVerdict("rollback", ["reward regression"], {}, {})
    monkeypatch.setattr(promotion, "judge_canary", lambda *args: verdict)
    monkeypatch.setattr(promotion, "UNRESOLVED_CHECKS", 10_000, raising=False)
    store = AdapterStore(tmp_path)
    path = publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), RollbackLostProxy(operator_promotes), FakeAudit()
    canary_config = CanaryConfig(enabled=True, poll_s=0.01, min_samples=1)
    p = promoter(tmp_path, replicas, proxy, audit, drain_s=0.05, canary=canary_config)
    outcome = p.promote(path)
    assert outcome.decision == "canary_rolled_back"
    assert replicas.loaded == {"policy-v1"} and replicas.unloaded == []
    event, payload = audit.events[-1]
    assert event == "canary_rolled_back"
    assert "left loaded" in payload["cleanup_failed"][-1]
    proxy.down = False  # the re-check settles it
    late = wait_for(p, 2)[-1]
    p.close()
    if operator_promotes:
        assert late.decision == "promoted" and replicas.loaded == {"policy-v1"}
        assert audit.names()[-1] == "canary_promoted_by_operator"
    else:
        assert late.decision == "canary_rolled_back" and not replicas.loaded
        assert proxy.canary is None and proxy.ended[-1][0] == "rollback"


# -- stopping mid-gate --------------------------------------------------------------------------


def test_closing_interrupts_a_running_gate_and_announces_the_candidate_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close()` waited up to 300 s for the gate suite, which takes 36-100 s on a CPU: `olp up`
    killed the learner after 30 s, with the candidate left loaded and never gated (it was
    marked announced, so the next start did not submit it again)."""
    from safety.gates.types import GateInterrupted

    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    CheckpointStore(tmp_path).mark_announced(2)  # the learner, as it submits v2
    p.gate_runner = p._run_gates  # the promoter's own suite call, with its stop wiring
    monkeypatch.setattr(p, "_zero_base", lambda like: "olp-zero-base")
    suite_started = threading.Event()

    def suite_until_stopped(*args: object, stop: threading.Event, **kwargs: object) -> GateReport:
        assert kwargs["api_key"] == "vllm-key"  # the suite reaches vLLM with its key
        suite_started.set()
        if stop.wait(60):  # a suite of minutes; run_gate_suite raises like this on `stop`
            raise GateInterrupted("asked to stop")
        return GateReport(True, [])

    monkeypatch.setattr(promotion, "run_gate_suite_sync", suite_until_stopped)
    p.submit(store.path(2))
    assert suite_started.wait(10)
    started = time.monotonic()
    p.close(timeout_s=30)
    assert time.monotonic() - started < 5
    assert [o.decision for o in p.outcomes] == ["interrupted"]
    assert "promotion_interrupted" in audit.names()
    assert not {"gate_result", "candidate_rejected", "promotion_failed"} & set(audit.names())
    payload = dict(audit.events)["promotion_interrupted"]
    assert payload["version"] == "policy-v2" and payload["incumbent"] == "policy-v1"
    assert replicas.unloaded == ["policy-v2"] and proxy.alias == "policy-v1"
    assert CheckpointStore(tmp_path).decided() == 0  # the next start submits v2 again
    assert not (tmp_path / "gates" / "policy-v2.json").exists()


def test_a_decision_never_moves_the_decided_marker_back(tmp_path: Path) -> None:
    checkpoints = CheckpointStore(tmp_path)
    assert checkpoints.decided() is None
    checkpoints.mark_decided(0)  # a new state dir: recorded, nothing decided yet
    assert checkpoints.decided() == 0
    checkpoints.mark_decided(5)
    checkpoints.mark_decided(4)  # v4's superseded record comes late: v5's stands
    assert checkpoints.decided() == 5


def test_the_learners_stop_signal_interrupts_a_gate_before_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close()` comes only after the training step in progress has ended; the stop signal
    itself must end the gate, or a learner busy training and gating is killed anyway."""
    from safety.gates.types import GateInterrupted

    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    stop = threading.Event()
    replicas, proxy, audit = Replicas(set()), Proxy("base"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, stop=stop)
    p.gate_runner = p._run_gates  # the promoter's own suite call, with its stop wiring
    monkeypatch.setattr(p, "_zero_base", lambda like: "olp-zero-base")
    suite_started = threading.Event()

    def suite_until_stopped(*args: object, stop: threading.Event, **kwargs: object) -> GateReport:
        suite_started.set()
        if stop.wait(60):
            raise GateInterrupted("asked to stop")
        return GateReport(True, [])

    monkeypatch.setattr(promotion, "run_gate_suite_sync", suite_until_stopped)
    p.submit(store.path(1))
    assert suite_started.wait(10)
    stop.set()
    deadline = time.monotonic() + 5
    while not p.outcomes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert [o.decision for o in p.outcomes] == ["interrupted"]  # before any close()
    assert "promotion_interrupted" in audit.names() and proxy.alias == "base"
    p.close(timeout_s=5)


def test_a_candidate_queued_behind_an_interrupted_gate_is_not_loaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen with `olp up`: after Ctrl-C the worker loaded the next queued candidate onto vLLM
    only to interrupt its gate at once."""
    store = AdapterStore(tmp_path)
    for version in (1, 2):
        publish(store, tmp_path, version)
    replicas, proxy, audit = Replicas(set()), Proxy("base"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    CheckpointStore(tmp_path).mark_announced(2)
    p._closing.set()
    outcome = p.promote(store.path(2))
    assert outcome.decision == "interrupted" and "gate_s" not in outcome.timings
    assert replicas.loaded == set() and replicas.unloaded == []
    assert audit.names() == ["promotion_interrupted"]
    assert "after_s" not in dict(audit.events)["promotion_interrupted"]
    assert CheckpointStore(tmp_path).decided() == 0  # gated at the next start


def test_an_incumbent_missing_from_a_restarted_replica_is_loaded_before_the_gate(
    tmp_path: Path,
) -> None:
    """After `olp up` started again, vLLM served only the base: every gate compared the
    candidate with HTTP 404s for the incumbent and rejected it (four gates failed closed)."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas(set()), Proxy("policy-v1"), FakeAudit()
    served_at_gate: list[set[str]] = []
    p = promoter(tmp_path, replicas, proxy, audit)

    def gate(candidate: str, incumbent: str) -> GateReport:
        served_at_gate.append(set(replicas.loaded))
        return GateReport(True, [])

    p.gate_runner = gate
    assert p.promote(store.path(2)).decision == "promoted"
    assert served_at_gate == [{"policy-v1", "policy-v2"}]
    assert (
        "adapter_reloaded",
        {"version": "policy-v1", "replica": "http://replica", "by": "promotion"},
    ) in audit.events
    # Served already: nothing loaded again, nothing audited.
    publish(store, tmp_path, 3)
    assert p.promote(store.path(3)).decision == "promoted"
    assert audit.names().count("adapter_reloaded") == 1


def test_an_incumbent_that_cannot_be_served_fails_the_promotion_not_the_candidate(
    tmp_path: Path,
) -> None:
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 2)  # policy-v1's directory is gone (pruned)
    replicas, proxy, audit = Replicas(set()), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    outcome = p.promote(store.path(2))
    assert outcome.decision == "failed" and "policy-v1" in outcome.reason
    assert "candidate_rejected" not in audit.names() and "promotion_failed" in audit.names()
    assert proxy.alias == "policy-v1"


def test_an_alias_the_proxy_lacks_is_refused_before_the_gate(tmp_path: Path) -> None:
    """The proxy adds no aliases: the flip would fail after minutes of gating, for every
    candidate. Refused at once, loading and gating nothing, saying which aliases exist."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), Proxy("base"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, alias="polcy")
    gated: list[str] = []
    p.gate_runner = lambda candidate, incumbent: gated.append(candidate) or GateReport(True, [])
    outcome = p.promote(store.path(1))
    assert outcome.decision == "skipped_unknown_alias"
    assert outcome.reason == "the proxy has no alias 'polcy' (its aliases: ['policy'])"
    assert gated == [] and replicas.loaded == set() and not proxy.flipped.is_set()
    assert (
        "promotion_skipped",
        {"version": "policy-v1", "reason": "unknown_alias", "alias": "polcy"},
    ) in audit.events


def test_the_replica_client_drops_idle_connections_before_vllms_keepalive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """httpx keeps idle connections 5 s, as long as vLLM does: a load or listing sent at
    that age could meet a connection vLLM was closing. Shortened here to keep it quick."""
    from tests.proxy.threaded_upstream import NotingUpstream, assert_reconnects_after_idle

    assert promotion.VLLM_SAFE_KEEPALIVE_S < 5.0
    monkeypatch.setattr(promotion, "VLLM_SAFE_KEEPALIVE_S", 0.3)
    server = NotingUpstream({("GET", "/v1/models"): {"data": [{"id": "base"}]}}).start()
    replicas = promotion.ReplicaSet([server.url])
    try:
        assert_reconnects_after_idle(lambda: replicas.served(server.url), server.connections)
    finally:
        replicas.close()
        server.stop()


# -- the gate report file -----------------------------------------------------------------------


def test_a_gate_report_that_cannot_be_written_still_audits_and_rejects(tmp_path: Path) -> None:
    """The report file was written before the `gate_result` record, outside any handler: a
    write that failed (disk full, a file where the gates folder should be) skipped the
    decision's audit records, and the rejected candidate stayed loaded."""
    from safety.gates.types import GateResult

    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 3)
    publish(store, tmp_path, 4)
    (tmp_path / "gates").write_text("not a directory")
    replicas, proxy, audit = Replicas({"policy-v3"}), Proxy("policy-v3"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    p.gate_runner = lambda c, i: GateReport(False, [GateResult.failed_closed("safety", "unsafe")])
    outcome = p.promote(store.path(4))
    assert outcome.decision == "rejected"
    assert audit.names() == ["gate_result", "candidate_rejected"]
    gate_result = audit.events[0][1]
    assert gate_result["passed"] is False
    assert "report_write_failed" in gate_result
    assert "policy-v4" not in replicas.loaded


# -- names that are not versions ----------------------------------------------------------------


def test_a_directory_moved_aside_does_not_stop_pruning(tmp_path: Path) -> None:
    """`policy-v6.moved-aside` (what the ResumeRefused message asks for) matched the
    `policy-v*` glob and its name failed to parse: every later cleanup raised before it
    pruned anything."""
    store = AdapterStore(tmp_path)
    for version in range(1, 7):
        publish(store, tmp_path, version)
    shutil.move(store.path(6), store.root / "policy-v6.moved-aside")
    audit = FakeAudit()
    p = promoter(
        tmp_path, Replicas({"policy-v5"}), Proxy("policy-v5"), audit, retain_dirs=2, keep_loaded=1
    )
    p._cleanup("policy-v5")
    assert store.versions() == [4, 5]
    assert (store.root / "policy-v6.moved-aside").is_dir()  # not ours to prune
    assert audit.names() == ["adapter_pruned"] * 3


def test_the_replicas_list_only_version_names(tmp_path: Path) -> None:
    """A LoRA an operator loaded as `policy-v3-hotfix` is no version: listing it made the
    cleanup's sort by version number raise."""

    def vllm(request: httpx.Request) -> httpx.Response:
        names = ["base", "policy-v3", "policy-v3-hotfix", "policy-vx"]
        return httpx.Response(200, json={"data": [{"id": n} for n in names]})

    replicas = ReplicaSet(["http://replica"])
    replicas._client = httpx.Client(transport=httpx.MockTransport(vllm))
    assert replicas.loaded_versions() == {"policy-v3"}


# -- an unload vLLM refuses -----------------------------------------------------------------------


def refusing_vllm(loaded: set[str]) -> ReplicaSet:
    """A ReplicaSet whose one replica lists `loaded` and refuses every unload (500)."""

    def vllm(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": n} for n in ["base", *loaded]]})
        if request.url.path == "/v1/unload_lora_adapter":
            return httpx.Response(500, text="engine busy")
        return httpx.Response(400, text="has already been loaded")  # each name is loaded

    replicas = ReplicaSet(["http://replica"])
    replicas._client = httpx.Client(transport=httpx.MockTransport(vllm))
    return replicas


def test_a_refused_unload_raises(tmp_path: Path) -> None:
    replicas = refusing_vllm({"policy-v1"})
    with pytest.raises(PromotionError, match="policy-v1 still loaded"):
        replicas.unload("policy-v1")


def test_cleanup_never_prunes_a_version_vllm_still_serves(tmp_path: Path) -> None:
    """vLLM refused the unload (non-200): it was only logged, the cleanup counted the version
    as unloaded and deleted the directory of an adapter vLLM still served."""
    store = AdapterStore(tmp_path)
    for version in (1, 2, 3):
        publish(store, tmp_path, version)
    replicas, audit = refusing_vllm({"policy-v1", "policy-v2", "policy-v3"}), FakeAudit()
    proxy = Proxy(alias="policy-v3", rollback_to="policy-v2")
    p = Promoter(
        PromotionConfig.model_validate({"drain_s": 3600, "keep_loaded": 1, "retain_dirs": 1}),
        GatesConfig(),
        replicas=replicas,
        proxy=proxy,  # type: ignore[arg-type]
        audit=audit,  # type: ignore[arg-type]
        state_dir=tmp_path,
        base_name="base",
        gate_runner=lambda c, i: GateReport(True, []),
    )
    p._cleanup("policy-v3")
    assert store.versions() == [1, 2, 3]  # v1 is still served; v2 is the rollback target
    assert audit.names() == ["adapter_unload_failed"]
    payload = audit.events[0][1]
    assert payload["version"] == "policy-v1" and "engine busy" in payload["error"]


def test_a_refused_unload_of_a_rejected_candidate_is_noted(tmp_path: Path) -> None:
    from safety.gates.types import GateResult

    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, audit = refusing_vllm({"policy-v1", "policy-v2"}), FakeAudit()
    p = Promoter(
        PromotionConfig.model_validate({"drain_s": 3600}),
        GatesConfig(),
        replicas=replicas,
        proxy=Proxy("policy-v1"),  # type: ignore[arg-type]
        audit=audit,  # type: ignore[arg-type]
        state_dir=tmp_path,
        base_name="base",
        gate_runner=lambda c, i: GateReport(False, [GateResult.failed_closed("kl", "too far")]),
    )
    assert p.promote(store.path(2)).decision == "rejected"
    rejected = dict(audit.events)["candidate_rejected"]
    assert "engine busy" in rejected["cleanup_failed"][0]


# -- never unload what the proxy serves --------------------------------------------------------


def point_alias_during_gate(proxy: Proxy, passed: bool) -> Callable[[str, str], GateReport]:
    """A gate during which an operator points the alias at the candidate (`olp rollback --to
    policy-v2`: allowed, it is loaded on every replica for the gate)."""

    def gate(candidate: str, incumbent: str) -> GateReport:
        proxy.alias = candidate
        return GateReport(passed, [])

    return gate


def test_a_candidate_the_alias_serves_is_not_unloaded_when_its_canary_is_refused(
    tmp_path: Path,
) -> None:
    """The canary start got 409 alias_changed, and the rollback path unloaded the version the
    alias now served: every request on the alias failed."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, canary={"enabled": True})
    p.gate_runner = point_alias_during_gate(proxy, passed=True)
    outcome = p.promote(store.path(2))
    assert proxy.alias == "policy-v2" and "policy-v2" in replicas.loaded
    assert replicas.unloaded == []
    assert outcome.decision == "promoted"
    assert audit.names()[-1] == "canary_promoted_by_operator"


def test_a_rejected_candidate_the_alias_serves_stays_loaded(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    p.gate_runner = point_alias_during_gate(proxy, passed=False)
    assert p.promote(store.path(2)).decision == "rejected"
    assert "policy-v2" in replicas.loaded and replicas.unloaded == []
    rejected = dict(audit.events)["candidate_rejected"]
    assert "routes to it" in rejected["left_loaded"]


def test_a_canary_rollback_keeps_a_candidate_an_operator_made_the_rollback_target(
    tmp_path: Path,
) -> None:
    """The unload after a canary's rollback asks the proxy first, as the cleanup does."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, canary={"enabled": True})
    proxy.rollback_to = "policy-v2"  # say, an operator's flips through it meanwhile
    p._abandon_canary("policy-v2", "policy-v1", "test")
    assert replicas.unloaded == []
    payload = dict(audit.events)["canary_rolled_back"]
    assert "left loaded" in payload["cleanup_failed"][-1]


# -- a learner that died before its candidate's gate decided ------------------------------------


def test_a_candidate_whose_gate_never_decided_is_gated_at_the_next_start(tmp_path: Path) -> None:
    """`announced.json` was written when the candidate was queued: a learner killed (SIGKILL,
    OOM) while the gate ran never submitted that candidate again, so it stayed ungated until
    a newer version came."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    proxy = Proxy("policy-v1")
    first = promoter(tmp_path, Replicas({"policy-v1"}), proxy, FakeAudit())
    gate_running, release = threading.Event(), threading.Event()

    def gate_until_killed(candidate: str, incumbent: str) -> GateReport:
        gate_running.set()
        release.wait(30)
        raise RuntimeError("the process is gone")  # never gets to decide anything

    first.gate_runner = gate_until_killed
    first.submit(store.path(2))
    CheckpointStore(tmp_path).mark_announced(2)  # what the learner writes after submit
    assert gate_running.wait(10)
    # -- killed here; the next start:
    replicas, audit = Replicas({"policy-v1"}), FakeAudit()
    second = promoter(tmp_path, replicas, proxy, audit)
    try:
        second.resume()
        outcomes = wait_for(second, 1)
    finally:
        release.set()
        second.close(timeout_s=5)
        first.close(timeout_s=5)
    assert [(o.version, o.decision) for o in outcomes] == [("policy-v2", "promoted")]
    assert proxy.alias == "policy-v2" and audit.names()[:2] == ["gate_result", "promotion"]
    assert CheckpointStore(tmp_path).decided() == 2


def test_a_decided_candidate_is_not_gated_again(tmp_path: Path) -> None:
    """The start-up's resubmission and the learner's own announcement of the same version
    (or a decided one) gate it once."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    gates: list[str] = []
    audit = FakeAudit()
    p = promoter(tmp_path, Replicas(set()), Proxy("policy-v1"), audit)
    p.gate_runner = lambda c, i: gates.append(c) or GateReport(False, [])
    p.submit(store.path(2))
    p.submit(store.path(2))
    wait_for(p, 1)
    p.submit(store.path(2))
    p.submit(store.path(1))
    p.close(timeout_s=5)
    assert gates == ["policy-v2"] and "candidate_superseded" not in audit.names()
    assert [o.decision for o in p.outcomes] == ["rejected"]


def test_an_old_state_dir_counts_what_it_announced_as_decided(tmp_path: Path) -> None:
    """A state dir from before decisions were recorded: what was announced counts as
    decided, as it did, so the first start does not gate the serving version again."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    CheckpointStore(tmp_path).mark_announced(1)
    p = promoter(tmp_path, Replicas(set()), Proxy("policy-v1"), FakeAudit())
    p.resume()
    p.close(timeout_s=5)
    assert p.outcomes == [] and CheckpointStore(tmp_path).decided() == 1


# -- a canary a learner that died left running ----------------------------------------------------


def orphaned_canary(tmp_path: Path, actor: str) -> tuple[AdapterStore, Proxy, Replicas]:
    """v2's canary, started by `actor`, still running in the proxy (serving.json keeps it)
    while nothing watches it; v3 and v4 are published."""
    store = AdapterStore(tmp_path)
    for version in (1, 2, 3, 4):
        publish(store, tmp_path, version)
    proxy = Proxy("policy-v1", canary={"target": "policy-v2", "share": 0.1})
    proxy.history = [
        {"kind": "canary_start", "actor": actor, "alias": "policy", "target": "policy-v2"}
    ]
    return store, proxy, Replicas({"policy-v1", "policy-v2"})


SHORT_CANARY = {"enabled": True, "poll_s": 0.01, "max_duration_s": 0.05}


def test_a_canary_a_dead_learner_left_running_is_rolled_back(tmp_path: Path) -> None:
    """Every later candidate's canary got 409 canary_running, `_canary_is_ours` said no, and
    the candidate was unloaded as canary_rolled_back: no promotion could ever happen, and
    the orphan kept serving its unjudged candidate."""
    store, proxy, replicas = orphaned_canary(tmp_path, promotion.ACTOR)
    audit = FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, canary=SHORT_CANARY)
    outcome = p.promote(store.path(3))
    orphan = audit.events[0]
    assert orphan[0] == "canary_rolled_back" and orphan[1]["orphaned"] is True
    assert orphan[1]["version"] == "policy-v2" and orphan[1]["stable"] == "policy-v1"
    assert proxy.ended[0][0] == "rollback" and "policy-v2" in replicas.unloaded
    # v3's own canary then ran, to a verdict (here: evidence short, rolled back).
    assert ("canary_result", "policy-v3") in [(n, e.get("version")) for n, e in audit.events]
    assert "canary start failed" not in outcome.reason


def test_the_orphan_is_ended_at_start_up(tmp_path: Path) -> None:
    _, proxy, replicas = orphaned_canary(tmp_path, promotion.ACTOR)
    CheckpointStore(tmp_path).mark_decided(4)  # nothing to gate: only the orphan
    audit = FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    p.resume()
    deadline = time.monotonic() + 10
    while proxy.canary is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    p.close(timeout_s=5)
    assert proxy.canary is None and audit.names() == ["canary_rolled_back"]


def test_an_operators_canary_is_left_alone(tmp_path: Path) -> None:
    store, proxy, replicas = orphaned_canary(tmp_path, "alice")
    audit = FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, canary=SHORT_CANARY)
    outcome = p.promote(store.path(3))
    assert proxy.canary == {"target": "policy-v2", "share": 0.1} and proxy.ended == []
    assert outcome.decision == "canary_rolled_back" and "canary_running" in outcome.reason
    assert "policy-v2" in replicas.loaded


# -- a proxy (or replica) that does not answer is no decision -----------------------------------


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_candidate_the_proxy_did_not_answer_for_is_retried_not_decided(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A proxy restarting as v2 arrived: `promotion_failed`, and v2 was recorded decided, so
    neither this learner nor its next start ever gated it (a good candidate never served)."""
    monkeypatch.setattr(promotion, "DEFERRED_RETRY_FIRST_S", 0.05)
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    proxy.down = True
    try:
        p.submit(store.path(2))
        assert wait_until(lambda: "promotion_deferred" in audit.names())
        assert CheckpointStore(tmp_path).decided() == 0  # the next start submits v2 again
        assert "promotion_failed" not in audit.names() and replicas.loaded == {"policy-v1"}
        payload = dict(audit.events)["promotion_deferred"]
        assert payload["version"] == "policy-v2" and "proxy restarting" in payload["error"]
        proxy.down = False  # back: the worker retries after its backoff
        assert wait_until(lambda: proxy.alias == "policy-v2")
    finally:
        p.close(timeout_s=5)
    assert [o.decision for o in p.outcomes if o.decision != "deferred"] == ["promoted"]
    assert CheckpointStore(tmp_path).decided() == 2


def test_the_promoter_outlives_an_audit_log_it_cannot_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A candidate whose promotion crashed was audited `promotion_failed` by the worker's
    crash handler; when that append failed too (a full disk) the worker thread died, was
    never started again, and every later candidate waited in the queue for ever."""
    from safety.audit import AuditError

    class Unwritable(FakeAudit):
        def append(self, actor: str, event: str, payload: dict | None = None) -> None:
            if event == "promotion_failed":
                raise AuditError("simulated: the disk is full")
            super().append(actor, event, payload)

    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    replicas, proxy = Replicas({"policy-v1"}), Proxy("policy-v1")
    p = promoter(tmp_path, replicas, proxy, Unwritable())
    promote = p.promote

    def crashes_on_v1(path: Path) -> PromotionOutcome:
        if path.name == "policy-v1":
            raise RuntimeError("boom")
        return promote(path)

    monkeypatch.setattr(p, "promote", crashes_on_v1)
    try:
        p.submit(store.path(1))
        assert wait_until(lambda: CheckpointStore(tmp_path).decided() == 1)
        p.submit(store.path(2))
        assert wait_until(lambda: proxy.alias == "policy-v2")  # the worker lives on
    finally:
        p.close(timeout_s=5)


def test_a_pending_retry_does_not_hold_up_close_and_the_next_start_gates_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(promotion, "DEFERRED_RETRY_FIRST_S", 60.0)
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    proxy = Proxy("policy-v1")
    proxy.down = True
    first_audit = FakeAudit()
    first = promoter(tmp_path, Replicas({"policy-v1"}), proxy, first_audit)
    first.submit(store.path(2))
    CheckpointStore(tmp_path).mark_announced(2)
    assert wait_until(lambda: "promotion_deferred" in first_audit.names())
    started = time.monotonic()
    first.close(timeout_s=30)
    assert time.monotonic() - started < 2
    assert CheckpointStore(tmp_path).decided() == 0
    # -- the next start, the proxy back:
    proxy.down = False
    second = promoter(tmp_path, Replicas({"policy-v1"}), proxy, FakeAudit())
    try:
        second.resume()
        outcomes = wait_for(second, 1)
    finally:
        second.close(timeout_s=5)
    assert [(o.version, o.decision) for o in outcomes] == [("policy-v2", "promoted")]


def test_a_newer_candidate_supersedes_a_deferred_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(promotion, "DEFERRED_RETRY_FIRST_S", 60.0)
    store = AdapterStore(tmp_path)
    for version in (1, 2, 3):
        publish(store, tmp_path, version)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    gated: list[str] = []
    p = promoter(tmp_path, replicas, proxy, audit)
    p.gate_runner = lambda c, i: gated.append(c) or GateReport(True, [])
    proxy.down = True
    try:
        p.submit(store.path(2))
        assert wait_until(lambda: "promotion_deferred" in audit.names())
        proxy.down = False
        p.submit(store.path(3))  # long before v2's retry is due
        assert wait_until(lambda: proxy.alias == "policy-v3")
    finally:
        p.close(timeout_s=5)
    assert gated == ["policy-v3"]
    assert ("candidate_superseded", {"version": "policy-v2", "by": "policy-v3"}) in audit.events
    assert CheckpointStore(tmp_path).decided() == 3


class UnreachableReplicas(Replicas):
    """A vLLM replica that does not answer a load (`error`), or refuses it."""

    def __init__(self, loaded: set[str], error: Exception) -> None:
        super().__init__(loaded)
        self.error = error

    def load(self, name: str, path: Path) -> None:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        httpx.ConnectError("connection refused"),
        httpx.ReadTimeout("timed out"),
        httpx.HTTPStatusError(
            "503", request=httpx.Request("GET", "http://replica"), response=httpx.Response(503)
        ),
        promotion.ProxyUnavailable("proxy GET /admin/status → 502: bad gateway"),
    ],
    ids=["refused", "timeout", "replica-5xx", "proxy-5xx"],
)
def test_a_replica_or_proxy_that_does_not_answer_defers_the_candidate(
    tmp_path: Path, error: Exception
) -> None:
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    replicas, proxy, audit = UnreachableReplicas(set(), error), Proxy("base"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    outcome = p.promote(store.path(1))
    assert outcome.decision == "deferred" and audit.names() == ["promotion_deferred"]
    assert CheckpointStore(tmp_path).decided() == 0 and proxy.alias == "base"


def test_a_candidate_a_replica_refuses_to_load_is_still_decided(tmp_path: Path) -> None:
    """The replica answered: its refusal is about the candidate (its files), a decision."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    refusal = PromotionError("http://replica refused to load policy-v1: bad adapter")
    replicas, proxy, audit = UnreachableReplicas(set(), refusal), Proxy("base"), FakeAudit()
    outcome = promoter(tmp_path, replicas, proxy, audit).promote(store.path(1))
    assert outcome.decision == "failed" and audit.names() == ["promotion_failed"]
    assert CheckpointStore(tmp_path).decided() == 1


def test_the_admin_client_tells_a_proxy_error_from_a_refusal() -> None:
    """5xx: the proxy could not answer (retried); 4xx: it answered no (a decision)."""

    def proxy(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/admin/status":
            return httpx.Response(503, text="restarting")
        return httpx.Response(409, text="alias_changed")

    admin = promotion.ProxyAdmin("http://proxy", "key")
    admin._client = httpx.Client(base_url="http://proxy", transport=httpx.MockTransport(proxy))
    with pytest.raises(promotion.ProxyUnavailable, match="503"):
        admin.status()
    with pytest.raises(PromotionError, match="409") as refused:
        admin.set_alias("policy", "policy-v2", expected="policy-v1")
    assert not isinstance(refused.value, promotion.ProxyUnavailable)
    assert promotion.unreachable(httpx.ConnectError("refused"))
    assert not promotion.unreachable(refused.value)


# -- the worker outlives its own failures; interrupted and unanswered are not decisions --------


def test_the_worker_outlives_a_full_disk_and_never_audits_a_serving_version_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decided.json could not be written (ENOSPC) after a flip: the promoter audited
    `promotion_failed` for the version serving, and when the write failed again the worker
    thread died, leaving every later candidate in the queue for ever."""
    from learner import checkpoint

    store = AdapterStore(tmp_path)
    v1, v2 = publish(store, tmp_path, 1), publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas(set()), Proxy(alias="base"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    write = checkpoint._write_version
    failures = {"left": 2}

    def full_disk(path: Path, version: int) -> None:
        if path.name == "decided.json" and failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(28, "No space left on device")
        write(path, version)

    monkeypatch.setattr(checkpoint, "_write_version", full_disk)
    p.submit(v1)
    assert [o.decision for o in wait_for(p, 1)] == ["promoted"]
    assert "promotion_failed" not in audit.names() and proxy.alias == "policy-v1"
    # A failed audit append while superseding: the worker still lives.
    real_append = audit.append

    def failing_append(actor: str, event: str, payload: dict | None = None) -> None:
        if event == "candidate_superseded":
            raise OSError(28, "No space left on device")
        real_append(actor, event, payload)

    audit.append = failing_append  # type: ignore[method-assign]
    p._queue.put(v2)  # both at once: v1's resubmission is superseded... or decided
    p._queue.put(publish(store, tmp_path, 3))
    p.submit(publish(store, tmp_path, 4))
    assert wait_until(lambda: proxy.alias == "policy-v4") and p._worker is not None
    assert p._worker.is_alive()
    p.close()


def test_a_learner_stopped_mid_canary_leaves_the_candidate_undecided(tmp_path: Path) -> None:
    """The stop was audited as a `canary_result` rollback and recorded as decided: a
    candidate that passed its gate was dropped with no evidence against it, where the
    docs say it is gated again at the next start."""
    store = AdapterStore(tmp_path)
    v1 = publish(store, tmp_path, 1)
    replicas, proxy, audit = Replicas(set()), Proxy(alias="base"), FakeAudit()
    canary = {"enabled": True, "poll_s": 0.05, "min_samples": 5}
    p = promoter(tmp_path, replicas, proxy, audit, canary=canary)
    p.submit(v1)
    assert wait_until(lambda: proxy.canary is not None)
    p.close()
    assert [o.decision for o in p.outcomes] == ["interrupted"]
    assert audit.names() == ["gate_result", "promotion_interrupted"]
    assert audit.events[-1][1]["stage"] == "canary"
    assert proxy.canary is None and proxy.ended == [("rollback", "the learner is stopping")]
    assert (CheckpointStore(tmp_path).decided() or 0) < store.latest()


def test_a_flip_that_gets_no_answer_defers_a_passing_candidate(tmp_path: Path) -> None:
    """A 5xx at the flip (a restarting proxy, a replica slow to list its models) with the
    alias unmoved recorded the candidate as failed, and it was never gated again."""
    store = AdapterStore(tmp_path)
    v1 = publish(store, tmp_path, 1)
    replicas, audit = Replicas(set()), FakeAudit()

    class Unanswered(Proxy):
        def set_alias(self, alias: str, target: str, expected: str | None = None) -> dict:
            raise promotion.ProxyUnavailable("proxy POST /admin/aliases → 502: upstream_error")

    proxy = Unanswered(alias="base")
    outcome = promoter(tmp_path, replicas, proxy, audit).promote(v1)
    assert outcome.decision == "deferred" and proxy.alias == "base"
    assert audit.names() == ["gate_result", "promotion_deferred"]
    assert audit.events[-1][1]["stage"] == "flip"
    assert "policy-v1" not in replicas.loaded  # unloaded until it is gated again
    assert (CheckpointStore(tmp_path).decided() or 0) < 1


def test_a_replica_that_does_not_answer_leaves_the_cleanup_going(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    for version in range(1, 6):
        publish(store, tmp_path, version)

    class OneDown(Replicas):
        def unload(self, name: str) -> None:
            if name == "policy-v1":
                raise httpx.ConnectError("replica restarting")
            super().unload(name)

    replicas = OneDown({f"policy-v{n}" for n in range(1, 6)})
    proxy, audit = Proxy(alias="policy-v5", rollback_to="policy-v4"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit, keep_loaded=2, retain_dirs=2)
    p._cleanup("policy-v5")
    assert sorted(replicas.loaded) == ["policy-v1", "policy-v4", "policy-v5"]
    assert audit.names()[0] == "adapter_unload_failed"
    assert sorted(p.name for p in (tmp_path / "adapters").glob("policy-v*")) == [
        "policy-v1",
        "policy-v4",
        "policy-v5",
    ]


def test_promotion_disabled_is_audited_as_a_skip(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    v1 = publish(store, tmp_path, 1)
    audit = FakeAudit()
    p = promoter(tmp_path, Replicas(set()), Proxy(), audit, enabled=False)
    assert p.promote(v1).decision == "skipped_disabled"
    assert audit.events == [("promotion_skipped", {"version": "policy-v1", "reason": "disabled"})]


def test_a_marker_a_crash_tore_is_taken_as_not_recorded(tmp_path: Path) -> None:
    """An empty decided.json or announced.json (renamed without an fsync, then an OS
    crash) stopped the learner at every start with a bare JSON traceback."""
    markers = CheckpointStore(tmp_path)
    markers.mark_decided(3)
    markers.mark_announced(3)
    assert markers.decided() == 3 and markers.announced() == 3
    for path in (markers.decided_path, markers.announced_path):
        path.write_text("")
    assert markers.decided() is None and markers.announced() == 0
    markers.announced_path.write_text('{"version": "3"}')
    assert markers.announced() == 0
    markers.mark_decided(4)
    assert markers.decided() == 4


def test_the_zero_base_is_made_for_its_adapter_shape_and_remade_when_it_is_not_zero(
    tmp_path: Path, make_lora_adapter
) -> None:
    """The stand-in for the base model was made once and reused unchecked: one made for
    another base model or LoRA shape failed every load, and one changed on disk was not the
    base model any more."""
    from safetensors.torch import load_file, save_file
    from structlog.testing import capture_logs

    from safety.gates.zero_adapter import WEIGHTS, is_zero_adapter_of

    replicas, proxy, audit = Replicas(set()), Proxy("base"), FakeAudit()
    p = promoter(tmp_path / "state", replicas, proxy, audit)
    like = make_lora_adapter(tmp_path / "v1", seed=1)
    name = p._zero_base(like)
    assert name.startswith("olp-zero-base-") and name in replicas.loaded
    kept = tmp_path / "state" / "adapters" / f".{name}"
    assert is_zero_adapter_of(kept, like)
    assert p._zero_base(make_lora_adapter(tmp_path / "v2", seed=2)) == name  # same shape
    assert replicas.unloaded == []
    tensors = load_file(kept / WEIGHTS)
    tensors[next(n for n in tensors if "lora_B" in n)][0, 0] = 3.0
    save_file(tensors, kept / WEIGHTS)
    with capture_logs() as logs:
        assert p._zero_base(like) == name
    assert [e["event"] for e in logs] == ["zero_base_remade"]
    assert replicas.unloaded == [name] and name in replicas.loaded  # vLLM keeps by name
    assert is_zero_adapter_of(kept, like)
    other = p._zero_base(make_lora_adapter(tmp_path / "r4", seed=1, rank=4))
    assert other != name and other in replicas.loaded


def test_a_superseded_candidate_that_cannot_be_audited_does_not_lose_the_newest(
    tmp_path: Path,
) -> None:
    """The newest candidate is taken out of the queue before the older ones are audited as
    superseded: when that append failed (a full disk), the newest was lost until the next
    candidate or start."""
    store = AdapterStore(tmp_path)
    v3, v4 = publish(store, tmp_path, 3), publish(store, tmp_path, 4)
    audit = FakeAudit()

    def full_disk(actor: str, event: str, payload: dict | None = None) -> None:
        raise OSError(28, "No space left on device")

    audit.append = full_disk  # type: ignore[method-assign]
    p = promoter(tmp_path, Replicas(set()), Proxy(alias="base"), audit)
    p._queue.put(v4)
    assert p._newest_undecided(v3) == v4
    assert p._queue.empty()


@contextlib.contextmanager
def _model_server_answering(status: int | None) -> Iterator[str]:
    """The base URL of a stand-in vLLM answering every POST with `status` (None: a port
    nothing listens on, so a connection is refused)."""
    import http.server
    import socket

    class Failing(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(status or 500)
            self.end_headers()
            self.wfile.write(b"failing")

        def log_message(self, *args: object) -> None:
            pass

    if status is None:
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()
        yield f"http://127.0.0.1:{port}"
        return
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _gating_against(
    tmp_path: Path, url: str, **config: object
) -> tuple[Promoter, Path, Replicas, Proxy, FakeAudit]:
    """A promoter whose real gate suite asks the model server at `url`, and candidate v2."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    candidate = publish(store, tmp_path, 2)
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    replicas.base_urls = [url]
    p = promoter(tmp_path, replicas, proxy, audit, **config)
    p.gate_runner = p._run_gates  # the promoter's real suite call
    p._zero_base = lambda like: "olp-zero-base"  # type: ignore[method-assign]
    return p, candidate, replicas, proxy, audit


@pytest.mark.parametrize("answer", [503, None], ids=["503", "refused"])
def test_a_model_server_that_does_not_answer_during_the_gate_defers_the_candidate(
    tmp_path: Path, answer: int | None
) -> None:
    """Every gate failed closed on the outage, and the candidate was recorded rejected and
    decided: never gated again, and the audit log called an outage a safety rejection."""
    with _model_server_answering(answer) as url:
        p, candidate, replicas, proxy, audit = _gating_against(tmp_path, url)
        outcome = p.promote(candidate)
    assert outcome.decision == "deferred", outcome.reason
    assert audit.names() == ["promotion_deferred"]
    _, payload = audit.events[0]
    assert payload["failed_gates"] and "UpstreamUnavailable" in payload["error"]
    assert CheckpointStore(tmp_path).decided() in (None, 0)  # gated again later
    assert "policy-v2" not in replicas.loaded and proxy.alias == "policy-v1"


def test_a_candidate_whose_gate_runs_go_unanswered_again_and_again_is_rejected(
    tmp_path: Path,
) -> None:
    """vLLM answering 5xx to a candidate's gate requests while the proxy and the adapter's
    load answer: deferred, and gated again after each backoff for as long as the learner
    made nothing newer, each run spending the replicas' time on it. At
    `max_unanswered_gates` runs in a row it is rejected, and the audit log says why."""
    with _model_server_answering(500) as url:
        p, candidate, replicas, proxy, audit = _gating_against(
            tmp_path, url, max_unanswered_gates=2
        )
        first = p.promote(candidate)
        assert first.decision == "deferred", first.reason
        assert CheckpointStore(tmp_path).decided() in (None, 0)
        second = p.promote(candidate)
    assert second.decision == "rejected", second.reason
    assert audit.names() == ["promotion_deferred", "gate_result", "candidate_rejected"]
    deferred, gate_result, rejected = (payload for _, payload in audit.events)
    assert deferred["unanswered_gates"] == 1
    assert gate_result["unanswered_gates"] == 2 and not gate_result["passed"]
    assert rejected["unanswered_gates"] == 2 and rejected["failed_gates"]
    assert CheckpointStore(tmp_path).decided() == 2  # decided: not gated again
    assert "policy-v2" not in replicas.loaded and proxy.alias == "policy-v1"


class _AuditFailingOnce(FakeAudit):
    """A full disk for one append of `event`, then room again."""

    def __init__(self, event: str) -> None:
        super().__init__()
        self.failing: str | None = event

    def append(self, actor: str, event: str, payload: dict | None = None) -> None:
        if event == self.failing:
            self.failing = None
            raise OSError(28, "No space left on device")
        super().append(actor, event, payload)


def _serving_v1_gating_v2(
    tmp_path: Path, failing_event: str
) -> tuple[Promoter, Path, Replicas, Proxy, _AuditFailingOnce]:
    """A promoter serving v1, candidate v2, and an audit log whose first append of
    `failing_event` meets a full disk."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    candidate = publish(store, tmp_path, 2)
    replicas, proxy = Replicas({"policy-v1"}), Proxy("policy-v1")
    audit = _AuditFailingOnce(failing_event)
    return promoter(tmp_path, replicas, proxy, audit), candidate, replicas, proxy, audit


def test_a_promotion_record_that_fails_after_the_flip_is_not_a_failed_promotion(
    tmp_path: Path,
) -> None:
    """The flip served v2, then the `promotion` append failed once: the worker audited
    `promotion_failed` for the serving version and scheduled no cleanup of the old ones.
    Now the outcome is `promoted`, the cleanup is scheduled, and the record is appended
    before the next candidate (here: as the learner stops)."""
    p, candidate, _replicas, proxy, audit = _serving_v1_gating_v2(tmp_path, "promotion")
    outcome = p.promote(candidate)
    assert outcome.decision == "promoted" and proxy.alias == "policy-v2"
    assert audit.names() == ["gate_result"]
    assert len(p._timers) == 1  # the cleanup of the versions it replaced
    p.close(5)
    assert audit.names() == ["gate_result", "promotion"]
    assert audit.events[-1][1]["version"] == "policy-v2" and audit.events[-1][1]["audited_late"]


def test_a_gate_result_that_cannot_be_audited_leaves_no_candidate_loaded(tmp_path: Path) -> None:
    """The `gate_result` append failed: the candidate was marked decided and kept its LoRA
    slot on every replica, which the cleanup's `keep_loaded` then kept for two more
    promotions. It is unloaded now (the proxy does not route to it)."""
    p, candidate, replicas, proxy, audit = _serving_v1_gating_v2(tmp_path, "gate_result")
    p.submit(candidate)
    deadline = time.monotonic() + 10
    while "promotion_failed" not in audit.names() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert audit.names() == ["promotion_failed"]
    assert proxy.alias == "policy-v1" and replicas.loaded == {"policy-v1"}
    p.close(5)


def test_an_unreadable_decided_marker_has_its_newest_candidate_gated_again(
    tmp_path: Path,
) -> None:
    """`CheckpointStore.decided()` reads an unreadable marker as not recorded, so that the
    newest candidate is gated again; the promoter took it for a state dir from before the
    marker and recorded the announced candidate as decided, its gate never run."""
    store = AdapterStore(tmp_path)
    publish(store, tmp_path, 1)
    publish(store, tmp_path, 2)
    markers = CheckpointStore(tmp_path)
    markers.mark_announced(2)
    markers.mark_decided(1)
    markers.decided_path.write_text('{"version": 1')  # damaged
    replicas, proxy, audit = Replicas({"policy-v1"}), Proxy("policy-v1"), FakeAudit()
    p = promoter(tmp_path, replicas, proxy, audit)
    p.resume()
    assert [o.decision for o in wait_for(p, 1)] == ["promoted"]
    assert audit.names() == ["gate_result", "promotion"] and proxy.alias == "policy-v2"
    p.close(5)
