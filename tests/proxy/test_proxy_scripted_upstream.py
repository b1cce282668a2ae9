"""Relay edge cases the shared vLLM server cannot be made to produce on demand: parallel
tool-call fragments (the dev server runs without a tool-call parser), an upstream dying
mid-stream, a replica dying after its first byte. The upstream here is a scripted aiohttp
server speaking vLLM's wire format; the proxy, SDK and sink are the real ones."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from proxy.relay import ends_with_done, ends_with_error_event, last_reads
from tests.proxy.conftest import ADMIN_KEY, KEYS, wait_for
from tests.proxy.threaded_upstream import ThreadedUpstream

PROMPT_IDS = [1, 2, 3, 4]
# Two parallel tool calls, their arguments split over several fragments, as vLLM streams them.
FRAGMENTS: list[tuple[dict[str, Any], list[int]]] = [
    ({"role": "assistant", "content": ""}, []),
    (
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": ""},
                }
            ]
        },
        [10],
    ),
    ({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}, [11, 12]),
    ({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}, [13]),
    (
        {
            "tool_calls": [
                {
                    "index": 1,
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": ""},
                }
            ]
        },
        [14],
    ),
    ({"tool_calls": [{"index": 1, "function": {"arguments": '{"tz": "CET"}'}}]}, [15, 16]),
    ({}, []),  # a token-less chunk vLLM sends only when token ids / logprobs are requested
    ({}, []),  # the finishing chunk
]


def _event(obj: dict[str, Any], multiline: bool = False) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if multiline:  # valid SSE: a `data:` field per line, joined with \n by the reader
        data = data.replace(b",", b",\ndata: ", 1)
    return b"data: " + data + b"\n\n"


class ScriptedUpstream(ThreadedUpstream):
    """Streams FRAGMENTS honouring logprobs / return_token_ids / include_usage like vLLM.
    `die_after` cuts the connection after that many chunks."""

    def __init__(
        self,
        die_after: int | None = None,
        linger_s: float = 0.0,
        multiline: bool = False,
        done_writes: tuple[bytes, ...] = (b"data: [DONE]\n\n",),
        usage_delay_s: float = 0.0,
    ) -> None:
        self.die_after = die_after
        self.usage_delay_s = usage_delay_s  # between the finish chunk and the usage chunk
        self.linger_s = linger_s  # between [DONE] and the end of the response
        self.multiline = multiline  # each event's JSON spread over several `data:` lines
        self.done_writes = done_writes  # the stream's end, a write (and a read) each
        super().__init__()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        ids, logprobs = bool(body.get("return_token_ids")), bool(body.get("logprobs"))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {
            "id": "chatcmpl-x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": body["model"],
        }
        total = 0
        for position, (delta, tokens) in enumerate(FRAGMENTS):
            if self.die_after is not None and position >= self.die_after:
                assert request.transport is not None
                request.transport.close()
                return response
            last = position == len(FRAGMENTS) - 1
            if not delta and not last and not ids and not logprobs:
                continue
            choice: dict[str, Any] = {
                "index": 0,
                "delta": delta,
                "logprobs": {
                    "content": [
                        {"token": "t", "logprob": -0.25, "bytes": [116], "top_logprobs": []}
                        for _ in tokens
                    ]
                }
                if logprobs and position
                else None,
                "finish_reason": "tool_calls" if last else None,
            }
            if position:
                choice["token_ids"] = tokens if ids else None
            chunk = {**base, "choices": [choice]}
            if position == 0:
                chunk["prompt_token_ids"] = PROMPT_IDS if ids else None
            total += len(tokens)
            await response.write(_event(chunk, self.multiline))
        await asyncio.sleep(self.usage_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(
                _event(
                    {
                        **base,
                        "choices": [],
                        "usage": {
                            "prompt_tokens": len(PROMPT_IDS),
                            "completion_tokens": total,
                            "total_tokens": len(PROMPT_IDS) + total,
                        },
                    },
                    self.multiline,
                )
            )
        for position, piece in enumerate(self.done_writes):
            if position:
                await asyncio.sleep(0.02)  # a read of its own at the proxy
            await response.write(piece)
        await asyncio.sleep(self.linger_s)
        await response.write_eof()
        return response

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


def stream_events(
    base_url: str, key: str | None, headers: dict[str, str] | None = None, **extra: Any
) -> list[dict[str, Any] | str]:
    """The data of a streamed chat request's events (`extra`: more body fields)."""
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "weather and time"}],
        "stream": True,
        **extra,
    }
    events: list[dict[str, Any] | str] = []
    with httpx.stream(
        "POST",
        base_url + "/v1/chat/completions",
        json=body,
        headers={**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})},
        timeout=30,
    ) as response:
        assert response.status_code == 200
        data: list[str] = []  # an event's `data:` lines, joined at its blank line (SSE)
        for line in response.iter_lines():
            if line.startswith("data: "):
                data.append(line[6:])
            elif not line and data:
                payload = "\n".join(data)
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                data = []
    return events


def normalise(events: list) -> list:
    """The chunks with the model name unified (direct requests name the served model)."""
    return [e if isinstance(e, str) else {**e, "model": "m"} for e in events]


def test_parallel_tool_call_fragments_reach_the_client_as_upstream_sent_them(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    direct = stream_events(scripted.url, None)
    captured = stream_events(harness.base_url, KEYS["alice"])  # augmented, then stripped
    relayed = stream_events(harness.base_url, KEYS["bob"])  # byte relay
    assert normalise(captured) == normalise(direct) == normalise(relayed)
    assert direct[-1] == "[DONE]"
    assert sum(1 for e in direct[:-1] if e["choices"][0]["finish_reason"]) == 1
    # What upstream got: the client's body plus the capture's additions (alice only).
    augmented, plain = scripted.requests[1], scripted.requests[2]
    assert augmented["logprobs"] is True and augmented["return_token_ids"] is True
    assert augmented["stream_options"] == {"include_usage": True}
    assert "logprobs" not in plain and plain["model"] == "base"
    harness.drain()
    [record] = sink.trajectories
    calls = record["choices"][0]["message"]["tool_calls"]
    assert calls == [
        {
            "id": "call_a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {
            "id": "call_b",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "CET"}'},
        },
    ]
    assert record["choices"][0]["token_ids"] == [10, 11, 12, 13, 14, 15, 16]
    assert record["prompt_token_ids"] == PROMPT_IDS
    assert record["trainable"] is True and record["choices"][0]["finish_reason"] == "tool_calls"
    # The SDK assembles the same calls from the proxied stream.
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
    names = {}
    for chunk in api.chat.completions.create(
        model="policy", stream=True, messages=[{"role": "user", "content": "x"}]
    ):
        for fragment in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            names[fragment.index] = names.get(fragment.index, "") + (fragment.function.name or "")
    assert names == {0: "get_weather", 1: "get_time"}


