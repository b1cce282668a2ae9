"""The proxy in front of an in-process fake of vLLM (no model server): hostile input that
must give a 4xx (never a 500), what a captured stream hands the client, echo, and token
counts. The fake answers like vLLM 0.32 without a tool-call parser (the `vllm_server`
fixture cannot be made to hold text back or count continuous usage on demand)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from deploy.ports import free_port
from proxy.aliases import Canary
from proxy.config import AuthFailureLimits, ProxyConfig, TenantConfig
from safety.pseudonym import pseudonym
from tests.proxy.conftest import ADMIN_KEY, KEYS, wait_for
from tests.proxy.threaded_upstream import ThreadedUpstream, assert_reconnects_after_idle

PROMPT_IDS = [1, 2, 3, 4]
# (text, token id): the empty texts are tokens whose text vLLM holds back (here the two
# halves of "é"), which it streams as empty chunks whatever the request asked for.
TOKENS = [("Hi", 11), ("", 12), (" é", 13), ("!", 14)]
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _usage(completion: int) -> dict[str, int]:
    prompt = len(PROMPT_IDS)
    total = prompt + completion
    return {"prompt_tokens": prompt, "total_tokens": total, "completion_tokens": completion}


def _chat_choice(body: dict[str, Any], position: int) -> dict[str, Any]:
    text, token = TOKENS[position]
    entry = {"token": text, "logprob": -0.5, "bytes": [], "top_logprobs": []}
    choice: dict[str, Any] = {
        "index": 0,
        "delta": {"content": text},
        "logprobs": {"content": [entry]} if body.get("logprobs") else None,
        "finish_reason": None,
    }
    if position == len(TOKENS) - 1:
        choice |= {"finish_reason": "stop", "stop_reason": None}
    choice["token_ids"] = [token] if body.get("return_token_ids") else None
    return choice


def _completion_choice(body: dict[str, Any], position: int) -> dict[str, Any]:
    text, token = TOKENS[position]
    ids = bool(body.get("return_token_ids"))
    logprobs = {"text_offset": [0], "token_logprobs": [-0.5], "tokens": [text]}
    logprobs["top_logprobs"] = [{text: -0.5}]
    return {
        "index": 0,
        "text": text,
        "logprobs": logprobs if body.get("logprobs") is not None else None,
        "finish_reason": "stop" if position == len(TOKENS) - 1 else None,
        "stop_reason": None,
        "prompt_token_ids": PROMPT_IDS if ids and not position else None,
        "token_ids": [token] if ids else None,
    }


class FakeVllm(ThreadedUpstream):
    """Streams TOKENS as vLLM does, honouring logprobs, return_token_ids and stream_options
    (`continuous_usage_stats` too); records every request body."""

    def _events(self, chat: bool, body: dict[str, Any]) -> list[bytes]:
        options = body.get("stream_options") or {}
        top = {
            "id": "x",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": body["model"],
        }
        chunks = []
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
            role |= {"logprobs": None, "finish_reason": None}
            ids = PROMPT_IDS if body.get("return_token_ids") else None
            chunks.append({**top, "choices": [role], "prompt_token_ids": ids})
        for position in range(len(TOKENS)):
            choice = _chat_choice(body, position) if chat else _completion_choice(body, position)
            chunks.append({**top, "choices": [choice]})
        if options.get("continuous_usage_stats"):
            completion = range(len(TOKENS) + 1) if chat else range(1, len(TOKENS) + 1)
            chunks = [{**c, "usage": _usage(n)} for c, n in zip(chunks, completion, strict=True)]
        if options.get("include_usage"):
            chunks.append({**top, "choices": [], "usage": _usage(len(TOKENS))})
        return [*map(_event, chunks), b"data: [DONE]\n\n"]

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.authorizations.append(request.headers.get("Authorization"))
        chat = request.path == "/v1/chat/completions"
        if not body.get("stream"):
            await asyncio.sleep(self.whole_delay_s)
            text = "".join(t for t, _ in TOKENS)
            choice: dict[str, Any] = {"index": 0, "finish_reason": "stop", "token_ids": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            usage = _usage(len(TOKENS))
            return web.json_response({"id": "x", "choices": [choice], "usage": usage})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in self._events(chat, body):
            if self.keep_alive:  # vLLM's --sse-keep-alive-interval: a comment event
                await response.write(b": keep-alive\n\n")
            await response.write(event)  # one read per event, like a paced model server
            await asyncio.sleep(self.event_delay_s)
        await response.write_eof()
        return response

    def __init__(self) -> None:
        super().__init__()
        # Knobs for the admin and readiness tests: how slowly /v1/models answers, and what.
        self.models_delay_s = 0.0
        self.whole_delay_s = 0.0  # before an unstreamed answer
        self.event_delay_s = 0.005  # between stream events
        self.keep_alive = False  # a `: keep-alive` comment before each event
        self.models_payload: Any = {"data": [{"id": "base"}, {"id": "policy-v1"}]}
        self.authorizations: list[str | None] = []  # of every request, in order

    async def _models(self, request: web.Request) -> web.Response:
        self.authorizations.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.models_delay_s)
        return web.json_response(self.models_payload)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._answer)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_get("/v1/models", self._models)


@pytest.fixture
def fake() -> Iterator[FakeVllm]:
    upstream = FakeVllm().start()
    yield upstream
    upstream.stop()


def _post(url: str, key: str | bytes | None, path: str, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", {})
    if key is not None:
        headers["Authorization"] = b"Bearer " + (key.encode() if isinstance(key, str) else key)
    return httpx.post(url + path, headers=headers, timeout=30, **kw)


def _assert_error(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and "Traceback" not in response.text
    return error


def _stream(url: str, key: str | None, path: str, body: dict[str, Any]) -> list[Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=30) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line) for line in lines]


def _named(events: list[Any]) -> list[Any]:
    return [e if isinstance(e, str) else {**e, "model": "m"} for e in events]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_captured_stream_keeps_the_empty_text_chunks_vllm_sends(make_proxy, fake, path):
    """vLLM streams a held-back token as `"content": ""` / `"text": ""` whether or not token
    ids were asked for: the captured client gets the very chunks a direct client gets."""
    harness, sink = make_proxy([fake.url])
    body = {**CHAT, "stream": True}
    if "chat" not in path:
        body = {"model": "policy", "prompt": "hi", "stream": True}
    direct = _stream(fake.url, None, path, body)
    captured = _stream(harness.base_url, KEYS["alice"], path, body)
    assert fake.requests[-1]["return_token_ids"] is True  # the capture's additions went up
    assert _named(captured) == _named(direct)
    # Every token's chunk (after chat's role chunk), the held-back one included.
    assert len(direct) == len(TOKENS) + ("chat" in path) + 1
    harness.drain()
    [record] = sink.trajectories
    assert record["choices"][0]["token_ids"] == [t for _, t in TOKENS]


@pytest.mark.parametrize("upstream_key", [None, "vllm-key"])
def test_upstreams_get_the_model_servers_key_never_the_clients(make_proxy, fake, upstream_key):
    """A vLLM started with --api-key refused every request the proxy relayed: the proxy had
    no key to send it."""
    harness, _ = make_proxy([fake.url], upstream_api_key=upstream_key)
    assert _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=CHAT).is_success
    _stream(harness.base_url, KEYS["alice"], "/v1/chat/completions", {**CHAT, "stream": True})
    assert httpx.get(harness.base_url + "/readyz", timeout=30).status_code == 200
    expected = f"Bearer {upstream_key}" if upstream_key else None
    assert fake.authorizations == [expected] * 3  # chat, streamed chat, readiness's models
    # A SecretStr: the config's dumps and reprs never hold the key.
    assert upstream_key is None or upstream_key not in harness.ctx.config.model_dump_json()


def test_completions_echo_is_relayed_uncaptured(make_proxy, fake):
    """`logprobs: 0` with echo asks vLLM for prompt logprobs (fatal next to LoRA requests)
    and `return_token_ids` empties the echoed prompt: an echo is never captured."""
    harness, sink = make_proxy([fake.url])
    body = {"model": "policy", "prompt": "hi", "echo": True, "max_tokens": 4}
    response = _post(harness.base_url, KEYS["alice"], "/v1/completions", json=body)
    assert response.status_code == 200
    assert "x-olp-trajectory-id" not in response.headers
    assert fake.requests[-1] == {**body, "model": "base"}
    _post(harness.base_url, KEYS["alice"], "/v1/completions", json={**body, "echo": False})
    assert fake.requests[-1]["logprobs"] == 0  # without echo alice is captured
    harness.drain()
    assert len(sink.trajectories) == 1
    metrics = httpx.get(harness.base_url + "/metrics", timeout=30).text
    assert 'olp_proxy_captures_skipped_total{reason="echo",tenant="alice"} 1.0' in metrics


def test_a_token_id_prompt_is_relayed_uncaptured(make_proxy, fake):
    """The Redactor reads text: an e-mail or a key sent as token ids reached the record
    twice (the prompt and its prompt_token_ids), trainable, readable with the tokenizer."""
    harness, sink = make_proxy([fake.url])
    for prompt in ([101, 2023, 102], [[101, 2023], [102]]):
        body = {"model": "policy", "prompt": prompt, "max_tokens": 4}
        response = _post(harness.base_url, KEYS["alice"], "/v1/completions", json=body)
        assert response.status_code == 200 and "x-olp-trajectory-id" not in response.headers
        assert fake.requests[-1] == {**body, "model": "base"}
    harness.drain()
    assert sink.trajectories == []
    metrics = httpx.get(harness.base_url + "/metrics", timeout=30).text
    assert 'olp_proxy_captures_skipped_total{reason="token_prompt",tenant="alice"} 2.0' in metrics


def test_chat_echo_is_refused(make_proxy, fake):
    harness, _ = make_proxy([fake.url])
    for key in (KEYS["alice"], KEYS["bob"]):
        echo = {**CHAT, "echo": True}
        response = _post(harness.base_url, key, "/v1/chat/completions", json=echo)
        assert _assert_error(response, 400, "unsupported_parameter")["param"] == "echo"
    assert fake.requests == []


def test_headers_that_are_not_utf8_give_4xx(make_proxy, fake):
    harness, sink = make_proxy([fake.url])
    url = harness.base_url
    chat = {"json": CHAT}
    _assert_error(_post(url, b"\xff\xfe", "/v1/chat/completions", **chat), 401, "invalid_api_key")
    admin = httpx.get(url + "/admin/status", headers={"Authorization": b"Bearer \xff"}, timeout=30)
    _assert_error(admin, 403, "forbidden")  # like any key that is not the admin key
    for header in ("X-Session-Id", "X-OLP-Group-Id", "X-OLP-Task"):
        for key in (KEYS["alice"], KEYS["bob"]):
            response = _post(url, key, "/v1/chat/completions", headers={header: b"s\xff"}, **chat)
            assert _assert_error(response, 400, "invalid_header")["param"] == header
    feedback = {"trajectory_id": "t", "kind": "accept"}
    not_utf8 = {"X-Session-Id": b"\xff"}
    response = _post(url, KEYS["alice"], "/v1/feedback", json=feedback, headers=not_utf8)
    _assert_error(response, 400, "invalid_header")
    assert fake.requests == [] and sink.feedback == []
    # UTF-8 beyond ASCII is fine.
    utf8 = {"X-Session-Id": "sé".encode()}
    ok = _post(url, KEYS["alice"], "/v1/chat/completions", headers=utf8, **chat)
    assert ok.status_code == 200
    harness.drain()
    assert sink.trajectories[-1]["session_id"] == "sé"


def test_long_client_labels_keep_their_first_256_characters(make_proxy, fake):
    """X-OLP-Group-Id and X-OLP-Task went into every record as sent, up to aiohttp's 8 KB
    header limit; now all three labels keep the same first 256 characters."""
    harness, sink = make_proxy([fake.url])
    labels = {
        name: name[-4:] + "x" * 6000 for name in ("X-Session-Id", "X-OLP-Group-Id", "X-OLP-Task")
    }
    response = _post(
        harness.base_url, KEYS["alice"], "/v1/chat/completions", json=CHAT, headers=labels
    )
    assert response.status_code == 200, response.text
    harness.drain()
    record = sink.trajectories[-1]
    assert record["session_id"] == labels["X-Session-Id"][:256]
    assert record["group_id"] == labels["X-OLP-Group-Id"][:256]
    assert record["task"] == labels["X-OLP-Task"][:256]


def test_a_user_with_a_lone_surrogate_is_hashed(make_proxy, fake):
    harness, sink = make_proxy([fake.url])
    raw = json.dumps({**CHAT, "user": "\ud800"}).encode()  # `\ud800`, as JSON allows
    response = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", content=raw)
    assert response.status_code == 200, response.text
    harness.drain()
    assert sink.trajectories[-1]["user"] == pseudonym(harness.ctx.pseudonym_key, "\ud800")


def test_json_nested_too_deeply_is_invalid_json(make_proxy, fake):
    harness, _ = make_proxy([fake.url])
    deep = b"[" * 1000 + b"]" * 1000
    url = harness.base_url
    for key, path, body in (
        (KEYS["alice"], "/v1/chat/completions", b'{"model":"policy","messages":' + deep + b"}"),
        (KEYS["bob"], "/v1/completions", b'{"model":"policy","prompt":' + deep + b"}"),
        (
            KEYS["alice"],
            "/v1/feedback",
            b'{"trajectory_id":"t","kind":"accept","metadata":{"a":' + deep + b"}}",
        ),
        (ADMIN_KEY, "/admin/canary", b'{"target":"policy-v1","share":' + deep + b"}"),
    ):
        _assert_error(_post(url, key, path, content=body), 400, "invalid_json")
    assert fake.requests == []


def test_feedback_the_sink_would_refuse_is_a_400(make_proxy, fake):
    harness, sink = make_proxy([fake.url])
    url = harness.base_url
    for raw, param in (
        (b'{"trajectory_id":"t","kind":"score","value":' + b"1" * 400 + b"}", "value"),
        (b'{"trajectory_id":"\\udc00","kind":"accept"}', "trajectory_id"),
    ):
        response = _post(url, KEYS["alice"], "/v1/feedback", content=raw)
        assert _assert_error(response, 400, "invalid_request")["param"] == param
    # Not strict JSON: refused as the body, before the field is looked at.
    raw = b'{"trajectory_id":"t","kind":"accept","metadata":{"x":NaN}}'
    response = _post(url, KEYS["alice"], "/v1/feedback", content=raw)
    _assert_error(response, 400, "invalid_json")
    canary = b'{"target":"policy-v1","share":' + b"1" * 400 + b"}"
    response = _post(url, ADMIN_KEY, "/admin/canary", content=canary)
    assert _assert_error(response, 400, "invalid_request")["param"] == "share"
    assert sink.feedback == []


def _tokens_counted(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    counted = {}
    for line in text.splitlines():
        if line.startswith("olp_proxy_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            counted[labels.split('direction="')[1].split('"')[0]] = float(value)
    return counted


@pytest.mark.parametrize("key", [KEYS["bob"], KEYS["alice"]])
def test_continuous_usage_is_counted_once(make_proxy, fake, key):
    """With `continuous_usage_stats` every chunk carries the running total; the stream's
    tokens are its last usage, counted once (uncaptured: bob; captured: alice)."""
    harness, _ = make_proxy([fake.url])
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {**CHAT, "stream": True, "stream_options": options}
    events = _stream(harness.base_url, key, "/v1/chat/completions", body)
    assert sum("usage" in e for e in events[:-1]) == len(TOKENS) + 2  # each chunk had usage
    assert _tokens_counted(harness.base_url) == {"in": len(PROMPT_IDS), "out": len(TOKENS)}


def _admin(url: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "X-OLP-Actor": "ops-test"}
    return httpx.post(url + path, json=body or {}, headers=headers, timeout=30)


def test_metric_series_of_versions_nothing_routes_to_are_removed(make_proxy, fake):
    """Every version promoted once kept its series on /metrics for the proxy's life (60
    promotions: 982 KB a scrape). A version neither routed to nor a rollback target goes;
    the requests refused before routing (`unknown`: the 401s and 429s alerts watch) stay."""
    fake.models_payload = {"data": [{"id": f"policy-v{n}"} for n in (1, 2, 3)] + [{"id": "base"}]}
    harness, _ = make_proxy([fake.url])
    refused = _post(harness.base_url, "wrong-key", "/v1/chat/completions", json=CHAT)
    assert refused.status_code == 401

    def versions_on_metrics() -> set[str]:
        text = httpx.get(harness.base_url + "/metrics").text
        return set(re.findall(r'olp_proxy_requests_total\{[^}]*policy_version="([^"]+)"', text))

    for target in ("policy-v1", "policy-v2", "policy-v3"):
        flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": target})
        assert flip.status_code == 200, flip.text
        answer = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200, answer.text
    # v3 serves, v2 is what a rollback would serve; v1 is neither.
    assert versions_on_metrics() == {"policy-v2", "policy-v3", "unknown"}
    assert _admin(harness.base_url, "/admin/rollback", {}).status_code == 200
    # v1 is the rollback target now, unseen
    assert versions_on_metrics() == {"policy-v2", "unknown"}
    assert (
        'status="401",stream="false",tenant="unauthenticated"} 1.0'
        in httpx.get(harness.base_url + "/metrics").text
    )


def test_a_long_history_is_folded_and_rollbacks_still_read_it(make_proxy, fake, tmp_path):
    """Every admin change copied, rewrote and fsynced the whole history on the event loop,
    and /admin/status carried it all: past twice `HISTORY_KEEP` entries the older ones fold
    into one `compacted` entry that keeps the lineage and the version names."""
    from proxy.serving_state import HISTORY_KEEP, ServingState, save_state

    history = [
        {"kind": "flip", "actor": "ops", "at": 1.0, "alias": "policy", "target": "policy-v1"},
        *[{"kind": "freeze", "actor": "ops", "at": 2.0}] * (2 * HISTORY_KEEP),
    ]
    state_dir = tmp_path / "long-history-state"
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(aliases={"policy": "policy-v1", "base": "base"}, history=history),
    )
    fake.models_payload = {"data": [{"id": i} for i in ("base", "policy-v1", "policy-v2")]}
    harness, _ = make_proxy([fake.url], state_dir=state_dir)
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v2"})
    assert flip.status_code == 200, flip.text
    saved = json.loads(harness.ctx.state_path.read_text())["history"]
    assert len(saved) == HISTORY_KEEP + 1 and saved[0]["kind"] == "compacted"
    assert saved[0]["lineages"] == {"policy": ["policy-v1"]}
    assert saved[0]["versions"] == ["policy-v1"]
    back = _admin(harness.base_url, "/admin/rollback", {})
    assert back.status_code == 200 and back.json()["serving_version"] == "policy-v1", back.text


@pytest.mark.parametrize(
    "path, body",
    [
        ("/admin/aliases", {"alias": "policy", "target": "policy-v1"}),
        ("/admin/canary", {"target": "policy-v1", "share": 0.5}),
    ],
)
def test_a_freeze_during_a_flips_replica_check_wins(make_proxy, fake, path, body):
    """An alias flip or canary start awaits every replica's /v1/models; a freeze that lands
    meanwhile must not be overtaken: nothing changes what serves once frozen."""
    harness, _ = make_proxy([fake.url])
    fake.models_delay_s = 0.5
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        asked = len(fake.authorizations)
        change = pool.submit(_admin, harness.base_url, path, body)
        wait_for(lambda: len(fake.authorizations) > asked)  # it waits on /v1/models now
        assert _admin(harness.base_url, "/admin/freeze").status_code == 200
        change_status = change.result().status_code
    ctx = harness.ctx
    kinds = [entry["kind"] for entry in ctx.state.history]
    # The change went first, whole (the freeze then ended any canary it started).
    assert change_status == 200 and kinds == [kinds[0], "freeze"], (change_status, kinds)
    assert ctx.state.frozen and ctx.aliases.canaries() == {}
    flipped = "aliases" in path
    assert ctx.aliases.resolve("policy") == ("policy-v1" if flipped else "base")


def test_ending_a_canary_by_its_target_leaves_another_running(make_proxy, fake):
    """The learner names its candidate when it ends a canary: an operator's canary started
    after the learner's had ended must not be the one it rolls back."""
    harness, _ = make_proxy([fake.url])
    started = _admin(harness.base_url, "/admin/canary", {"target": "policy-v1", "share": 0.5})
    assert started.status_code == 200, started.text
    end = {"decision": "rollback", "reason": "learner verdict", "target": "policy-v2"}
    _assert_error(_admin(harness.base_url, "/admin/canary/end", end), 409, "canary_changed")
    assert harness.ctx.aliases.canaries()["policy"].target == "policy-v1"
    # A reason the audit log cannot write (a lone surrogate) is the caller's error, not a 500.
    unwritable = json.dumps(end | {"target": "policy-v1", "reason": "\ud800"}).encode()
    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    refused = httpx.post(
        harness.base_url + "/admin/canary/end", content=unwritable, headers=headers, timeout=30
    )
    error = _assert_error(refused, 400, "invalid_request")
    assert error["param"] == "reason"
    assert harness.ctx.aliases.canaries()["policy"].target == "policy-v1"
    ended = _admin(harness.base_url, "/admin/canary/end", end | {"target": "policy-v1"})
    assert ended.status_code == 200 and harness.ctx.aliases.canaries() == {}


