"""`Expect: 100-continue`: the proxy answers it only once the request passed the checks made
before the body is read (key, limits, declared size); a refused client gets its final
status instead and never uploads the body."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from tests.proxy.conftest import ADMIN_KEY, KEYS
from tests.proxy.test_proxy_scripted_upstream import ScriptedUpstream

CHAT = {"model": "policy", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


class ExpectingClient:
    """A client that sends the head with `Expect: 100-continue` and holds the body back until
    told to continue, as curl does for a large upload."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.received = b""

    def send_head(self, path: str, key: str | None, length: int, expect: str) -> None:
        kind = "x-www-form-urlencoded" if path.startswith("/admin/ui/") else "json"
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/{kind}\r\n"
            f"Content-Length: {length}\r\nExpect: {expect}\r\n"
            + (f"Authorization: Bearer {key}\r\n" if key else "")
            + "\r\n"
        )
        self.sock.sendall(head.encode())

    def first_answer(self) -> tuple[str, dict[str, str]]:
        """The status line and the headers of the next thing the server answers."""
        while b"\r\n\r\n" not in self.received:
            chunk = self.sock.recv(65536)
            assert chunk, f"closed after {self.received!r}"
            self.received += chunk
        head, _, self.received = self.received.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return status_line, headers

    def body(self, headers: dict[str, str]) -> bytes:
        """The answer's body, by its Content-Length (a refused request's connection is held
        by aiohttp until the client closes it or 10 s passed, waiting for the body)."""
        length = int(headers["content-length"])
        while len(self.received) < length:
            chunk = self.sock.recv(65536)
            assert chunk, f"closed after {self.received!r}"
            self.received += chunk
        body, self.received = self.received[:length], self.received[length:]
        return body

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def expecting() -> Iterator[list[ExpectingClient]]:
    clients: list[ExpectingClient] = []
    yield clients
    for client in clients:
        client.close()


def _refused_before_the_body(
    port: int, clients: list, path: str, key: str | None, length: int
) -> tuple[str, dict]:
    client = ExpectingClient(port)
    clients.append(client)
    client.send_head(path, key, length, "100-continue")
    status_line, headers = client.first_answer()
    # The held-back body may still follow: read as the next request, it would be garbage.
    assert headers["connection"] == "close", headers
    return status_line, json.loads(client.body(headers))


def test_a_refused_request_gets_its_status_instead_of_a_continue(make_proxy, scripted, expecting):
    harness, sink = make_proxy([scripted.url])
    port = harness.port
    status, body = _refused_before_the_body(port, expecting, "/v1/chat/completions", None, 100)
    assert status == "HTTP/1.1 401 Unauthorized", status
    assert body["error"]["code"] == "missing_api_key"
    too_large = harness.ctx.config.max_body_bytes + 1
    status, body = _refused_before_the_body(
        port, expecting, "/v1/chat/completions", KEYS["alice"], too_large
    )
    assert status.split()[1] == "413", status
    assert body["error"]["code"] == "request_too_large"
    status, body = _refused_before_the_body(port, expecting, "/v1/feedback", "wrong-key", 100)
    assert status.split()[1] == "401", status
    status, body = _refused_before_the_body(port, expecting, "/admin/freeze", KEYS["alice"], 10)
    assert status.split()[1] in {"401", "403"}, status
    # carol may send 2 requests a minute: the third is refused before its body.
    for _ in range(2):
        client = ExpectingClient(port)
        expecting.append(client)
        client.send_head("/v1/chat/completions", KEYS["carol"], 10, "100-continue")
        assert client.first_answer()[0] == "HTTP/1.1 100 Continue"
        client.sock.sendall(b"not json!!")
        status_line, headers = client.first_answer()
        assert status_line.split()[1] == "400", status_line
        assert headers.get("connection") != "close"  # the body was read: the connection is whole
    status, body = _refused_before_the_body(
        port, expecting, "/v1/chat/completions", KEYS["carol"], 10
    )
    assert status.split()[1] == "429", status
    assert sink.trajectories == []


def test_an_unknown_expectation_is_refused(make_proxy, scripted, expecting):
    harness, _ = make_proxy([scripted.url])
    client = ExpectingClient(harness.port)
    expecting.append(client)
    client.send_head("/v1/chat/completions", KEYS["alice"], 10, "something-else")
    assert client.first_answer()[0].split()[1] == "417"


def test_an_admitted_request_continues_and_is_served_and_captured(
    make_proxy, vllm_server, expecting
):
    harness, sink = make_proxy([vllm_server.base_url])
    payload = json.dumps(CHAT).encode()
    client = ExpectingClient(harness.port)
    expecting.append(client)
    client.send_head("/v1/chat/completions", KEYS["alice"], len(payload), "100-continue")
    assert client.first_answer()[0] == "HTTP/1.1 100 Continue"
    client.sock.sendall(payload)
    status_line, headers = client.first_answer()
    assert status_line == "HTTP/1.1 200 OK", (status_line, client.received[:300])
    answer = json.loads(client.body(headers))
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert b"100 Continue" not in client.received
    harness.drain()
    [record] = sink.trajectories
    assert record["status"] == "ok" and record["trainable"] is True


def test_an_admin_request_continues_once_the_key_is_checked(make_proxy, scripted, expecting):
    harness, _ = make_proxy([scripted.url])
    payload = b"{}"
    client = ExpectingClient(harness.port)
    expecting.append(client)
    client.send_head("/admin/freeze", ADMIN_KEY, len(payload), "100-continue")
    assert client.first_answer()[0] == "HTTP/1.1 100 Continue"
    client.sock.sendall(payload)
    assert client.first_answer()[0].split()[1] == "200"
    assert harness.ctx.state.frozen


def test_the_operator_sign_in_form_continues_only_within_its_size(make_proxy, scripted, expecting):
    harness, _ = make_proxy([scripted.url])
    too_large = ExpectingClient(harness.port)
    expecting.append(too_large)
    too_large.send_head("/admin/ui/login", None, 1024 * 1024, "100-continue")
    status_line, headers = too_large.first_answer()
    assert status_line.split()[1] == "413", status_line
    assert headers["connection"] == "close"
    form = f"key={ADMIN_KEY}&actor=form-op".encode()
    client = ExpectingClient(harness.port)
    expecting.append(client)
    client.send_head("/admin/ui/login", None, len(form), "100-continue")
    assert client.first_answer()[0] == "HTTP/1.1 100 Continue"
    client.sock.sendall(form)
    status_line, headers = client.first_answer()
    assert status_line.split()[1] == "303", status_line
    assert "set-cookie" in headers
