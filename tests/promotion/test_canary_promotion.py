"""Canary through the real proxy, vLLM and adapters: live evidence promotes or rolls back.

The gate suite is replaced by a passing report here (it has its own tests); everything after
the gate is real: the proxy splits training traffic, captures trajectories with the serving
version, the learner's reward assembler scores them, and the promoter decides on that.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai

from learner.config import RewardConfig, VerifierSpec
from learner.promotion import PromotionOutcome
from learner.rewards.assembler import RewardAssembler
from proxy.aliases import routing_fraction
from safety.audit import iter_records, verify
from safety.gates.types import GateReport

QUESTION = "What is 2 + 2? Reply with only the number."
CANARY = {"enabled": True, "share": 0.5, "min_samples": 5, "poll_s": 0.3, "max_duration_s": 240}


def passing_gate(candidate: str, incumbent: str) -> GateReport:
    return GateReport(passed=True, results=[], candidate=candidate, incumbent=incumbent)


def ask(url: str, session: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="acme-key", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="policy",
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=12,
        temperature=0,
        extra_headers={"X-Session-Id": session},
    )
    return raw.headers["x-olp-policy-version"]


def run_canary(proxy, promoter, version_dir: Path, requests: int) -> tuple[PromotionOutcome, dict]:
    """Promote in the background; send traffic one request at a time (temperature-0 replies
    are only reproducible without concurrent requests), score what was captured, feed the
    monitor."""
    result: dict[str, PromotionOutcome] = {}
    worker = threading.Thread(target=lambda: result.update(o=promoter.promote(version_dir)))
    worker.start()
    admin = {"Authorization": "Bearer test-admin-key"}
    deadline = time.monotonic() + 60
    while not httpx.get(f"{proxy.url}/admin/status", headers=admin).json()["canaries"]:
        assert worker.is_alive() and time.monotonic() < deadline, result
        time.sleep(0.1)
    served: dict[str, int] = {}
    arms = {True: 0, False: 0}  # half the sessions on each arm, by the proxy's own hash
    while sum(arms.values()) < requests:
        session = uuid.uuid4().hex
        arm = routing_fraction(session) < CANARY["share"]
        if arms[arm] >= requests // 2:
            continue
        arms[arm] += 1
        version = ask(proxy.url, session)
        served[version] = served.get(version, 0) + 1
    records = proxy.state_dir / "records" / "trajectories.jsonl"
    time.sleep(1.0)  # capture writes off the response path
    trajectories = [json.loads(line) for line in records.read_text().splitlines()]
    assembler = RewardAssembler(
        RewardConfig(verifiers=[VerifierSpec(path="learner.rewards.verifiers:number_answer")])
    )
    promoter.canary_monitor.observe(assembler.assemble([{"trajectory": t} for t in trajectories]))
    worker.join(timeout=120)
    assert not worker.is_alive(), "the canary did not decide"
    return result["o"], served


def audit_events(proxy) -> list[dict]:
    return list(iter_records(proxy.state_dir / "audit" / "audit.jsonl"))


def test_damaged_candidate_is_rolled_back_by_live_evidence(
    proxy, publish, make_promoter, vllm_server
):
    promoter = make_promoter(gate_runner=passing_gate, canary=CANARY)
    outcome, served = run_canary(proxy, promoter, publish(1, scale=8.0, seed=5), requests=16)
    assert set(served) == {vllm_server.model_name, "policy-v1"}, served
    assert outcome.decision == "canary_rolled_back", outcome
    status = httpx.get(
        f"{proxy.url}/admin/status", headers={"Authorization": "Bearer test-admin-key"}
    ).json()
    assert status["canaries"] == {} and status["serving_version"] == vllm_server.model_name
    assert ask(proxy.url, uuid.uuid4().hex) == vllm_server.model_name
    models = httpx.get(f"{vllm_server.base_url}/v1/models").json()["data"]
    assert "policy-v1" not in {m["id"] for m in models}  # unloaded after the rollback
    records = audit_events(proxy)
    names = [r["event"] for r in records]
    assert names[-3:] == ["canary_started", "canary_result", "canary_rolled_back"], names
    result = records[-2]["payload"]
    assert result["decision"] == "rollback"
    evidence = result["evidence"]
    assert evidence["candidate"]["samples"] >= 5 and evidence["stable"]["samples"] >= 5
    print("canary rollback evidence:", json.dumps(evidence), "served:", served)
    assert verify(proxy.state_dir / "audit").ok


def test_near_identical_candidate_is_promoted_after_its_canary(
    proxy, publish, make_promoter, vllm_server
):
    promoter = make_promoter(gate_runner=passing_gate, canary=CANARY)
    outcome, served = run_canary(proxy, promoter, publish(1, scale=0.01), requests=16)
    assert set(served) == {vllm_server.model_name, "policy-v1"}, served
    assert outcome.decision == "promoted", outcome
    assert ask(proxy.url, uuid.uuid4().hex) == "policy-v1"
    records = audit_events(proxy)
    names = [r["event"] for r in records]
    assert names[-4:] == ["canary_started", "canary_result", "canary_promoted", "promotion"]
    evidence = records[-3]["payload"]["evidence"]
    print("canary promote evidence:", json.dumps(evidence), "served:", served)
    assert records[-1]["payload"]["via"] == "canary"
    assert verify(proxy.state_dir / "audit").ok


def test_a_canary_a_dead_learner_left_running_is_rolled_back_at_start_up(
    proxy, publish, make_promoter, vllm_server
):
    """The proxy keeps a canary in serving.json after the learner that started it died; the
    next learner recognises it by the history's actor and rolls it back (audited), so later
    candidates' canaries are not refused with 409 canary_running."""
    from learner.checkpoint import CheckpointStore
    from learner.promotion import ProxyAdmin, ReplicaSet

    version_dir = publish(1, scale=0.01)
    replicas = ReplicaSet([vllm_server.base_url])
    dead_learner = ProxyAdmin(proxy.url, "test-admin-key")  # X-OLP-Actor: olp-learner
    try:
        replicas.load("policy-v1", version_dir)
        dead_learner.start_canary("policy", "policy-v1", 0.5)
    finally:
        replicas.close()
        dead_learner.close()
    CheckpointStore(proxy.state_dir).mark_decided(1)  # no candidate to gate: the orphan only
    promoter = make_promoter(gate_runner=passing_gate, canary=CANARY)
    promoter.resume()
    deadline = time.monotonic() + 30
    while not any(r["payload"].get("orphaned") for r in audit_events(proxy)):
        assert time.monotonic() < deadline, "the orphaned canary was not rolled back"
        time.sleep(0.1)
    admin = {"Authorization": "Bearer test-admin-key"}
    status = httpx.get(f"{proxy.url}/admin/status", headers=admin).json()
    assert status["canaries"] == {} and status["serving_version"] == vllm_server.model_name
    ours = [r for r in audit_events(proxy) if r["actor"] == "olp-learner"]
    # The proxy's record of the rollback, then the learner's.
    assert [r["event"] for r in ours][-2:] == ["canary_rolled_back", "canary_rolled_back"]
    assert ours[-1]["payload"]["version"] == "policy-v1"
    models = httpx.get(f"{vllm_server.base_url}/v1/models").json()["data"]
    assert "policy-v1" not in {m["id"] for m in models}
