"""Pure-logic units of the proxy: config, tenants, relay stripping, SSE, capture checks,
feedback validation, aliases, serving state. The real-stack tests cover the same features."""

from __future__ import annotations

import json
import pickle
import threading
from collections import Counter
from typing import Any

import pytest
from pydantic import ValidationError

from proxy.aliases import AliasTable
from proxy.capture import (
    _CAPTURE_FIELDS,
    _CONTEXT_FIELDS,
    SAMPLING_KEYS,
    CaptureContext,
    CaptureService,
    TrajectoryCapture,
    pack_capture,
    redact_record,
    sampling_of,
    unpack_capture,
)
from proxy.config import ProxyConfig, TenantConfig, sha256_hex
from proxy.errors import AuthError, ProxyError
from proxy.feedback import RecentTrajectories, TrajectoryOwner, check_owner, parse_feedback
from proxy.relay import (
    NestedTooDeeply,
    SSEParser,
    capture_refusal,
    ends_with_error_event,
    parse_json,
    plan_request,
    strip_chunk,
    strip_response,
    usage_of,
)
from proxy.routing import UpstreamPool
from proxy.serving_state import ServingState, load_state, save_state, switch_applies
from proxy.tenants import TenantRegistry, TokenBucket, opts_out_of_training
from proxy.validation import validate_completion_request
from replay.schemas import validate_trajectory
from safety.redaction import Redactor


def test_plaintext_keys_are_hashed_and_dropped():
    tenant = TenantConfig(name="t", api_key="secret-key")
    assert tenant.api_key_sha256 == sha256_hex("secret-key")
    assert "secret-key" not in tenant.model_dump_json()
    config = ProxyConfig(admin_key="adm")
    assert config.admin_key_sha256 == sha256_hex("adm")
    with pytest.raises(ValidationError, match="api_key_sha256"):
        TenantConfig(name="t", api_key_sha256="not-hex")
    with pytest.raises(ValidationError, match="without /v1"):
        ProxyConfig(upstreams=["http://h:1/v1"])
    with pytest.raises(ValidationError, match="extra"):
        ProxyConfig(unknown_key=1)


@pytest.mark.parametrize("field", ["serving_state", "records_dir"])
@pytest.mark.parametrize(
    "value, reason",
    [("/var/olp/serving.json", "absolute"), ("../elsewhere/serving.json", "'..'"), ("", "empty")],
)
def test_state_paths_stay_below_the_state_dir(field, value, reason):
    """`proxy.state.*` are paths below the state dir: an absolute serving_state made the
    state dir unknowable (state_dir_of indexed past the path's parents: the operator page
    answered 500, /admin/status showed no gates), and '..' wrote outside it."""
    with pytest.raises(ValidationError) as err:
        ProxyConfig(state={field: value})
    message = str(err.value)
    assert f"state.{field}" in message and reason in message, message
    assert ProxyConfig(state={field: "sub/dir/name.json"}).state.model_dump()[field] == (
        "sub/dir/name.json"
    )


def test_auth_and_training_opt_in():
    registry = TenantRegistry(
        [
            TenantConfig(name="on", api_key="k1", training_enabled=True),
            TenantConfig(name="off", api_key="k2"),
        ]
    )
    on = registry.authenticate("Bearer k1")
    off = registry.authenticate("bearer k2")
    assert (on.name, off.name) == ("on", "off")
    for header in (None, "", "Bearer", "Basic k1"):
        with pytest.raises(ProxyError) as err:
            registry.authenticate(header)
        assert err.value.status == 401 and err.value.code == "missing_api_key"
    with pytest.raises(ProxyError) as err:
        registry.authenticate("Bearer nope")
    assert err.value.code == "invalid_api_key"
    assert registry.wants_training(on, opts_out_of_training([])) is True
    assert registry.wants_training(on, opts_out_of_training(["0"])) is False
    assert registry.wants_training(off, opts_out_of_training(["1"])) is False  # never opts in
    assert registry.apply_overrides({"off": {"enabled": True, "config_enabled": False}}) == []
    assert registry.wants_training(off, opts_out_of_training([])) is True
    # A switch set while the config said otherwise than it says now is stale: not applied.
    stale = {"on": {"enabled": False, "config_enabled": False}}
    assert registry.apply_overrides(stale) == ["on"]
    assert registry.wants_training(on, opts_out_of_training([])) is True
    # A tenant the config no longer names: kept, the switch applied again to a new tenant
    # given the name, whatever its own `training_enabled` said.
    gone = {"removed": {"enabled": True, "config_enabled": False}}
    assert registry.apply_overrides(gone) == ["removed"]


@pytest.mark.parametrize(
    ("lines", "opts_out"),
    [
        *[([], False), ([""], False), ([" "], False), (["1"], False), (["TRUE"], False)],
        *[(["on"], False), (["1", "yes"], False), (["1,"], False)],
        *[(["0"], True), ([" 0 "], True), (["False"], True), (["no"], True), (["OFF"], True)],
        # A second line, or a list on one line (the same to HTTP): any off value opts out.
        *[(["1", "0"], True), (["1, 0"], True), (["0,1"], True), (["on", " off"], True)],
    ],
)
def test_train_header_values(lines, opts_out):
    assert opts_out_of_training(lines) is opts_out


@pytest.mark.parametrize("lines", [["never"], ["disabled"], ["2"], ["0, never"], ["1", "nein"]])
def test_train_header_that_is_neither_off_nor_on_is_refused(lines):
    with pytest.raises(ProxyError) as err:
        opts_out_of_training(lines)
    assert (err.value.status, err.value.code, err.value.param) == (
        400,
        "invalid_header",
        "X-OLP-Train",
    )
    value = [word.strip() for line in lines for word in line.split(",")][-1]
    assert repr(value) in err.value.message


def test_anonymous_only_without_required_auth():
    registry = TenantRegistry([TenantConfig(name="t", api_key="k")], require_auth=False)
    assert registry.authenticate(None).name == "anonymous"
    assert registry.wants_training(registry.authenticate(None), False) is False
    # The SDK's placeholder for a server that needs no key (it cannot send none).
    assert registry.authenticate("Bearer EMPTY").name == "anonymous"
    assert registry.authenticate("Bearer k").name == "t"
    with pytest.raises(AuthError):
        TenantRegistry([], require_auth=True).authenticate("Bearer EMPTY")


