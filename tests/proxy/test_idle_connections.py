"""Client connections that hold no request being served are closed after `idle_timeout_s`
(aiohttp's default keeps them an hour), and a request that takes longer is not cut. A body
that stops arriving gets a 408 after `body_timeout_s` without bytes, which frees its tenant's
concurrency slot; a body that keeps arriving, however slowly, is read whole."""

from __future__ import annotations

import json
import select
import socket
import time

import httpx
import openai
import pytest

from tests.proxy.conftest import ADMIN_KEY, KEYS, wait_for

IDLE_S = 1.0
BODY_TIMEOUT_S = 1.0


def _closed_after(sock: socket.socket, limit_s: float) -> float | None:
    """Seconds until the server closed `sock` (EOF or reset), None if still open at `limit_s`."""
    started = time.monotonic()
    sock.settimeout(0.1)
    while time.monotonic() - started < limit_s:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except ConnectionResetError:
            return time.monotonic() - started
    return None


@pytest.fixture
def short_idle_proxy(make_proxy, vllm_server):
    return make_proxy([vllm_server.base_url], idle_timeout_s=IDLE_S)


def test_half_sent_headers_and_silent_connections_are_closed(short_idle_proxy):
    harness, _ = short_idle_proxy
    trickling = socket.create_connection(("127.0.0.1", harness.port))
    trickling.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    silent = socket.create_connection(("127.0.0.1", harness.port))
    with trickling, silent:
        # Closed by the idle timer (aiohttp checks it with up to a second's slack), long
        # before aiohttp's own default of an hour.
        assert _closed_after(trickling, IDLE_S + 5) is not None
        assert _closed_after(silent, 1.0) is not None


def test_a_request_longer_than_the_idle_timeout_is_served_whole(short_idle_proxy):
    harness, sink = short_idle_proxy
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    started = time.monotonic()
    chunks = list(
        api.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "Count from one to fifty in words."}],
            max_tokens=96,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    took_s = time.monotonic() - started
    assert took_s > IDLE_S, f"the request took {took_s:.2f} s: too short to show anything"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    harness.drain()
    assert [r["status"] for r in sink.trajectories] == ["ok"]
    assert len(sink.trajectories[0]["choices"][0]["token_ids"]) == 96
    # The connection the request used was idle afterwards and is closed; the next request
    # gets a new one.
    again = api.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert again.choices[0].finish_reason is not None


def _answer(sock: socket.socket, limit_s: float) -> tuple[int, dict[str, str], bytes]:
    """The status, headers and body of the response on `sock` (Content-Length framed)."""
    sock.settimeout(limit_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed without an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(status_line.split()[1]), headers, body


def _post_head(
    port: int, path: str, key: str, length: int, content_type: str = "application/json"
) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


@pytest.fixture
def short_body_timeout_proxy(make_proxy, vllm_server):
    return make_proxy([vllm_server.base_url], body_timeout_s=BODY_TIMEOUT_S)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/feedback"])
def test_a_body_that_stops_arriving_gets_a_408_and_frees_the_tenants_slot(
    short_body_timeout_proxy, path: str
):
    harness, sink = short_body_timeout_proxy
    alice = harness.ctx.tenants.tenants["alice"]
    with socket.create_connection(("127.0.0.1", harness.port)) as stalled:
        stalled.sendall(_post_head(harness.port, path, KEYS["alice"], 500) + b'{"model": ')
        if path == "/v1/chat/completions":
            wait_for(lambda: alice.in_flight == 1)  # admitted before its body is read
        started = time.monotonic()
        status, headers, body = _answer(stalled, BODY_TIMEOUT_S + 10)
        waited_s = time.monotonic() - started
    assert status == 408, body
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout"
    # Feedback holds no concurrency slot: its whole body is timed (the next test).
    stalled_for = "not whole after 1 s" if path == "/v1/feedback" else "no bytes for 1 s"
    assert stalled_for in error["message"]
    assert headers["x-request-id"].startswith("req-")
    assert BODY_TIMEOUT_S * 0.9 <= waited_s < BODY_TIMEOUT_S + 5
    assert alice.in_flight == 0
    assert sink.trajectories == [] and sink.feedback == []
    # The tenant is served as before.
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    answer = api.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert answer.choices[0].finish_reason is not None


def test_a_body_arriving_slowly_but_steadily_is_read_whole(short_body_timeout_proxy):
    """The timeout bounds each wait for more bytes, not the whole body: one sent in pieces
    over three times `body_timeout_s` is served."""
    harness, sink = short_body_timeout_proxy
    body = json.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    ).encode()
    pieces = [body[i : i + 8] for i in range(0, len(body), 8)]
    gap_s = 3 * BODY_TIMEOUT_S / len(pieces)
    assert gap_s < BODY_TIMEOUT_S / 2
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", harness.port)) as slow:
        slow.sendall(_post_head(harness.port, "/v1/chat/completions", KEYS["alice"], len(body)))
        for piece in pieces:
            time.sleep(gap_s)
            slow.sendall(piece)
        status, _, answer = _answer(slow, 60)
    assert time.monotonic() - started > 2 * BODY_TIMEOUT_S
    assert status == 200, answer
    assert json.loads(answer)["choices"][0]["finish_reason"] is not None
    harness.drain()
    assert [r["status"] for r in sink.trajectories] == ["ok"]


