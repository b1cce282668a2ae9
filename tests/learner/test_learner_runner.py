"""`olp learner` under torchrun: rank 0 alone promotes, watches the canary and reloads
adapters (fakes for the promoter, reloader, proxy and replicas; no model, no ranks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deploy import learner_runner
from deploy.config import OlpConfig
from learner import distributed, service
from learner.canary import CanaryMonitor
from learner.distributed import DistContext
from learner.service import LearnerSummary

# What the fake proxy's /admin/status says.
STATUS: dict[str, Any] = {
    "aliases": {"policy": "policy-v3"},
    "canaries": {"policy": {"target": "policy-v4", "share": 0.1}},
    "rollback_targets": {"policy": "policy-v2"},
    "history": [],
}


class Built:
    """What run() built, in order."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.learner_kwargs: dict[str, Any] = {}
        self.proxy_timeouts: list[float | None] = []
        self.reload_wanted: Any = None  # the reloader's `routed` callable


def fakes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, rank: int, world: int) -> Built:
    built = Built()

    class Promoter:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.events.append("promoter")
            self.canary_monitor = CanaryMonitor()

        def submit(self, path: Path) -> None:
            pass

        def resume(self) -> None:
            built.events.append("promoter.resume")

        def close(self) -> None:
            built.events.append("promoter.close")

    class Reloader:
        def __init__(self, replicas: Any, routed: Any, *args: Any) -> None:
            built.events.append("reloader")
            self.replicas = replicas
            built.reload_wanted = routed

        def start(self, interval_s: float) -> None:
            built.events.append("reloader.start")

        def close(self) -> None:
            built.events.append("reloader.close")

    class Client:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            built.events.append(type(self).__name__)

        def close(self) -> None:
            pass

    class ProxyAdmin(Client):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.proxy_timeouts.append(kwargs.get("timeout_s"))

        def status(self) -> dict[str, Any]:
            return STATUS

    class ReplicaSet(Client):
        pass

    class AuditLog:
        @classmethod
        def from_config(cls, *args: Any) -> AuditLog:
            built.events.append("audit")
            return cls()

    def run_learner(*args: Any, **kwargs: Any) -> LearnerSummary:
        built.events.append("run_learner")
        built.learner_kwargs = kwargs
        return LearnerSummary(version=0, steps=0, consumed=0)

    for name, fake in [
        ("Promoter", Promoter),
        ("AdapterReloader", Reloader),
        ("ProxyAdmin", ProxyAdmin),
        ("ReplicaSet", ReplicaSet),
        ("AuditLog", AuditLog),
    ]:
        monkeypatch.setattr(learner_runner, name, fake)
    monkeypatch.setattr(learner_runner, "resolve_model_dir", lambda policy: tmp_path / "model")
    monkeypatch.setattr(learner_runner.signal, "signal", lambda *args: None)
    monkeypatch.setattr(service, "run_learner", run_learner)
    monkeypatch.setattr(distributed, "init_distributed", lambda: DistContext(rank, world))
    # No process group here: rank 0's word (on the learner lock) is this rank's own.
    monkeypatch.setattr(distributed, "broadcast_object", lambda ctx, obj: obj)
    monkeypatch.setenv("OLP_ADMIN_KEY", "test-admin-key")
    return built