def test_rate_limit_and_concurrency():
    registry = TenantRegistry(
        [TenantConfig(name="t", api_key="k", requests_per_minute=2, max_concurrent=5)]
    )
    tenant = registry.authenticate("Bearer k")
    first = registry.admit(tenant)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    registry.admit(tenant).release()
    with pytest.raises(ProxyError) as err:
        registry.admit(tenant)
    assert err.value.status == 429
    assert int(err.value.headers["retry-after"]) >= 1
    assert err.value.headers["x-ratelimit-remaining-requests"] == "0"
    # Reset means "until the bucket is full" on a 429 too (it said "until the next one"):
    # two requests of a 2/minute bucket spent, so about 60 s, not 30.
    reset = float(err.value.headers["x-ratelimit-reset-requests"].removesuffix("s"))
    assert 59 < reset <= 60
    first.release()
    first.release()  # idempotent
    assert tenant.in_flight == 0
    busy = TenantRegistry(
        [TenantConfig(name="b", api_key="k", max_concurrent=1, requests_per_minute=0)]
    )
    b = busy.authenticate("Bearer k")
    slot = busy.admit(b)
    with pytest.raises(ProxyError, match="concurrent"):
        busy.admit(b)
    slot.release()
    busy.admit(b).release()


def test_token_bucket_refills():
    bucket = TokenBucket(60)
    now = bucket.updated
    for _ in range(60):
        assert bucket.take(now) == 0
    assert bucket.take(now) == pytest.approx(1.0)
    assert bucket.take(now + 1.0) == 0


