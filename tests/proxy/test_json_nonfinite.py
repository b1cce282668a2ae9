"""`parse_json` refuses numbers strict JSON cannot carry (NaN, Infinity, -Infinity, and
literals out of float range such as 1e400, which Python's `json` read as inf).

A client body holding one used to be accepted: the record then failed the sink's strict
encoding (allow_nan=False) and went to the DLQ, and enough of those stopped the learner
(DlqRatioExceeded). Now the client gets a 400 `invalid_json`. Upstream data is still read
as it came where the proxy asks for that (`allow_nonfinite=True`): a capture flags a
non-finite logprob instead of losing the record."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from proxy.relay import parse_json, usage_of
from tests.proxy.conftest import KEYS
from tests.proxy.test_proxy_fake_vllm import CHAT, FakeVllm
from tests.proxy.threaded_upstream import ThreadedUpstream

NONFINITE = [
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"1e400",
    b"-1e400",
    b"1.5E+999",
    b"-0.1e99999",
]

# Each forces the fallback parser (msgspec refuses them, Python's json reads them): a lone
# surrogate, an int beyond 64 bits, or nothing in particular (msgspec's own refusal).
FALLBACK_COMPANIONS = [b'"x"', b'"\\ud800"', b"123456789012345678901234567890"]


@pytest.mark.parametrize("companion", FALLBACK_COMPANIONS)
@pytest.mark.parametrize("number", NONFINITE)
def test_a_nonfinite_number_is_not_json_the_proxy_reads(number: bytes, companion: bytes) -> None:
    for doc in (
        b'{"temperature":' + number + b',"c":' + companion + b"}",
        b'{"c":' + companion + b',"tools":[{"parameters":{"minimum":' + number + b"}}]}",
        b"[" + companion + b"," + number + b"]",
        number,
    ):
        with pytest.raises(ValueError, match="strict JSON"):
            parse_json(doc)


def test_the_message_does_not_echo_a_huge_literal() -> None:
    literal = b"1" + b"0" * 5000 + b"e400"
    with pytest.raises(ValueError) as info:
        parse_json(b'{"a":' + literal + b"}")
    assert len(str(info.value)) < 200


@pytest.mark.parametrize(
    "doc",
    [
        b'{"a":1e308,"b":-1.7976931348623157e308,"c":1e-400,"d":-0.0}',
        b'{"a":1e308,"b":"\\ud800","c":1e-400,"d":-0.0}',  # the fallback parser
        b'{"n":123456789012345678901234567890,"f":2.5}',
        b'{"s":"NaN Infinity 1e400"}',  # words in a string are text
    ],
)
def test_fast_path_and_fallback_agree_on_finite_numbers(doc: bytes) -> None:
    obj, encode = parse_json(doc)
    assert obj == json.loads(doc)
    assert json.loads(encode(obj)) == obj


def test_upstream_data_may_still_hold_them_where_asked() -> None:
    obj, encode = parse_json(b'{"logprob":-Infinity,"x":NaN}', allow_nonfinite=True)
    assert obj["logprob"] == -math.inf and math.isnan(obj["x"])
    assert encode(obj) == b'{"logprob":-Infinity,"x":NaN}'
    obj, _ = parse_json(b'{"a":1e400}', allow_nonfinite=True)
    assert obj["a"] == math.inf
    # The usage of a whole response is found whatever its logprobs hold.
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    for logprob in (b"NaN", b"-Infinity", b"-1e400"):
        raw = b'{"choices":[{"logprobs":' + logprob + b'}],"usage":' + json.dumps(usage).encode()
        assert usage_of(raw + b"}") == usage


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    upstream = FakeVllm().start()
    yield upstream
    upstream.stop()


def _post(url: str, content: bytes) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"}
    return httpx.post(url + "/v1/chat/completions", content=content, headers=headers, timeout=30)


def test_a_client_body_with_one_is_a_400_in_openai_format(make_proxy, fake) -> None:
    harness, sink = make_proxy([fake.url])
    body: dict[str, Any] = {**CHAT, "temperature": 0.5}
    ok = json.dumps(body).encode()
    for number in NONFINITE:
        response = _post(harness.base_url, ok.replace(b"0.5", number))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "invalid_json"
        assert "strict JSON" in error["message"]
    assert fake.requests == [] and sink.trajectories == []
    assert _post(harness.base_url, ok).status_code == 200


class NonFiniteUpstream(ThreadedUpstream):
    """Answers with a logprob vLLM could write as `NaN`/`-Infinity`, in a field order the
    byte strip cannot prove (so the proxy parses the upstream's data), streamed or not."""

    CHUNK = (
        b'{"choices":[{"index":0,"finish_reason":null,"delta":{"content":"hi"},'
        b'"logprobs":{"content":[{"token":"hi","logprob":-Infinity,"top_logprobs":[]}]},'
        b'"token_ids":[5]}],"id":"c","object":"chat.completion.chunk","x":NaN}'
    )
    USAGE = b'{"choices":[],"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}'

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if not body.get("stream"):
            return web.Response(
                body=b'{"id":"c","x":NaN,"choices":[{"index":0,"finish_reason":"stop",'
                b'"message":{"role":"assistant","content":"hi"},"logprobs":null}],'
                b'"usage":{"prompt_tokens":2,"completion_tokens":1,"total_tokens":3}}',
                content_type="application/json",
            )
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + self.CHUNK + b"\n\n")
        await response.write(b"data: " + self.USAGE + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)


@pytest.mark.parametrize("tenant", ["alice", "bob"])  # captured, not captured
@pytest.mark.parametrize("stream", [True, False])
def test_upstream_data_holding_one_still_reaches_the_client(make_proxy, tenant, stream) -> None:
    """Only the client's body must be strict JSON: what upstream sends is relayed as it came
    (the proxy's re-parse of upstream data is lenient, `allow_nonfinite=True`)."""
    upstream = NonFiniteUpstream().start()
    try:
        harness, _ = make_proxy([upstream.url])
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        response = httpx.post(
            harness.base_url + "/v1/chat/completions",
            json={**CHAT, "stream": stream},
            headers=headers,
            timeout=30,
        )
        assert response.status_code == 200, response.text
        assert b"NaN" in response.content
        if stream:
            assert response.text.rstrip().endswith("data: [DONE]")
        if stream and tenant == "bob":  # what the client did not ask for is stripped for alice
            assert b"-Infinity" in response.content
    finally:
        upstream.stop()
