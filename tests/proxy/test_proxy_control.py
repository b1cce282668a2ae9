"""Training opt-in, client disconnects, feedback and the admin API, through the real stack."""

from __future__ import annotations

import contextlib
import json
import re
import time
import uuid

import httpx
import openai
import pytest

from proxy.config import sha256_hex
from replay.sink import JsonlSink
from safety.audit import verify
from tests.proxy.conftest import ADMIN_KEY, KEYS, wait_for

PROMPT = [{"role": "user", "content": "Hi"}]


def api(harness, tenant="alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS[tenant], max_retries=0)


def chat(harness, tenant="alice", headers=None, **kwargs):
    return api(harness, tenant).chat.completions.with_raw_response.create(
        model="policy",
        messages=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_headers=headers or {},
        **kwargs,
    )


def admin(harness, method, path, body=None, key=ADMIN_KEY, actor="ops-test"):
    headers = {"X-OLP-Actor": actor}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, harness.base_url + path, json=body, headers=headers, timeout=30)


def test_training_off_or_opted_out_gives_no_trajectory(proxy):
    harness, sink = proxy
    off = chat(harness, "bob")
    opt_in_attempt = chat(harness, "bob", headers={"X-OLP-Train": "1"})
    opted_out = chat(harness, "alice", headers={"X-OLP-Train": "0"})
    for raw in (off, opt_in_attempt, opted_out):
        assert raw.parse().choices[0].message.content
        assert "x-olp-trajectory-id" not in raw.headers
        assert raw.headers["x-olp-policy-version"] == "base"
    # A spelling of its own is refused, not taken as "train on this".
    with pytest.raises(openai.BadRequestError) as refused:
        chat(harness, "alice", headers={"X-OLP-Train": "never"})
    assert refused.value.body["param"] == "X-OLP-Train" and "'never'" in refused.value.message
    # An opt-out on a second header line counts (only the first line was read).
    two_lines = httpx.post(
        harness.base_url + "/v1/chat/completions",
        headers=[
            ("Authorization", f"Bearer {KEYS['alice']}"),
            ("X-OLP-Train", "1"),
            ("X-OLP-Train", "0"),
        ],
        json={"model": "policy", "messages": PROMPT, "max_tokens": 2},
        timeout=120,
    )
    assert two_lines.status_code == 200 and "x-olp-trajectory-id" not in two_lines.headers
    captured = chat(harness, "alice")
    harness.drain()
    assert [r["trajectory_id"] for r in sink.trajectories] == [
        captured.headers["x-olp-trajectory-id"]
    ]
    assert sink.trajectories[0]["tenant"] == sha256_hex("alice")


def _adapter_active(vllm_server, name: str) -> bool:
    """Whether vLLM runs or queues a request on adapter `name` now: the latest sample of its
    `vllm:lora_requests_info` gauge (value = when that state began) names the adapters in
    use. A unique adapter makes this specific to one test on the shared server."""
    text = httpx.get(vllm_server.base_url + "/metrics", timeout=10).text
    samples = [
        (float(line.rsplit(" ", 1)[1]), line)
        for line in text.splitlines()
        if line.startswith("vllm:lora_requests_info{")
    ]
    assert samples, "vLLM exposes no vllm:lora_requests_info"
    latest = max(samples)[1]
    return re.search(rf'(running|waiting)_lora_adapters="[^"]*\b{name}\b', latest) is not None