def test_plan_adds_only_what_is_missing():
    body = {"model": "policy", "messages": [], "stream": True}
    plan = plan_request("chat.completions", body, "policy-v3", capture=True)
    sent = plan.upstream_body
    assert sent["model"] == "policy-v3" and body["model"] == "policy"
    assert sent["logprobs"] is True and sent["return_token_ids"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert plan.added_logprobs and plan.added_token_ids and plan.added_usage
    own = {
        "model": "p",
        "prompt": "x",
        "logprobs": 2,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    plan = plan_request("completions", own, "base", capture=True)
    assert not plan.augmented and plan.upstream_body["logprobs"] == 2
    plan = plan_request("chat.completions", body, "base", capture=False)
    assert plan.upstream_body == {**body, "model": "base"} and not plan.augmented


def test_completions_echo_is_never_captured():
    """The capture's `logprobs: 0` would make vLLM compute prompt logprobs for an echo, and
    its `return_token_ids` would empty the echoed prompt text."""
    echo = {"model": "m", "prompt": "x", "echo": True}
    assert capture_refusal("completions", echo) == "echo"
    assert capture_refusal("completions", {**echo, "echo": False}) is None
    assert capture_refusal("completions", {"model": "m", "prompt": "x"}) is None
    assert capture_refusal("chat.completions", {"model": "m", "messages": []}) is None


def test_strip_restores_what_vllm_sends_unasked():
    plan = plan_request("chat.completions", {"model": "m", "messages": []}, "base", True)
    payload = {
        "prompt_token_ids": [1, 2],
        "choices": [
            {
                "index": 0,
                "message": {"content": "hi"},
                "logprobs": {"content": []},
                "token_ids": [5],
            }
        ],
        "usage": {"prompt_tokens": 2},
    }
    out = strip_response(plan, payload)
    assert out["prompt_token_ids"] is None
    assert out["choices"][0]["logprobs"] is None and out["choices"][0]["token_ids"] is None
    assert payload["prompt_token_ids"] == [1, 2]  # the capture keeps its copy


def test_strip_chunk_drops_usage_and_empty_chunks():
    plan = plan_request(
        "chat.completions", {"model": "m", "messages": [], "stream": True}, "base", True
    )
    usage_only = {"choices": [], "usage": {"prompt_tokens": 1}}
    assert strip_chunk(plan, usage_only) is None
    empty = {
        "choices": [
            {
                "index": 0,
                "delta": {},
                "logprobs": {"content": [{"logprob": -1}]},
                "finish_reason": None,
                "token_ids": [7],
            }
        ]
    }
    assert strip_chunk(plan, empty) is None
    tool = {
        "choices": [
            {
                "index": 0,
                "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": [8],
            }
        ]
    }
    kept = strip_chunk(plan, tool)
    assert kept["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == "{"
    assert kept["choices"][0]["token_ids"] is None
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "token_ids": []}]}
    assert strip_chunk(plan, final)["choices"][0]["finish_reason"] == "stop"
    # Text held back (a partial UTF-8 character, a stop string): vLLM sends this chunk
    # whether or not token ids were asked for, so the client gets it.
    held_back = {
        "choices": [
            {
                "index": 0,
                "delta": {"content": ""},
                "logprobs": {"content": [{"logprob": -1}]},
                "finish_reason": None,
                "token_ids": [9],
            }
        ]
    }
    kept = strip_chunk(plan, held_back)
    assert kept["choices"] == [
        {
            "index": 0,
            "delta": {"content": ""},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": None,
        }
    ]
    # The client asked for token ids itself: vLLM sends the empty delta for them anyway.
    own_ids = plan_request(
        "chat.completions",
        {"model": "m", "messages": [], "stream": True, "return_token_ids": True},
        "base",
        True,
    )
    assert strip_chunk(own_ids, empty)["choices"][0]["token_ids"] == [7]
    completions = plan_request("completions", {"model": "m", "stream": True}, "base", True)
    empty_text = {
        "choices": [{"index": 0, "text": "", "logprobs": {"tokens": ["\ufffd"]}, "token_ids": [9]}]
    }
    assert strip_chunk(completions, empty_text)["choices"][0]["text"] == ""
    client_usage = plan_request(
        "chat.completions",
        {"model": "m", "messages": [], "stream": True, "stream_options": {"include_usage": True}},
        "base",
        True,
    )
    assert strip_chunk(client_usage, usage_only) == usage_only


def test_sse_parser_handles_split_events_and_crlf():
    parser = SSEParser()
    assert list(parser.feed(b'data: {"a":')) == []
    assert list(parser.feed(b"1}\r\n\r\ndata: [DONE]\n\n")) == [b'{"a":1}', b"[DONE]"]
    assert list(parser.feed(b": keep-alive comment\n\n")) == []
    assert parser.rest() == b""


def test_sse_parser_joins_multi_line_data_and_skips_events_without_data():
    parser = SSEParser()
    events = list(parser.feed(b"event: x\ndata: a\ndata:  b\n\nid: 3\n\ndata:c\n\ndata: d"))
    assert events == [b"a\nb", b"c"]
    assert parser.rest() == b"data: d"


def test_strip_chunk_in_place_edits_the_chunk_like_the_copy():
    plan = plan_request(
        "chat.completions", {"model": "m", "messages": [], "stream": True}, "base", True
    )
    chunk = {
        "prompt_token_ids": [1, 2],
        "choices": [
            {"index": 0, "delta": {"content": "x"}, "logprobs": {"content": []}, "token_ids": [5]}
        ],
    }
    copy = strip_chunk(plan, json.loads(json.dumps(chunk)))
    ids = chunk["prompt_token_ids"]
    assert strip_chunk(plan, chunk, in_place=True) == copy
    assert chunk == copy and ids == [1, 2]  # values are replaced, never mutated


def test_parse_json_round_trips_what_only_the_json_module_reads():
    obj, encode = parse_json(b'{"a":[1,2.5,"\\u00e9"],"b":null}')
    assert obj == {"a": [1, 2.5, "é"], "b": None}
    assert json.loads(encode(obj)) == obj
    obj, encode = parse_json(b'{"logprob":-Infinity}', allow_nonfinite=True)  # upstream data
    assert obj["logprob"] == float("-inf")
    assert encode(obj) == b'{"logprob":-Infinity}'
    with pytest.raises(ValueError):  # a client's body (tests/proxy/test_json_nonfinite.py)
        parse_json(b'{"logprob":-Infinity}')
    obj, encode = parse_json(b'{"s":"\\ud800x","n":123456789012345678901234567890}')
    assert obj["s"] == "\ud800x"  # a lone surrogate: UTF-8 cannot carry it, the escape can
    assert json.loads(encode(obj)) == obj
    with pytest.raises(ValueError):
        parse_json(b'{"a":')


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_json_nested_too_deeply_is_a_value_error(depth: int):
    """msgspec and `json` both raise RecursionError (no ValueError) on deep nesting."""
    deep = b'{"usage":' + b"[" * depth + b"]" * depth + b"}"
    with pytest.raises(NestedTooDeeply):
        parse_json(deep)
    with pytest.raises(ValueError):
        usage_of(deep)


def _capture(endpoint="chat.completions") -> TrajectoryCapture:
    return TrajectoryCapture(
        CaptureContext(
            trajectory_id="t1",
            request_id="r1",
            session_id="s1",
            tenant_hash=sha256_hex("x"),
            user_hash=None,
            endpoint=endpoint,
            model_alias="policy",
            policy_version="policy-v2",
            group_id=None,
            task=None,
            request_body={
                "model": "policy",
                "messages": [{"role": "user", "content": "mail me at jane.doe@example.com"}],
            },
            sampling={"temperature": 1.0},
        )
    )


def _chunk(index, ids, logprobs, content=None, tool=None, finish=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if tool is not None:
        delta["tool_calls"] = [tool]
    return {
        "choices": [
            {
                "index": index,
                "delta": delta,
                "finish_reason": finish,
                "token_ids": ids,
                "logprobs": {"content": [{"logprob": lp} for lp in logprobs]},
            }
        ]
    }


def test_capture_merges_stream_and_tool_call_fragments():
    capture = _capture()
    capture.add_chunk(
        {
            "prompt_token_ids": [1, 2, 3],
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
    )
    capture.add_chunk(
        _chunk(
            0,
            [10],
            [-0.5],
            tool={
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            },
        )
    )
    capture.add_chunk(
        _chunk(0, [11, 12], [-0.1, -0.2], tool={"index": 0, "function": {"arguments": '{"city": '}})
    )
    capture.add_chunk(
        _chunk(
            0,
            [13],
            [-0.3],
            tool={"index": 0, "function": {"arguments": '"Paris"}'}},
            finish="tool_calls",
        )
    )
    capture.add_chunk(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    )
    record = capture.build("ok")
    validate_trajectory(record)
    [choice] = record["choices"]
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        }
    ]
    assert choice["token_ids"] == [10, 11, 12, 13]
    assert choice["logprobs"] == [-0.5, -0.1, -0.2, -0.3]
    assert record["trainable"] is True and record["flags"] == []


def test_a_capture_crosses_to_the_worker_as_raw_request_bytes():
    """What the proxy hands KafkaSinkProcess (`pack_capture`) carries the client's body once,
    as the bytes it came in, and the worker's copy builds the same record; so does the
    pickle a capture that MessagePack cannot hold falls back to."""
    raw = json.dumps(
        {"model": "policy", "messages": [{"role": "user", "content": "unique-marker " * 50}]}
    ).encode()
    capture = _capture()
    capture.context.request_body, _ = parse_json(raw)
    capture.context.request_raw = raw
    capture.add_sse(b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":0}}\n\n')
    packed = pack_capture(capture)
    pickled = pickle.dumps(capture, protocol=pickle.HIGHEST_PROTOCOL)
    assert packed[:1] == b"m"  # MessagePack, not the pickle
    for data in (packed, pickled):
        assert data.count(b"unique-marker") == 50  # the raw bytes only, not the dict as well
    records = [c.build("ok") for c in (capture, unpack_capture(packed), pickle.loads(pickled))]
    for record in records:
        record.pop("event_id")
        record.pop("timings")
    assert records[1] == records[0] and records[2] == records[0]
    assert capture.context.request_body is not None  # the proxy's own object is untouched
    without_raw = _capture()
    assert pickle.loads(pickle.dumps(without_raw)).context.request_body == (
        without_raw.context.request_body
    )
    assert unpack_capture(pack_capture(without_raw)).context.request_body == (
        without_raw.context.request_body
    )


def test_a_packed_capture_keeps_every_attribute_in_its_place():
    """`pack_capture` writes the context's and the capture's values by position: each
    crosses, and in its own place (a distinct value in every field of its usual type)."""
    capture = _capture()
    context = capture.context
    context.request_raw = json.dumps(context.request_body).encode()
    values: dict[str, Any] = {
        "trajectory_id": "t-0",
        "request_id": "r-1",
        "session_id": "s-2",
        "tenant_hash": "a" * 64,
        "user_hash": "b" * 64,
        "endpoint": "completions",
        "model_alias": "alias-6",
        "policy_version": "policy-v7",
        "group_id": "g-8",
        "task": "task-9",
        "sampling": {"temperature": 0.5, "stop": ["x"]},
        "created_at": 1_700_000_000.25,
        "started": 12.5,
    }
    assert set(values) | {"request_raw"} == set(_CONTEXT_FIELDS)
    for name, value in values.items():
        setattr(context, name, value)
    capture.prompt_token_ids = [1, 2]
    capture.usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    capture.ttft_s = 0.125
    capture.finished_at = 13.75
    capture.unparsable = 4
    capture.add_sse(b"data: {}\n\n")
    capture.add_raw_response(b'{"choices": []}')
    packed = pack_capture(capture)
    assert packed[:1] == b"m"
    copy = unpack_capture(packed)
    for name in (*_CONTEXT_FIELDS, "request_body"):
        assert getattr(copy.context, name) == getattr(context, name), name
    for name in _CAPTURE_FIELDS:
        assert getattr(copy, name) == getattr(capture, name), name
    assert type(copy.context.request_raw) is bytes and type(copy._raw_response) is bytes


def test_a_packed_capture_larger_than_its_first_buffer_crosses_whole():
    """`pack_capture` sizes its buffer for the raw request and answer: a stream's events,
    which it does not count, and a long context grow it, and all of it crosses."""
    capture = _capture()
    context = capture.context
    context.request_body = {"model": "m", "messages": [{"role": "user", "content": "é" * 50_000}]}
    context.request_raw = json.dumps(context.request_body).encode()
    context.task = "t" * 5_000
    blocks = [
        b'data: {"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(3_000)
    ]
    for block in blocks:
        capture.add_sse(block)
    packed = pack_capture(capture)
    assert packed[:1] == b"m" and len(packed) > sum(map(len, blocks)) + 50_000
    copy = unpack_capture(packed)
    assert copy._raw_sse == blocks and copy.context.task == context.task
    assert copy.context.request_body == context.request_body


@pytest.mark.parametrize("case", ["lone_surrogate", "huge_int", "parsed_choice"])
def test_a_capture_msgpack_cannot_hold_crosses_pickled(case: str):
    """A lone surrogate (JSON's `\\ud800` parses to one), an integer over 64 bits or a
    choice already parsed: MessagePack cannot hold them, the capture crosses as a pickle,
    and the copy is the same."""
    capture = _capture()
    if case == "lone_surrogate":
        capture.context.model_alias = "model-\ud800"
    elif case == "huge_int":
        capture.context.sampling = {"seed": 2**70}
    else:
        capture.add_chunk(_chunk(0, [10], [-0.5], content="hi", finish="stop"))
    packed = pack_capture(capture)
    assert packed[:1] == b"p"
    copy = unpack_capture(packed)
    assert copy.context.model_alias == capture.context.model_alias
    assert copy.context.sampling == capture.context.sampling
    assert copy.choices.keys() == capture.choices.keys()
    with pytest.raises(ValueError, match="not a packed capture"):
        unpack_capture(b"x" + packed[1:])


def test_a_pickled_capture_keeps_every_attribute():
    """`TrajectoryCapture.__reduce__` sends tuples of values, read field by field: each
    field of the context and of the capture crosses, and in its own place."""
    capture = _capture()
    context = capture.context
    # A distinct value in every field, so that two swapped fields cannot go unnoticed.
    for index, name in enumerate(_CONTEXT_FIELDS):
        setattr(context, name, f"context-{index}")
    context.request_raw = json.dumps(context.request_body).encode()
    for index, name in enumerate(_CAPTURE_FIELDS):
        setattr(capture, name, f"capture-{index}")
    assert set(_CONTEXT_FIELDS) | {"request_body"} == set(CaptureContext.__struct_fields__)
    # `_sampled` is made by `build`, in the process that builds: it never crosses.
    built_there = {"context", "_sampled"}
    assert set(_CAPTURE_FIELDS) | built_there == set(TrajectoryCapture.__struct_fields__)
    copy = pickle.loads(pickle.dumps(capture, protocol=pickle.HIGHEST_PROTOCOL))
    for name in (*_CONTEXT_FIELDS, "request_body"):
        assert getattr(copy.context, name) == getattr(context, name), name
    for name in _CAPTURE_FIELDS:
        assert getattr(copy, name) == getattr(capture, name), name
    alone = pickle.loads(pickle.dumps(context))  # a context pickled on its own
    assert all(getattr(alone, name) == getattr(context, name) for name in context.__struct_fields__)
    with pytest.raises(AttributeError):  # nothing outside the fields, which all cross
        capture.extra = "lost"  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        context.extra = "lost"  # type: ignore[attr-defined]


def test_capture_flags_disagreeing_counts_and_aborts():
    capture = _capture()
    capture.add_chunk({"prompt_token_ids": [1, 2], "choices": []})
    capture.add_chunk(_chunk(0, [10, 11], [-0.5], content="hi", finish="stop"))
    capture.add_chunk(
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}}
    )
    record = capture.build("ok")
    validate_trajectory(record)
    assert record["trainable"] is False
    assert set(record["flags"]) == {
        "logprob_count_mismatch",
        "token_count_mismatch",
        "prompt_token_count_mismatch",
    }
    aborted = _capture()
    aborted.add_chunk({"prompt_token_ids": [1], "choices": []})
    aborted.add_chunk(_chunk(0, [10], [-0.5], content="h"))
    record = aborted.build("aborted")
    validate_trajectory(record)
    assert record["status"] == "aborted" and not record["trainable"]
    assert "aborted" in record["flags"] and "missing_usage" in record["flags"]


