"""Client connections that hold no request being served are closed after `idle_timeout_s`
(aiohttp's default keeps them an hour), and a request that takes longer is not cut."""

from __future__ import annotations

import socket
import time

import openai
import pytest

from tests.proxy.conftest import KEYS

IDLE_S = 1.0


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
