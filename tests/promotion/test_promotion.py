"""Gate → hot swap → rollback through the real vLLM, the real proxy and real adapters."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from safety.audit import iter_records, verify


def served_version(url: str, key: str = "acme-key") -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    raw = client.chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    return raw.headers["x-olp-policy-version"]


def events(proxy) -> list[str]:
    return [r["event"] for r in iter_records(proxy.state_dir / "audit" / "audit.jsonl")]


def test_near_identical_candidate_is_promoted_and_served(proxy, publish, make_promoter):
    promoter = make_promoter()
    outcome = promoter.promote(publish(1, scale=0.01))
    assert outcome.decision == "promoted", outcome.reason
    assert outcome.report is not None and outcome.report.passed
    assert served_version(proxy.url) == "policy-v1"
    report = json.loads((proxy.state_dir / "gates" / "policy-v1.json").read_text())
    assert {r["name"] for r in report["results"]} >= {"regression", "kl_cap", "safety_probes"}
    assert {"gate_result", "promotion", "alias_set"} <= set(events(proxy))
    assert verify(proxy.state_dir / "audit").ok


def test_damaged_candidate_is_rejected_and_unloaded(proxy, publish, make_promoter, vllm_server):
    promoter = make_promoter()
    outcome = promoter.promote(publish(1, scale=8.0, seed=5))
    assert outcome.decision == "rejected"
    assert outcome.report is not None and outcome.report.failed_gates
    assert served_version(proxy.url) == "base"
    assert "policy-v1" not in promoter.replicas.served(vllm_server.base_url)
    assert "candidate_rejected" in events(proxy)


def test_kl_cap_breach_rejects(proxy, publish, make_promoter, small_gates):
    gates = small_gates(
        kl={"max_prompts": 2, "max_tokens": 8, "cap": 1e-6},
        regression={"enabled": False},
        safety_probes={"enabled": False},
        monitors={"enabled": False},
        poisoning={"enabled": False},
    )
    outcome = make_promoter(gates).promote(publish(1, scale=0.5, seed=2))
    assert outcome.decision == "rejected"
    assert outcome.report is not None and outcome.report.failed_gates == ["kl_cap"]


def test_a_guard_model_that_does_not_answer_defers_the_candidate(
    proxy, publish, make_promoter, small_gates
):
    """No answer from the guard is no verdict on the candidate: deferred (gated again later),
    not rejected and decided; serving is unaffected either way."""
    from deploy.ports import free_port

    gates = small_gates(
        safety_probes={
            "max_probes": 2,
            "classifier": {
                "kind": "openai",
                "base_url": f"http://127.0.0.1:{free_port()}",
                "model": "guard",
            },
        },
        regression={"enabled": False},
        kl={"enabled": False},
        monitors={"enabled": False},
        poisoning={"enabled": False},
    )
    outcome = make_promoter(gates).promote(publish(1, scale=0.01))
    assert outcome.decision == "deferred", outcome.reason
    assert "safety_probes: UpstreamUnavailable" in outcome.reason
    assert served_version(proxy.url) == "base"  # serving is unaffected


def test_frozen_blocks_promotion_and_rollback_restores(proxy, publish, make_promoter, small_gates):
    # The gates themselves are tested above; here one short real gate keeps this quick.
    quick = small_gates(
        regression={"max_probes": 2},
        kl={"enabled": False},
        safety_probes={"enabled": False},
        monitors={"enabled": False},
        poisoning={"enabled": False},
    )
    promoter = make_promoter(quick)
    assert promoter.promote(publish(1, scale=0.01)).decision == "promoted"
    assert promoter.promote(publish(2, scale=0.01, seed=1)).decision == "promoted"
    assert served_version(proxy.url) == "policy-v2"

    config = proxy.state_dir.parent / "olp.yaml"
    olp = [sys.executable, "-m", "deploy.cli"]
    env_key = {"OLP_ADMIN_KEY": proxy.admin_key}
    run = lambda *a: subprocess.run(  # noqa: E731
        [*olp, *a, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**__import__("os").environ, **env_key},
    )
    frozen = run("freeze")
    assert frozen.returncode == 0, frozen.stderr
    outcome = promoter.promote(publish(3, scale=0.01, seed=2))
    assert outcome.decision == "skipped_frozen"
    assert served_version(proxy.url) == "policy-v2"

    rolled = run("rollback")
    assert rolled.returncode == 0, rolled.stderr
    assert served_version(proxy.url) == "policy-v1"
    audit = list(iter_records(proxy.state_dir / "audit" / "audit.jsonl"))
    rollback = [r for r in audit if r["event"] == "rollback"][-1]
    assert rollback["payload"]["target"] == "policy-v1"
    assert rollback["payload"]["previous"] == "policy-v2"
    assert "promotion_skipped" in [r["event"] for r in audit]
    verified = run("audit", "verify")
    assert verified.returncode == 0 and "OK" in verified.stdout


def test_streams_running_across_a_swap_all_complete(proxy, publish, make_promoter):
    client = openai.OpenAI(base_url=f"{proxy.url}/v1", api_key=proxy.tenant_key)
    errors: list[BaseException] = []
    versions: list[str] = []
    finished: list[str | None] = []

    def stream_once() -> None:
        try:
            raw = client.chat.completions.with_raw_response.create(
                model="policy",
                stream=True,
                max_tokens=12,
                messages=[{"role": "user", "content": "Count to five."}],
            )
            versions.append(raw.headers["x-olp-policy-version"])
            last = None
            for chunk in raw.parse():
                if chunk.choices and chunk.choices[0].finish_reason:
                    last = chunk.choices[0].finish_reason
            finished.append(last)
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    def traffic(rounds: int) -> None:
        for _ in range(rounds):
            stream_once()

    threads = [threading.Thread(target=traffic, args=(3,)) for _ in range(4)]
    for thread in threads:
        thread.start()
    outcome = make_promoter().promote(publish(1, scale=0.01))
    for thread in threads:
        thread.join(timeout=600)
    assert outcome.decision == "promoted", outcome.reason
    assert errors == []
    assert len(finished) == 12 and all(reason in ("stop", "length") for reason in finished)
    assert set(versions) <= {"base", "policy-v1"}
    stream_once()
    assert versions[-1] == "policy-v1"


def test_a_replica_that_lost_the_serving_adapter_gets_it_back(proxy, publish, vllm_server):
    """A vLLM that restarts serves only the base: every request on the alias got vLLM's 404
    until someone loaded the adapter again by hand. Unloading it behind olp's back leaves
    the replica in the same state."""
    from learner.promotion import ProxyAdmin, ReplicaSet, routed_targets
    from learner.reload import AdapterReloader
    from safety.audit import AuditLog
    from tests.promotion.conftest import ADMIN_KEY

    admin = ProxyAdmin(proxy.url, ADMIN_KEY)
    replicas = ReplicaSet([vllm_server.base_url])
    audit_path = proxy.state_dir / "audit" / "audit.jsonl"
    reloader = AdapterReloader(
        replicas,
        lambda: routed_targets(admin.status()),
        AuditLog(audit_path),
        proxy.state_dir / "adapters",
    )
    try:
        v1 = publish(1, scale=0.01)
        replicas.load("policy-v1", v1)
        admin.set_alias("policy", "policy-v1")
        assert reloader.check() == []  # served: nothing to do
        httpx.post(
            f"{vllm_server.base_url}/v1/unload_lora_adapter",
            json={"lora_name": "policy-v1"},
            timeout=30,
        ).raise_for_status()
        with pytest.raises(openai.NotFoundError):
            served_version(proxy.url)
        assert reloader.check() == [(vllm_server.base_url, "policy-v1")]
        assert served_version(proxy.url) == "policy-v1"
        assert "adapter_reloaded" in events(proxy)

        # Weights that no longer match their recorded sha256 are not loaded; said once.
        httpx.post(
            f"{vllm_server.base_url}/v1/unload_lora_adapter",
            json={"lora_name": "policy-v1"},
            timeout=30,
        ).raise_for_status()
        weights = v1 / "adapter_model.safetensors"
        weights.chmod(0o644)
        weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
        assert reloader.check() == [] and reloader.check() == []
        assert "policy-v1" not in replicas.served(vllm_server.base_url)
        assert events(proxy).count("adapter_reload_failed") == 1
        assert verify(proxy.state_dir / "audit").ok
    finally:
        replicas.close()
        admin.close()


def test_an_incumbent_a_restarted_replica_lost_is_loaded_before_the_gate(
    proxy, publish, make_promoter, small_gates, vllm_server
):
    """After `olp up` started again the new vLLM served only the base, and the first gate
    compared the candidate with HTTP 404s for the incumbent: four gates failed closed and a
    good candidate was rejected."""
    from learner.promotion import ProxyAdmin
    from tests.promotion.conftest import ADMIN_KEY

    gates = small_gates(
        regression={"max_probes": 2},
        kl={"enabled": False},
        safety_probes={"enabled": False},
        monitors={"enabled": False},
        poisoning={"enabled": False},
    )
    promoter = make_promoter(gates)
    admin = ProxyAdmin(proxy.url, ADMIN_KEY)
    try:
        promoter.replicas.load("policy-v1", publish(1, scale=0.01))
        admin.set_alias("policy", "policy-v1")
        httpx.post(  # as a restarted vLLM: the incumbent is gone
            f"{vllm_server.base_url}/v1/unload_lora_adapter",
            json={"lora_name": "policy-v1"},
            timeout=30,
        ).raise_for_status()
        outcome = promoter.promote(publish(2, scale=0.01, seed=3))
    finally:
        admin.close()
    assert outcome.report is not None, outcome.reason
    assert all(r.metric is not None for r in outcome.report.results), outcome.report.to_dict()
    assert outcome.decision == "promoted", outcome.report.to_dict()
    records = list(iter_records(proxy.state_dir / "audit" / "audit.jsonl"))
    reloaded = [r["payload"] for r in records if r["event"] == "adapter_reloaded"]
    assert reloaded == [
        {"version": "policy-v1", "replica": vllm_server.base_url, "by": "promotion"}
    ]