# A whole chat response of one token, consistent in every count.
ONE_TOKEN_RESPONSE = {
    "prompt_token_ids": [1, 2],
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "ok"},
            "finish_reason": "stop",
            "token_ids": [9],
            "logprobs": {"content": [{"logprob": -0.1}]},
        }
    ],
    "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
}


def test_capture_flags_beam_search():
    capture = _capture()
    capture.context.sampling = {"use_beam_search": True, "n": 2}
    capture.add_response(ONE_TOKEN_RESPONSE)
    record = capture.build("ok")
    validate_trajectory(record)
    assert record["flags"] == ["beam_search"] and record["trainable"] is False
    capture.context.sampling = {"use_beam_search": False}
    assert capture.check("ok") == []


@pytest.mark.parametrize("endpoint", ["chat.completions", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_record_without_given_sampling_reads_what_was_sent_upstream(endpoint, stream):
    """The proxy leaves `sampling` out of the context and the record reads it from the
    client's body when it is built (in the sink's worker): that holds only while the plan
    never changes a sampling field, which this checks for every one of them."""
    every = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "max_tokens": 16,
        "max_completion_tokens": 16,
        "stop": ["\n"],
        "stop_token_ids": [2],
        "seed": 7,
        "n": 2,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logit_bias": {"5": -1},
        "ignore_eos": False,
        "min_tokens": 1,
        "best_of": 2,
        "use_beam_search": False,
    }
    assert set(every) == set(SAMPLING_KEYS)
    text = {"messages": [{"role": "user", "content": "hi"}]}
    if endpoint == "completions":
        text = {"prompt": "hi"}
    body = {"model": "policy", **text, "stream": stream, **every}
    plan = plan_request(endpoint, body, "policy-v2", capture=True)
    assert plan.augmented
    capture = _capture(endpoint)
    capture.context.request_body, capture.context.sampling = body, None
    assert capture.context.sampling_params() == sampling_of(plan.upstream_body) == every
    # And in a worker: a context pickled with the raw body parses it and reads the same.
    capture.context.request_raw = json.dumps(body).encode()
    capture.context.sampling = None
    unpickled = pickle.loads(pickle.dumps(capture))
    assert unpickled.context.sampling is None
    assert unpickled.context.sampling_params() == every


@pytest.mark.parametrize("count", ["abc", "2", 2.0, True, -1, None])
def test_usage_counts_that_are_not_counts_are_flagged_not_fatal(count: Any):
    """`int("abc")` failed the whole build: the record was lost and the text went into the
    log's traceback. It is kept, flagged, its usage counted 0."""
    capture = _capture()
    response = json.loads(json.dumps(ONE_TOKEN_RESPONSE))
    response["usage"]["prompt_tokens"] = count
    capture.add_raw_response(json.dumps(response).encode())
    record = capture.build("ok")
    validate_trajectory(record)
    assert record["usage"]["prompt_tokens"] == 0
    assert record["trainable"] is False
    assert "abc" not in json.dumps(record)
    assert "missing_usage" in record["flags"]


def test_redaction_drops_token_ids_of_records_with_secrets():
    capture = _capture()
    capture.add_response(ONE_TOKEN_RESPONSE)
    record = redact_record(capture.build("ok"), Redactor().redact_obj)
    validate_trajectory(record)
    assert "jane.doe@example.com" not in json.dumps(record)
    assert sum(record["redactions"].values()) == 1
    assert record["prompt_token_ids"] == [] and record["choices"][0]["token_ids"] == []
    assert record["trainable"] is False and "redacted" in record["flags"]


def test_feedback_validation_and_ownership():
    ok = parse_feedback({"trajectory_id": "t", "kind": "score", "value": 0.5}, 1024)
    assert ok.value == 0.5 and ok.choice_index == 0
    bad = [
        ([], "JSON object"),
        ({"kind": "accept"}, "trajectory_id"),
        ({"trajectory_id": "t", "kind": "love"}, "kind"),
        ({"trajectory_id": "t", "kind": ["accept"]}, "kind"),  # unhashable: was a 500
        ({"trajectory_id": "t", "kind": {}}, "kind"),
        ({"trajectory_id": "t", "kind": "score"}, "value"),
        # Accepted before, then counted as invalid by the learner: pass or fail is the value.
        ({"trajectory_id": "t", "kind": "test_result"}, "value"),
        ({"trajectory_id": "t", "kind": "accept", "value": "1"}, "value"),
        ({"trajectory_id": "t", "kind": "accept", "value": True}, "value"),
        ({"trajectory_id": "t", "kind": "accept", "metadata": []}, "metadata"),
        ({"trajectory_id": "t", "kind": "accept", "choice_index": -1}, "choice_index"),
        ({"trajectory_id": "t", "kind": "accept", "extra": 1}, "extra"),
        ({"trajectory_id": "t", "kind": "accept", "metadata": {"x": "y" * 2000}}, "metadata"),
        # An int too large for a float; then what the sink's strict JSON would refuse
        # after the client got its 202.
        ({"trajectory_id": "t", "kind": "score", "value": 10**400}, "value"),
        ({"trajectory_id": "t", "kind": "score", "value": float("nan")}, "value"),
        ({"trajectory_id": "t", "kind": "accept", "metadata": {"x": float("nan")}}, "metadata"),
        ({"trajectory_id": "\ud800", "kind": "accept"}, "trajectory_id"),
    ]
    for body, needle in bad:
        with pytest.raises(ProxyError, match=needle) as err:
            parse_feedback(body, 1024)
        assert err.value.status == 400
    recent = RecentTrajectories(capacity=2)
    recent.add("a", "tenant-1", "s-a")
    assert (
        check_owner(
            recent, parse_feedback({"trajectory_id": "a", "kind": "accept"}, 64), "tenant-1"
        )
        == "s-a"
    )
    with pytest.raises(ProxyError) as err:
        check_owner(recent, parse_feedback({"trajectory_id": "a", "kind": "accept"}, 64), "t-2")
    assert err.value.status == 403
    recent.add("b", "t", "s", choices=3)
    for index, status in ((2, None), (3, 400)):
        body = {"trajectory_id": "b", "kind": "accept", "choice_index": index}
        if status is None:
            assert check_owner(recent, parse_feedback(body, 64), "t") == "s"
        else:
            with pytest.raises(ProxyError, match="out of range") as err:
                check_owner(recent, parse_feedback(body, 64), "t")
            assert err.value.status == status
    recent.add("c", "t", "s")
    assert recent.get("a") is None and len(recent) == 2  # bounded
    assert recent.get("b") == TrajectoryOwner("t", "s", choices=3)


def test_request_validation_messages():
    cases = [
        ("chat.completions", {"model": "m"}, "messages"),
        ("chat.completions", {"model": "m", "messages": [{"content": "x"}]}, "messages\\[0\\]"),
        ("chat.completions", {"model": "m", "messages": [{"role": "user"}] * 3}, "Too many"),
        (
            "chat.completions",
            {"model": "m", "messages": [{"role": "user"}], "temperature": "hot"},
            "temperature",
        ),
        ("chat.completions", {"model": "m", "messages": [{"role": "user"}], "n": 0}, "'n'"),
        ("completions", {"model": "m", "prompt": 5}, "prompt"),
        ("completions", {"prompt": "x"}, "model"),
        ("completions", {"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
    ]
    for endpoint, body, needle in cases:
        with pytest.raises(ProxyError, match=needle):
            validate_completion_request(endpoint, body, max_messages=2, max_choices=4)


def test_alias_table_swaps_whole_snapshots():
    table = AliasTable({"policy": "base", "base": "base"})
    before = table.snapshot()
    assert table.set("policy", "policy-v1") == "base"
    assert before["policy"] == "base" and table.resolve("policy") == "policy-v1"
    with pytest.raises(TypeError):
        table.snapshot()["policy"] = "x"  # type: ignore[index]
    with pytest.raises(ValueError):
        table.set("policy", "")


def test_serving_state_round_trip(tmp_path):
    path = tmp_path / "control" / "serving.json"
    switch = {"enabled": True, "config_enabled": False}
    state = ServingState(
        aliases={"policy": "policy-v2"}, frozen=True, tenant_training={"a": dict(switch)}
    )
    state.record("flip", "ops", alias="policy", target="policy-v2", previous="base")
    save_state(path, state)
    loaded = load_state(path, {"policy": "base", "base": "base"})
    assert loaded.aliases == {"policy": "policy-v2", "base": "base"}
    assert loaded.frozen and loaded.tenant_training == {"a": switch}
    assert loaded.history[0]["actor"] == "ops"
    assert [p.name for p in path.parent.iterdir()] == ["serving.json"]
    path.write_text("{nope")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_state(path, {})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frozen", "false"),
        ("learning_frozen", 0),
        ("tenant_training", {"bob": "false"}),
        ("tenant_training", {"bob": {"enabled": "0"}}),
        ("tenant_training", {"bob": {"enabled": True, "config_enabled": "no"}}),
    ],
)
def test_serving_state_flags_must_be_json_booleans(tmp_path, field, value):
    """`bool("false")` is True: a hand-edited "false" froze serving or trained a tenant."""
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"state_version": 1, "aliases": {}, field: value}))
    with pytest.raises(ValueError, match=f"serving state {path}: .*{field}"):
        load_state(path, {})