def test_events_spread_over_several_data_lines_reach_a_captured_client_whole(make_proxy):
    """An upstream may write one event's JSON over several `data:` lines (valid SSE; some
    gateways pretty-print). Captured and stripped, each event went out as one `data:` field
    with raw newlines in it: the client read only its first line and the SDK failed to
    decode every chunk."""
    upstream = ScriptedUpstream(multiline=True).start()
    try:
        harness, sink = make_proxy([upstream.url])
        direct = stream_events(upstream.url, None)
        captured = stream_events(harness.base_url, KEYS["alice"])
        relayed = stream_events(harness.base_url, KEYS["bob"])
        api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
        names = {}
        for chunk in api.chat.completions.create(
            model="policy", stream=True, messages=[{"role": "user", "content": "x"}]
        ):
            for fragment in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                names[fragment.index] = names.get(fragment.index, "") + (
                    fragment.function.name or ""
                )
    finally:
        upstream.stop()
    assert normalise(captured) == normalise(direct) == normalise(relayed)
    assert names == {0: "get_weather", 1: "get_time"}
    harness.drain()
    record = sink.trajectories[0]
    assert record["trainable"] is True, record["flags"]
    assert record["choices"][0]["token_ids"] == [10, 11, 12, 13, 14, 15, 16]


def test_upstream_dying_mid_stream_ends_with_an_error_event(make_proxy):
    upstream = ScriptedUpstream(die_after=3).start()
    try:
        harness, sink = make_proxy([upstream.url])
        events = stream_events(harness.base_url, KEYS["alice"])
    finally:
        upstream.stop()
    assert events[-1] != "[DONE]"
    assert events[-1]["error"]["code"] == "upstream_error"
    assert len(events) >= 3
    harness.drain()
    [record] = sink.trajectories
    assert record["status"] == "error" and record["trainable"] is False


def test_a_client_leaving_as_its_error_event_goes_out_keeps_the_upstream_failure(
    make_proxy, monkeypatch
):
    """The client left while the proxy wrote its mid-stream error event (the write waits
    on a full socket buffer; a patch makes it wait here): the stream's bookkeeping never
    ran, it was counted a 499 client disconnect though its 200 had gone out, and the
    upstream failure was lost."""
    write = web.StreamResponse.write

    async def slow_error_write(self: web.StreamResponse, data: bytes) -> None:
        if b'"upstream_error"' in bytes(data):
            await asyncio.sleep(1.0)
        await write(self, data)

    monkeypatch.setattr(web.StreamResponse, "write", slow_error_write)
    upstream = ScriptedUpstream(die_after=3).start()
    try:
        harness, sink = make_proxy([upstream.url])
        body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        with httpx.stream(
            "POST", harness.base_url + "/v1/chat/completions", json=body, headers=headers
        ) as response:
            assert response.status_code == 200
            # Held: httpx closes the connection of a half-read response as soon as its line
            # iterator is collected, and the client must leave at the end of the block, not
            # (racing the upstream's death) right after its first line.
            lines = response.iter_lines()
            next(lines)
            time.sleep(0.5)  # the proxy is writing its error event now; the client leaves
        harness.drain()

        def counted() -> list[str]:
            text = httpx.get(harness.base_url + "/metrics").text
            return [
                line
                for line in text.splitlines()
                if line.startswith(("olp_proxy_requests_total{", "olp_proxy_errors_total{"))
            ]

        wait_for(lambda: any("upstream_mid_stream" in line for line in counted()), timeout_s=5)
    finally:
        upstream.stop()
    lines = counted()
    assert any('status="200"' in line and 'stream="true"' in line for line in lines), lines
    assert not any('status="499"' in line or "client_disconnect" in line for line in lines)
    [record] = sink.trajectories
    assert record["status"] == "error"


class FailingGeneration(ScriptedUpstream):
    """vLLM when a generation fails mid-stream: a token, then its in-band error event (as
    `create_streaming_error_response` writes it, json.dumps spacing), then [DONE]."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "base"}
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        token = {
            "index": 0,
            "delta": {"content": 'say {"error": 1}'},  # the text's quotes arrive escaped
            "logprobs": {"content": [{"token": "t", "logprob": -0.1, "top_logprobs": []}]},
            "finish_reason": None,
            "token_ids": [7],
        }
        error = {"error": {"message": "Internal server error", "type": "InternalServerError"}}
        events = [
            _event({**base, "choices": [first], "prompt_token_ids": PROMPT_IDS}),
            _event({**base, "choices": [token]}),
            b"data: " + json.dumps({**error, "param": None, "code": 500}).encode() + b"\n\n",
            b"data: [DONE]\n\n",
        ]
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response


@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured, relayed as bytes
def test_an_error_event_from_upstream_is_an_upstream_error_not_an_ok(make_proxy, tenant):
    upstream = FailingGeneration().start()
    try:
        harness, sink = make_proxy([upstream.url])
        events = stream_events(harness.base_url, KEYS[tenant])
    finally:
        upstream.stop()
    # The client gets the stream as vLLM sent it, its error event included.
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["type"] == "InternalServerError"
    harness.settle()
    errors = harness.ctx.metrics.registry.get_sample_value(
        "olp_proxy_errors_total", {"kind": "upstream_mid_stream", "tenant": tenant}
    )
    assert errors == 1.0
    harness.drain()
    if tenant == "alice":
        [record] = sink.trajectories
        assert record["status"] == "error" and record["trainable"] is False
    else:
        assert sink.trajectories == []


def test_no_retry_on_another_replica_after_the_first_byte(make_proxy, scripted):
    dying = ScriptedUpstream(die_after=2).start()
    try:
        harness, _ = make_proxy([dying.url, scripted.url])
        session = next(  # a session id whose sticky replica is the dying one
            s
            for s in (f"s{i}" for i in range(100))
            if harness.ctx.pool.order(s)[0].url == dying.url
        )
        with httpx.stream(
            "POST",
            harness.base_url + "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
            },
            headers={"Authorization": f"Bearer {KEYS['bob']}", "X-Session-Id": session},
            timeout=30,
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    finally:
        dying.stop()
    assert len(dying.requests) == 1 and scripted.requests == []
    assert '"error"' in lines[-1]


def test_every_client_field_reaches_upstream(make_proxy, scripted):
    harness, _ = make_proxy([scripted.url])
    fields = {
        "temperature": 0.3,
        "top_p": 0.9,
        "stop": ["\n\n"],
        "seed": 11,
        "max_tokens": 7,
        "max_completion_tokens": 7,
        "n": 1,
        "user": "u-1",
        "presence_penalty": 0.1,
        "response_format": {"type": "json_object"},
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": True,
        "vendor_extension": {"nested": [1, 2]},
    }
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        **fields,
    }
    for key in (KEYS["bob"], KEYS["alice"]):  # relayed as is / captured
        with httpx.stream(
            "POST",
            harness.base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as response:
            assert response.status_code == 200
            response.read()
    plain, captured = scripted.requests
    # The proxy asks for every stream's usage (its token counts), and strips it again.
    assert plain == {**body, "model": "base", "stream_options": {"include_usage": True}}
    assert {k: captured[k] for k in body if k != "model"} == {
        k: v for k, v in body.items() if k != "model"
    }


class TruncatedErrorUpstream(ThreadedUpstream):
    """Answers 400 with a Content-Length it never fills, then drops the connection: the
    proxy fails while reading vLLM's own error body."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        response = web.StreamResponse(status=400, headers={"Content-Type": "application/json"})
        response.content_length = 200
        await response.prepare(request)
        await response.write(b'{"error": {"message": "bad')
        assert request.transport is not None
        request.transport.close()
        return response

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)