@pytest.mark.parametrize("fails", ["save", "audit"])
@pytest.mark.parametrize(
    "path, body",
    [
        ("/admin/aliases", {"alias": "policy", "target": "policy-v1"}),
        ("/admin/canary", {"target": "policy-v1", "share": 0.5}),
        ("/admin/freeze", {}),
        ("/admin/tenants/alice/training", {"enabled": False}),
    ],
)
def test_a_change_that_cannot_be_saved_or_audited_does_not_serve(
    make_proxy, fake, monkeypatch, path, body, fails
):
    """A full disk under the state file or the audit log: the change answered 500 but was
    serving already, unaudited, until a restart quietly undid it. It is undone, and the
    503 says it was not applied and what refused it (a bare 500 named neither)."""
    from proxy import admin

    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    before = (dict(ctx.aliases.snapshot()), dict(ctx.aliases.canaries()), ctx.state.to_json())
    on_disk = ctx.state_path.read_bytes() if ctx.state_path.exists() else None
    audited = ctx.audit.path.read_bytes() if ctx.audit.path.exists() else b""
    training = {name: t.training_enabled for name, t in ctx.tenants.tenants.items()}

    def refuse(*_: Any, **__: Any) -> None:
        raise OSError(28, "No space left on device")

    if fails == "save":
        monkeypatch.setattr(admin, "save_state", refuse)
    else:
        monkeypatch.setattr(ctx.audit, "append", refuse)
    refused = _admin(harness.base_url, path, body)
    _assert_error(refused, 503, "state_not_saved" if fails == "save" else "audit_unavailable")
    message = refused.json()["error"]["message"]
    assert message.startswith("The change was not applied") and "No space left" in message
    after = (dict(ctx.aliases.snapshot()), dict(ctx.aliases.canaries()), ctx.state.to_json())
    assert after == before
    assert {name: t.training_enabled for name, t in ctx.tenants.tenants.items()} == training
    assert (ctx.audit.path.read_bytes() if ctx.audit.path.exists() else b"") == audited
    if fails == "audit":  # the state file was written, then put back
        assert json.loads(ctx.state_path.read_bytes()) == (
            json.loads(on_disk) if on_disk else before[2]
        )
    monkeypatch.undo()  # the disk is back: the same change goes through
    assert _admin(harness.base_url, path, body).status_code == 200