def test_a_training_switch_of_the_earlier_format_still_applies(tmp_path):
    path = tmp_path / "serving.json"
    path.write_text(json.dumps({"state_version": 1, "tenant_training": {"bob": True}}))
    switch = load_state(path, {}).tenant_training["bob"]
    assert switch == {"enabled": True, "config_enabled": None}
    assert switch_applies(switch, False) and switch_applies(switch, True)
    assert not switch_applies({"enabled": True, "config_enabled": False}, True)


def test_keys_and_session_ids_that_are_not_utf8_never_raise():
    """aiohttp decodes header bytes that are not UTF-8 to lone surrogates."""
    from proxy.aliases import routing_fraction
    from proxy.operator_auth import key_matches

    assert sha256_hex("\udcff") != sha256_hex("\ufffd")
    registry = TenantRegistry([TenantConfig(name="a", api_key="k")])
    with pytest.raises(ProxyError) as err:
        registry.authenticate("Bearer \udcff\udcfe")
    assert (err.value.status, err.value.code) == (401, "invalid_api_key")
    assert not key_matches((sha256_hex("k"),), "\udcff")
    assert 0 <= routing_fraction("s\udcff") < 1
    assert len(UpstreamPool(["http://a:1"]).order("s\udcff")) == 1


def test_canary_share_that_is_no_float_is_a_400():
    from proxy.admin import _share

    assert _share(0.25) == 0.25
    for bad in (10**400, float("inf"), True, "0.5", 1):
        with pytest.raises(ProxyError) as err:
            _share(bad)
        assert err.value.status == 400 and err.value.param == "share"


