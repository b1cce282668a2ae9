"""The 502/504 a client gets when no replica answers names the request id, never the model
server's address (vLLM's host and port stay behind the proxy); the log keeps the detail."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

import httpx
from structlog.testing import capture_logs

from deploy.ports import free_port
from proxy.log_context import merge_request_context
from tests.proxy.conftest import KEYS

BODY = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}


def post(harness, request_id: str, **body):
    return httpx.post(
        harness.base_url + "/v1/chat/completions",
        json={**BODY, **body},
        headers={"Authorization": f"Bearer {KEYS['alice']}", "x-request-id": request_id},
        timeout=60,
    )


def assert_hides(message: str, url: str) -> None:
    parts = urlsplit(url)
    assert parts.hostname not in message and str(parts.port) not in message, message
    assert "Cannot connect" not in message and "ClientConnectorError" not in message


def test_a_dead_upstream_s_502_names_the_request_not_the_replica(make_proxy):
    dead = f"http://127.0.0.1:{free_port()}"
    harness, _ = make_proxy([dead])
    with capture_logs(processors=[merge_request_context]) as logs:
        for stream in (False, True):
            response = post(harness, f"dead-{stream}", stream=stream)
            assert response.status_code == 502
            error = response.json()["error"]
            assert error["code"] == "upstream_error"
            assert f"dead-{stream}" in error["message"]
            assert_hides(error["message"], dead)
    # The detail is in the log, with the request id.
    logged = [e for e in logs if e["event"] == "upstream_unavailable"]
    assert {e["request_id"] for e in logged} == {"dead-False", "dead-True"}
    assert all(str(urlsplit(dead).port) in e["error"] for e in logged)


def test_a_silent_upstream_s_504_names_the_request_not_the_replica(make_proxy):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        harness, _ = make_proxy([url], read_timeout_s=0.5)
        response = post(harness, "silent-1")
    finally:
        listener.close()
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "upstream_timeout" and "silent-1" in error["message"]
    assert_hides(error["message"], url)


def test_the_real_model_server_s_address_is_not_in_a_502(make_proxy, vllm_server):
    """A live replica behind a dead one: the client gets its answer; with only dead ones
    the 502 names neither."""
    dead = f"http://127.0.0.1:{free_port()}"
    harness, _ = make_proxy([dead, vllm_server.base_url])
    assert post(harness, "live-1", max_tokens=2).status_code == 200
    harness_dead, _ = make_proxy([dead])
    response = post(harness_dead, "dead-2", max_tokens=2)
    assert response.status_code == 502
    assert_hides(response.json()["error"]["message"], dead)
    assert_hides(response.json()["error"]["message"], vllm_server.base_url)
