"""Request bodies with a Content-Encoding: gzip and deflate are decoded (within the body
limit); a body that is not what its header says is a 400, a coding the proxy cannot decode
(br, zstd, ...) a 415, both OpenAI-shaped and carrying x-request-id, never a 500 or
aiohttp's plain-text 400."""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator

import httpx
import pytest

from deploy.ports import free_port
from tests.proxy.conftest import ADMIN_KEY, KEYS
from tests.proxy.test_proxy_errors import assert_openai_error
from tests.proxy.test_proxy_scripted_upstream import ScriptedUpstream

BODY = json.dumps(
    {"model": "policy", "messages": [{"role": "user", "content": "x"}], "stream": True}
).encode()


@pytest.fixture
def scripted() -> Iterator[ScriptedUpstream]:
    upstream = ScriptedUpstream().start()
    yield upstream
    upstream.stop()


def post(harness, content, encoding: str, path="/v1/chat/completions", key=KEYS["alice"], **kw):
    headers = {
        "Authorization": f"Bearer {key}",
        "Content-Type": "application/json",
        "Content-Encoding": encoding,
        **kw.pop("headers", {}),
    }
    return httpx.post(harness.base_url + path, content=content, headers=headers, timeout=60)


def test_a_body_that_is_not_what_its_encoding_says_is_a_400(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    for encoding in ("gzip", "deflate", "x-gzip"):
        response = post(harness, BODY, encoding, headers={"x-request-id": f"bad-{encoding}"})
        error = assert_openai_error(response, 400, "invalid_content_encoding")
        assert response.headers["x-request-id"] == f"bad-{encoding}"
        assert error["request_id"] == f"bad-{encoding}"
    truncated = gzip.compress(BODY)[:-12]
    assert_openai_error(post(harness, truncated, "gzip"), 400, "invalid_content_encoding")
    response = post(harness, BODY, "gzip", path="/v1/feedback")
    assert_openai_error(response, 400, "invalid_content_encoding")
    errors = harness.ctx.metrics.registry.get_sample_value(
        "olp_proxy_errors_total", {"kind": "internal_error", "tenant": "alice"}
    )
    assert not errors
    assert scripted.requests == []
    harness.drain()
    assert sink.trajectories == [] and sink.feedback == []


@pytest.mark.parametrize("encoding", ["br", "zstd", "compress", "gzip, br"])
def test_a_coding_the_proxy_cannot_decode_is_a_415_with_the_request_id(make_proxy, encoding):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"])
    response = post(harness, BODY, encoding, headers={"x-request-id": "enc-1"})
    error = assert_openai_error(response, 415, "unsupported_content_encoding")
    assert response.headers["x-request-id"] == "enc-1" and error["request_id"] == "enc-1"
    assert "gzip" in error["message"]
    # The admin API and the feedback endpoint alike.
    response = post(harness, b"{}", encoding, path="/admin/freeze", key=ADMIN_KEY)
    assert_openai_error(response, 415, "unsupported_content_encoding")
    response = post(harness, b"{}", encoding, path="/v1/feedback")
    assert_openai_error(response, 415, "unsupported_content_encoding")


def test_gzip_and_deflate_bodies_are_served(make_proxy, scripted):
    harness, sink = make_proxy([scripted.url])
    bodies = {
        "gzip": gzip.compress(BODY),
        "GZip": gzip.compress(BODY[:40]) + gzip.compress(BODY[40:]),  # two members
        "deflate": zlib.compress(BODY),
        "identity, deflate": zlib.compress(BODY),
    }
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)  # deflate without the zlib wrapper
    bodies["identity"] = BODY
    for encoding, content in bodies.items():
        response = post(harness, content, encoding)
        assert response.status_code == 200, (encoding, response.text)
        assert response.text.rstrip().endswith("data: [DONE]")
    response = post(harness, raw.compress(BODY) + raw.flush(), "deflate")
    assert response.status_code == 200, response.text
    assert all(
        request["messages"] == [{"role": "user", "content": "x"}] for request in scripted.requests
    )
    harness.drain()
    assert len(sink.trajectories) == len(bodies) + 1
    feedback = gzip.compress(json.dumps({"trajectory_id": "t-1", "kind": "accept"}).encode())
    assert post(harness, feedback, "gzip", path="/v1/feedback").status_code == 202


def test_a_body_that_decodes_past_the_limit_is_a_413(make_proxy):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"], max_body_bytes=64 * 1024)
    bomb = gzip.compress(b'{"model": "policy", "pad": "' + b" " * 10_000_000 + b'"}')
    assert len(bomb) < 64 * 1024
    assert_openai_error(post(harness, bomb, "gzip"), 413, "request_too_large")


@pytest.mark.parametrize("charset", ["utf-16", "utf-32", "utf-8-sig"])
def test_a_body_in_another_unicode_encoding_goes_upstream_as_utf8(make_proxy, scripted, charset):
    """JSON may come as UTF-16 or -32 (vLLM reads it); what goes upstream, and into the
    record, is UTF-8. A body in no such encoding is a 400 (test_400_malformed_...)."""
    harness, sink = make_proxy([scripted.url])
    body = json.loads(BODY) | {"messages": [{"role": "user", "content": "é"}]}
    answer = httpx.post(
        harness.base_url + "/v1/chat/completions",
        content=json.dumps(body).encode(charset),
        headers={"Authorization": f"Bearer {KEYS['alice']}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert scripted.requests[-1]["messages"] == [{"role": "user", "content": "é"}]
    harness.drain()
    assert sink.trajectories[0]["request"]["messages"] == [{"role": "user", "content": "é"}]