def test_session_sticky_replica_order():
    pool = UpstreamPool(["http://a:1", "http://b:1", "http://c:1"])
    first = [r.url for r in pool.order("session-42")]
    assert all([r.url for r in pool.order("session-42")] == first for _ in range(5))
    starts = {pool.order(f"s{i}")[0].url for i in range(50)}
    assert starts == {"http://a:1", "http://b:1", "http://c:1"}
    pool._mark_down(pool.replicas[[r.url for r in pool.replicas].index(first[0])], "test")
    assert pool.order("session-42")[-1].url == first[0]  # a failed replica goes last


def test_a_replica_failing_in_a_row_stays_down_longer_until_it_answers(monkeypatch):
    """With the same 5 s each time, a dead replica took traffic again every 5 s, each of
    those requests waiting its connect or read timeout."""
    from proxy import routing

    clock = [1000.0]
    monkeypatch.setattr(routing.time, "monotonic", lambda: clock[0])
    pool = UpstreamPool(["http://a:1", "http://b:1"], down_for_s=5.0)
    replica = pool.replicas[0]
    downs = []
    for _ in range(6):
        pool._mark_down(replica, "test")
        downs.append(replica.down_until - clock[0])
    assert downs == [5.0, 10.0, 20.0, 40.0, routing.MAX_DOWN_S, routing.MAX_DOWN_S]


def test_a_down_replicas_share_spreads_over_the_others():
    """Rotated from a start point, every request (and every session) of a down replica went
    to the one after it in the list, which took twice its share."""
    pool = UpstreamPool(["http://a:1", "http://b:1", "http://c:1"])
    sessions = [f"s{i}" for i in range(600)]
    first = {s: pool.order(s)[0].url for s in sessions}
    pool._mark_down(pool.replicas[0], "test")
    now = {s: pool.order(s)[0].url for s in sessions}
    moved = Counter(now[s] for s in sessions if first[s] == "http://a:1")
    assert set(moved) == {"http://b:1", "http://c:1"} and min(moved.values()) > 50
    # Sessions on the healthy replicas stay where they were (their prefix caches).
    assert all(now[s] == first[s] for s in sessions if first[s] != "http://a:1")
    turns = Counter(pool.order(None)[0].url for _ in range(300))
    assert turns == {"http://b:1": 150, "http://c:1": 150}
    assert [r.url for r in pool.order(None)][-1] == "http://a:1"  # tried last
    twice = UpstreamPool(["http://a:1", "http://a:1"])  # a URL listed twice: two replicas
    assert len({id(twice.order(f"s{i}")[0]) for i in range(50)}) == 2


class _Lineage:
    """The serving state and alias table `_rollback_target` reads, changed as the admin API
    would change them."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.state = ServingState(aliases={"policy": "base"})
        self.aliases = AliasTable({"policy": "base"})
        self.ctx = SimpleNamespace(state=self.state, config=ProxyConfig(), aliases=self.aliases)

    def change(self, kind: str, target: str) -> None:
        previous = self.aliases.set("policy", target)
        self.state.record(kind, "ops", alias="policy", target=target, previous=previous)

    def target(self) -> str:
        from proxy.admin import _rollback_target, rollback_target

        found = _rollback_target(self.ctx, "policy")
        assert rollback_target(self.ctx, "policy") == found
        return found


def test_rollback_walks_back_the_lineage_skipping_rolled_back_versions():
    lineage = _Lineage()
    for version in ("policy-v1", "policy-v2", "policy-v3"):
        lineage.change("flip", version)
    assert lineage.target() == "policy-v2"
    lineage.change("rollback", "policy-v2")
    assert lineage.target() == "policy-v1"
    lineage.change("rollback", "policy-v1")
    assert lineage.target() == "base"
    lineage.change("rollback", "base")
    with pytest.raises(ProxyError) as err:
        lineage.target()
    assert err.value.status == 409


def test_rollback_after_a_new_version_returns_to_what_served_before_it():
    # Back one version, then a new one: rollback returns to the version it replaced.
    lineage = _Lineage()
    for version in ("policy-v1", "policy-v2", "policy-v3"):
        lineage.change("flip", version)
    lineage.change("rollback", "policy-v2")
    lineage.change("flip", "policy-v4")
    assert lineage.target() == "policy-v2"
    # Back over several versions at once: none of those skipped is a target again (the
    # old rule marked only the version rolled back from, and answered policy-v3 here).
    lineage = _Lineage()
    for version in ("policy-v1", "policy-v2", "policy-v3", "policy-v4"):
        lineage.change("flip", version)
    lineage.change("rollback", "policy-v1")
    lineage.change("flip", "policy-v5")
    assert lineage.target() == "policy-v1"
    lineage.change("rollback", "policy-v1")
    assert lineage.target() == "base"
    # A rollback to a version that never served (loaded by hand) is undone by the next.
    lineage.change("rollback", "policy-v9")
    assert lineage.target() == "policy-v1"


def test_compacted_history_keeps_every_lineage_and_version_name():
    """History grew by every admin change for ever, and each change copied, rewrote and
    fsynced all of it on the event loop (50k entries: 0.9 s with no request served). Past
    twice the kept count the older entries fold into one, which keeps what they decide:
    each alias's lineage (what rollbacks read) and every version name (never reused)."""
    import random

    from proxy.serving_state import alias_lineage

    rng = random.Random(7)
    full = ServingState(aliases={"policy": "base", "other": "base"})
    compacting = ServingState(aliases=dict(full.aliases))
    served = {"policy": "base", "other": "base"}
    for number in range(1, 400):
        alias = rng.choice(["policy", "policy", "other"])
        lineage = alias_lineage(full.history, alias, "base")
        if rng.random() < 0.3 and len(lineage) > 1:
            kind, target = "rollback", rng.choice(lineage[:-1])
        else:
            kind, target = "flip", rng.choice([f"policy-v{number}", "base"])
        for state in (full, compacting):
            state.record(kind, "ops", alias=alias, target=target, previous=served[alias])
            state.record("freeze", "ops", learning=False)  # entries that decide nothing
        served[alias] = target
        compacting.compact_history("base", keep=10)
        assert len(compacting.history) <= 21
        for name in ("policy", "other"):
            assert alias_lineage(compacting.history, name, "base") == alias_lineage(
                full.history, name, "base"
            )
    [folded] = [e for e in compacting.history if e["kind"] == "compacted"]
    named = {e["target"] for e in full.history if str(e.get("target", "")).startswith("policy-v")}
    kept = {e["target"] for e in compacting.history if "target" in e}
    assert set(folded["versions"]) | kept >= named
    assert folded["entries"] + len(compacting.history) - 1 == len(full.history)
    # The base model's served name changed since: the lineage starts from the new one.
    assert alias_lineage(compacting.history, "policy", "qwen")[0] == "qwen"