@pytest.mark.parametrize(
    "path, body, event",
    [
        ("/admin/aliases", {"alias": "policy", "target": "policy-v1"}, "alias_set"),
        ("/admin/canary", {"target": "policy-v1", "share": 0.5}, "canary_started"),
        ("/admin/freeze", {}, "freeze"),
        ("/admin/tenants/alice/training", {"enabled": False}, "tenant_training"),
    ],
)
def test_a_change_whose_audit_record_is_written_stands(make_proxy, fake, path, body, event):
    """The audit line is written and fsynced before its head file; when the head then fails,
    the change was undone and answered 500 while the log kept its record, and `verify`
    passed: the record of truth named a change that never served. Now the record decides:
    the change stands, saved and audited, and answers 200."""
    from safety.audit import iter_records, verify

    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    before = ctx.state.to_json()
    blocked = ctx.audit.path.with_name(ctx.audit.path.name + ".head.tmp")
    blocked.mkdir()  # the head's tmp file cannot be written; the line can
    changed = _admin(harness.base_url, path, body)
    assert changed.status_code == 200, changed.text
    assert ctx.state.to_json() != before
    assert json.loads(ctx.state_path.read_bytes()) == ctx.state.to_json()
    assert [r["event"] for r in iter_records(ctx.audit.path)] == [event]
    assert verify(ctx.audit.path).ok
    blocked.rmdir()  # the disk recovers: the chain goes on from that record
    assert _admin(harness.base_url, "/admin/unfreeze").status_code == 200
    # The head caught up with the record it had missed, and the log says so.
    events = [event, "head_caught_up", "unfreeze"]
    assert [r["event"] for r in iter_records(ctx.audit.path)] == events
    result = verify(ctx.audit.path)
    assert (result.ok, result.records, result.reason) == (True, 3, "")


@contextlib.contextmanager
def _audit_log_locked(ctx: Any) -> Iterator[None]:
    """Hold the audit log's file lock as another process would (`olp audit verify` reading a
    long log, the backup recipe, the learner appending)."""
    from safety.audit import lock_path

    fd = os.open(lock_path(ctx.audit.path), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _saved_frozen(ctx: Any) -> bool:
    return ctx.state_path.exists() and json.loads(ctx.state_path.read_bytes())["frozen"]


def test_an_admin_change_waiting_on_the_audit_log_blocks_no_traffic(make_proxy, fake):
    """The audit append (its file lock, its fsync) ran on the event loop: while another
    process held the log's lock, every request to the proxy waited. The change serves only
    once its record is written."""
    from safety.audit import iter_records

    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _audit_log_locked(ctx):
            freezing = pool.submit(_admin, harness.base_url, "/admin/freeze")
            wait_for(lambda: _saved_frozen(ctx))  # saved: its append waits on the lock now
            assert httpx.get(harness.base_url + "/healthz", timeout=5).status_code == 200
            served = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=CHAT)
            assert served.status_code == 200, served.text
            status = httpx.get(
                harness.base_url + "/admin/status",
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                timeout=5,
            ).json()
            assert status["frozen"] is False  # not yet recorded: not yet serving
            assert not freezing.done()
        assert freezing.result(timeout=30).status_code == 200
    assert ctx.state.frozen
    assert [r["event"] for r in iter_records(ctx.audit.path)] == ["freeze"]


def test_a_stop_while_an_admin_change_is_recorded_leaves_state_and_log_agreeing(tmp_path, fake):
    """Stopping the proxy cancels every task: the change was undone (and the old state
    saved) while its record, in a thread nothing stops, still landed in the log."""
    from proxy.app import build_app
    from proxy.context import CONTEXT
    from proxy.server import app_runner
    from safety.audit import iter_records
    from tests.proxy.conftest import CollectingSink, default_tenants

    config = ProxyConfig(upstreams=[fake.url], port=0, admin_key=ADMIN_KEY, drain_s=0.2)
    app = build_app(config, default_tenants(), CollectingSink(), tmp_path / "state")
    ctx = app[CONTEXT]

    async def freeze_then_stop() -> None:
        runner = app_runner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            (
                "POST /admin/freeze HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {ADMIN_KEY}\r\nContent-Length: 0\r\n\r\n"
            ).encode()
        )
        await writer.drain()
        while not _saved_frozen(ctx):  # saved: its append waits on the lock
            await asyncio.sleep(0.01)
        await runner.cleanup()
        writer.close()

    locked = contextlib.ExitStack()
    locked.enter_context(_audit_log_locked(ctx))
    runner = asyncio.Runner()
    try:
        runner.run(freeze_then_stop())
    finally:
        # The other process lets go of the log while asyncio is closing the loop.
        threading.Timer(0.5, locked.close).start()
    runner.close()  # cancels what is left, then waits for the executor's threads
    records = [r["event"] for r in iter_records(ctx.audit.path)]
    assert records == ["freeze"] and _saved_frozen(ctx)


def _waits_on_the_audit_lock(ctx: Any) -> bool:
    """Whether a lock request on the audit log's lock file is blocked (Linux: /proc/locks
    lists a waiter with `->`, its file by inode)."""
    from safety.audit import lock_path

    inode = f":{os.stat(lock_path(ctx.audit.path)).st_ino} "
    return any("->" in line and inode in line for line in open("/proc/locks"))


