"""AdapterReloader's decisions against fake replicas (the real-vLLM path is in
tests/promotion/test_promotion.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from learner.reload import AdapterReloader
from safety.audit import AuditLog, iter_records


class FakeReplicas:
    """One replica that is down until `up` is set, then serves `served`."""

    def __init__(self) -> None:
        self.base_urls = ["http://replica"]
        self.up = False
        self.served_names: set[str] = {"base"}
        self.loads: list[str] = []
        self.listing_timeouts: list[float | None] = []

    def served(self, url: str, timeout_s: float | None = None) -> set[str]:
        self.listing_timeouts.append(timeout_s)
        if not self.up:
            raise httpx.ConnectError("connection refused")
        return set(self.served_names)

    def load_on(self, url: str, name: str, path: Path) -> None:
        self.loads.append(name)
        self.served_names.add(name)


def _adapter(root: Path, name: str) -> None:
    import hashlib

    path = root / name
    path.mkdir(parents=True)
    weights = b"weights of " + name.encode()
    (path / "adapter_model.safetensors").write_bytes(weights)
    meta = {"weights_sha256": hashlib.sha256(weights).hexdigest()}
    (path / "olp_meta.json").write_text(json.dumps(meta))


def test_a_restarting_replica_is_checked_again_soon_and_gets_its_adapter(tmp_path: Path) -> None:
    replicas = FakeReplicas()
    _adapter(tmp_path / "adapters", "policy-v3")
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    routed = {"base", "policy-v3"}
    reloader = AdapterReloader(replicas, lambda: routed, audit, tmp_path / "adapters")  # type: ignore[arg-type]
    assert reloader.check() == [] and reloader.replica_down
    reloader.start(interval_s=60)  # down: the next check comes within 2 s, not 60
    try:
        replicas.up = True
        deadline = time.monotonic() + 10
        while "policy-v3" not in replicas.loads and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        reloader.close()
    assert replicas.loads == ["policy-v3"]  # the base is never "reloaded"
    assert not reloader.replica_down
    events = [r["event"] for r in iter_records(tmp_path / "audit.jsonl")]
    assert events == ["adapter_reloaded"]


def test_a_pruned_version_is_reported_once_not_at_every_check(tmp_path: Path) -> None:
    replicas = FakeReplicas()
    replicas.up = True
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    reloader = AdapterReloader(
        replicas,  # type: ignore[arg-type]
        lambda: {"policy-v9"},
        audit,
        tmp_path / "adapters",
    )
    assert reloader.check() == [] and reloader.check() == []
    records = list(iter_records(tmp_path / "audit.jsonl"))
    assert [r["event"] for r in records] == ["adapter_reload_failed"]
    assert "does not exist" in records[0]["payload"]["error"]
    assert replicas.loads == []


def test_the_first_check_runs_when_the_reloader_starts(tmp_path: Path) -> None:
    """After `olp up` started again, the new vLLM lacked the serving adapter until the first
    check, one interval (15 s) after the learner started: every request for it failed."""
    replicas = FakeReplicas()
    replicas.up = True
    _adapter(tmp_path / "adapters", "policy-v3")
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    reloader = AdapterReloader(
        replicas,  # type: ignore[arg-type]
        lambda: {"base", "policy-v3"},
        audit,
        tmp_path / "adapters",
    )
    reloader.start(interval_s=3600)
    try:
        deadline = time.monotonic() + 10
        while "policy-v3" not in replicas.loads and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        reloader.close()
    assert replicas.loads == ["policy-v3"]


def test_an_adapter_whose_config_was_edited_is_not_reloaded(tmp_path: Path) -> None:
    """Only the weights were hashed: an edited adapter_config.json (lora_alpha scales every
    output) was served after a vLLM restart unnoticed. A version published before the
    config was hashed still reloads on its weights."""
    from learner.adapter_store import AdapterStore

    store = AdapterStore(tmp_path)  # versions in <root>/adapters
    for version in (1, 2):
        files = tmp_path / f"files-{version}"
        files.mkdir()
        (files / "adapter_model.safetensors").write_bytes(b"weights %d" % version)
        (files / "adapter_config.json").write_text('{"lora_alpha": 32}')
        store.publish(version, files, {"parent_version": version - 1})
    assert store.read_meta(1)["config_sha256"]
    (store.path(1) / "adapter_config.json").write_text('{"lora_alpha": 3200}')
    _adapter(tmp_path / "adapters", "policy-v3")  # a meta without config_sha256
    replicas = FakeReplicas()
    replicas.up = True
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    routed = {"policy-v1", "policy-v2", "policy-v3"}
    reloader = AdapterReloader(replicas, lambda: routed, audit, tmp_path / "adapters")  # type: ignore[arg-type]
    reloader.check()
    assert sorted(replicas.loads) == ["policy-v2", "policy-v3"]
    [failed] = [
        r for r in iter_records(tmp_path / "audit.jsonl") if r["event"] != "adapter_reloaded"
    ]
    assert failed["event"] == "adapter_reload_failed"
    assert "policy-v1: config sha256" in failed["payload"]["error"]


class FailingAudit:
    """An audit log whose appends fail until `works` is set (a full disk)."""

    def __init__(self, path: Path) -> None:
        self.log = AuditLog(path, fsync=False)
        self.works = False

    def append(self, actor: str, event: str, payload: dict) -> dict:
        if not self.works:
            raise OSError(28, "No space left on device")
        return self.log.append(actor, event, payload)


def test_a_reload_failure_the_audit_log_could_not_take_is_recorded_later(
    tmp_path: Path,
) -> None:
    """The failure was marked as audited before the append: one failed write (a full disk)
    left it unrecorded at every later check, and the exception ended the check."""
    replicas = FakeReplicas()
    replicas.up = True
    _adapter(tmp_path / "adapters", "policy-v3")
    audit = FailingAudit(tmp_path / "audit.jsonl")
    reloader = AdapterReloader(
        replicas,  # type: ignore[arg-type]
        lambda: ["policy-v9", "policy-v3"],
        audit,  # type: ignore[arg-type]
        tmp_path / "adapters",
    )
    assert reloader.check() == [("http://replica", "policy-v3")]  # went on past v9
    audit.works = True
    replicas.served_names.discard("policy-v3")
    reloader.check()
    events = [(r["event"], r["payload"]["version"]) for r in iter_records(tmp_path / "audit.jsonl")]
    assert events == [("adapter_reload_failed", "policy-v9"), ("adapter_reloaded", "policy-v3")]


def test_a_version_that_fails_oddly_does_not_stop_the_others(tmp_path: Path) -> None:
    """A meta file that is JSON but not an object raised AttributeError, which ended the
    check: the versions after it, the alias's target among them, stayed unloaded."""
    replicas = FakeReplicas()
    replicas.up = True
    _adapter(tmp_path / "adapters", "policy-v3")
    _adapter(tmp_path / "adapters", "policy-v2")
    (tmp_path / "adapters" / "policy-v2" / "olp_meta.json").write_text("[]")
    audit = AuditLog(tmp_path / "audit.jsonl", fsync=False)
    reloader = AdapterReloader(
        replicas,  # type: ignore[arg-type]
        lambda: ["policy-v2", "policy-v3"],
        audit,
        tmp_path / "adapters",
    )
    assert reloader.check() == [("http://replica", "policy-v3")]
    [failed] = [r for r in iter_records(tmp_path / "audit.jsonl") if r["event"].endswith("failed")]
    assert failed["payload"]["version"] == "policy-v2"


def test_the_serving_versions_load_first_and_listings_do_not_wait_a_loads_timeout(
    tmp_path: Path,
) -> None:
    """A hung replica's listing waited the client's 60 s (a load's timeout) at every check,
    holding the other replicas back; and the older rollback target loaded before the alias
    target, whose requests were failing meanwhile."""
    from learner.promotion import kept_targets_in_order

    status = {
        "aliases": {"policy": "policy-v5", "base": "base"},
        "canaries": {},
        "rollback_targets": {"policy": "policy-v4"},
    }
    order = kept_targets_in_order(status)
    assert order[0] == "policy-v5" and order[-1] == "policy-v4"
    replicas = FakeReplicas()
    replicas.up = True
    for name in order:
        _adapter(tmp_path / "adapters", name)
    reloader = AdapterReloader(
        replicas,  # type: ignore[arg-type]
        lambda: order,
        AuditLog(tmp_path / "audit.jsonl", fsync=False),
        tmp_path / "adapters",
    )
    reloader.check()
    assert replicas.loads == ["policy-v5", "policy-v4"]
    assert replicas.listing_timeouts[0] == 5.0