@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured / relayed as is
def test_an_upstream_error_body_cut_short_is_a_502_not_a_500(make_proxy, tenant):
    upstream = TruncatedErrorUpstream().start()
    try:
        harness, sink = make_proxy([upstream.url])
        response = httpx.post(
            harness.base_url + "/v1/chat/completions",
            json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
            headers={"Authorization": f"Bearer {KEYS[tenant]}"},
            timeout=30,
        )
    finally:
        upstream.stop()
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "upstream_error" and error["request_id"] in error["message"]
    assert harness.ctx.tenants.tenants[tenant].in_flight == 0
    harness.drain()
    assert [r["status"] for r in sink.trajectories] == (["error"] if tenant == "alice" else [])
    metrics = httpx.get(harness.base_url + "/metrics", timeout=30).text.splitlines()
    counted = [m for m in metrics if m.startswith("olp_proxy_requests_total{")]
    assert any(f'tenant="{tenant}"' in m and 'status="502"' in m for m in counted), counted


class PlainErrorUpstream(ThreadedUpstream):
    """Answers each request with the next of `answers` (status, content type, body): what a
    load balancer or a server that is not vLLM sends in its place."""

    def __init__(
        self, answers: list[tuple[int, str, bytes] | tuple[int, str, bytes, dict]]
    ) -> None:
        self.answers = list(answers)
        super().__init__()

    async def _chat(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        status, content_type, body, *headers = self.answers.pop(0)
        return web.Response(
            status=status,
            body=body,
            content_type=content_type,
            headers=headers[0] if headers else None,
        )

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)


def _errors_through_the_proxy(
    make_proxy, answers: list
) -> tuple[Any, list[openai.APIStatusError], list[dict[str, Any]]]:
    """Each of `answers` (PlainErrorUpstream's) as the OpenAI SDK raises it through the
    proxy: the harness, the raised errors in order and the proxy's log events."""
    upstream = PlainErrorUpstream(answers).start()
    try:
        harness, _ = make_proxy([upstream.url])
        api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
        raised: list[openai.APIStatusError] = []
        with capture_logs() as logs:
            for _ in answers:
                with pytest.raises(openai.APIStatusError) as caught:
                    api.chat.completions.create(
                        model="policy", messages=[{"role": "user", "content": "x"}]
                    )
                raised.append(caught.value)
    finally:
        upstream.stop()
    return harness, raised, logs


def test_an_upstream_error_that_is_not_openai_shaped_becomes_one(make_proxy):
    """vLLM's errors (nested, or the flat shape of older releases) reach the client as they
    came; a plain-text or HTML error page gets an OpenAI error with the same status, which
    the SDK reads, and its text (which may name the upstream) stays in the log, redacted."""
    page = (
        b"<html><body>500 Internal Server Error: 10.1.2.3:8000 key sk-proj-A1b2C3d4E5f6G7h8I9j0K1l2"
    )
    page += b"</body></html>"
    flat = b'{"object": "error", "message": "too long", "type": "BadRequestError", "code": 400}'
    nested = b'{"error": {"message": "no such model", "type": "NotFoundError", "code": 404}}'
    _, raised, logs = _errors_through_the_proxy(
        make_proxy,
        [
            (500, "text/html", page),  # (502-504 are retried on another replica)
            # An address across the excerpt's 300-byte cut: redacted before the cut.
            (404, "text/plain", b"404: Not Found " + b"." * 276 + b" alice@example.com"),
            (400, "application/json", flat),
            (404, "application/json", nested),
            (500, "application/json", b'["not", "an", "error"]'),
        ],
    )
    assert [e.status_code for e in raised] == [500, 404, 400, 404, 500]
    html, text, old_vllm, vllm, array = raised
    for error in (html, text, array):
        body = error.response.json()["error"]
        assert body["code"] == "upstream_error"
        assert error.response.headers["x-request-id"] in body["message"]
        assert "without an OpenAI error" in body["message"]
        assert "10.1.2.3" not in error.response.text
    assert html.response.json()["error"]["type"] == "api_error"
    assert text.response.json()["error"]["type"] == "invalid_request_error"
    assert old_vllm.response.content == flat
    assert vllm.response.content == nested
    assert isinstance(text, openai.NotFoundError)
    logged = [e for e in logs if e["event"] == "upstream_error_not_openai_shaped"]
    assert [e["status"] for e in logged] == [500, 404, 500]
    assert "10.1.2.3:8000" in logged[0]["excerpt"]
    assert "sk-proj-A1b2C3d4E5f6G7h8I9j0K1l2" not in logged[0]["excerpt"]
    assert "alice" not in logged[1]["excerpt"]