def test_an_operator_sign_in_waiting_on_the_audit_log_blocks_no_traffic(make_proxy, fake):
    """The sign-in's audit record was appended on the event loop, as admin changes were."""
    harness, _ = make_proxy([fake.url])
    form = {"key": ADMIN_KEY, "actor": "form-op"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _audit_log_locked(harness.ctx):
            signing_in = pool.submit(
                httpx.post, harness.base_url + "/admin/ui/login", data=form, timeout=30
            )
            wait_for(lambda: _waits_on_the_audit_lock(harness.ctx))
            assert httpx.get(harness.base_url + "/healthz", timeout=5).status_code == 200
            assert not signing_in.done()
        signed_in = signing_in.result(timeout=30)
    assert signed_in.status_code == 303 and "set-cookie" in signed_in.headers


def test_a_sign_in_whose_browser_left_while_it_was_recorded_opens_its_session(make_proxy, fake):
    """Cancelled between its record and its session, the log said `operator_login` with no
    session behind it (and a sign-in link was spent on nothing)."""
    from proxy.operator_page import OPERATOR
    from safety.audit import iter_records

    harness, _ = make_proxy([fake.url])
    sessions = harness.app[OPERATOR].sessions
    form = f"key={ADMIN_KEY}&actor=form-op".encode()
    with _audit_log_locked(harness.ctx):
        browser = socket.create_connection(("127.0.0.1", harness.port), timeout=10)
        browser.sendall(
            (
                "POST /admin/ui/login HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                "Content-Type: application/x-www-form-urlencoded\r\n"
                f"Content-Length: {len(form)}\r\n\r\n"
            ).encode()
            + form
        )
        wait_for(lambda: _waits_on_the_audit_lock(harness.ctx))
        browser.close()
        time.sleep(0.2)  # the proxy sees the connection go and cancels the handler
    wait_for(lambda: len(sessions._sessions) == 1)
    assert [r["event"] for r in iter_records(harness.ctx.audit.path)] == ["operator_login"]


def test_an_admin_change_whose_client_left_while_it_was_recorded_is_served(make_proxy, fake):
    """aiohttp cancels the handler of a client that went away: cancelled while its record
    was being written, the change would be undone on the live tables with its record landing
    in the log. It runs to its end instead."""
    from safety.audit import iter_records, verify

    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    with _audit_log_locked(ctx):
        client = socket.create_connection(("127.0.0.1", harness.port), timeout=10)
        client.sendall(
            (
                "POST /admin/freeze HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {ADMIN_KEY}\r\nContent-Length: 0\r\n\r\n"
            ).encode()
        )
        wait_for(lambda: _saved_frozen(ctx))
        client.close()
        time.sleep(0.2)  # the proxy sees the connection go and cancels the handler
    wait_for(lambda: ctx.state.frozen)
    assert _saved_frozen(ctx)
    assert [r["event"] for r in iter_records(ctx.audit.path)] == ["freeze"]
    assert verify(ctx.audit.path).ok


@pytest.mark.parametrize(
    "payload", [[], {"data": "policy-v1"}, {"data": ["policy-v1"]}, {"data": [["id"]]}]
)
def test_a_models_list_of_another_shape_is_a_replica_problem_not_a_500(make_proxy, fake, payload):
    """/v1/models that is JSON but not vLLM's `{"data": [{"id": ...}]}` (a wrong upstream
    URL, a different server): /readyz says which replica, an alias flip gives 502."""
    harness, _ = make_proxy([fake.url])
    fake.models_payload = payload
    ready = httpx.get(harness.base_url + "/readyz", timeout=30)
    assert ready.status_code == 503, ready.text
    assert ready.json()["replicas"]["replica-0"] == "ValueError"
    ready = _readyz(harness, ADMIN_KEY)
    assert ready.status_code == 503, ready.text
    assert ready.json()["replicas"][fake.url] != "ok"
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    _assert_error(flip, 502, "upstream_error")
    assert harness.ctx.aliases.resolve("policy") == "base"


def test_a_model_id_that_is_not_a_name_is_passed_over_not_a_500(make_proxy, fake):
    """An id of another type (a list) in /v1/models raised TypeError: every flip was a 500."""
    harness, _ = make_proxy([fake.url])
    fake.models_payload = {"data": [{"id": ["odd"]}, {"id": "base"}, {"id": "policy-v1"}]}
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    assert flip.status_code == 200, flip.text
    assert harness.ctx.aliases.resolve("policy") == "policy-v1"


def test_freeze_takes_a_null_learning_as_its_default(make_proxy, fake):
    harness, _ = make_proxy([fake.url])
    frozen = _admin(harness.base_url, "/admin/freeze", {"learning": None})
    assert frozen.status_code == 200 and frozen.json()["learning_frozen"] is True


def _readyz(harness, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(harness.base_url + "/readyz", headers=headers, timeout=30)


def test_overlapping_readyz_share_one_probe_and_leave_room_for_a_rollback(make_proxy, fake):
    """/readyz takes no key, and each call listed every replica's models through the small
    pool of model listings, whose 2 s timeouts count the wait for a connection: 20
    overlapping calls (a 0.4 s listing) answered 503 for a healthy replica, and a flip and a
    rollback meanwhile failed with 502 "did not list its models"."""
    harness, _ = make_proxy([fake.url])
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    assert flip.status_code == 200, flip.text
    fake.models_delay_s = 0.4
    listed = len(fake.authorizations)
    with concurrent.futures.ThreadPoolExecutor(21) as pool:
        probes = [pool.submit(_readyz, harness) for _ in range(20)]
        rollback = pool.submit(_admin, harness.base_url, "/admin/rollback", {})
        answers = [probe.result() for probe in probes]
        back = rollback.result()
    assert back.status_code == 200, back.text
    assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
    assert all(a.json()["replicas"] == {"replica-0": "ok"} for a in answers)
    # The probes overlapped: far fewer listings than calls (the rollback's check is one).
    assert len(fake.authorizations) - listed <= 10


def test_readyz_names_replicas_by_position_unless_the_admin_key_asks(make_proxy, fake):
    """/readyz takes no key (a load balancer's probe sends none), and its body listed every
    replica's URL: anyone who could reach the proxy learnt the model servers' host:port.
    Now it names them `replica-<N>` in the configured order, its problems by their kind
    only (an error's text names the host too); the admin key shows the URLs and the texts,
    and a wrong key is no 401 there, just the view without them."""
    lacking = FakeVllm().start()
    lacking.models_payload = {"data": [{"id": "base"}]}
    running = True
    dead = f"http://127.0.0.1:{free_port()}"
    try:
        harness, _ = make_proxy([lacking.url, dead, fake.url])
        harness.ctx.aliases.start_canary("policy", Canary("policy-v1", 0.25, 0.0))
        for key in (None, "wrong", KEYS["alice"]):
            ready = _readyz(harness, key)
            assert ready.status_code == 200, ready.text
            body = ready.json()
            assert list(body["replicas"]) == ["replica-0", "replica-1", "replica-2"]
            assert body == {
                "ready": True,
                "replicas": {
                    "replica-0": "ok",
                    "replica-1": "ClientConnectorError",
                    "replica-2": "ok",
                },
                "unserved_aliases": {},
                "unserved_canaries": {},
                "replicas_missing_targets": {"replica-0": ["policy-v1"]},
            }
            for url in (lacking.url, dead, fake.url):
                port = url.rsplit(":", 1)[1]
                assert port not in ready.text
            assert "127.0.0.1" not in ready.text
        admin = _readyz(harness, ADMIN_KEY)
        assert admin.status_code == 200, admin.text
        body = admin.json()
        assert list(body["replicas"]) == [lacking.url, dead, fake.url]
        assert body["replicas"][lacking.url] == body["replicas"][fake.url] == "ok"
        assert body["replicas"][dead].startswith("ClientConnectorError: ")
        assert body["replicas_missing_targets"] == {lacking.url: ["policy-v1"]}
        assert body["unserved_canaries"] == {} and body["ready"] is True
        # None answers: still 503, still no address.
        lacking.stop()
        running = False
        fake.models_payload = []
        ready = _readyz(harness)
        assert ready.status_code == 503 and ready.json()["ready"] is False
        assert set(ready.json()["replicas"]) == {"replica-0", "replica-1", "replica-2"}
        assert fake.url.rsplit(":", 1)[1] not in ready.text
    finally:
        if running:
            lacking.stop()


def test_wrong_keys_at_readyz_count_for_the_throttle_and_a_lockout_hides_the_urls(make_proxy, fake):
    """A key checked at /readyz is an admin key checked: wrong ones count like the admin
    API's, or /readyz would let the admin key be guessed at line rate; a tenant's own key is
    no wrong key (a client probing with it must not lock itself out of /v1). A locked-out
    address still gets its readiness (never 429, never 401), without the URLs whatever key
    it sends."""
    harness, _ = make_proxy([fake.url], auth_failures=AuthFailureLimits(max_failures=2))
    assert _readyz(harness).json()["replicas"] == {"replica-0": "ok"}  # no key: not counted
    assert _readyz(harness).json()["replicas"] == {"replica-0": "ok"}
    for _ in range(3):  # a tenant's key: the view without URLs, not counted
        assert _readyz(harness, KEYS["alice"]).json()["replicas"] == {"replica-0": "ok"}
    assert httpx.get(
        harness.base_url + "/v1/models",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=30,
    ).is_success
    for _ in range(2):
        ready = _readyz(harness, "guess")
        assert ready.status_code == 200 and ready.json()["replicas"] == {"replica-0": "ok"}
    locked = httpx.get(
        harness.base_url + "/v1/models",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        timeout=30,
    )
    _assert_error(locked, 429, "auth_throttled")
    ready = _readyz(harness, ADMIN_KEY)
    assert ready.status_code == 200 and ready.json()["replicas"] == {"replica-0": "ok"}


def test_wrong_keys_at_readyz_count_without_require_auth_too(make_proxy, fake):
    """With `require_auth: false` every unknown key is served as `anonymous`: none counted
    at /readyz, whose answer still told the admin key apart (its URLs), so the admin key
    could be guessed without limit."""
    harness, _ = make_proxy(
        [fake.url], require_auth=False, auth_failures=AuthFailureLimits(max_failures=2)
    )
    for _ in range(3):  # a tenant's key is still no wrong key
        assert _readyz(harness, KEYS["alice"]).json()["replicas"] == {"replica-0": "ok"}
    for guess in ("guess-1", "guess-2"):
        assert _readyz(harness, guess).json()["replicas"] == {"replica-0": "ok"}
    ready = _readyz(harness, ADMIN_KEY)  # locked out: the admin key is not looked at
    assert ready.status_code == 200 and ready.json()["replicas"] == {"replica-0": "ok"}


def test_readyz_names_a_canary_target_no_replica_serves(make_proxy, fake):
    """A canary's share of traffic goes to its own target: unloaded, that share gets 404s."""
    harness, _ = make_proxy([fake.url])
    harness.ctx.aliases.start_canary("policy", Canary("policy-v7", 0.25, 0.0))
    ready = httpx.get(harness.base_url + "/readyz", timeout=30).json()
    assert ready["unserved_canaries"] == {"policy": "policy-v7"}
    assert ready["unserved_aliases"] == {}
    harness.ctx.aliases.start_canary("policy", Canary("policy-v1", 0.25, 0.0))  # served
    assert httpx.get(harness.base_url + "/readyz", timeout=30).json()["unserved_canaries"] == {}


def test_base_is_the_base_models_served_name_in_admin_targets(make_proxy, fake):
    """With `policy.served_model_name: smollm`, `base` in a flip, rollback or canary names
    that model (before, `smollm` was refused and `base` was not served)."""
    fake.models_payload = {"data": [{"id": "smollm"}, {"id": "policy-v1"}]}
    harness, _ = make_proxy([fake.url], base_served_name="smollm")
    assert harness.ctx.aliases.resolve("policy") == "smollm"
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    assert flip.status_code == 200, flip.text
    back = _admin(harness.base_url, "/admin/rollback", {"to": "base"})
    assert back.status_code == 200 and back.json()["target"] == "smollm", back.text
    forward = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    assert forward.status_code == 200, forward.text
    again = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "smollm"})
    assert again.status_code == 200 and harness.ctx.aliases.resolve("policy") == "smollm"
    bad = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "other"})
    assert _assert_error(bad, 400, "invalid_request")["param"] == "target"