def test_client_disconnect_mid_stream_aborts_upstream_and_trajectory(
    make_proxy, vllm_server, loaded_adapter, tmp_path
):
    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "state"
    save_state(
        state_dir / "control" / "serving.json", ServingState(aliases={"policy": loaded_adapter})
    )
    harness, sink = make_proxy([vllm_server.base_url], state_dir=state_dir)
    with httpx.stream(
        "POST",
        harness.base_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        json={
            "model": "policy",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1500,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=120,
    ) as response:
        assert response.headers["x-olp-policy-version"] == loaded_adapter
        trajectory_id = response.headers["x-olp-trajectory-id"]
        seen = 0
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                seen += 1
            if seen >= 3:
                # 1500 tokens through a LoRA take minutes here: the request still runs.
                # (Checked before leaving the loop, which closes the connection: the
                # proxy's handler is cancelled at once and closes vLLM's.)
                assert _adapter_active(vllm_server, loaded_adapter)
                break
    # Leaving the loop closed the connection mid-stream.
    wait_for(lambda: len(sink.trajectories) == 1, timeout_s=30)
    [record] = sink.trajectories
    assert record["trajectory_id"] == trajectory_id
    assert record["status"] == "aborted" and record["trainable"] is False
    assert "aborted" in record["flags"]
    assert 0 < len(record["choices"][0]["token_ids"]) < 1500
    # The proxy closed its upstream connection, so vLLM aborted the request.
    wait_for(lambda: not _adapter_active(vllm_server, loaded_adapter), timeout_s=15)
    metrics = httpx.get(harness.base_url + "/metrics").text
    assert 'olp_proxy_errors_total{kind="client_disconnect",tenant="alice"} 1.0' in metrics
    assert harness.ctx.tenants.tenants["alice"].in_flight == 0


def test_pii_in_the_client_labels_leaves_as_one_pseudonym_per_label(proxy):
    """X-Session-Id, X-OLP-Group-Id and X-OLP-Task reached Kafka as sent, e-mail and all.
    Now a label holding PII goes out as a hash: trajectories and feedback of one session
    still share it, and two sessions stay apart."""
    harness, sink = proxy
    labels = {"X-OLP-Group-Id": "grp jane@example.com", "X-OLP-Task": "fix for bob@example.com"}
    first = chat(harness, "alice", headers={"X-Session-Id": "jane@example.com", **labels})
    other = chat(harness, "alice", headers={"X-Session-Id": "bob@example.com"})
    plain = chat(harness, "alice", headers={"X-Session-Id": "sess-plain"})
    feedback = httpx.post(
        harness.base_url + "/v1/feedback",
        json={"trajectory_id": first.headers["x-olp-trajectory-id"], "kind": "accept"},
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=10,
    )
    assert feedback.status_code == 202
    wait_for(lambda: len(sink.trajectories) >= 3)
    by_id = {r["trajectory_id"]: r for r in sink.trajectories}
    record = by_id[first.headers["x-olp-trajectory-id"]]
    assert "example.com" not in json.dumps(record) + json.dumps(sink.feedback)
    assert re.fullmatch(r"redacted-[0-9a-f]{32}", record["session_id"])
    assert record["group_id"].startswith("redacted-") and record["task"].startswith("redacted-")
    assert sink.feedback[-1]["session_id"] == record["session_id"]
    assert by_id[other.headers["x-olp-trajectory-id"]]["session_id"] != record["session_id"]
    assert by_id[plain.headers["x-olp-trajectory-id"]]["session_id"] == "sess-plain"
    assert record["trainable"]  # the model saw no label: its tokens may still train


def test_feedback_accept_validate_and_ownership(proxy):
    harness, sink = proxy
    trajectory_id = chat(harness, "alice", headers={"X-Session-Id": "sess-fb"}).headers[
        "x-olp-trajectory-id"
    ]
    url = harness.base_url + "/v1/feedback"

    def send(body, key=KEYS["alice"]):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(url, json=body, headers=headers, timeout=10)

    accepted = send(
        {
            "trajectory_id": trajectory_id,
            "kind": "score",
            "value": 0.75,
            "metadata": {"note": "mail jane.doe@example.com"},
        }
    )
    assert accepted.status_code == 202 and accepted.json()["known"] is True
    assert accepted.headers["x-request-id"]
    unknown = send({"trajectory_id": "not-seen-by-this-proxy", "kind": "thumbs_up"})
    assert unknown.status_code == 202 and unknown.json()["known"] is False
    bad = send({"trajectory_id": trajectory_id, "kind": "love"})
    assert bad.status_code == 400 and "kind" in bad.json()["error"]["message"]
    assert send({"trajectory_id": trajectory_id, "kind": "accept"}, key=None).status_code == 401
    other = send({"trajectory_id": trajectory_id, "kind": "reject"}, key=KEYS["bob"])
    assert other.status_code == 403
    # A choice the answer does not have joined nothing (the learner counted it unmatched).
    beyond = send({"trajectory_id": trajectory_id, "kind": "accept", "choice_index": 1})
    assert beyond.status_code == 400, beyond.text
    assert beyond.json()["error"]["param"] == "choice_index"
    assert "has 1 choice (0-0)" in beyond.json()["error"]["message"]
    two = (
        api(harness, "alice")
        .chat.completions.with_raw_response.create(
            model="policy", messages=PROMPT, max_tokens=2, temperature=1.0, seed=3, n=2
        )
        .headers["x-olp-trajectory-id"]
    )
    assert send({"trajectory_id": two, "kind": "reject", "choice_index": 1}).status_code == 202
    assert send({"trajectory_id": two, "kind": "reject", "choice_index": 2}).status_code == 400
    event, orphan, second = sink.feedback
    assert second["trajectory_id"] == two and second["choice_index"] == 1
    assert event["trajectory_id"] == trajectory_id and event["session_id"] == "sess-fb"
    assert event["tenant"] == sha256_hex("alice") and event["value"] == 0.75
    assert "jane.doe@example.com" not in json.dumps(event)
    assert orphan["session_id"] == "not-seen-by-this-proxy"


def test_jsonl_sink_gets_records(make_proxy, vllm_server, tmp_path):
    sink = JsonlSink(tmp_path / "records")
    harness, _ = make_proxy([vllm_server.base_url], sink=sink)
    raw = chat(harness, "alice", stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    harness.drain()
    sink.close()
    lines = (tmp_path / "records" / "trajectories.jsonl").read_text().splitlines()
    [record] = [json.loads(line) for line in lines]
    assert record["trajectory_id"] == raw.headers["x-olp-trajectory-id"]
    assert record["choices"][0]["message"]["content"] == text
    assert (tmp_path / "records" / "dlq.jsonl").read_text() == ""


def test_admin_auth(proxy, make_proxy, vllm_server):
    harness, _ = proxy
    assert admin(harness, "GET", "/admin/status", key=None).status_code == 401
    assert admin(harness, "GET", "/admin/status", key=KEYS["alice"]).status_code == 403
    assert admin(harness, "POST", "/admin/freeze", {}, key="wrong").status_code == 403
    no_admin, _ = make_proxy([vllm_server.base_url], admin_key=None)
    refused = admin(no_admin, "GET", "/admin/status")
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_disabled"


def test_an_actor_name_the_audit_log_cannot_take_whole_is_refused(proxy):
    """Taken as `admin` instead (the change made, a 200), `alice smith`'s freeze went into
    the audit log under nobody's name."""
    harness, _ = proxy
    before = sum(1 for _ in harness.ctx.audit.iter_records())
    for actor in ("alice smith", "x" * 65, "ops/1"):
        refused = admin(harness, "POST", "/admin/freeze", {}, actor=actor)
        assert refused.status_code == 400, actor
        error = refused.json()["error"]
        assert error["code"] == "invalid_actor" and error["param"] == "X-OLP-Actor"
        assert "nothing was changed" in error["message"]
    assert harness.ctx.state.frozen is False
    assert sum(1 for _ in harness.ctx.audit.iter_records()) == before
    page = httpx.get(
        harness.base_url + "/admin/ui",
        headers={"Authorization": f"Bearer {ADMIN_KEY}", "X-OLP-Actor": "alice smith"},
    )
    assert page.status_code == 400 and "X-OLP-Actor" in page.text
    no_header = httpx.post(
        harness.base_url + "/admin/unfreeze", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert no_header.status_code == 200  # without the header: `admin`, as before
    assert admin(harness, "POST", "/admin/unfreeze", actor="night-shift@ops").status_code == 200
    actors = [r.get("actor") for r in harness.ctx.audit.iter_records()][before:]
    assert actors == ["admin", "night-shift@ops"]


def test_admin_ui_refuses_without_a_key_and_serves_with_it(proxy):
    harness, _ = proxy
    page = httpx.get(harness.base_url + "/admin/ui")
    assert page.status_code == 401 and page.headers["content-type"].startswith("text/html")
    assert "Serving" not in page.text and ADMIN_KEY not in page.text
    signed_in = httpx.get(
        harness.base_url + "/admin/ui", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert signed_in.status_code == 200 and ADMIN_KEY not in signed_in.text


def test_internal_admin_token_of_olp_up(tmp_path, vllm_server):
    """`olp up` hands the learner a per-run token through the environment; the proxy's
    entry point admits it next to the operator's key. Embedded (not `owns_process`), it
    leaves the host process's garbage-collector settings alone."""
    import asyncio
    import gc
    import threading

    from deploy.ports import free_port
    from proxy.config import ProxyConfig
    from proxy.server import serve_proxy
    from tests.proxy.conftest import CollectingSink, default_tenants

    port = free_port()
    config = ProxyConfig(upstreams=[vllm_server.base_url], port=port, admin_key=ADMIN_KEY)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    sink = CollectingSink()
    thread = threading.Thread(
        target=loop.run_until_complete,
        args=(
            serve_proxy(
                config,
                default_tenants(),
                tmp_path,
                stop=stop,
                sink=sink,
                internal_admin_token="run-token",
            ),
        ),
    )
    threshold, frozen = gc.get_threshold(), gc.get_freeze_count()
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(base + "/healthz"))
    try:
        assert (gc.get_threshold(), gc.get_freeze_count()) == (threshold, frozen)
        assert "\nolp_proxy_gc_frozen_objects 0.0\n" in httpx.get(base + "/metrics").text
        for key, status in (("run-token", 200), (ADMIN_KEY, 200), ("other", 403)):
            response = httpx.get(base + "/admin/status", headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == status
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
    assert sink.closed  # serve_proxy closes the sink it was given on the way out


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture
def loaded_adapter(vllm_server, make_lora_adapter, tmp_path):
    """A LoRA adapter loaded into the shared vLLM under a unique policy-v<N> name."""
    name = f"policy-v{uuid.uuid4().int % 10**12}"
    path = make_lora_adapter(tmp_path / name, seed=3)
    response = httpx.post(
        vllm_server.base_url + "/v1/load_lora_adapter",
        json={"lora_name": name, "lora_path": str(path)},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    yield name
    httpx.post(
        vllm_server.base_url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60
    )


def test_admin_flip_rollback_freeze_persist(make_proxy, vllm_server, loaded_adapter, tmp_path):
    state_dir = tmp_path / "state"
    harness, sink = make_proxy([vllm_server.base_url], state_dir=state_dir)
    assert chat(harness).headers["x-olp-policy-version"] == "base"
    missing = admin(harness, "POST", "/admin/aliases", {"alias": "policy", "target": "policy-v0"})
    assert missing.status_code == 409 and missing.json()["error"]["code"] == "not_loaded"
    bad = admin(harness, "POST", "/admin/aliases", {"alias": "policy", "target": "evil"})
    assert bad.status_code == 400
    # The learner's flip names the version it gated against: a changed alias is a 409.
    moved = {"alias": "policy", "target": loaded_adapter, "expected": "policy-v9"}
    for path, extra in (("/admin/aliases", {}), ("/admin/canary", {"share": 0.5})):
        changed = admin(harness, "POST", path, moved | extra)
        assert changed.status_code == 409, changed.text
        assert changed.json()["error"]["code"] == "alias_changed"
    flip = admin(
        harness,
        "POST",
        "/admin/aliases",
        {"alias": "policy", "target": loaded_adapter, "expected": "base"},
    )
    assert flip.status_code == 200 and flip.json()["previous"] == "base"
    served = chat(harness)
    assert served.headers["x-olp-policy-version"] == loaded_adapter
    base = api(harness, "bob").chat.completions.with_raw_response.create(
        model="base", messages=PROMPT, max_tokens=2
    )
    assert base.headers["x-olp-policy-version"] == "base"
    harness.drain()
    assert sink.trajectories[-1]["policy_version"] == loaded_adapter

    status = admin(harness, "GET", "/admin/status").json()
    assert status["serving_version"] == loaded_adapter
    assert status["rollback_targets"] == {"policy": "base"}  # the learner keeps it loaded
    assert status["history"][-1]["actor"] == "ops-test"
    assert {t["name"]: t["training_enabled"] for t in status["tenants"]} == {
        "alice": True,
        "bob": False,
        "carol": True,
    }

    frozen = admin(harness, "POST", "/admin/freeze", {"learning": True})
    assert frozen.json() == {"frozen": True, "learning_frozen": True}
    refused = admin(harness, "POST", "/admin/aliases", {"alias": "policy", "target": "base"})
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "frozen"
    rolled = admin(harness, "POST", "/admin/rollback", {})
    assert rolled.json() == {
        "alias": "policy",
        "target": "base",
        "previous": loaded_adapter,
        "serving_version": "base",
    }
    assert chat(harness).headers["x-olp-policy-version"] == "base"
    enabled = admin(harness, "POST", "/admin/tenants/bob/training", {"enabled": True})
    assert enabled.status_code == 200
    assert "x-olp-trajectory-id" in chat(harness, "bob").headers
    assert (
        admin(harness, "POST", "/admin/tenants/nobody/training", {"enabled": True}).status_code
        == 404
    )

    # A restarted proxy keeps the serving state.
    harness.stop()
    again, _ = make_proxy([vllm_server.base_url], state_dir=state_dir)
    status = admin(again, "GET", "/admin/status").json()
    assert status["aliases"]["policy"] == "base" and status["frozen"] is True
    assert status["rollback_targets"] == {}  # back at the start of the lineage
    assert {t["name"]: t["training_enabled"] for t in status["tenants"]}["bob"] is True
    assert [e["kind"] for e in status["history"]] == [
        "flip",
        "freeze",
        "rollback",
        "tenant_training",
    ]
    unfrozen = admin(again, "POST", "/admin/unfreeze")
    assert unfrozen.json()["frozen"] is False
    # `null` drops bob's switch: its config (training off) decides again.
    cleared = admin(again, "POST", "/admin/tenants/bob/training", {"enabled": None})
    assert cleared.json() == {"tenant": "bob", "training_enabled": False, "switch": None}
    assert "x-olp-trajectory-id" not in chat(again, "bob").headers
    audit_dir = state_dir / "audit"
    result = verify(audit_dir / "audit.jsonl")
    assert result.ok
    events = [json.loads(line) for line in (audit_dir / "audit.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "alias_set",
        "freeze",
        "rollback",
        "tenant_training",
        "unfreeze",
        "tenant_training",
    ]
    assert {e["actor"] for e in events} == {"ops-test"}
    assert re.fullmatch(r"[0-9a-f]{64}", events[-1]["hash"])


def _read_topic(bootstrap: str, topic: str, want: int, timeout_s: float = 30.0) -> list:
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        deadline = time.monotonic() + timeout_s
        partitions: list = []
        while not partitions and time.monotonic() < deadline:
            partitions = [
                TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()
            ]
            time.sleep(0.1)
        consumer.assign(partitions)
        consumer.seek_to_beginning()
        messages: list = []
        while len(messages) < want and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                messages.extend(batch)
        return messages
    finally:
        consumer.close()


def test_records_reach_kafka_keyed_by_session(make_proxy, vllm_server, kafka_bootstrap, tmp_path):
    """The production sink: trajectory and feedback land on `<prefix>.*` keyed by session."""
    from replay.config import StreamConfig
    from replay.producer import KafkaSink

    prefix = f"proxytest{uuid.uuid4().hex[:10]}"
    sink = KafkaSink(
        StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix),
        tmp_path / "spill-state",
    )
    harness, _ = make_proxy([vllm_server.base_url], sink=sink)
    raw = chat(harness, "alice", headers={"X-Session-Id": "kafka-session"})
    trajectory_id = raw.headers["x-olp-trajectory-id"]
    # Secrets as structured metadata (a CI hook posting its job's settings) went to Kafka
    # as they were: the redactor read each value without its key.
    token = "3f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c"
    feedback = httpx.post(
        harness.base_url + "/v1/feedback",
        json={
            "trajectory_id": trajectory_id,
            "kind": "accept",
            "metadata": {"job": {"db_password": "hunter2x", "GITHUB_TOKEN": token}, "n": 3},
        },
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
    )
    assert feedback.status_code == 202
    harness.drain()
    harness.call(sink.aclose())
    [trajectory] = _read_topic(kafka_bootstrap, f"{prefix}.trajectories", 1)
    [event] = _read_topic(kafka_bootstrap, f"{prefix}.feedback", 1)
    assert trajectory.key == event.key == b"kafka-session"
    record = json.loads(trajectory.value)
    assert record["trajectory_id"] == trajectory_id and record["trainable"] is True
    sent = json.loads(event.value)
    assert sent["trajectory_id"] == trajectory_id
    assert sent["metadata"] == {
        "job": {
            "db_password": "[REDACTED:secret_assignment]",
            "GITHUB_TOKEN": "[REDACTED:secret_assignment]",
        },
        "n": 3,
    }
    assert b"hunter2x" not in event.value and token.encode() not in event.value


def test_a_body_too_large_for_the_topics_records_is_served_uncaptured(
    make_proxy, vllm_server, kafka_bootstrap, tmp_path
):
    """A body near max_body_bytes made a record over the topic's max_request_size_bytes: it
    went to the dead-letter topic (a 64 KiB excerpt at most) while the client got a
    trajectory id its feedback could never join. Over half the topic's limit, a body is now
    served without capture (`captures_skipped{reason="too_large"}`)."""
    from replay.config import StreamConfig
    from replay.producer import KafkaSink

    prefix = f"proxytest{uuid.uuid4().hex[:10]}"
    stream = StreamConfig(
        bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, max_request_size_bytes=65536
    )
    sink = KafkaSink(stream, tmp_path / "spill-state")
    harness, _ = make_proxy([vllm_server.base_url], sink=sink)
    assert harness.ctx.capture.max_body_bytes == (65536 - 1024) // 2
    big = chat(harness, "alice", user="u" * 40_000)
    assert big.parse().choices[0].finish_reason is not None
    assert "x-olp-trajectory-id" not in big.headers
    small = chat(harness, "alice")
    trajectory_id = small.headers["x-olp-trajectory-id"]
    skipped = harness.ctx.metrics.captures_skipped.labels("alice", "too_large")
    assert skipped._value.get() == 1
    harness.drain()
    harness.call(sink.aclose())
    [record] = _read_topic(kafka_bootstrap, f"{prefix}.trajectories", 1)
    assert json.loads(record.value)["trajectory_id"] == trajectory_id


@pytest.mark.parametrize(
    ("limit", "captured_before_pause"),
    [({"capture_backlog_limit": 3}, 3), ({"capture_backlog_bytes": 1}, 1)],
    ids=["records", "bytes"],
)
def test_training_requests_go_uncaptured_while_the_sinks_backlog_is_at_its_limit(
    make_proxy, vllm_server, kafka_bootstrap, tmp_path, limit, captured_before_pause
):
    """A sink worker that gets no CPU (stopped here; at idle priority behind busy cores in
    production) must not let captures pile up in the proxy's memory: at
    `capture_backlog_limit` records, or `capture_backlog_bytes` of captures (a count alone
    let a few thousand large agent requests hold gigabytes; at one byte, one waiting capture
    is enough), requests are served without capture and counted, and capture resumes once
    the worker caught up. Every captured request reaches Kafka."""
    import os
    import signal

    from replay.config import StreamConfig
    from replay.sink_process import KafkaSinkProcess

    prefix = f"backlog{uuid.uuid4().hex[:10]}"
    sink = KafkaSinkProcess(
        StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, sink_hung_after_s=120),
        tmp_path / "sink-state",
    )
    harness, _ = make_proxy([vllm_server.base_url], sink=sink, **limit)
    assert sink.wait_idle(60)
    worker = sink._proc.pid
    os.kill(worker, signal.SIGSTOP)
    try:
        captured = [
            chat(harness, "alice").headers.get("x-olp-trajectory-id")
            for _ in range(captured_before_pause)
        ]
        assert all(captured)
        harness.drain()  # capture runs after the answer went out
        assert sink.backlog() == captured_before_pause
        assert sink.backlog_bytes() > 1000 * captured_before_pause  # the packed captures
        skipped = chat(harness, "alice")
        assert skipped.status_code == 200 and skipped.parse().choices[0].message is not None
        assert "x-olp-trajectory-id" not in skipped.headers
        text = httpx.get(harness.base_url + "/metrics").text
        assert 'olp_proxy_captures_skipped_total{reason="backlog",tenant="alice"} 1.0' in text
        os.kill(worker, signal.SIGCONT)
        assert sink.wait_idle(60)
        assert sink.backlog_bytes() == 0
        resumed = chat(harness, "alice").headers.get("x-olp-trajectory-id")
        assert resumed
        harness.drain()
    finally:
        os.kill(worker, signal.SIGCONT)
        sink.close()
    records = _read_topic(kafka_bootstrap, f"{prefix}.trajectories", captured_before_pause + 1)
    assert {json.loads(r.value)["trajectory_id"] for r in records} == {*captured, resumed}


def test_a_sink_worker_that_stopped_reading_is_replaced_while_capture_is_paused(
    make_proxy, vllm_server, kafka_bootstrap, tmp_path
):
    """A worker that stops reading its pipe blocks the sink's feeder in its write (a capture
    larger than the pipe holds), and the feeder can no longer check it for silence. Paused
    on `capture_backlog_bytes`, the proxy put nothing more, so nothing checked: capture
    stayed paused for good. The paused proxy now asks the sink to kill a silent worker; the
    new one takes over and every captured request reaches Kafka."""
    import os
    import signal

    from replay.config import StreamConfig
    from replay.sink_process import KafkaSinkProcess

    prefix = f"hung{uuid.uuid4().hex[:10]}"
    sink = KafkaSinkProcess(
        StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix, sink_hung_after_s=1),
        tmp_path / "sink-state",
    )
    harness, _ = make_proxy([vllm_server.base_url], sink=sink, capture_backlog_bytes=100_000)
    assert sink.wait_idle(60)
    worker = sink._proc.pid
    os.kill(worker, signal.SIGSTOP)
    try:
        # An unknown extra field is passed through, and captured with the request body.
        large = chat(harness, "alice", extra_body={"olp_test_pad": "x" * 2_000_000})
        first = large.headers.get("x-olp-trajectory-id")
        assert first
        harness.drain()
        wait_for(lambda: len(sink._pending) == 1, timeout_s=10)  # the feeder is writing it
        time.sleep(1.5)  # the worker is silent for longer than sink_hung_after_s
        assert sink.child_restarts == 0
        skipped = chat(harness, "alice")  # paused: served uncaptured, and the sink is asked
        assert skipped.status_code == 200 and "x-olp-trajectory-id" not in skipped.headers
        wait_for(lambda: sink.child_restarts == 1, timeout_s=10)
        assert sink.wait_idle(60)
        resumed = chat(harness, "alice").headers.get("x-olp-trajectory-id")
        assert resumed
        harness.drain()
        assert sink.wait_idle(60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
        sink.close()
    records = _read_topic(kafka_bootstrap, f"{prefix}.trajectories", 2)
    assert {json.loads(r.value)["trajectory_id"] for r in records} == {first, resumed}


def test_the_kafka_sinks_series_are_on_metrics(tmp_path, vllm_server, kafka_bootstrap):
    """`olp proxy` built its KafkaSinkProcess without a registry: no `olp_stream_*` series
    (queued, spilled, DLQ, broker up) reached /metrics, only the operator page."""
    import asyncio
    import threading
    import uuid

    from deploy.ports import free_port
    from proxy.config import ProxyConfig
    from proxy.server import serve_proxy
    from replay.config import StreamConfig
    from tests.proxy.conftest import KEYS, default_tenants

    port = free_port()
    config = ProxyConfig(upstreams=[vllm_server.base_url], port=port, admin_key=ADMIN_KEY)
    stream = StreamConfig(
        bootstrap_servers=kafka_bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:8]}"
    )
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(
        target=loop.run_until_complete,
        args=(serve_proxy(config, default_tenants(), tmp_path, stream=stream, stop=stop),),
    )
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(base + "/healthz"), timeout_s=60)
    try:
        reply = httpx.post(
            base + "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2,
            },
            headers={"Authorization": f"Bearer {KEYS['alice']}"},  # training on
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        queued = 'olp_stream_queued_total{kind="trajectory"} 1.0'
        wait_for(lambda: queued in httpx.get(base + "/metrics").text, timeout_s=30)
        text = httpx.get(base + "/metrics").text
        assert "olp_proxy_requests_total{" in text  # the proxy's own series still there
        assert text.count("# HELP olp_stream_queued_total ") == 1
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()
