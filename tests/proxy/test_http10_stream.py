"""A streamed answer to an HTTP/1.0 request (what nginx sends to its backends by default):
no chunked encoding, which HTTP/1.0 lacks; the stream ends with the connection instead."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.proxy.conftest import KEYS
from tests.proxy.test_proxy_scripted_upstream import ScriptedUpstream


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


def raw_post(port: int, body: dict, key: str, version: str = "1.0") -> tuple[str, dict, bytes]:
    """POST over a bare socket with the given HTTP version; reads until the server closes."""
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/{version}\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n"
        + ("Connection: close\r\n" if version == "1.1" else "")
        + "\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(head.encode() + payload)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    raw_head, _, content = received.partition(b"\r\n\r\n")
    status_line, *lines = raw_head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status_line, headers, content


STREAM = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}


@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured / relayed as bytes
def test_an_http10_stream_is_sent_unchunked_and_ends_with_the_connection(
    make_proxy, scripted, tenant
):
    harness, sink = make_proxy([scripted.url])
    status_line, headers, content = raw_post(harness.port, STREAM, KEYS[tenant])
    assert status_line.split()[1] == "200", (status_line, content[:500])
    assert headers["content-type"].startswith("text/event-stream")
    assert "transfer-encoding" not in headers
    assert headers.get("connection", "close").lower() == "close"
    assert headers["x-request-id"]
    assert content.endswith(b"data: [DONE]\n\n")
    events = [line[6:] for line in content.split(b"\n") if line.startswith(b"data: ")]
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])
    harness.drain()
    if tenant == "alice":
        [record] = sink.trajectories
        assert record["status"] == "ok" and record["trainable"] is True
    else:
        assert sink.trajectories == []
    errors = harness.ctx.metrics.registry.get_sample_value(
        "olp_proxy_errors_total", {"kind": "internal_error", "tenant": tenant}
    )
    assert not errors


def test_an_http11_stream_is_still_chunked(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    status_line, headers, content = raw_post(harness.port, STREAM, KEYS["bob"], version="1.1")
    assert status_line.split()[1] == "200"
    assert headers["transfer-encoding"] == "chunked"
    assert content.endswith(b"0\r\n\r\n")
    assert b"data: [DONE]\n\n" in content


def test_an_http10_stream_from_the_real_model_server(proxy):
    harness, sink = proxy
    body = {**STREAM, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    status_line, headers, content = raw_post(harness.port, body, KEYS["alice"])
    assert status_line.split()[1] == "200", (status_line, content[:500])
    assert "transfer-encoding" not in headers
    assert content.endswith(b"data: [DONE]\n\n")
    harness.drain()
    [record] = sink.trajectories
    assert record["status"] == "ok"