def test_a_flip_to_the_version_already_serving_changes_and_audits_nothing(make_proxy, fake):
    """It answered 200 and wrote a flip and an `alias_set` audit record whose `previous` was
    its `target`. Now 409 `already_serving`, as a rollback or canary of that version is;
    with a canary running, the same flip ends the canary, a change, and stands."""
    from safety.audit import iter_records

    fake.models_payload = {"data": [{"id": i} for i in ("base", "policy-v1", "policy-v2")]}
    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    flip = {"alias": "policy", "target": "policy-v1"}
    assert _admin(harness.base_url, "/admin/aliases", flip).status_code == 200
    saved = ctx.state_path.read_bytes()
    again = _admin(harness.base_url, "/admin/aliases", flip)
    assert "already serves policy-v1" in _assert_error(again, 409, "already_serving")["message"]
    assert ctx.state_path.read_bytes() == saved
    assert [r["event"] for r in iter_records(ctx.audit.path)] == ["alias_set"]
    canary = _admin(harness.base_url, "/admin/canary", {"target": "policy-v2", "share": 0.5})
    assert canary.status_code == 200, canary.text
    ends = _admin(harness.base_url, "/admin/aliases", flip)
    assert ends.status_code == 200 and ends.json()["previous"] == "policy-v1", ends.text
    assert not ctx.aliases.canaries() and ctx.aliases.resolve("policy") == "policy-v1"
    audited = [r for r in iter_records(ctx.audit.path) if r["event"] == "alias_set"]
    assert audited[-1]["payload"]["ended_canary"]["target"] == "policy-v2"


def test_an_unfreeze_with_parameters_or_a_bad_body_is_refused_and_changes_nothing(make_proxy, fake):
    """Its body was never read: `{"learning": false}`, meant as "keep learning paused",
    lifted the whole freeze, and a body that was no JSON answered 200."""
    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    assert _admin(harness.base_url, "/admin/freeze", {"learning": True}).status_code == 200
    kept = _admin(harness.base_url, "/admin/unfreeze", {"learning": False})
    assert "takes no parameters" in _assert_error(kept, 400, "invalid_request")["message"]
    headers = {"Authorization": f"Bearer {ADMIN_KEY}", "X-OLP-Actor": "ops-test"}
    garbage = httpx.post(harness.base_url + "/admin/unfreeze", content=b"{no", headers=headers)
    _assert_error(garbage, 400, "invalid_json")
    assert ctx.state.frozen and ctx.state.learning_frozen
    assert _admin(harness.base_url, "/admin/unfreeze").status_code == 200  # `{}`
    assert not ctx.state.frozen


def test_a_rollback_of_a_version_no_longer_served_is_refused(make_proxy, fake):
    """Between the operator's look and `olp rollback` the learner flipped to v2 (or started
    its canary): the rollback undid v2 (or ended the canary) and v1, the version meant, kept
    serving. With `from` (what `olp rollback` sends) the proxy refuses instead."""
    fake.models_payload = {"data": [{"id": i} for i in ("base", "policy-v1", "policy-v2")]}
    harness, _ = make_proxy([fake.url])
    aliases = harness.ctx.aliases
    for target in ("policy-v1", "policy-v2"):  # the operator saw v1; the learner flips to v2
        body = {"alias": "policy", "target": target}
        assert _admin(harness.base_url, "/admin/aliases", body).status_code == 200
    stale = _admin(harness.base_url, "/admin/rollback", {"from": "policy-v1"})
    assert (
        "serves policy-v2, not policy-v1" in _assert_error(stale, 409, "alias_changed")["message"]
    )
    assert aliases.resolve("policy") == "policy-v2"
    canary = _admin(harness.base_url, "/admin/canary", {"target": "policy-v1", "share": 0.5})
    assert canary.status_code == 200, canary.text
    behind_canary = _admin(harness.base_url, "/admin/rollback", {"from": "policy-v2"})
    message = _assert_error(behind_canary, 409, "alias_changed")["message"]
    assert "runs a canary of policy-v1" in message and "policy" in aliases.canaries()
    ended = _admin(harness.base_url, "/admin/rollback", {"from": "policy-v1"})  # the canary's
    assert ended.status_code == 200 and not aliases.canaries(), ended.text
    back = _admin(harness.base_url, "/admin/rollback", {"from": "policy-v2"})
    assert back.status_code == 200 and back.json()["serving_version"] == "policy-v1", back.text


def test_a_rollback_goes_ahead_past_a_replica_that_does_not_answer(make_proxy, fake):
    """A bad version that took a replica down could not be rolled back: the target had to
    be listed by every replica, and the dead one answered nothing (502). Now the replicas
    that answer must list it, the others are named in the response and the audit record;
    a flip still needs every replica, and with none answering nothing is rolled back."""
    from safety.audit import iter_records

    fake.models_payload = {"data": [{"id": i} for i in ("base", "policy-v1", "policy-v2")]}
    dead = f"http://127.0.0.1:{free_port()}"
    harness, _ = make_proxy([fake.url, dead])
    ctx = harness.ctx
    for target in ("policy-v1", "policy-v2"):
        ctx.aliases.set("policy", target)
        ctx.state.record("flip", "test", alias="policy", target=target, previous=None)
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    assert "did not list its models" in _assert_error(flip, 502, "upstream_error")["message"]
    back = _admin(harness.base_url, "/admin/rollback", {"from": "policy-v2"})
    assert back.status_code == 200, back.text
    assert back.json()["serving_version"] == "policy-v1"
    assert back.json()["unconfirmed_replicas"] == [dead]
    record = list(iter_records(ctx.audit.path))[-1]
    assert record["event"] == "rollback" and record["payload"]["unconfirmed_replicas"] == [dead]
    # A replica that answers without the target (here the base model) still refuses it,
    # and one that answers something other than a model list is no confirmation either.
    fake.models_payload = {"data": [{"id": "policy-v1"}]}
    lacking = _admin(harness.base_url, "/admin/rollback", {})
    assert fake.url in _assert_error(lacking, 409, "not_loaded")["message"]
    fake.models_payload = []
    garbled = _admin(harness.base_url, "/admin/rollback", {})
    assert "did not list its models" in _assert_error(garbled, 502, "upstream_error")["message"]
    assert ctx.aliases.resolve("policy") == "policy-v1"
    # None answers: nothing confirms the target, nothing is rolled back.
    alone, _ = make_proxy([dead])
    alone.ctx.aliases.set("policy", "policy-v1")
    alone.ctx.state.record("flip", "test", alias="policy", target="policy-v1", previous=None)
    none = _admin(alone.base_url, "/admin/rollback", {})
    assert "nothing was rolled back" in _assert_error(none, 502, "upstream_error")["message"]
    assert alone.ctx.aliases.resolve("policy") == "policy-v1"


def test_a_rollback_to_goes_back_only_to_a_version_the_alias_served(make_proxy, fake):
    """`rollback {"to": ...}` took any loaded version, and rollback works while frozen: a
    frozen alias could be moved to a version it never served, a promotion past the freeze.
    Now `to` must be earlier in the alias's lineage; a plain rollback still works frozen."""
    from safety.audit import iter_records

    fake.models_payload = {"data": [{"id": i} for i in ("base", "policy-v1", "policy-v7")]}
    harness, _ = make_proxy([fake.url])
    ctx = harness.ctx
    flip = _admin(harness.base_url, "/admin/aliases", {"alias": "policy", "target": "policy-v1"})
    assert flip.status_code == 200, flip.text
    assert _admin(harness.base_url, "/admin/freeze").status_code == 200
    forward = _admin(harness.base_url, "/admin/rollback", {"to": "policy-v7"})
    message = _assert_error(forward, 409, "not_in_lineage")["message"]
    assert "policy-v7" in message and "base" in message
    assert ctx.aliases.resolve("policy") == "policy-v1"
    assert [e["kind"] for e in ctx.state.history] == ["flip", "freeze"]
    same = _admin(harness.base_url, "/admin/rollback", {"to": "policy-v1"})
    _assert_error(same, 409, "already_serving")
    back = _admin(harness.base_url, "/admin/rollback", {})  # frozen: still allowed
    assert back.status_code == 200 and back.json()["serving_version"] == "base", back.text
    assert _admin(harness.base_url, "/admin/unfreeze").status_code == 200
    # v1, then v7, then back to v1: v7 was rolled back past, so going to it is a flip.
    for target in ("policy-v1", "policy-v7"):
        body = {"alias": "policy", "target": target}
        assert _admin(harness.base_url, "/admin/aliases", body).status_code == 200
    to_v1 = _admin(harness.base_url, "/admin/rollback", {"to": "policy-v1"})
    assert to_v1.status_code == 200 and to_v1.json()["previous"] == "policy-v7", to_v1.text
    again = _admin(harness.base_url, "/admin/rollback", {"to": "policy-v7"})
    _assert_error(again, 409, "not_in_lineage")
    to_base = _admin(harness.base_url, "/admin/rollback", {"to": "base"})
    assert to_base.status_code == 200 and to_base.json()["serving_version"] == "base"
    events = [(r["event"], r["payload"].get("target")) for r in iter_records(ctx.audit.path)]
    assert [e for e in events if e[0] == "rollback"] == [
        ("rollback", "base"),
        ("rollback", "policy-v1"),
        ("rollback", "base"),
    ]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/admin/aliases", {"alias": "policy", "target": "policy-v1\n"}, "target"),
        (
            "/admin/aliases",
            {"alias": "policy", "target": "policy-v1", "expected": "base\n"},
            "expected",
        ),
        (
            "/admin/aliases",
            {"alias": "policy", "target": "policy-v1", "expected": "policy-v0\n"},
            "expected",
        ),
        ("/admin/rollback", {"to": "policy-v1\n"}, "to"),
        ("/admin/canary", {"target": "policy-v1\n", "share": 0.5}, "target"),
    ],
)
def test_a_version_with_a_trailing_newline_is_a_400(make_proxy, fake, path, body, param):
    """`^policy-v[0-9]+$` with `match`: `$` matches before a final newline, so
    'policy-v1\n' passed as a version and met a 409 (not loaded, alias changed) instead."""
    harness, _ = make_proxy([fake.url])
    refused = _admin(harness.base_url, path, body)
    assert _assert_error(refused, 400, "invalid_request")["param"] == param
    assert harness.ctx.state.history == []


