"""The log lines of a request carry its X-Session-Id as the records do: as it came when the
Redactor finds nothing in it, else as the same `redacted-<hash>` pseudonym, never the raw
label (an e-mail address as a session id)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from structlog.testing import capture_logs

from deploy.ports import free_port
from proxy.capture import private_label
from proxy.log_context import merge_request_context
from safety.redaction import Redactor
from tests.proxy.conftest import KEYS
from tests.proxy.test_proxy_scripted_upstream import ScriptedUpstream

BODY = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


def request(harness, session_id: str, path: str = "/v1/chat/completions", body=BODY):
    return httpx.post(
        harness.base_url + path,
        json=body,
        headers={"Authorization": f"Bearer {KEYS['alice']}", "X-Session-Id": session_id},
        timeout=30,
    )


def request_with_id(harness, request_id: str) -> httpx.Response:
    return httpx.post(
        harness.base_url + "/v1/chat/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {KEYS['alice']}", "x-request-id": request_id},
        timeout=30,
    )


def lines_of(logs: list[dict], request_id: str) -> list[dict]:
    return [e for e in logs if e.get("request_id") == request_id]


def test_a_session_id_holding_pii_is_logged_as_its_pseudonym(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    session = "jane.doe@example.com"
    pseudonym = private_label(session, Redactor().redact_obj, harness.ctx.pseudonym_key)
    assert pseudonym.startswith("redacted-")
    with capture_logs(processors=[merge_request_context]) as logs:
        response = request(harness, session)
        assert response.status_code == 200
        response.read()
        harness.drain()
        failed = request(harness, session, body={"model": "policy"})  # a 400: logged too
        assert failed.status_code == 400
    for answered in (response, failed):
        lines = lines_of(logs, answered.headers["x-request-id"])
        assert lines and all(e["session_id"] == pseudonym for e in lines), lines
    assert "jane.doe" not in json.dumps(logs, default=str)
    [record] = sink.trajectories
    assert record["session_id"] == pseudonym  # the same pseudonym as the record's


def test_a_plain_session_id_is_logged_as_it_came(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    with capture_logs(processors=[merge_request_context]) as logs:
        response = request(harness, "chat-42")
        response.read()
        harness.drain()  # the "request" line is written after the answer went out
    lines = lines_of(logs, response.headers["x-request-id"])
    assert lines and all(e["session_id"] == "chat-42" for e in lines)


def test_a_session_id_that_is_not_utf8_is_refused_and_never_logged_raw(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    with capture_logs(processors=[merge_request_context]) as logs:
        response = httpx.post(
            harness.base_url + "/v1/chat/completions",
            json=BODY,
            headers=[
                ("Authorization", f"Bearer {KEYS['alice']}"),
                ("X-Session-Id", "4111 1111 1111 1111 \xff".encode("latin-1")),
            ],
            timeout=30,
        )
    assert response.status_code == 400
    lines = lines_of(logs, response.headers["x-request-id"])
    assert lines and all(e["session_id"].startswith("redacted-") for e in lines), lines
    assert "4111" not in json.dumps(logs, default=str)


def test_a_request_id_holding_pii_is_logged_as_the_record_carries_it(make_proxy, scripted):
    """x-request-id is the client's label too: a card number fits its characters."""
    harness, sink = make_proxy([scripted.url])
    card = "4111111111111111"
    with capture_logs(processors=[merge_request_context]) as logs:
        response = request_with_id(harness, card)
        assert response.status_code == 200
        response.read()
        harness.drain()
    assert response.headers["x-request-id"] == card  # echoed to the client that sent it
    [record] = sink.trajectories
    assert record["request_id"].startswith("redacted-")
    lines = lines_of(logs, record["request_id"])
    assert any(e.get("event") == "request" for e in lines), logs
    assert card not in json.dumps(logs, default=str)


def test_the_proxys_own_request_id_is_logged_as_it_came(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    with capture_logs(processors=[merge_request_context]) as logs:
        response = request(harness, "chat-42")
        response.read()
        harness.drain()  # the "request" line is written after the answer went out
    assert lines_of(logs, response.headers["x-request-id"])


def test_a_request_id_holding_pii_stays_out_of_the_lines_about_a_failure(make_proxy):
    """The lines about a request that failed carry its id as its other lines do (they used to
    name the raw x-request-id themselves)."""
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"])  # nothing listens there
    card = "4111111111111111"
    with capture_logs(processors=[merge_request_context]) as logs:
        response = request_with_id(harness, card)
    assert response.status_code == 502
    assert response.headers["x-request-id"] == card
    failed = [e for e in logs if e.get("event") == "upstream_unavailable"]
    assert len(failed) == 1, logs
    key = harness.ctx.pseudonym_key
    assert failed[0]["request_id"] == private_label(card, Redactor().redact_obj, key)
    assert card not in json.dumps(logs, default=str)


@pytest.mark.parametrize(
    "secret", [":bob.smith@example.com", ": card 4111 1111 1111 1111"], ids=["e-mail", "card"]
)
def test_a_label_longer_than_the_limit_is_not_cut_through_its_pii(make_proxy, scripted, secret):
    """Cut to 256 characters first, `...:bob.smith@example.c` no longer matched the e-mail
    pass and went out as it was, into the record, the feedback event and the logs."""
    harness, sink = make_proxy([scripted.url])
    label = "w" * (250 - len(secret) // 2) + secret  # the cut falls inside the secret
    assert len(label) > 256 and len(label[:256]) < len(label)
    headers = {
        "Authorization": f"Bearer {KEYS['alice']}",
        "X-Session-Id": label,
        "X-OLP-Group-Id": label,
        "X-OLP-Task": label,
    }
    pseudonym = private_label(label, Redactor().redact_obj, harness.ctx.pseudonym_key)
    assert pseudonym.startswith("redacted-")
    with capture_logs(processors=[merge_request_context]) as logs:
        response = httpx.post(
            harness.base_url + "/v1/chat/completions", json=BODY, headers=headers, timeout=30
        )
        assert response.status_code == 200
        response.read()
        harness.drain()
        unknown = httpx.post(  # a trajectory this proxy does not know: keyed by the header
            harness.base_url + "/v1/feedback",
            json={"trajectory_id": "client-made-id-42", "kind": "accept"},
            headers=headers,
            timeout=30,
        )
        assert unknown.status_code == 202, unknown.text
    [record] = sink.trajectories
    [event] = sink.feedback
    assert record["session_id"] == record["group_id"] == record["task"] == pseudonym
    assert event["session_id"] == pseudonym  # joins and partitions with its trajectory
    lines = lines_of(logs, response.headers["x-request-id"])
    assert lines and all(e["session_id"] == pseudonym for e in lines)
    leaked = label[:256][-12:]  # what the cut kept of the secret, and what went out before
    assert leaked not in json.dumps([record, event, logs], default=str)


def test_a_long_label_without_pii_is_cut_to_the_limit(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    label = "chat-" + "7" * 300
    response = request(harness, label)
    response.read()
    harness.drain()
    [record] = sink.trajectories
    assert record["session_id"] == label[:256]