def test_the_base_model_under_an_earlier_served_name_is_the_base_in_a_lineage():
    """After `policy.served_model_name` changed from m1 to m2, a rollback to the base
    recorded as `m1` counted as a version: a plain rollback from policy-v2 went to `m1`,
    which nothing serves (409 not_loaded), where it should serve the base, now `m2`."""
    from proxy.serving_state import alias_lineage

    state = ServingState(aliases={"policy": "m1"})
    state.record("flip", "ops", alias="policy", target="policy-v1", previous="m1")
    state.record("rollback", "ops", alias="policy", target="m1", previous="policy-v1")
    state.record("flip", "ops", alias="policy", target="policy-v2", previous="m1")
    assert alias_lineage(state.history, "policy", "m1") == ["m1", "policy-v2"]
    assert alias_lineage(state.history, "policy", "m2") == ["m2", "policy-v2"]
    # A folded history that kept the old name in its lineage reads the same way.
    state.record("flip", "ops", alias="policy", target="m1", previous="policy-v2")
    state.compact_history("m1", keep=0)
    assert alias_lineage(state.history, "policy", "m2") == ["m2", "policy-v2", "m2"]


def test_a_concurrency_429_carries_the_rate_limit_headers():
    """docs/proxy.md: every answer to a tenant with a requests-per-minute limit carries
    `x-ratelimit-*`, a concurrency 429 too (and it does not spend a request)."""
    registry = TenantRegistry(
        [TenantConfig(name="t", api_key="k", requests_per_minute=10, max_concurrent=1)]
    )
    tenant = registry.authenticate("Bearer k")
    slot = registry.admit(tenant)
    with pytest.raises(ProxyError) as err:
        registry.admit(tenant)
    assert err.value.code == "concurrency_limit_exceeded"
    assert err.value.headers["retry-after"] == "1"
    assert err.value.headers["x-ratelimit-limit-requests"] == "10"
    assert err.value.headers["x-ratelimit-remaining-requests"] == "9"
    assert err.value.headers["x-ratelimit-reset-requests"].endswith("s")
    slot.release()
    assert registry.admit(tenant).headers["x-ratelimit-remaining-requests"] == "8"


def test_a_concurrency_429_with_the_bucket_spent_says_when_a_request_is_allowed() -> None:
    """It said `retry-after: 1`, and a client that waited that long met a second 429."""
    registry = TenantRegistry(
        [TenantConfig(name="t", api_key="k", requests_per_minute=1, max_concurrent=1)]
    )
    tenant = registry.authenticate("Bearer k")
    registry.admit(tenant)  # in flight, and the bucket's one request spent
    with pytest.raises(ProxyError) as err:
        registry.admit(tenant)
    assert err.value.code == "concurrency_limit_exceeded"
    assert 55 <= int(err.value.headers["retry-after"]) <= 60


def test_feedback_metadata_size_is_counted_as_the_sink_writes_it() -> None:
    """A lone surrogate travels as its six-character escape; other text as UTF-8; the JSON
    is compact (measured with `", "` and `": "`, list-heavy metadata well under the limit
    was refused)."""
    escaped = {"x": "\ud800" * 100}  # `{"x":"…"}`: 8 characters around 600 of escapes
    with pytest.raises(ProxyError, match="metadata"):
        parse_feedback({"trajectory_id": "t", "kind": "accept", "metadata": escaped}, 607)
    accepted = parse_feedback({"trajectory_id": "t", "kind": "accept", "metadata": escaped}, 608)
    assert accepted.metadata == escaped
    listed = {"tests": list(range(10)), "ok": True}
    compact = len(b'{"tests":[0,1,2,3,4,5,6,7,8,9],"ok":true}')
    assert parse_feedback({"trajectory_id": "t", "kind": "accept", "metadata": listed}, compact)
    with pytest.raises(ProxyError, match="metadata"):
        parse_feedback({"trajectory_id": "t", "kind": "accept", "metadata": listed}, compact - 1)


@pytest.mark.parametrize(
    ("before_last", "last", "found"),
    [
        (b"", b'data: {"error": {"message": "x"}}\n\ndata: [DONE]\n\n', True),
        (b'data: {"error":{"message":"x"}}\n\n', b"data: [DONE]\n\n", True),
        (b'data: {"id":"c"}\n\ndata: {"err', b'or": {"message": "x"}}\n\n', True),  # split
        (b"data: {", b'"error": {}}\n\ndata: [DONE]\n\n', True),
        # Model text that reads {"error": ...} arrives with its quotes escaped.
        (b"", b'data: {"id":"c","choices":[{"delta":{"content":"{\\"error\\": 1}"}}]}\n\n', False),
        (b'{\\"err', b'or\\": 1}"}}]}\n\ndata: [DONE]\n\n', False),
        (b"", b"data: [DONE]\n\n", False),
    ],
)
def test_ends_with_error_event_finds_vllms_in_band_error_only(
    before_last: bytes, last: bytes, found: bool
) -> None:
    assert ends_with_error_event(before_last, last) is found


