"""Canary routing and its admin API, through the real proxy and vLLM."""

from __future__ import annotations

import json

import pytest

from proxy.aliases import AliasTable, Canary, routing_fraction
from safety.audit import verify
from tests.proxy.test_proxy_control import admin, chat, loaded_adapter  # noqa: F401 - fixture

SHARE = 0.5


def test_route_is_sticky_and_only_takes_eligible_traffic():
    table = AliasTable({"policy": "base"})
    table.start_canary("policy", Canary("policy-v2", 0.25, 0.0))
    keys = [f"session-{i}" for i in range(2000)]
    routed = [table.route("policy", k, canary_eligible=True) for k in keys]
    share = routed.count("policy-v2") / len(keys)
    assert 0.22 < share < 0.28
    assert routed == [table.route("policy", k, canary_eligible=True) for k in keys]
    assert {table.route("policy", k, canary_eligible=False) for k in keys} == {"base"}
    assert table.resolve("policy") == "base"
    assert table.set("policy", "policy-v2") == "base"
    assert table.canaries() == {}  # a flip ends the alias's canary
    with pytest.raises(ValueError):
        table.start_canary("policy", Canary("policy-v3", 1.0, 0.0))
    with pytest.raises(ValueError):
        table.start_canary("nope", Canary("policy-v3", 0.5, 0.0))


def test_canary_splits_training_traffic_by_session_and_ends_audited(
    make_proxy,
    vllm_server,
    loaded_adapter,  # noqa: F811 - the imported fixture
    tmp_path,
):
    state_dir = tmp_path / "state"
    harness, sink = make_proxy([vllm_server.base_url], state_dir=state_dir)
    start = {"target": loaded_adapter, "share": SHARE}
    for bad in (0, 1, 1.5, "half", True, None):
        refused = admin(harness, "POST", "/admin/canary", {**start, "share": bad})
        assert refused.status_code == 400, bad
        assert refused.json()["error"]["param"] == "share"
    not_loaded = admin(harness, "POST", "/admin/canary", {**start, "target": "policy-v0"})
    assert not_loaded.status_code == 409 and not_loaded.json()["error"]["code"] == "not_loaded"
    same = admin(harness, "POST", "/admin/canary", {**start, "target": "base"})
    assert same.status_code == 409 and same.json()["error"]["code"] == "already_serving"
    no_key = admin(harness, "POST", "/admin/canary", start, key=None)
    assert no_key.status_code == 401

    started = admin(harness, "POST", "/admin/canary", start)
    assert started.status_code == 200, started.text
    assert started.json() == {
        "alias": "policy",
        "target": loaded_adapter,
        "share": SHARE,
        "stable": "base",
    }
    again = admin(harness, "POST", "/admin/canary", start)
    assert again.status_code == 409 and again.json()["error"]["code"] == "canary_running"

    sessions = [f"canary-s{i}" for i in range(16)]  # fixed: random ids may split one-sided
    expected = {s: loaded_adapter if routing_fraction(s) < SHARE else "base" for s in sessions}
    assert set(expected.values()) == {"base", loaded_adapter}, "pick other session ids"
    for session in sessions:
        for _ in range(2):  # a session stays on its arm
            served = chat(harness, headers={"X-Session-Id": session})
            assert served.headers["x-olp-policy-version"] == expected[session]
        # Traffic that is not recorded for training never meets the canary.
        not_training = chat(harness, "bob", headers={"X-Session-Id": session})
        assert not_training.headers["x-olp-policy-version"] == "base"
        opted_out = chat(harness, headers={"X-Session-Id": session, "X-OLP-Train": "0"})
        assert opted_out.headers["x-olp-policy-version"] == "base"
    harness.drain()
    by_session = {t["session_id"]: t["policy_version"] for t in sink.trajectories}
    assert by_session == expected
    status = admin(harness, "GET", "/admin/status").json()
    assert status["canaries"]["policy"]["target"] == loaded_adapter
    assert status["serving_version"] == "base"  # the stable target is unchanged

    # A restarted proxy keeps the running canary.
    harness.stop()
    harness, sink = make_proxy([vllm_server.base_url], state_dir=state_dir)
    session = next(s for s, v in expected.items() if v == loaded_adapter)
    assert (
        chat(harness, headers={"X-Session-Id": session}).headers["x-olp-policy-version"]
        == loaded_adapter
    )

    bad_end = admin(harness, "POST", "/admin/canary/end", {"decision": "maybe"})
    assert bad_end.status_code == 400
    promoted = admin(
        harness, "POST", "/admin/canary/end", {"decision": "promote", "reason": "evidence ok"}
    )
    assert promoted.json() == {
        "alias": "policy",
        "decision": "promote",
        "target": loaded_adapter,
        "serving_version": loaded_adapter,
    }
    for session in sessions[:4]:
        served = chat(harness, headers={"X-Session-Id": session})
        assert served.headers["x-olp-policy-version"] == loaded_adapter
    none_left = admin(harness, "POST", "/admin/canary/end", {"decision": "rollback"})
    assert none_left.status_code == 404 and none_left.json()["error"]["code"] == "no_canary"

    # `olp rollback` during a canary undoes the canary, not the stable version.
    assert admin(harness, "POST", "/admin/canary", {"target": "base", "share": 0.3}).is_success
    rolled = admin(harness, "POST", "/admin/rollback", {})
    assert rolled.json()["decision"] == "rollback"
    assert rolled.json()["serving_version"] == loaded_adapter
    # So does a rollback `to` the stable version (`olp rollback --to`, `from` the canary's
    # target): it was 409 already_serving, the canary left running.
    assert admin(harness, "POST", "/admin/canary", {"target": "base", "share": 0.3}).is_success
    to_stable = admin(harness, "POST", "/admin/rollback", {"to": loaded_adapter, "from": "base"})
    assert to_stable.status_code == 200, to_stable.text
    assert to_stable.json()["decision"] == "rollback"
    assert admin(harness, "GET", "/admin/status").json()["canaries"] == {}
    # Freezing ends a running canary; a frozen proxy starts none.
    assert admin(harness, "POST", "/admin/canary", {"target": "base", "share": 0.3}).is_success
    assert admin(harness, "POST", "/admin/freeze", {"learning": False}).is_success
    status = admin(harness, "GET", "/admin/status").json()
    assert status["canaries"] == {} and status["serving_version"] == loaded_adapter
    frozen = admin(harness, "POST", "/admin/canary", {"target": "base", "share": 0.3})
    assert frozen.status_code == 409 and frozen.json()["error"]["code"] == "frozen"

    audit_log = state_dir / "audit" / "audit.jsonl"
    assert verify(audit_log).ok
    events = [json.loads(line) for line in audit_log.read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "canary_started",
        "canary_promoted",
        "canary_started",
        "canary_rolled_back",
        "canary_started",
        "canary_rolled_back",
        "canary_started",
        "freeze",
    ]
    assert all(e["actor"] == "ops-test" for e in events)
    assert events[1]["payload"]["reason"] == "evidence ok"
    assert events[-1]["payload"]["ended_canaries"]["policy"]["target"] == "base"