def test_an_address_split_where_the_error_is_redacted_stays_out_of_the_log(make_proxy):
    """The error body is redacted in a window and the excerpt cut from the redacted text:
    private keys before the window's edge shrank to markers and pulled the part of an
    address split there (`jane.doe@exa`, which no pattern matches) into the excerpt."""
    from proxy.completions import _ERROR_REDACTED_BYTES

    line = base64.b64encode(bytes(range(48))).decode()  # 64 characters

    def pem(lines: int) -> str:
        return f"-----BEGIN PRIVATE KEY-----\n{(line + chr(10)) * lines}-----END PRIVATE KEY-----\n"

    # Keys up to a few characters before the edge: redacted, they shrink to markers.
    keys = "refused: " + pem(34) * (_ERROR_REDACTED_BYTES // len(pem(34)))
    room = _ERROR_REDACTED_BYTES - len(keys) - len(pem(0)) - len(" jane.doe@exa")
    keys += pem(room // len(line + "\n"))
    pad = _ERROR_REDACTED_BYTES - len(keys.encode()) - len(" jane.doe@exa")
    assert 0 <= pad < 100
    body = (keys + "x" * pad + " jane.doe@example.com thanks").encode()
    assert body[:_ERROR_REDACTED_BYTES].endswith(b" jane.doe@exa")  # the edge inside it
    _, raised, logs = _errors_through_the_proxy(make_proxy, [(400, "text/plain", body)])
    assert [e.status_code for e in raised] == [400]
    [logged] = [e for e in logs if e["event"] == "upstream_error_not_openai_shaped"]
    assert "[REDACTED:private_key]" in logged["excerpt"] and "jane" not in logged["excerpt"]


def test_the_model_server_refusing_the_proxys_key_is_a_502_not_the_clients_401(make_proxy):
    """Relayed as it came, the upstream's 401 made the client's SDK raise
    AuthenticationError for a key the proxy had accepted: clients took the deployment's
    misconfiguration for their own key being wrong. An upstream 429's retry-after was lost."""
    too_many = b'{"error": {"message": "slow down", "type": "RateLimitError", "code": 429}}'
    harness, raised, logs = _errors_through_the_proxy(
        make_proxy,
        [
            (401, "application/json", b'{"error": "Unauthorized"}'),  # vLLM's --api-key
            (403, "text/plain", b"Forbidden"),
            (429, "application/json", too_many, {"Retry-After": "7"}),
        ],
    )
    assert [e.status_code for e in raised] == [502, 502, 429]
    for error, status in zip(raised[:2], (401, 403), strict=True):
        assert isinstance(error, openai.InternalServerError)
        body = error.response.json()["error"]
        assert body["code"] == "upstream_error" and f"HTTP {status}" in body["message"]
        assert error.response.headers["x-request-id"] in body["message"]
    assert [e["status"] for e in logs if e["event"] == "upstream_refused_credentials"] == [
        401,
        403,
    ]
    limited = raised[2]
    assert isinstance(limited, openai.RateLimitError)
    assert limited.response.content == too_many
    assert limited.response.headers["retry-after"] == "7"
    errors = harness.ctx.metrics.errors
    assert errors.labels("upstream_401", "bob")._value.get() == 1


class HangingUpstream(ThreadedUpstream):
    """Takes the request and never finishes its answer (`headers_first`: sends the headers
    and part of the body first); notes when the proxy closes the connection."""

    def __init__(self, headers_first: bool = False) -> None:
        self.headers_first = headers_first
        self.disconnected = threading.Event()
        super().__init__()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        if self.headers_first:
            response.content_length = 1000
            await response.prepare(request)
            await response.write(b'{"id": "chatcmpl-x", ')
        while request.transport is not None and not request.transport.is_closing():
            await asyncio.sleep(0.02)
        self.disconnected.set()
        return response

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)


@pytest.mark.parametrize("headers_first", [False, True])  # waiting for headers / for the body
@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured / relayed as is
def test_a_client_leaving_an_unstreamed_request_cancels_it_upstream(
    make_proxy, tenant, headers_first
):
    """Without handler cancellation only a stream noticed a departed client: an unstreamed
    request kept vLLM generating and the tenant's concurrency slot taken until its end."""
    upstream = HangingUpstream(headers_first).start()
    try:
        harness, sink = make_proxy([upstream.url])
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                harness.base_url + "/v1/chat/completions",
                json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
                headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                timeout=httpx.Timeout(30, read=1.0),
            )
        assert upstream.disconnected.wait(10), "the upstream request was not closed"
    finally:
        upstream.stop()
    wait_for(lambda: harness.ctx.tenants.tenants[tenant].in_flight == 0)
    harness.drain()
    assert [r["status"] for r in sink.trajectories] == (["aborted"] if tenant == "alice" else [])
    metrics = httpx.get(harness.base_url + "/metrics", timeout=30).text.splitlines()
    assert any(
        m.startswith("olp_proxy_requests_total{") and 'status="499"' in m for m in metrics
    ), metrics
    assert f'olp_proxy_errors_total{{kind="client_disconnect",tenant="{tenant}"}} 1.0' in metrics


@pytest.mark.parametrize("where", ["before_admission", "in_relay"])
def test_an_unexpected_failure_is_a_counted_500(make_proxy, monkeypatch, where):
    """A bug answers 500 `internal_error` (the middleware), and the request is still in the
    metrics and the log; before, only ProxyErrors were counted."""
    harness, sink = make_proxy(["http://127.0.0.1:9"])

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    target = harness.ctx.aliases if where == "before_admission" else harness.ctx.pool
    monkeypatch.setattr(target, "route" if where == "before_admission" else "open", broken)
    response = httpx.post(
        harness.base_url + "/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=30,
    )
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
    assert harness.ctx.tenants.tenants["alice"].in_flight == 0
    metrics = httpx.get(harness.base_url + "/metrics", timeout=30).text.splitlines()
    assert any(
        m.startswith("olp_proxy_requests_total{") and 'status="500"' in m for m in metrics
    ), metrics
    assert any(
        m.startswith("olp_proxy_errors_total{") and 'kind="internal_error"' in m for m in metrics
    ), metrics
    harness.drain()
    expected = [] if where == "before_admission" else ["error"]
    assert [r["status"] for r in sink.trajectories] == expected