def test_ranks_after_0_run_no_promoter_canary_or_reloader(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Every rank built a Promoter and an AdapterReloader: each rank's reloader loaded the
    routed adapters onto the replicas (duplicate loads and audit records), and rank 0's
    canary was fed rank 0's share of the live evidence only."""
    built = fakes(monkeypatch, tmp_path, rank=1, world=2)
    assert learner_runner.run(OlpConfig(state_dir=tmp_path)) == 0
    assert built.events == ["run_learner"]  # no promoter, reloader, audit log or clients
    kwargs = built.learner_kwargs
    assert kwargs["ctx"] == DistContext(1, 2)
    for main_only in ("canary", "on_candidate", "is_frozen", "served_versions", "on_started"):
        assert kwargs.get(main_only) is None, main_only


def test_rank_0_promotes_and_feeds_the_canary(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    built = fakes(monkeypatch, tmp_path, rank=0, world=2)
    assert learner_runner.run(OlpConfig(state_dir=tmp_path)) == 0
    assert built.events.count("promoter") == 1 and built.events.count("reloader") == 1
    assert built.events.index("reloader.start") < built.events.index("run_learner")
    # An undecided candidate and a dead learner's canary are seen to once the learner has
    # checked its state (run_learner calls on_started then), not before: a store it refuses
    # must not be gated.
    assert "promoter.resume" not in built.events
    assert built.events[-3:] == ["run_learner", "reloader.close", "promoter.close"]
    built.learner_kwargs["on_started"]()
    assert built.events[-1] == "promoter.resume"
    kwargs = built.learner_kwargs
    assert isinstance(kwargs["canary"], CanaryMonitor)
    assert kwargs["ctx"] == DistContext(0, 2)
    assert kwargs["on_candidate"] is not None and kwargs["is_frozen"] is not None


def test_rank_0_closes_the_promoter_and_reloader_when_the_learner_raises(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    built = fakes(monkeypatch, tmp_path, rank=0, world=1)

    def fails(*args: Any, **kwargs: Any) -> LearnerSummary:
        raise RuntimeError("learner died")

    monkeypatch.setattr(service, "run_learner", fails)
    with pytest.raises(RuntimeError, match="learner died"):
        learner_runner.run(OlpConfig(state_dir=tmp_path))
    assert built.events[-2:] == ["reloader.close", "promoter.close"]


def test_the_reloader_restores_what_a_rollback_would_serve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """After a vLLM restart only alias and canary targets came back: `olp rollback` was then
    refused (409 not_loaded), although the learner keeps its target loaded otherwise."""
    built = fakes(monkeypatch, tmp_path, rank=0, world=1)
    assert learner_runner.run(OlpConfig(state_dir=tmp_path)) == 0
    assert set(built.reload_wanted()) == {"policy-v2", "policy-v3", "policy-v4"}


class FlakyProxy:
    """A proxy admin client whose /admin/status answers from a script (an exception: down)."""

    def __init__(self, answers: list[Any]) -> None:
        self.answers = answers
        self.asked = 0

    def status(self) -> dict[str, Any]:
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_learning_counts_as_frozen_until_the_proxy_answers_once() -> None:
    """An operator's freeze lives in the proxy's state: a learner that starts while the
    proxy is down must not train through it."""
    proxy = FlakyProxy([ConnectionError("refused"), {"learning_frozen": False}])
    flag = learner_runner.FreezeFlag(proxy, ttl_s=0.0)  # type: ignore[arg-type]
    assert flag() is True
    assert flag() is False
    assert proxy.asked == 2


def test_a_proxy_that_stops_answering_keeps_the_last_value() -> None:
    for known in (True, False):
        proxy = FlakyProxy([{"learning_frozen": known}, ConnectionError("restarting")])
        flag = learner_runner.FreezeFlag(proxy, ttl_s=0.0)  # type: ignore[arg-type]
        assert flag() is known
        assert flag() is known
        assert proxy.asked == 2


def test_the_freeze_flag_asks_with_a_short_timeout(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The flag is asked in the learner's loop: with the promoter's 30 s client, a proxy
    that accepts and never answers held a stop for 30 s (past `olp up`'s deadline)."""
    built = fakes(monkeypatch, tmp_path, rank=0, world=1)
    assert learner_runner.run(OlpConfig(state_dir=tmp_path)) == 0
    flag = built.learner_kwargs["is_frozen"]
    assert isinstance(flag, learner_runner.FreezeFlag)
    assert learner_runner.FREEZE_ASK_TIMEOUT_S in built.proxy_timeouts
    assert learner_runner.FREEZE_ASK_TIMEOUT_S <= 5
