"""A feedback event's ids as they leave for Kafka: a client's trajectory id holding PII goes
out as its pseudonym (like the session id beside it), the proxy's own ids as issued; and a
feedback whose trajectory the proxy no longer remembers, sent without X-Session-Id, is keyed
like its trajectory whenever that key can be derived from the trajectory id."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import httpx
import pytest

from proxy.capture import private_label
from safety.redaction import Redactor
from tests.proxy.conftest import KEYS
from tests.proxy.test_proxy_scripted_upstream import ScriptedUpstream

REDACT = Redactor().redact_obj
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


def chat(harness, headers: dict[str, str] | None = None) -> httpx.Response:
    response = httpx.post(
        harness.base_url + "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {KEYS['alice']}", **(headers or {})},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    return response


def feedback(harness, trajectory_id: str, headers: dict[str, str] | None = None) -> dict:
    response = httpx.post(
        harness.base_url + "/v1/feedback",
        json={"trajectory_id": trajectory_id, "kind": "accept"},
        headers={"Authorization": f"Bearer {KEYS['alice']}", **(headers or {})},
        timeout=30,
    )
    assert response.status_code == 202, response.text
    return response.json()


def test_a_trajectory_id_holding_pii_leaves_as_its_pseudonym(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    for trajectory_id in ("jane.doe@example.com", "call 4111 1111 1111 1111"):
        assert feedback(harness, trajectory_id)["known"] is False
        event = sink.feedback[-1]
        pseudonym = private_label(trajectory_id, REDACT, harness.ctx.pseudonym_key)
        assert pseudonym.startswith("redacted-")
        # Keyed: the plain sha256 of a guessed address does not find it.
        assert pseudonym != private_label(trajectory_id, REDACT)
        assert event["trajectory_id"] == pseudonym
        assert event["session_id"] == pseudonym  # no X-Session-Id: keyed by the same
    assert "jane" not in json.dumps(sink.feedback) and "4111" not in json.dumps(sink.feedback)


def test_ids_the_proxy_issued_leave_as_issued(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    issued = [
        chat(harness).headers["x-olp-trajectory-id"],
        chat(harness, {"x-request-id": "client-7"}).headers["x-olp-trajectory-id"],
    ]
    for trajectory_id in issued:
        assert feedback(harness, trajectory_id)["known"] is True
        assert sink.feedback[-1]["trajectory_id"] == trajectory_id
    # Unknown to this proxy (a restart), in the shapes it issues: as they came.
    for trajectory_id in (f"req-{secrets.token_hex(16)}", secrets.token_hex(16), "4" * 32):
        assert feedback(harness, trajectory_id)["known"] is False
        assert sink.feedback[-1]["trajectory_id"] == trajectory_id
    plain = "client-made-id-42"  # nothing in it to redact
    feedback(harness, plain)
    assert sink.feedback[-1]["trajectory_id"] == plain


def test_feedback_after_a_restart_is_keyed_like_its_trajectory(make_proxy, scripted):
    """A request without X-Session-Id (nor x-request-id) is keyed by its request id; its
    trajectory id is that id, so a proxy that no longer remembers it keys the feedback the
    same, and the two share a Kafka partition."""
    first, sink = make_proxy([scripted.url])
    trajectory_id = chat(first).headers["x-olp-trajectory-id"]
    first.drain()
    [record] = sink.trajectories
    restarted, restarted_sink = make_proxy([scripted.url])
    assert feedback(restarted, trajectory_id)["known"] is False
    [event] = restarted_sink.feedback
    assert event["trajectory_id"] == record["trajectory_id"]
    assert event["session_id"] == record["session_id"]
    # With X-Session-Id the trajectory is keyed by it; feedback that sends it matches too.
    session = "jane@example.com"
    with_session = chat(first, {"X-Session-Id": session}).headers["x-olp-trajectory-id"]
    first.drain()
    feedback(restarted, with_session, {"X-Session-Id": session})
    assert restarted_sink.feedback[-1]["session_id"] == sink.trajectories[-1]["session_id"]
    key = first.ctx.pseudonym_key
    assert sink.trajectories[-1]["session_id"] == private_label(session, REDACT, key)


def test_feedback_after_a_restart_of_a_real_model_server_trajectory(make_proxy, vllm_server):
    first, sink = make_proxy([vllm_server.base_url])
    response = httpx.post(
        first.base_url + "/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=120,
    )
    assert response.status_code == 200
    first.drain()
    [record] = sink.trajectories
    restarted, restarted_sink = make_proxy([vllm_server.base_url])
    feedback(restarted, response.headers["x-olp-trajectory-id"])
    [event] = restarted_sink.feedback
    assert event["session_id"] == record["session_id"]
    assert event["trajectory_id"] == record["trajectory_id"]


def test_feedback_on_what_was_not_captured_is_not_recorded(make_proxy, scripted):
    """A tenant with training off, and a request sent with `X-OLP-Train: 0`, had their
    feedback recorded all the same (202, `known: false`), its metadata on the feedback
    topic, though nothing could join it and the tenant's consent was not there."""
    harness, sink = make_proxy([scripted.url])
    off = httpx.post(
        harness.base_url + "/v1/feedback",
        json={"trajectory_id": "req-" + "0" * 32, "kind": "accept", "metadata": {"edit": "mine"}},
        headers={"Authorization": f"Bearer {KEYS['bob']}"},
        timeout=30,
    )
    assert off.status_code == 202 and off.json()["status"] == "not_recorded", off.text
    assert "training is off for this tenant" in off.json()["reason"]
    opted_out = chat(harness, {"X-OLP-Train": "0"})
    assert "x-olp-trajectory-id" not in opted_out.headers
    answer = feedback(harness, opted_out.headers["x-request-id"])
    assert answer["status"] == "not_recorded" and "X-OLP-Train: 0" in answer["reason"]
    assert sink.feedback == []
    captured = chat(harness)
    assert feedback(harness, captured.headers["x-olp-trajectory-id"])["status"] == "accepted"
    assert len(sink.feedback) == 1