def test_a_client_gone_when_its_stream_begins_is_a_departure_not_a_500(
    make_proxy, monkeypatch, scripted
):
    """A client that leaves just as its answer's headers go out (before handler cancellation
    tells the handler) made `prepare` raise: logged as an unhandled error with a traceback,
    counted a 500, and the trajectory recorded as `error` instead of `aborted`."""
    from aiohttp.client_exceptions import ClientConnectionResetError

    harness, sink = make_proxy([scripted.url])

    prepare = web.StreamResponse.prepare

    async def closing_transport(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if request.app is harness.app:  # the proxy's answer; the upstream's goes out
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", closing_transport)
    with pytest.raises(httpx.HTTPError):  # aiohttp cannot answer either: the connection ends
        httpx.post(
            harness.base_url + "/v1/chat/completions",
            json={
                "model": "policy",
                "messages": [{"role": "user", "content": "x"}],
                "stream": True,
            },
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
            timeout=30,
        )
    monkeypatch.undo()
    harness.drain()
    [record] = sink.trajectories
    assert record["status"] == "aborted"
    wait_for(lambda: harness.ctx.tenants.tenants["alice"].in_flight == 0)
    metrics = httpx.get(harness.base_url + "/metrics", timeout=30).text.splitlines()
    assert any(
        m.startswith("olp_proxy_requests_total{") and 'status="499"' in m for m in metrics
    ), metrics
    assert 'olp_proxy_errors_total{kind="client_disconnect",tenant="alice"} 1.0' in metrics
    assert not any('kind="internal_error"' in m for m in metrics)


def test_a_client_leaving_right_after_done_keeps_a_whole_trajectory(make_proxy):
    """The OpenAI SDK closes the connection as soon as it reads [DONE], before the stream's
    last bytes: the answer reached it whole, so the record is `ok`, not `aborted` (with
    handler cancellation the proxy's handler is cancelled right then)."""
    upstream = ScriptedUpstream(linger_s=3.0).start()
    try:
        harness, sink = make_proxy([upstream.url])
        body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}
        with httpx.stream(
            "POST",
            harness.base_url + "/v1/chat/completions",
            json={**body, "stream": True},
            headers={"Authorization": f"Bearer {KEYS['alice']}"},
            timeout=30,
        ) as response:
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    break  # and leave, as the SDK does
        harness.drain()
    finally:
        upstream.stop()
    [record] = sink.trajectories
    assert record["status"] == "ok" and record["trainable"], record["flags"]
    wait_for(lambda: harness.ctx.tenants.tenants["alice"].in_flight == 0)


class CleanCut(ScriptedUpstream):
    """A model server that ends its stream cleanly after two chunks, without `[DONE]`; with
    `second_bytes`, in the middle of its second event."""

    def __init__(self, second_bytes: int | None = None) -> None:
        self.second_bytes = second_bytes
        super().__init__()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "base"}
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        token = {"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}
        await response.write(_event({**base, "choices": [first], "prompt_token_ids": PROMPT_IDS}))
        await response.write(_event({**base, "choices": [token]})[: self.second_bytes])
        await response.write_eof()
        return response


@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured, relayed as bytes
def test_a_stream_ended_without_done_is_cut_short_not_an_ok(make_proxy, tenant):
    """Closed cleanly but without `data: [DONE]`, the answer just stopped at the client, and
    the request was counted and recorded `ok`."""
    upstream = CleanCut().start()
    try:
        harness, sink = make_proxy([upstream.url])
        events = stream_events(harness.base_url, KEYS[tenant])
    finally:
        upstream.stop()
    assert events[1]["choices"][0]["delta"]["content"] == "Hel"
    assert events[-1]["error"]["code"] == "upstream_error" and "[DONE]" not in events
    metrics = httpx.get(harness.base_url + "/metrics").text
    assert f'olp_proxy_errors_total{{kind="upstream_mid_stream",tenant="{tenant}"}} 1.0' in metrics
    harness.drain()
    if tenant == "alice":
        [record] = sink.trajectories
        assert record["status"] == "error" and record["trainable"] is False
    else:
        assert sink.trajectories == []


@pytest.mark.parametrize(
    ("tenant", "usage"),
    [("alice", False), ("bob", False), ("bob", True)],
    ids=["captured", "uncaptured", "uncaptured-client-usage"],
)
def test_a_stream_cut_mid_event_ends_with_an_error_the_sdk_reads(make_proxy, tenant, usage):
    """An uncaptured stream relayed the half event and then the proxy's error event with no
    border between them: one event of bad JSON, and the SDK raised JSONDecodeError instead
    of the APIError that says the model server failed (request id included)."""
    upstream = CleanCut(second_bytes=40).start()
    try:
        harness, _ = make_proxy([upstream.url])
        api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS[tenant], max_retries=0)
        extra: dict[str, Any] = {"stream_options": {"include_usage": True}} if usage else {}
        with pytest.raises(openai.APIError, match="failed mid-stream"):
            for _ in api.chat.completions.create(
                model="policy", stream=True, messages=[{"role": "user", "content": "x"}], **extra
            ):
                pass
    finally:
        upstream.stop()


class OddChunk(ScriptedUpstream):
    """A model server (not vLLM) that sends a chunk whose `choices` is not a list."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "base"}
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        await response.write(_event({**base, "choices": [first], "prompt_token_ids": PROMPT_IDS}))
        await response.write(_event({**base, "choices": 5}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def test_a_chunk_the_relay_cannot_handle_ends_the_stream_with_an_error_event(make_proxy):
    """It raised past the 200: the middleware's 500 response went into the chunked body as
    raw bytes, and the SDK raised a connection error naming nothing."""
    upstream = OddChunk().start()
    try:
        harness, sink = make_proxy([upstream.url])
        api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["alice"], max_retries=0)
        with pytest.raises(openai.APIError, match="The proxy failed mid-stream") as raised:
            for _ in api.chat.completions.create(
                model="policy", stream=True, messages=[{"role": "user", "content": "x"}]
            ):
                pass
        assert not isinstance(raised.value, openai.APIConnectionError)
    finally:
        upstream.stop()
    harness.drain()
    [record] = sink.trajectories  # kept, flagged (its build once failed, the record lost)
    assert record["status"] == "error" and record["trainable"] is False
    assert "unparsable_upstream_data" in record["flags"]
    # The proxy's failure, as its error event says: not the model server's.
    registry = harness.ctx.metrics.registry
    errors = {
        kind: registry.get_sample_value("olp_proxy_errors_total", {"kind": kind, "tenant": "alice"})
        for kind in ("internal_error", "upstream_mid_stream")
    }
    assert errors == {"internal_error": 1.0, "upstream_mid_stream": None}


class EndlessStream(ScriptedUpstream):
    """Streams token events until its client goes; `ended` says how its handler ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []
        super().__init__()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "base"}
        token = {"index": 0, "delta": {"content": "x" * 400}, "finish_reason": None}
        event = _event({**base, "choices": [token]})
        try:
            while True:
                await response.write(event)
        except (ConnectionError, asyncio.CancelledError):
            self.ended.append("client gone")
            raise