def test_a_feedback_body_trickling_in_is_cut_off_after_body_timeout_s(short_body_timeout_proxy):
    """A feedback post holds no concurrency slot, and each wait for more bytes was timed
    alone: one key sending a byte now and then kept any number of posts open (one per post
    its feedback rate allowed), file descriptors and buffers with them."""
    harness, sink = short_body_timeout_proxy
    body = b'{"trajectory_id": "req-' + b"0" * 32 + b'", "kind": "thumbs", "value": 1}'
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", harness.port)) as slow:
        slow.sendall(_post_head(harness.port, "/v1/feedback", KEYS["alice"], len(body)))
        for byte in body[:12]:  # a byte every quarter timeout, until the answer comes
            if select.select([slow], [], [], BODY_TIMEOUT_S / 4)[0]:
                break
            slow.sendall(bytes([byte]))
        status, _, answer = _answer(slow, BODY_TIMEOUT_S + 10)
    assert status == 408, answer
    assert "not whole after 1 s" in json.loads(answer)["error"]["message"]
    assert time.monotonic() - started < 3 * BODY_TIMEOUT_S
    assert sink.feedback == []


def test_admin_and_operator_bodies_that_stop_arriving_get_a_408(short_body_timeout_proxy):
    """The admin API and the operator page's forms are bounded too: before, a stalled admin
    request waited until TCP gave up on it."""
    harness, _ = short_body_timeout_proxy
    with socket.create_connection(("127.0.0.1", harness.port)) as stalled:
        stalled.sendall(_post_head(harness.port, "/admin/freeze", ADMIN_KEY, 200) + b'{"reas')
        status, headers, body = _answer(stalled, BODY_TIMEOUT_S + 10)
    assert status == 408, body
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert headers["x-request-id"].startswith("req-")
    assert not harness.ctx.state.frozen
    form = "application/x-www-form-urlencoded"
    with socket.create_connection(("127.0.0.1", harness.port)) as stalled:
        stalled.sendall(_post_head(harness.port, "/admin/ui/login", "", 200, form) + b"key=adm")
        status, headers, body = _answer(stalled, BODY_TIMEOUT_S + 10)
    assert status == 408, body
    assert headers["content-type"].startswith("text/html")
    assert b"The form stopped arriving" in body
    assert "set-cookie" not in headers
    # Whole bodies are served as before.
    bearer = {"Authorization": f"Bearer {ADMIN_KEY}"}
    frozen = httpx.post(harness.base_url + "/admin/freeze", headers=bearer, json={})
    assert frozen.status_code == 200 and harness.ctx.state.frozen