def test_feedback_has_a_rate_limit_of_its_own(make_proxy, fake):
    """A key could post feedback without limit (every event reaches the stream); now it
    has a bucket the size of the tenant's per-minute limit, apart from its completions'."""
    harness, sink = make_proxy([fake.url])  # carol: 2 requests per minute
    url, event = harness.base_url + "/v1/feedback", {"trajectory_id": "t", "kind": "accept"}
    answers = [_post(url, KEYS["carol"], "", json=event) for _ in range(3)]
    assert [a.status_code for a in answers] == [202, 202, 429]
    assert answers[1].headers["x-ratelimit-remaining-requests"] == "0"
    error = _assert_error(answers[2], 429, "rate_limit_exceeded")
    assert "Feedback" in error["message"] and int(answers[2].headers["retry-after"]) >= 1
    assert len(sink.feedback) == 2
    carol = harness.ctx.tenants.tenants["carol"]
    assert carol.bucket is not None and carol.bucket.tokens == 2  # completions untouched


@pytest.mark.parametrize(
    "path, body",
    [
        ("/admin/aliases", {"alias": "nope", "target": "base"}),
        ("/admin/aliases", {"alias": "Policy", "target": "base"}),
        ("/admin/rollback", {"alias": "nope"}),
        ("/admin/rollback", {"alias": 7}),
        ("/admin/canary", {"alias": "nope", "target": "policy-v1", "share": 0.5}),
    ],
)
def test_admin_changes_to_an_alias_the_table_lacks_are_400s(make_proxy, fake, path, body):
    harness, _ = make_proxy([fake.url])
    before = harness.ctx.aliases.resolve("policy")
    response = _admin(harness.base_url, path, body)
    assert _assert_error(response, 400, "invalid_request")["param"] == "alias"
    assert "Unknown alias" in response.json()["error"]["message"]
    assert harness.ctx.aliases.resolve("policy") == before
    assert harness.ctx.aliases.public_names() == ["base", "policy"]
    assert harness.ctx.aliases.canaries() == {}


def test_feedback_metadata_with_a_lone_surrogate_is_kept(make_proxy, fake):
    """The sink writes a lone surrogate as its escape (replay.schemas.dumps_json); the
    proxy used to refuse such metadata because the sink could not carry it."""
    harness, sink = make_proxy([fake.url])
    raw = b'{"trajectory_id":"t","kind":"accept","metadata":{"note":"a\\ud800b"}}'
    response = _post(harness.base_url, KEYS["alice"], "/v1/feedback", content=raw)
    assert response.status_code == 202, response.text
    assert [event["metadata"] for event in sink.feedback] == [{"note": "a\ud800b"}]


def test_a_model_whose_name_holds_a_slash_can_be_retrieved(make_proxy, fake):
    harness, _ = make_proxy([fake.url], base_model_aliases=["base", "HuggingFaceTB/SmolLM2"])
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    url = harness.base_url + "/v1/models/"
    found = httpx.get(url + "HuggingFaceTB/SmolLM2", headers=headers, timeout=30)
    assert found.status_code == 200, found.text
    assert found.json()["id"] == "HuggingFaceTB/SmolLM2" and found.json()["object"] == "model"
    missing = httpx.get(url + "HuggingFaceTB/other", headers=headers, timeout=30)
    assert _assert_error(missing, 404, "model_not_found")["param"] == "model"


def test_a_base_served_under_another_name_is_recorded_as_base(make_proxy, fake):
    """With `policy.served_model_name: smollm` every base-served trajectory said `smollm`,
    which the trajectory schema refuses: the sink sent them all to the DLQ."""
    from replay.schemas import validate_record

    fake.models_payload = {"data": [{"id": "smollm"}]}
    harness, sink = make_proxy([fake.url], base_served_name="smollm")
    response = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.headers["x-olp-policy-version"] == "smollm"  # what served it upstream
    harness.drain()
    record = sink.trajectories[-1]
    assert record["policy_version"] == "base"
    validate_record("trajectory", record)


def test_a_tenant_over_its_limits_gets_a_429_before_its_body_is_read(make_proxy, fake):
    """Limits are applied before the body is read: requests that fail validation spend a
    request too (else a tenant past its limit keeps the proxy reading and parsing bodies of
    up to `max_body_bytes` at any rate), and a body still arriving holds a concurrency slot
    (else any number of uploads are buffered at once)."""
    tenants = [
        TenantConfig(name="carol", api_key=KEYS["carol"], requests_per_minute=2),
        TenantConfig(name="dave", api_key="key-dave", requests_per_minute=0, max_concurrent=1),
    ]
    harness, _ = make_proxy([fake.url], tenants=tenants)
    url = harness.base_url
    bad = [_post(url, KEYS["carol"], "/v1/chat/completions", content=b"{") for _ in range(2)]
    assert [b.headers["x-ratelimit-remaining-requests"] for b in bad] == ["1", "0"]
    for answer in bad:
        _assert_error(answer, 400, "invalid_json")
    _assert_error(
        _post(url, KEYS["carol"], "/v1/chat/completions", json=CHAT), 429, "rate_limit_exceeded"
    )

    upload = socket.create_connection(("127.0.0.1", harness.port))
    try:  # a body that is still arriving: half of it sent
        upload.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
            b"Authorization: Bearer key-dave"
            b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + b" " * 500
        )
        wait_for(lambda: harness.ctx.tenants.tenants["dave"].in_flight == 1)
        second = _post(url, "key-dave", "/v1/chat/completions", json=CHAT)
        _assert_error(second, 429, "concurrency_limit_exceeded")
        assert _in_flight_series(url) == {"carol": 0.0, "dave": 1.0}
    finally:
        upload.close()
    wait_for(lambda: harness.ctx.tenants.tenants["dave"].in_flight == 0)
    assert _in_flight_series(url) == {"carol": 0.0, "dave": 0.0}
    assert _post(url, "key-dave", "/v1/chat/completions", json=CHAT).status_code == 200


def _in_flight_series(url: str) -> dict[str, float]:
    """`olp_proxy_in_flight` per tenant, as /metrics shows it."""
    prefix = 'olp_proxy_in_flight{tenant="'
    lines = httpx.get(url + "/metrics", timeout=30).text.splitlines()
    return {
        line[len(prefix) :].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(prefix)
    }


class ClosesReusedConnections(FakeVllm):
    """Answers the first request of each connection and closes the connection when another
    one arrives on it: vLLM's keep-alive timer (5 s) ending as a pooled connection's next
    request goes out."""

    def __init__(self) -> None:
        super().__init__()
        self.connections: set[Any] = set()
        self.closed = 0

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        if request.protocol in self.connections:
            self.closed += 1
            assert request.transport is not None
            request.transport.close()
            return web.Response()  # never sent: the connection is gone
        self.connections.add(request.protocol)
        return await super()._answer(request)


@pytest.mark.parametrize("tenant", ["alice", "bob"])
def test_a_pooled_connection_the_replica_closes_is_retried_not_a_502(make_proxy, tenant):
    upstream = ClosesReusedConnections().start()
    try:
        harness, sink = make_proxy([upstream.url])
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        answers = [
            _post(harness.base_url, KEYS[tenant], "/v1/chat/completions", json=body)
            for _ in range(3)
        ]
    finally:
        upstream.stop()
    assert [a.status_code for a in answers] == [200, 200, 200], answers[-1].text
    assert upstream.closed == 2 and len(upstream.connections) == 3
    harness.drain()
    assert len(sink.trajectories) == (3 if tenant == "alice" else 0)