def test_a_client_that_stops_reading_its_stream_is_disconnected(make_proxy):
    """A client that read the start of its stream and then nothing more, its connection
    left open, held its concurrency slot, an upstream connection and the generation for as
    long as it kept the connection: no write was timed, and the paused upstream read never
    timed out either."""
    import socket

    upstream = EndlessStream().start()
    try:
        harness, _ = make_proxy([upstream.url], send_timeout_s=1.0)
        body = json.dumps(
            {"model": "policy", "stream": True, "messages": [{"role": "user", "content": "x"}]}
        )
        host, port = harness.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.sendall(
                (
                    f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                    f"Authorization: Bearer {KEYS['bob']}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n{body}"
                ).encode()
            )
            assert client.recv(100).startswith(b"HTTP/1.1 200")
            bob = harness.ctx.tenants.tenants["bob"]
            wait_for(lambda: bob.in_flight == 1, timeout_s=5)
            # Reads nothing more; the connection stays open.
            wait_for(lambda: bob.in_flight == 0, timeout_s=20)
            wait_for(lambda: upstream.ended == ["client gone"], timeout_s=10)
        metrics = httpx.get(harness.base_url + "/metrics").text
        assert 'olp_proxy_errors_total{kind="client_disconnect",tenant="bob"} 1.0' in metrics
    finally:
        upstream.stop()


@pytest.mark.parametrize(
    "done_writes",
    [
        (b"data: ", b"[DONE]", b"\n\n"),  # `[DONE]` over three reads
        (b"data: [DO", b"NE]\n", b"\n"),
        (b"data: [DONE]\n",),  # the last event without its blank line
        (b"data: [DONE]",),  # nor a line end
        (b"data: [DONE]\n\n", b": bye\n\n"),  # a comment after it
    ],
    ids=["three-reads", "split-three", "one-lf", "no-lf", "comment-after"],
)
@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured, relayed as bytes
def test_a_stream_ended_in_pieces_is_whole_and_ok(make_proxy, tenant, done_writes):
    """Only the last two reads were searched for `[DONE]`: split over three, the stream
    was taken for cut short (an error event after `[DONE]`, an `error` record); and a
    captured stream whose last event lacked its blank line never sent it, `[DONE]`
    included."""
    upstream = ScriptedUpstream(done_writes=done_writes).start()
    try:
        harness, sink = make_proxy([upstream.url])
        events = stream_events(harness.base_url, KEYS[tenant])
    finally:
        upstream.stop()
    if tenant == "alice" or b"".join(done_writes).endswith(b"\n\n"):
        assert events[-1] == "[DONE]"
    else:  # relayed as they came: the client's SSE reader drops an unended last event
        assert events[-1] != "[DONE]" and "error" not in events[-1]
    assert not any(isinstance(e, dict) and "error" in e for e in events)
    assert "olp_proxy_errors_total{" not in httpx.get(harness.base_url + "/metrics").text
    harness.drain()
    if tenant == "alice":
        [record] = sink.trajectories
        assert record["status"] == "ok" and record["trainable"] is True, record["flags"]


def test_last_reads_joins_fragments_to_the_read_before():
    event = b'data: {"id":"x","choices":[]}\n\n'
    reads = (b"", b"")
    for data in (event, b"data: ", b"[DONE]", b"\n\n"):
        reads = last_reads(*reads, data)
    assert reads == (b"", event + b"data: [DONE]\n\n")
    assert ends_with_done(*reads)
    reads = (b"", b"")
    error = b'data: {"error": {"message": "boom", "code": 500}}\n\n'
    for data in (event, error[:10], error[10:20], error[20:]):
        reads = last_reads(*reads, data)
    assert ends_with_error_event(*reads)
    big = b"x" * 100
    assert last_reads(b"a" * 40, big, b"y" * 40) == (big, b"y" * 40)  # references, no join


@pytest.mark.parametrize(
    ("before_last", "last", "done"),
    [
        (b"", b"data: [DONE]\n\n", True),
        (b'data: {"a":1}\n\ndata: [DO', b"NE]\n\n", True),
        (b"data: [DONE]", b"\n\n", True),
        (b"", b"data:[DONE]\r\n\r\n", True),
        (b"", b'data: {"a":1}\n\n', False),
        (b"data: [DONE]\n\n", b'data: {"a":1}\n\n', False),
        (b"", b"", False),
    ],
)
def test_ends_with_done(before_last, last, done):
    assert ends_with_done(before_last, last) is done


class Gzipping(ThreadedUpstream):
    """A compressing hop between the proxy and the model server (a balancer's gzip): it
    compresses whatever the client accepts."""

    def add_routes(self, app: web.Application) -> None:
        async def chat(request: web.Request) -> web.Response:
            self.requests.append({"accept-encoding": request.headers.get("Accept-Encoding")})
            body = await request.json()
            response = web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "hi"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
            response.enable_compression()
            return response

        app.router.add_post("/v1/chat/completions", chat)


def test_the_proxy_asks_its_upstream_for_an_uncompressed_answer(make_proxy):
    upstream = Gzipping().start()
    try:
        harness, _ = make_proxy([upstream.url])
        answer = httpx.post(
            harness.base_url + "/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEYS['bob']}"},
            json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
            timeout=30,
        )
    finally:
        upstream.stop()
    assert answer.status_code == 200, answer.text  # was 502 "invalid JSON"
    assert answer.json()["choices"][0]["message"]["content"] == "hi"
    assert upstream.requests == [{"accept-encoding": "identity"}]


class GzippingRegardless(ThreadedUpstream):
    """A hop that compresses whatever the client asked for (`Accept-Encoding: identity`
    included), streams too."""

    def add_routes(self, app: web.Application) -> None:
        async def chat(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.requests.append(body)
            response = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream"
                    if body.get("stream")
                    else "application/json"
                }
            )
            response.enable_compression(force=web.ContentCoding.gzip)
            await response.prepare(request)
            await response.write(b'data: {"id": "x", "choices": []}\n\ndata: [DONE]\n\n')
            await response.write_eof()
            return response

        app.router.add_post("/v1/chat/completions", chat)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_an_answer_compressed_against_the_proxys_ask_is_a_502(make_proxy, tenant, stream):
    """Relayed, a stream reached the client as gzip bytes under text/event-stream."""
    upstream = GzippingRegardless().start()
    try:
        harness, sink = make_proxy([upstream.url])
        with capture_logs() as logs:
            answer = httpx.post(
                harness.base_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEYS[tenant]}"},
                json={
                    "model": "policy",
                    "messages": [{"role": "user", "content": "x"}],
                    "stream": stream,
                },
                timeout=30,
            )
    finally:
        upstream.stop()
    assert answer.status_code == 502, answer.content[:200]
    error = answer.json()["error"]
    assert error["code"] == "upstream_error" and answer.headers["x-request-id"] in error["message"]
    assert [e["content_encoding"] for e in logs if e["event"] == "upstream_answer_compressed"] == [
        "gzip"
    ]
    harness.drain()
    assert [r["status"] for r in sink.trajectories] == (["error"] if tenant == "alice" else [])