def test_a_sampled_error_token_is_not_an_error_event() -> None:
    """With `logprobs: 0` a completions chunk lists the sampled token's top logprob: a token
    `error` wrote `[{"error": -0.1}]`, and the stream counted as an upstream error."""
    chunk = b'data: {"id":"c","choices":[{"logprobs":{"top_logprobs":[{"error":-0.1}]}}]}\n\n'
    usage = b'data: {"id":"c","choices":[],"usage":{"total_tokens":3}}\n\ndata: [DONE]\n\n'
    assert not ends_with_error_event(b"", chunk + usage)
    event = b'data: {"error":{"message":"Internal server error","code":500}}\n\n'
    assert ends_with_error_event(b"", chunk + event + b"data: [DONE]\n\n")
    assert ends_with_error_event(chunk + event[:9], event[9:] + b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("extra", "added"),
    [
        ({"top_logprobs": 3}, False),
        ({"logprob_token_ids": [5]}, False),
        ({"top_logprobs": 0}, True),
    ],
)
def test_top_logprobs_without_logprobs_is_left_for_vllm_to_refuse(extra, added) -> None:
    """vLLM answers 400 to `top_logprobs` > 0 without `logprobs`: the proxy added `logprobs`,
    and the client got a 200 with the logprobs stripped."""
    body = {"model": "m", "messages": [], **extra}
    plan = plan_request("chat.completions", body, "base", capture=True)
    assert plan.added_logprobs is added
    assert plan.upstream_body.get("logprobs") is (True if added else None)


def test_logprob_token_ids_without_logprobs_on_completions_is_left_for_vllm_to_refuse() -> None:
    """The completions branch added `logprobs: 0`: vLLM served what it refuses (400) for the
    client's own body, and the client got a 200 without its logprobs."""
    body = {"model": "m", "prompt": "hi", "logprob_token_ids": [5]}
    plan = plan_request("completions", body, "base", capture=True)
    assert not plan.added_logprobs and "logprobs" not in plan.upstream_body
    plain = plan_request("completions", {"model": "m", "prompt": "hi"}, "base", capture=True)
    assert plain.added_logprobs and plain.upstream_body["logprobs"] == 0


class _BackloggedSink:
    """A sink that says how many records, and how many bytes of captures, it holds."""

    held = 0
    held_bytes = 0
    hung_checks = 0

    def backlog(self) -> int:
        return self.held

    def kill_if_hung(self) -> None:
        self.hung_checks += 1

    def backlog_bytes(self) -> int:
        return self.held_bytes

    def put_trajectory(self, record: dict) -> None: ...

    def put_feedback(self, event: dict) -> None: ...

    async def aclose(self) -> None: ...


def test_capture_pauses_at_the_backlog_limit_until_half_of_it_is_left() -> None:
    """The sink's worker can fall behind for as long as the cores stay busy: past the limit
    new requests go uncaptured instead of growing the proxy's memory, and capture resumes
    only at half the limit, not on every record that flickers across the line."""
    sink = _BackloggedSink()
    service = CaptureService(sink, None, backlog_limit=10)
    seen = []
    for held in (0, 9, 10, 11, 9, 6, 5, 4, 9, 10):
        sink.held = held
        seen.append(service.has_room())
    assert seen == [True, True, False, False, False, False, True, True, True, False]
    # Asked at each call that answered False (a worker that stopped reading blocks the
    # sink's own check, and a paused proxy puts nothing), not when it resumed.
    assert sink.hung_checks == seen.count(False)
    assert CaptureService(sink, None).has_room()  # no limit given
    assert CaptureService(object(), None, backlog_limit=1).has_room()  # a sink without one


def test_capture_pauses_at_the_backlog_bytes_limit_until_both_are_down_to_half() -> None:
    """A count of items alone let a few thousand large agent requests (up to half the topic's
    record size each) hold gigabytes: the captures' bytes pause capture too, and it resumes
    only when the bytes and the items are both down to half of their limits."""
    sink = _BackloggedSink()
    service = CaptureService(sink, None, backlog_limit=10, backlog_bytes_limit=1000)
    seen = []
    for held, held_bytes in (
        (1, 999),  # under both
        (1, 1000),  # the bytes reach their limit: paused
        (1, 600),  # not yet half
        (1, 500),  # half the bytes, few items: resumed
        (9, 10),
        (10, 10),  # the items reach theirs: paused
        (5, 501),  # half the items, not half the bytes
        (5, 500),  # both: resumed
    ):
        sink.held, sink.held_bytes = held, held_bytes
        seen.append(service.has_room())
    assert seen == [True, False, False, True, True, False, False, True]
    unweighed = CaptureService(sink, None, backlog_limit=10)  # no byte limit given
    sink.held, sink.held_bytes = 1, 10**12
    assert unweighed.has_room()


async def test_a_worker_building_sink_gets_packed_captures_and_none_is_lost():
    """CaptureService hands a worker-building sink each capture packed, with a builder that
    unpacks it; a capture that neither packs nor pickles has its record built here and
    handed over as a record instead."""

    class WorkerSink:
        def __init__(self) -> None:
            self.captures: list[tuple[bytes, str]] = []
            self.records: list[dict[str, Any]] = []
            self.build: Any = None

        def build_records_with(self, build: Any, on_outcome: Any, on_failures: Any) -> None:
            self.build = build

        def put_capture(self, capture: bytes, status: str) -> None:
            self.captures.append((capture, status))

        def put_trajectory(self, record: dict[str, Any]) -> None:
            self.records.append(record)

    sink = WorkerSink()
    service = CaptureService(sink, None)
    capture = _capture()
    capture.context.request_raw = json.dumps(capture.context.request_body).encode()
    capture.add_raw_response(
        b'{"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 0}}'
    )
    service.submit(capture, "ok")
    [(packed, status)] = sink.captures
    assert packed[:1] == b"m" and status == "ok"
    built = sink.build(packed, status)  # what the worker does with it
    assert built["trajectory_id"] == "t1" and built["request"] == capture.context.request_body

    odd = _capture()
    odd.context.trajectory_id = "t2"
    odd.context.request_body["metadata"] = threading.Lock()  # neither MessagePack nor pickle
    service.submit(odd, "ok")
    await service.drain(timeout_s=5)
    assert len(sink.captures) == 1
    [record] = sink.records
    assert record["trajectory_id"] == "t2" and record["status"] == "ok"


async def test_each_replica_has_its_own_connection_pool():
    """aiohttp's per-host limit groups by host and port: replicas behind one gateway (by
    path) or a URL listed twice shared one limit, and a hung one held the other's."""
    urls = ["http://gw:1/a", "http://gw:1/b", "http://gw:1/a"]
    pool = UpstreamPool(urls, max_connections=3)
    await pool.start()
    try:
        sessions = [pool.session(replica) for replica in pool.replicas]
        assert len({id(session) for session in sessions}) == 3
        assert all(session.connector.limit == 3 for session in sessions)
    finally:
        await pool.close()