class NotesConnections(FakeVllm):
    """Notes the connection each request came on."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(request.protocol)
        return await super()._answer(request)


def test_upstream_connections_idle_past_the_keepalive_are_not_reused(make_proxy):
    """Kept below vLLM's own keep-alive (5 s), the proxy never sends on a connection vLLM is
    about to close."""
    upstream = NotesConnections().start()
    try:
        harness, _ = make_proxy([upstream.url], upstream_keepalive_s=0.3)
        body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        headers = {"Authorization": f"Bearer {KEYS['bob']}"}
        # One client: a new one per call took up to 0.15 s to make, a fair part of the 0.3 s
        # that back-to-back calls must stay within to share the proxy's upstream connection.
        with httpx.Client(timeout=30) as client:

            def ask() -> None:
                url = harness.base_url + "/v1/chat/completions"
                assert client.post(url, json=body, headers=headers).is_success

            assert_reconnects_after_idle(ask, upstream.seen)
    finally:
        upstream.stop()


def _bob(training: bool) -> list[TenantConfig]:
    return [TenantConfig(name="bob", api_key=KEYS["bob"], training_enabled=training)]


def _captured(harness: Any) -> bool:
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = _post(harness.base_url, KEYS["bob"], "/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return "x-olp-trajectory-id" in answer.headers


def test_a_training_switch_yields_to_a_config_changed_since_it_was_set(make_proxy, fake, tmp_path):
    """A switch set at run time outranked the config for ever: an operator who adopted it in
    the config and later turned the tenant off there (consent withdrawn) still trained on
    it. A switch now keeps the config's value it overrode and is dropped once that changes."""
    state = tmp_path / "switch-state"
    first, _ = make_proxy([fake.url], tenants=_bob(False), state_dir=state)
    turned_on = _admin(first.base_url, "/admin/tenants/bob/training", {"enabled": True})
    assert turned_on.json() == {"tenant": "bob", "training_enabled": True, "switch": True}
    first.stop()
    # The same config: the switch still decides, after a restart too.
    again, _ = make_proxy([fake.url], tenants=_bob(False), state_dir=state)
    assert _captured(again)
    tenants = httpx.get(
        again.base_url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
    ).json()["tenants"]
    assert tenants == [
        {"name": "bob", "training_enabled": True, "training_switch": True, "in_flight": 0}
    ]
    again.stop()
    # The operator writes the switch into the config: the switch is dropped (and saved so).
    adopted, _ = make_proxy([fake.url], tenants=_bob(True), state_dir=state)
    assert _captured(adopted)
    assert adopted.ctx.tenants.tenants["bob"].training_override is None
    assert json.loads(adopted.ctx.state_path.read_text())["tenant_training"] == {}
    adopted.stop()
    # ... and later turns the tenant off there: off, however the switch was set before.
    withdrawn, _ = make_proxy([fake.url], tenants=_bob(False), state_dir=state)
    assert not _captured(withdrawn)
    # `null` drops a switch: the config decides again, and says so.
    _admin(withdrawn.base_url, "/admin/tenants/bob/training", {"enabled": True})
    cleared = _admin(withdrawn.base_url, "/admin/tenants/bob/training", {"enabled": None})
    assert cleared.json() == {"tenant": "bob", "training_enabled": False, "switch": None}
    assert not _captured(withdrawn)
    assert "bob" not in withdrawn.ctx.state.tenant_training
    for bad in ({}, {"enabled": "on"}, {"enabled": 1}):
        refused = _admin(withdrawn.base_url, "/admin/tenants/bob/training", bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "enabled"


def test_a_base_alias_always_serves_the_base_model(make_proxy, fake, tmp_path):
    """`base` could be flipped to an adapter (and the flip survived restarts): clients that
    pin a base alias to stay off the learned policy were moved onto it."""
    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "base-alias-state"
    for path, body in (
        ("/admin/aliases", {"alias": "base", "target": "policy-v1"}),
        ("/admin/canary", {"alias": "base", "target": "policy-v1", "share": 0.5}),
        ("/admin/rollback", {"alias": "base"}),
    ):
        harness, _ = make_proxy([fake.url], state_dir=state_dir)
        refused = _admin(harness.base_url, path, body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "base_alias"
        assert harness.ctx.aliases.resolve("base") == "base"
        harness.stop()
    # A state file from before the refusal: the base alias is put back at start-up.
    canary = Canary(target="policy-v1", share=0.5, started_at=0.0)
    stale = ServingState(
        aliases={"policy": "policy-v1", "base": "policy-v1"},
        canaries={"base": canary.to_json()},
    )
    save_state(state_dir / "control" / "serving.json", stale)
    harness, _ = make_proxy([fake.url], state_dir=state_dir)
    assert harness.ctx.aliases.resolve("base") == "base"
    assert harness.ctx.aliases.resolve("policy") == "policy-v1"
    assert harness.ctx.aliases.canaries() == {}
    saved = json.loads(harness.ctx.state_path.read_text())
    assert saved["aliases"]["base"] == "base" and saved["canaries"] == {}
    reset = [r["payload"] for r in harness.ctx.audit.iter_records()]
    assert {"alias": "base", "was": "policy-v1", "canary": True} in reset


def test_a_policy_alias_on_the_base_models_old_served_name_follows_the_new_one(
    make_proxy, fake, tmp_path
):
    """Rolled back to the base model, then `policy.served_model_name` changed: the file's
    `policy` kept the old served name, a model vLLM no longer serves, and every `policy`
    request was a 404 (a target the admin API itself would refuse)."""
    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "renamed-base-state"
    stale = Canary(target="base", share=0.5, started_at=0.0)
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(
            aliases={"policy": "base", "base": "base"}, canaries={"policy": stale.to_json()}
        ),
    )
    harness, _ = make_proxy([fake.url], state_dir=state_dir, base_served_name="qwen")
    assert harness.ctx.aliases.resolve("policy") == "qwen"
    assert harness.ctx.aliases.canaries() == {}
    saved = json.loads(harness.ctx.state_path.read_text())
    assert saved["aliases"]["policy"] == "qwen" and saved["canaries"] == {}
    audited = {r["event"]: r["payload"] for r in harness.ctx.audit.iter_records()}
    assert audited["policy_alias_reset"] == {"alias": "policy", "was": "base", "now": "qwen"}
    assert audited["canary_dropped"]["alias"] == "policy"
    # A version and the current name stay as they are.
    state_dir = tmp_path / "versions-state"
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(aliases={"policy": "policy-v3", "base": "qwen"}),
    )
    harness, _ = make_proxy([fake.url], state_dir=state_dir, base_served_name="qwen")
    assert harness.ctx.aliases.resolve("policy") == "policy-v3"


def test_an_alias_the_config_no_longer_names_is_dropped_at_start_up(make_proxy, fake, tmp_path):
    """A renamed policy alias or a base alias taken out of the config stayed public from
    serving.json: still listed and served, and the dropped base alias could be flipped to
    an adapter, moving the clients that pinned it onto the learned policy."""
    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "renamed-alias-state"
    canary = Canary(target="policy-v2", share=0.5, started_at=0.0)
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(
            aliases={"policy": "policy-v1", "base": "base", "llama": "base"},
            canaries={"policy": canary.to_json()},
        ),
    )
    harness, _ = make_proxy(
        [fake.url], state_dir=state_dir, policy_alias="assistant", base_model_aliases=["base"]
    )
    auth = {"Authorization": f"Bearer {KEYS['alice']}"}
    listed = httpx.get(f"{harness.base_url}/v1/models", headers=auth).json()["data"]
    assert sorted(model["id"] for model in listed) == ["assistant", "base"]
    for alias in ("policy", "llama"):
        body = {**CHAT, "model": alias}
        answer = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=body)
        assert answer.status_code == 404, answer.text
        flip = _admin(harness.base_url, "/admin/aliases", {"alias": alias, "target": "policy-v1"})
        assert flip.status_code == 400 and "Unknown alias" in flip.text, flip.text
    saved = json.loads(harness.ctx.state_path.read_text())
    assert saved["aliases"] == {"assistant": "base", "base": "base"}
    assert saved["canaries"] == {}
    # What serves changed without an operator's command: the audit log says so.
    audited = [r for r in harness.ctx.audit.iter_records() if r["event"] == "alias_dropped"]
    assert sorted(((r["actor"], r["payload"]) for r in audited), key=lambda a: a[1]["alias"]) == [
        (
            "olp-proxy",
            {
                "alias": "llama",
                "was": "base",
                "canary": False,
                "reason": "the config no longer names it",
            },
        ),
        (
            "olp-proxy",
            {
                "alias": "policy",
                "was": "policy-v1",
                "canary": True,
                "reason": "the config no longer names it",
            },
        ),
    ]


def test_a_training_switch_of_a_tenant_the_config_dropped_is_dropped_and_audited(
    make_proxy, fake, tmp_path
):
    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "ghost-switch-state"
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(
            aliases={"policy": "base", "base": "base"},
            tenant_training={"ghost": {"enabled": True, "config_enabled": False}},
        ),
    )
    harness, _ = make_proxy([fake.url], state_dir=state_dir)
    saved = json.loads(harness.ctx.state_path.read_text())
    assert saved.get("tenant_training", {}) == {}
    [dropped] = [
        r["payload"]
        for r in harness.ctx.audit.iter_records()
        if r["event"] == "tenant_training_switch_dropped"
    ]
    assert dropped["tenant"] == "ghost" and dropped["config_enabled"] is None
    assert dropped["reason"] == "the config no longer names the tenant"


def test_a_start_up_change_the_audit_log_cannot_record_is_logged_and_serving_goes_on(
    make_proxy, fake, tmp_path
):
    from structlog.testing import capture_logs

    from proxy.serving_state import ServingState, save_state

    state_dir = tmp_path / "damaged-audit-state"
    save_state(
        state_dir / "control" / "serving.json",
        ServingState(aliases={"policy": "base", "base": "base", "llama": "base"}),
    )
    audit_file = state_dir / "audit" / "audit.jsonl"
    audit_file.parent.mkdir(parents=True)
    audit_file.write_bytes(b'{"seq": 1, "damaged": true}\n')
    with capture_logs() as logs:
        harness, _ = make_proxy([fake.url], state_dir=state_dir, base_model_aliases=["base"])
    errors = [e for e in logs if e["event"] == "startup_change_not_audited"]
    assert len(errors) == 1 and errors[0]["audit_event"] == "alias_dropped"
    assert errors[0]["alias"] == "llama" and "not a valid audit record" in errors[0]["error"]
    answer = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=CHAT)
    assert answer.status_code == 200, answer.text


def test_the_policy_alias_cannot_be_a_base_alias():
    from proxy.config import ProxyConfig

    with pytest.raises(ValueError, match="policy_alias 'policy' is also in base_model_aliases"):
        ProxyConfig(base_model_aliases=["base", "policy"])