class Slow(ThreadedUpstream):
    """Answers each request after `delay_s`."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        super().__init__()

    def add_routes(self, app: web.Application) -> None:
        async def chat(request: web.Request) -> web.Response:
            self.requests.append(await request.json())
            await asyncio.sleep(self.delay_s)
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": "base",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "ok"},
                            "finish_reason": "stop",
                        }
                    ],
                }
            )

        app.router.add_post("/v1/chat/completions", chat)


def test_a_request_waiting_for_a_pooled_connection_is_not_a_replica_timeout(make_proxy):
    """With every upstream connection busy, a request waited `connect_timeout_s` for one,
    timed out, marked the healthy replicas down and answered 504."""
    replicas = [Slow(delay_s=1.5).start(), Slow(delay_s=1.5).start()]
    try:
        harness, _ = make_proxy(
            [r.url for r in replicas], max_upstream_connections=1, connect_timeout_s=0.3
        )

        def ask(_: int) -> int:
            return httpx.post(
                harness.base_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEYS['bob']}"},
                json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
                timeout=30,
            ).status_code

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            statuses = list(pool.map(ask, range(3)))
        pool_state = harness.ctx.pool.replicas
    finally:
        for replica in replicas:
            replica.stop()
    assert statuses == [200, 200, 200]
    assert [replica.failures for replica in pool_state] == [0, 0]


def test_an_answer_slower_than_the_read_timeout_is_a_504_not_a_retry(make_proxy):
    """vLLM sends nothing of an unstreamed answer before it is whole: a generation longer
    than read_timeout_s was taken for a failed replica and run again on every other one in
    turn (each marked down), the client waiting for all of them before its 504."""
    replicas = [Slow(delay_s=1.5).start() for _ in range(3)]
    try:
        harness, _ = make_proxy([r.url for r in replicas], read_timeout_s=0.5)
        started = time.monotonic()
        with capture_logs() as logs:
            answer = httpx.post(
                harness.base_url + "/v1/chat/completions",
                headers={"Authorization": f"Bearer {KEYS['bob']}"},
                json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
                timeout=30,
            )
        took_s = time.monotonic() - started
        pool_state = harness.ctx.pool.replicas
    finally:
        for replica in replicas:
            replica.stop()
    assert answer.status_code == 504, answer.text
    assert answer.json()["error"]["code"] == "upstream_timeout"
    assert took_s < 1.4  # one read timeout, not three
    assert sorted(len(r.requests) for r in replicas) == [0, 0, 1]
    # Not retried, but the replica is marked down (below).
    assert sorted(replica.failures for replica in pool_state) == [0, 0, 1]
    assert [e["event"] for e in logs if e["event"].startswith("upstream_")] == [
        "upstream_replica_failed",
        "upstream_unavailable",
    ]


class Models(ThreadedUpstream):
    """`GET /v1/models` answers `listing`; chat answers after `delay_s`."""

    def __init__(self, listing: Any, delay_s: float = 0.0) -> None:
        self.listing, self.delay_s = listing, delay_s
        super().__init__()

    def add_routes(self, app: web.Application) -> None:
        async def models(request: web.Request) -> web.Response:
            return web.json_response(self.listing)

        async def chat(request: web.Request) -> web.Response:
            self.requests.append(await request.json())
            await asyncio.sleep(self.delay_s)
            return web.json_response({"id": "x", "object": "chat.completion", "choices": []})

        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/chat/completions", chat)


def _ask(harness: Any, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        harness.base_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEYS['bob']}"},
        json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
        timeout=timeout,
    )


def test_a_replica_that_never_answers_is_marked_down(make_proxy):
    """Not retried after a read timeout, and not marked down either: a hung replica kept its
    turn in the round robin, so every other request waited the whole timeout for a 504."""
    hung, healthy = Slow(delay_s=3).start(), Slow(delay_s=0).start()
    try:
        harness, _ = make_proxy([hung.url, healthy.url], read_timeout_s=0.5)
        statuses = [_ask(harness).status_code for _ in range(6)]
    finally:
        hung.stop()
        healthy.stop()
    assert statuses.count(504) <= 1 and statuses.count(200) >= 5, statuses
    assert len(hung.requests) <= 1


class DropsAfter(ThreadedUpstream):
    """Reads the request, 'generates' for `after_s`, then drops the connection."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self.ids: list[str] = []
        super().__init__()

    def add_routes(self, app: web.Application) -> None:
        async def chat(request: web.Request) -> web.Response:
            self.requests.append(await request.json())
            self.ids.append(request.headers.get("X-Request-Id", ""))
            await asyncio.sleep(self.after_s)
            assert request.transport is not None
            request.transport.abort()
            return web.Response()

        app.router.add_post("/v1/chat/completions", chat)


def test_a_connection_lost_after_the_request_ran_is_not_sent_again(make_proxy):
    """A disconnect was taken for a stale pooled connection whatever the wait: the request
    ran again on the same replica, then twice on the next (one request, 4 generations on 2
    replicas, 4 s for a 502)."""
    replicas = [DropsAfter(after_s=1.3).start() for _ in range(2)]
    try:
        harness, _ = make_proxy([r.url for r in replicas])
        started = time.monotonic()
        answer = _ask(harness)
        took_s = time.monotonic() - started
    finally:
        for replica in replicas:
            replica.stop()
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_error"
    assert sorted(len(r.requests) for r in replicas) == [0, 1]
    assert took_s < 2.5


def test_a_connection_closed_at_once_is_sent_again_under_a_new_id(make_proxy):
    replica = DropsAfter(after_s=0.0).start()
    try:
        harness, _ = make_proxy([replica.url])
        answer = _ask(harness)
    finally:
        replica.stop()
    assert answer.status_code == 502
    assert len(replica.ids) == 2 and replica.ids[1] == replica.ids[0] + "-resent"


class DropsAtOnceThenLate(DropsAfter):
    """Drops its first connection at once (a pooled one closing), the next after 1.3 s."""

    def add_routes(self, app: web.Application) -> None:
        async def chat(request: web.Request) -> web.Response:
            self.requests.append(await request.json())
            self.ids.append(request.headers.get("X-Request-Id", ""))
            if len(self.requests) > 1:
                await asyncio.sleep(self.after_s)
            assert request.transport is not None
            request.transport.abort()
            return web.Response()

        app.router.add_post("/v1/chat/completions", chat)


def test_a_resend_lost_after_it_ran_is_not_sent_to_another_replica(make_proxy):
    """The one resend after a connection closed at once was not held to the late-loss rule:
    lost after the replica had it for a while, it was retried on the next replica, and the
    generation ran twice."""
    first, second = DropsAtOnceThenLate(after_s=1.3).start(), DropsAfter(after_s=0.0).start()
    try:
        harness, _ = make_proxy([first.url, second.url])
        answer = _ask(harness)
    finally:
        first.stop()
        second.stop()
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_error"
    assert len(first.ids) == 2 and first.ids[1] == first.ids[0] + "-resent"
    assert second.requests == []


def test_readiness_and_flips_do_not_wait_behind_busy_request_connections(make_proxy):
    """Model listings shared the requests' pool, their 2 s timeout counting the wait for a
    free connection: with every connection busy on healthy requests, /readyz said 503 and
    an alias flip failed with 502."""
    listing = {"object": "list", "data": [{"id": "base"}, {"id": "policy-v1"}]}
    replica = Models(listing, delay_s=4.0).start()
    try:
        harness, _ = make_proxy([replica.url], max_upstream_connections=1)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(_ask, harness)
            wait_for(lambda: len(replica.requests) == 1, timeout_s=5)
            ready = httpx.get(harness.base_url + "/readyz", timeout=10)
            flip = httpx.post(
                harness.base_url + "/admin/aliases",
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                json={"alias": "policy", "target": "policy-v1"},
                timeout=10,
            )
            assert busy.result().status_code == 200
    finally:
        replica.stop()
    assert ready.status_code == 200, ready.text
    assert flip.status_code == 200, flip.text


@pytest.mark.parametrize("listing", [{}, {"detail": "Not Found"}])
def test_a_model_listing_without_data_is_not_an_empty_one(make_proxy, listing):
    replica = Models(listing).start()
    try:
        harness, _ = make_proxy([replica.url])
        ready = httpx.get(harness.base_url + "/readyz", timeout=10)
    finally:
        replica.stop()
    assert ready.status_code == 503, ready.text
    assert ready.json()["replicas"] == {"replica-0": "ValueError"}


class SilentUpstream(ScriptedUpstream):
    """A replica that takes requests and answers none until `release` (a deadlocked engine)."""

    def __init__(self) -> None:
        self.released = asyncio.Event()
        super().__init__()

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.released.set)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(await request.json())
        await self.released.wait()
        raise web.HTTPServiceUnavailable()


def test_a_replica_that_never_answers_holds_only_its_own_connections(make_proxy):
    """One connection limit for all replicas: the silent one's requests held every
    connection until their read timeout, and the healthy replica's requests waited for
    one that long."""
    silent, healthy = SilentUpstream().start(), ScriptedUpstream().start()
    try:
        harness, _ = make_proxy(
            [silent.url, healthy.url], max_upstream_connections=2, read_timeout_s=120
        )
        pool = harness.ctx.pool
        sessions = {url: [] for url in (silent.url, healthy.url)}
        for n in range(200):
            sessions[pool.order(f"s-{n}")[0].url].append(f"s-{n}")
        body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}

        def post(session_id: str, timeout_s: float) -> httpx.Response:
            headers = {"Authorization": f"Bearer {KEYS['bob']}", "X-Session-Id": session_id}
            return httpx.post(
                harness.base_url + "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=timeout_s,
            )

        with concurrent.futures.ThreadPoolExecutor(6) as threads:
            stuck = [threads.submit(post, s, 150) for s in sessions[silent.url][:2]]
            wait_for(lambda: len(silent.requests) == 2)
            served = [threads.submit(post, s, 20) for s in sessions[healthy.url][:4]]
            assert [f.result().status_code for f in served] == [200] * 4, served[0].result().text
            assert not any(f.done() for f in stuck)
            silent.release()
            assert all(f.result().status_code for f in stuck)
    finally:
        silent.release()
        silent.stop()
        healthy.stop()


class BusyOnce(ScriptedUpstream):
    """Answers its first request 503 (an engine restarting), then as vLLM does."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        if not self.requests:
            self.requests.append(await request.json())
            raise web.HTTPServiceUnavailable()
        return await super()._chat(request)


def test_a_replica_that_answers_again_starts_its_next_cool_down_short(make_proxy, scripted):
    """A replica's cool-down doubles with each failure in a row; one answer resets it."""
    busy = BusyOnce().start()
    try:
        harness, _ = make_proxy([busy.url, scripted.url])
        pool = harness.ctx.pool
        session = next(s for s in (f"s{i}" for i in range(100)) if pool.order(s)[0].url == busy.url)
        replica = pool.order(session)[0]
        body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}
        headers = {"Authorization": f"Bearer {KEYS['bob']}", "X-Session-Id": session}
        url = harness.base_url + "/v1/chat/completions"
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
        assert replica.failures == 1 and len(scripted.requests) == 1  # served by the other
        replica.down_until = 0.0  # its cool-down has passed
        assert httpx.post(url, json=body, headers=headers, timeout=30).status_code == 200
        assert replica.failures == 0 and len(busy.requests) == 2
    finally:
        busy.stop()


@pytest.mark.parametrize("key", [KEYS["alice"], KEYS["bob"]])  # captured and not
def test_a_finish_chunk_waits_for_the_usage_chunk_a_second_at_most(make_proxy, key):
    """The finish chunk waits for the next read to take the usage chunk's fingerprint
    (`proxy.fingerprint`); an upstream that stalled there held the answer's last text up
    to the read timeout (300 s). After `FINISH_HOLD_S` it goes out as it is."""
    upstream = ScriptedUpstream(usage_delay_s=4.0).start()
    try:
        harness, _ = make_proxy([upstream.url])
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        arrivals = []
        started = time.monotonic()
        with httpx.stream(
            "POST",
            harness.base_url + "/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=30,
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    arrivals.append((time.monotonic() - started, line))
    finally:
        upstream.stop()
    [(finished_at, _)] = [(t, line) for t, line in arrivals if '"finish_reason":"' in line]
    done_at = arrivals[-1][0]
    assert arrivals[-1][1] == "data: [DONE]"
    assert done_at >= 4.0
    assert done_at - finished_at > 2.0, arrivals  # out about a second after it came