def test_proxies_configured_with_one_pseudonym_key_label_alike(make_proxy, fake, tmp_path):
    """Feedback may reach another proxy than its request: with one configured key their
    pseudonyms (and so the Kafka keys and joins) agree; without, each state dir has its own."""
    shared = "a-key-every-proxy-of-this-deployment-has"
    one, _ = make_proxy([fake.url], state_dir=tmp_path / "a", pseudonym_key=shared)
    two, _ = make_proxy([fake.url], state_dir=tmp_path / "b", pseudonym_key=shared)
    three, _ = make_proxy([fake.url], state_dir=tmp_path / "c")
    assert one.ctx.pseudonym_key == two.ctx.pseudonym_key == shared.encode()
    assert three.ctx.pseudonym_key not in (None, shared.encode())
    with pytest.raises(ValueError, match="16 characters or more"):
        ProxyConfig(pseudonym_key="short")


@pytest.mark.parametrize("drain_s", [0.0, 2.0])
def test_a_stop_cancels_requests_still_running_after_drain_s_and_records_them(
    make_proxy, fake, drain_s
):
    """aiohttp waited 60 s for requests in flight, `olp up` killed the proxy at 30 s, and
    a long stream's trajectory (with the sink's memory) was lost. What the drain cuts is
    counted `shutdown` (it was `client_disconnect`, as if the clients had left), and an
    unstreamed request that got no answer with status 503 (was 499)."""
    import threading

    fake.event_delay_s = 2.0  # a stream of about 30 s
    fake.whole_delay_s = 5.0  # past the drain
    harness, sink = make_proxy([fake.url], drain_s=drain_s)
    started = threading.Event()

    def unstreamed() -> None:
        headers = {"Authorization": f"Bearer {KEYS['bob']}"}
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(harness.base_url + "/v1/chat/completions", json=CHAT, headers=headers)

    def stream() -> None:
        headers = {"Authorization": f"Bearer {KEYS['alice']}"}
        body = {**CHAT, "stream": True}
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream(
                "POST", harness.base_url + "/v1/chat/completions", json=body, headers=headers
            ) as answer,
        ):
            for _ in answer.iter_bytes():
                started.set()

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    waiting = threading.Thread(target=unstreamed, daemon=True)
    waiting.start()
    assert started.wait(10)
    wait_for(lambda: len(fake.requests) == 2)
    began = time.monotonic()
    harness.call(harness._runner.cleanup(), timeout_s=30)
    took = time.monotonic() - began
    harness._runner = None
    harness.drain()
    # Not twice drain_s, as aiohttp's two waits of its shutdown timeout made it; and not
    # the whole stream for drain_s 0 (aiohttp reads a timeout of 0 as none).
    assert took < drain_s + 1.5, f"the stop waited {took:.1f} s with drain_s {drain_s}"
    [record] = sink.trajectories
    assert record["status"] == "aborted"
    value = harness.ctx.metrics.registry.get_sample_value
    for tenant in ("alice", "bob"):
        assert value("olp_proxy_errors_total", {"kind": "shutdown", "tenant": tenant}) == 1
        left = {"kind": "client_disconnect", "tenant": tenant}
        assert value("olp_proxy_errors_total", left) is None
    for tenant, streamed, status in (("alice", "true", "200"), ("bob", "false", "503")):
        series = {"endpoint": "chat.completions", "tenant": tenant, "policy_version": "base"}
        series |= {"stream": streamed, "status": status}
        assert value("olp_proxy_requests_total", series) == 1, tenant


def test_clients_that_leave_during_the_drain_are_departures_not_shutdown(make_proxy, fake):
    """Only what the drain itself cuts is `shutdown`: a client that closes its connection
    while the proxy drains left on its own (499 `client_disconnect`, as at any other time)."""
    fake.event_delay_s = 2.0  # a stream of about 30 s
    fake.whole_delay_s = 5.0
    harness, _ = make_proxy([fake.url], drain_s=20.0)

    def connected(stream: bool, key: str) -> socket.socket:
        body = json.dumps({**CHAT, "stream": stream}).encode()
        client = socket.create_connection(("127.0.0.1", harness.port))
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        client.sendall(head.encode() + body)
        return client

    clients = [connected(False, KEYS["bob"]), connected(True, KEYS["alice"])]
    wait_for(lambda: len(fake.requests) == 2)
    stop = asyncio.run_coroutine_threadsafe(harness._runner.cleanup(), harness.loop)
    wait_for(lambda: harness.ctx.drain_ends_at is not None)
    for client in clients:
        client.close()
    stop.result(30)
    harness._runner = None
    value = harness.ctx.metrics.registry.get_sample_value
    for tenant in ("alice", "bob"):
        left = {"kind": "client_disconnect", "tenant": tenant}
        assert value("olp_proxy_errors_total", left) == 1, tenant
        assert value("olp_proxy_errors_total", {"kind": "shutdown", "tenant": tenant}) is None
    series = {"endpoint": "chat.completions", "tenant": "bob", "policy_version": "base"}
    assert value("olp_proxy_requests_total", {**series, "stream": "false", "status": "499"}) == 1


def test_a_failure_after_a_whole_answer_keeps_the_connection(make_proxy, fake, monkeypatch):
    """The bookkeeping failed after the answer's end went out: re-raised (the response had
    started), aiohttp closed the keep-alive connection, and the client's next request on it
    met a reset."""
    import proxy.completions as completions

    count = completions.CompletionRelay._count_request
    failures = [RuntimeError("a bookkeeping bug")]

    def fails_once(self: Any, *args: Any) -> Any:
        if failures:
            raise failures.pop()
        return count(self, *args)

    monkeypatch.setattr(completions.CompletionRelay, "_count_request", fails_once)
    harness, _ = make_proxy([fake.url])
    headers = {"Authorization": f"Bearer {KEYS['bob']}"}
    with httpx.Client(timeout=30) as client:
        for _ in range(2):  # one connection
            answer = client.post(
                harness.base_url + "/v1/chat/completions", json=CHAT, headers=headers
            )
            assert answer.status_code == 200, answer.text
    assert not failures


def test_sse_comments_reach_captured_clients_as_they_come(make_proxy, fake):
    """A captured stream's events were re-read for their `data:` only: vLLM's keep-alive
    comments (`--sse-keep-alive-interval`) reached uncaptured clients and were dropped for
    captured ones."""
    fake.keep_alive = True
    harness, sink = make_proxy([fake.url])
    bodies = {}
    for tenant in ("alice", "bob"):  # captured, uncaptured
        answer = _post(
            harness.base_url,
            KEYS[tenant],
            "/v1/chat/completions",
            json={**CHAT, "stream": True},
        )
        assert answer.status_code == 200, answer.text
        bodies[tenant] = answer.content
    # One before each event upstream sent, the usage chunk the proxy asked for included
    # (the chunk is dropped, the comment before it is the client's as any other).
    sent = fake._events(True, {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert bodies["alice"].count(b": keep-alive\n\n") == len(sent)
    assert bodies["alice"] == bodies["bob"]
    harness.drain()
    assert len(sink.trajectories) == 1


def test_a_parsed_and_stripped_answer_is_written_as_vllm_writes_it(make_proxy):
    """An answer the byte strip cannot prove (JSON with spaces, a token `_ids`) is parsed:
    it was written back by msgspec, whose floats read `-0.000012` where vLLM's (Python's
    `json`) read `-1.2e-05`."""
    from tests.proxy.threaded_upstream import NotingUpstream

    answer = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": "base",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "user_ids é"},
                "logprobs": {
                    "content": [
                        {"token": "user", "logprob": -1.2e-05, "bytes": [], "top_logprobs": []},
                        {"token": "_ids", "logprob": -0.5, "bytes": [], "top_logprobs": []},
                    ]
                },
                "finish_reason": "stop",
                "token_ids": [5, 6],
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
        "prompt_token_ids": [1, 2, 3],
    }
    upstream = NotingUpstream({("POST", "/v1/chat/completions"): answer}).start()
    try:
        harness, _ = make_proxy([upstream.url])
        body = {**CHAT, "logprobs": True}  # the client's own logprobs: only ids are added
        got = _post(harness.base_url, KEYS["alice"], "/v1/chat/completions", json=body)
    finally:
        upstream.stop()
    assert got.status_code == 200, got.text
    assert b'"logprob":-1.2e-05' in got.content and "é" in got.content.decode()
    parsed = got.json()
    assert parsed["choices"][0]["token_ids"] is None and parsed["prompt_token_ids"] is None
    assert parsed["choices"][0]["logprobs"] == answer["choices"][0]["logprobs"]


class ErrorMidStream(FakeVllm):
    """vLLM's in-band error event (`json.dumps` with spaces and `\\u` escapes) after the
    first chunk of a stream."""

    ERROR = (
        b'data: {"error": {"message": "Request failed: g\\u00e9n\\u00e9rateur", '
        b'"type": "InternalServerError", "param": null, "code": 500}}\n\n'
    )

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(self._events(True, body)[0])
        await response.write(self.ERROR + b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def test_an_error_event_reaches_a_captured_client_as_vllm_wrote_it(make_proxy):
    """Parsed because the byte strip cannot prove it, the event was written back compact
    and with raw UTF-8, though the proxy had nothing to take out of it."""
    upstream = ErrorMidStream().start()
    try:
        harness, _ = make_proxy([upstream.url])
        got = _post(
            harness.base_url, KEYS["alice"], "/v1/chat/completions", json={**CHAT, "stream": True}
        )
    finally:
        upstream.stop()
    assert ErrorMidStream.ERROR in got.content


def test_a_stream_refused_for_its_body_is_counted_as_a_stream(make_proxy, fake):
    """`stream` was read after validation: a stream refused with a 400 counted as
    `stream="false"`, out of a stream error-rate panel."""
    harness, _ = make_proxy([fake.url])
    refused = _post(
        harness.base_url,
        KEYS["bob"],
        "/v1/chat/completions",
        json={**CHAT, "stream": True, "n": 0},
    )
    assert refused.status_code == 400, refused.text
    text = httpx.get(harness.base_url + "/metrics").text
    [line] = [
        line
        for line in text.splitlines()
        if line.startswith("olp_proxy_requests_total{") and 'status="400"' in line
    ]
    assert 'stream="true"' in line and line.endswith(" 1.0"), line
