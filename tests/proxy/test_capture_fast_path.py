"""The typed chat path of `TrajectoryCapture` (`_absorb_chat`, `_sse_payloads`) builds
exactly the record the dict path builds (`_absorb_each` on `SSEParser`'s events), for
vLLM's shapes and for streams mangled every way a broken upstream could: the same dict,
key order and types, the same flags and `unparsable` count, or the same exception.

Also: `private_label` leaves the proxy's generated ids as the redactor would, and the
event id keeps uuid4's shape."""

from __future__ import annotations

import json
import math
import random
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from proxy import capture as capture_module
from proxy.capture import (
    CaptureContext,
    Redact,
    TrajectoryCapture,
    build_record,
    private_label,
    redact_record,
)
from proxy.relay import SSEParser, sse_event
from replay.schemas import RecordKind, derived_event_id, validate_record
from safety.config import CustomPattern
from safety.redaction import Redactor
from tests.proxy.test_strip_bytes import (
    VLLM_CHAT_STREAM,
    VLLM_CHAT_WHOLE,
    VLLM_COMPLETIONS_STREAM,
    VLLM_COMPLETIONS_WHOLE,
    _generated_chunks,
)

REDACT = Redactor().redact_obj


class _DictPath(TrajectoryCapture):
    """The capture as it parsed before the typed views: the SSE parser, then each event
    (or the response) as a dict through `add_chunk` / `add_response`."""

    def _absorb_raw(self) -> None:
        raw_response, raw_sse = self._raw_response, self._raw_sse
        self._raw_response, self._raw_sse = None, []
        events = [e for e in SSEParser().feed(b"".join(raw_sse)) if e != b"[DONE]"]
        self._absorb_each(raw_response, events)


def _context(endpoint: str) -> CaptureContext:
    return CaptureContext(
        trajectory_id="t1",
        request_id="req-" + "ab" * 16,
        session_id="req-" + "ab" * 16,
        tenant_hash="h",
        user_hash=None,
        endpoint=endpoint,  # type: ignore[arg-type]
        model_alias="base",
        policy_version="base",
        group_id=None,
        task=None,
        request_body={"model": "base", "messages": [{"role": "user", "content": "hi"}]},
        sampling={"max_tokens": 16},
        created_at=1.0,
        started=2.0,
    )


def _outcome(
    cls: type[TrajectoryCapture],
    endpoint: str,
    sse: list[bytes],
    response: bytes | None,
    redact: Redact | None,
) -> str:
    """What building gives, written so that any difference shows (types, key order, NaN)."""
    capture = cls(_context(endpoint))
    for block in sse:
        capture.add_sse(block)
    if response is not None:
        capture.add_raw_response(response)
    capture.finished_at = 3.0
    try:
        record = build_record(capture, "ok", redact)
    except Exception as exc:  # the dict path may raise on odd input: so must the other
        return f"raised {type(exc).__name__}"
    assert re.fullmatch(r"[0-9a-f]{32}", record.pop("event_id"))
    return repr((record, capture.unparsable))


def _same(
    endpoint: str, sse: list[bytes], response: bytes | None = None, redact: Redact | None = None
) -> str:
    fast = _outcome(TrajectoryCapture, endpoint, sse, response, redact)
    assert fast == _outcome(_DictPath, endpoint, sse, response, redact)
    return fast


def _event(obj: Any) -> bytes:
    return sse_event(json.dumps(obj, separators=(",", ":")).encode())


def _bench_stream(tokens: int = 16) -> list[bytes]:
    """The shape of bench/bench_proxy.py's streamed answer (logprobs, token ids, usage)."""
    base = {"id": "chatcmpl-bench", "created": 1, "model": "base"}
    events = [
        _event(
            {
                **base,
                "object": "chat.completion.chunk",
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                "prompt_token_ids": list(range(1, 33)),
            }
        )
    ]
    for i in range(tokens):
        lp = {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
        choice = {
            "index": 0,
            "delta": {"content": "x"},
            "logprobs": {"content": [lp]},
            "finish_reason": "length" if i == tokens - 1 else None,
            "token_ids": [100 + i],
        }
        events.append(_event({**base, "object": "chat.completion.chunk", "choices": [choice]}))
    usage = {"prompt_tokens": 32, "completion_tokens": tokens, "total_tokens": 32 + tokens}
    events.append(
        _event({**base, "object": "chat.completion.chunk", "choices": [], "usage": usage})
    )
    return [*events, b"data: [DONE]\n\n"]


def _tool_stream() -> list[bytes]:
    """Two choices, interleaved, one calling two tools in fragments."""
    lp = {"content": [{"token": "a", "logprob": -0.25, "bytes": [97], "top_logprobs": []}]}
    chunks: list[dict[str, Any]] = [
        {"choices": [{"index": 1, "delta": {"role": "assistant"}}], "prompt_token_ids": [1, 2]},
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
    ]
    for n, (index, args) in enumerate([(0, '{"a"'), (1, '{"q": '), (0, ": 1}"), (1, '"x"}')]):
        fragment: dict[str, Any] = {"index": index, "function": {"arguments": args}}
        if n < 2:
            fragment.update(id=f"call_{index}", type="function")
            fragment["function"]["name"] = "look" if index else "add"
        elif index:
            fragment["function"]["name"] = "up"  # a name may come in fragments too
        chunks.append(
            {
                "choices": [
                    {
                        "index": 1,
                        "delta": {"tool_calls": [fragment]},
                        "logprobs": lp,
                        "token_ids": [n],
                    },
                    {"index": 0, "delta": {"content": str(n)}, "logprobs": lp, "token_ids": [n]},
                ]
            }
        )
    chunks.append({"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}]})
    chunks.append({"choices": [{"index": 1, "finish_reason": "tool_calls", "delta": {}}]})
    chunks.append({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 8}})
    return [*map(_event, chunks), b"data: [DONE]\n\n"]


def _bench_whole(tokens: int = 16) -> bytes:
    lp = {"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "x" * tokens},
                    "logprobs": {"content": [lp] * tokens},
                    "finish_reason": "length",
                    "token_ids": list(range(100, 100 + tokens)),
                },
                {
                    "index": 1,
                    "message": {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    "finish_reason": "tool_calls",
                    "token_ids": [1],
                    "logprobs": {"content": [lp]},
                },
            ],
            "usage": {"prompt_tokens": 2, "completion_tokens": tokens + 1},
            "prompt_token_ids": [1, 2],
        }
    ).encode()


STREAMS = {
    "vllm": [*map(sse_event, VLLM_CHAT_STREAM), b"data: [DONE]\n\n"],
    "bench": _bench_stream(),
    "tools": _tool_stream(),
    "generated": [sse_event(raw) for e, raw in _generated_chunks() if e == "chat.completions"],
}
RESPONSES = {"vllm": VLLM_CHAT_WHOLE, "bench": _bench_whole()}

# Values the typed views refuse or read differently from a dict: each takes the dict path.
VALUE_SWAPS = [
    (b'"index":0', [b'"index":0.0', b'"index":"0"', b'"index":null', b'"index":true',
                    b'"index":1']),
    (b'"logprob":-0.5', [b'"logprob":"-0.5"', b'"logprob":-Infinity', b'"logprob":NaN',
                         b'"logprob":null', b'"logprob":1e400', b'"logprob":-5', b'"logprob":true',
                         b'"logprob":-0', b'"logprob":123456789012345678901234567890']),
    (b'"token_ids":[100]', [b'"token_ids":[100.0]', b'"token_ids":["a"]', b'"token_ids":null',
                            b'"token_ids":{}', b'"token_ids":7', b'"token_ids":[]',
                            b'"token_ids":[-1]', b'"token_ids":[18446744073709551616]']),
    (b'"delta":{"content":"x"}', [b'"delta":[]', b'"delta":"x"', b'"delta":null', b'"delta":{}',
                                  b'"delta":0', b'"delta":["x"]', b'"delta":{"content":5}',
                                  b'"delta":{"content":null}', b'"delta":{"content":["a"]}',
                                  b'"delta":{"content":"\\ud800"}', b'"delta":{"role":7}',
                                  b'"delta":{"content":"x","content":"y"}',
                                  b'"delta":{"tool_calls":{}}', b'"delta":{"tool_calls":[1]}',
                                  b'"delta":{"tool_calls":[{"function":"f"}]}',
                                  b'"delta":{"tool_calls":[{"function":""}]}',
                                  b'"delta":{"tool_calls":[{"index":"1","id":5}]}',
                                  b'"delta":{"tool_calls":[{"function":{"name":1}}]}',
                                  b'"delta":{"cont\\u0065nt":"e"}']),
    (b'"finish_reason":null', [b'"finish_reason":5', b'"finish_reason":""', b'"finish_reason":[]']),
    (b'"choices":[', [b'"choices":{},"x":[', b'"choices":null,"x":[', b'"choices":[1,']),
    (b'"logprobs":{"content":[', [b'"logprobs":{"content":null,"x":[', b'"logprobs":{"content":[1,',
                                  b'"logprobs":{"content":"ab","x":[', b'"logprobs":{"x":[',
                                  b'"logprobs":{"content":[{},']),
    (b'"id":"call_', [b'"id":"","x":"call_', b'"id":null,"x":"call_', b'"id":5,"x":"call_',
                      b'"type":"","id":"call_', b'"type":null,"id":"call_',
                      b'"index":2,"id":"call_', b'"index":-1,"id":"call_']),
    (b'"type":"function"', [b'"type":""', b'"type":null', b'"type":5', b'"type":"custom"']),
    (b'"arguments":"', [b'"arguments":"","x":"', b'"arguments":null,"x":"', b'"arguments":1,"x":"',
                        b'"name":"","arguments":"', b'"name":null,"arguments":"']),
    (b'"usage":{', [b'"usage":[{', b'"usage":"x","u":{', b'"usage":{"completion_tokens":"16",']),
    (b'"prompt_token_ids":[', [b'"prompt_token_ids":"x","p":[', b'"prompt_token_ids":[1.5,',
                               b'"prompt_token_ids":[[1],']),
]  # fmt: skip
INSERTS = [b'"', b"{", b"}", b",", b"[", b"]", b"\n", b"\r\n", b" ", b"\\", b"0", b":", b"\n\n"]


def _mangled(stream: list[bytes], rng: random.Random) -> Iterator[list[bytes]]:
    block = b"".join(stream)
    for _ in range(60):
        at = rng.randrange(len(block))
        yield [block[:at] + block[at + 1 :]]  # a byte dropped
        yield [block[:at] + rng.choice(INSERTS) + block[at:]]  # one inserted
        yield [block[:at]]  # cut off
    for i in range(len(stream)):
        event = stream[i]
        cut = rng.randrange(6, max(7, len(event) - 2))
        yield [*stream[:i], event[:cut] + b"\n\n", *stream[i + 1 :]]  # an event truncated
        yield [*stream[:i], event.replace(b"{", b'{"index":1,', 2), *stream[i + 1 :]]
    for old, news in VALUE_SWAPS:
        if old in block:
            for new in news:
                yield [block.replace(old, new, 1)]
                yield [block.replace(old, new)]
    # Framing the fast split leaves to the parser.
    yield [b": ping\n\n", block]
    yield [block.replace(b"\n\n", b"\r\n\r\n")]
    yield [block.replace(b"data: ", b"data:")]
    yield [block.replace(b"data: ", b"data:  ", 1)]
    yield [block.replace(b"data: ", b"event: chunk\ndata: ", 2)]
    yield [stream[0].replace(b"data: ", b"data: [\ndata: ")[:-2] + b"]\n\n", *stream[1:]]
    yield [b"data: [DONE]\n\n", block]
    yield [block + b"data: {}\n\n"]
    yield [block + b"data: []\n\n"]
    yield [block + b"data: \n\n"]
    yield [b"\n\n" + block]


@pytest.mark.parametrize("name", sorted(STREAMS))
def test_typed_path_builds_the_dict_paths_record_of_a_stream(name: str) -> None:
    stream = STREAMS[name]
    assert "raised" not in _same("chat.completions", stream, redact=REDACT)
    assert "raised" not in _same("chat.completions", [b"".join(stream)])
    blocks = [b"".join(stream)[i : i + 97] for i in range(0, len(b"".join(stream)), 97)]
    _same("chat.completions", blocks)  # blocks need not end at an event border
    # A later empty role keeps the earlier one (the dict path reads a role only if truthy).
    roles = [_event({"choices": [{"delta": {"role": role}}]}) for role in ("tool", "", None)]
    assert "'role': 'tool'" in _same("chat.completions", [*stream, *roles])
    rng = random.Random(name)
    outcomes = {_same("chat.completions", sse) for sse in _mangled(stream, rng)}
    # Some mangled events fail the build in both paths (a delta's content a number), others
    # are counted unparsable and flagged (a chunk whose `choices` is no list failed the
    # whole build before).
    assert any("unparsable_upstream_data" in outcome for outcome in outcomes)


def test_vllm_shapes_take_the_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Else the comparisons above would test the dict path against itself."""

    dict_path_ran: list[int] = []

    def refuse(*_: Any) -> None:
        dict_path_ran.append(1)
        raise AssertionError("the dict path ran")

    monkeypatch.setattr(TrajectoryCapture, "_absorb_each", refuse)
    # _outcome turns a raise into its text (the AssertionError included), so both say it.
    outcomes = [
        _outcome(TrajectoryCapture, "chat.completions", stream, None, REDACT)
        for stream in STREAMS.values()
    ] + [
        _outcome(TrajectoryCapture, "chat.completions", [], response, REDACT)
        for response in RESPONSES.values()
    ]
    assert len(outcomes) == len(STREAMS) + len(RESPONSES) > 0
    assert not any(outcome.startswith("raised") for outcome in outcomes)
    assert dict_path_ran == []


@pytest.mark.parametrize("name", sorted(RESPONSES))
def test_typed_path_builds_the_dict_paths_record_of_a_response(name: str) -> None:
    response = RESPONSES[name]
    assert "raised" not in _same("chat.completions", [], response, REDACT)
    rng = random.Random(name)
    for _ in range(100):
        at = rng.randrange(len(response))
        _same("chat.completions", [], response[:at] + response[at + 1 :])
        _same("chat.completions", [], response[:at] + rng.choice(INSERTS) + response[at:])
    for old, new in [
        (b'"message":{', b'"message":[],"m":{'),
        (b'"message":{', b'"message":"x","m":{'),
        (b'"message":{', b'"message":null,"m":{'),
        (b'"role":"assistant"', b'"role":null'),
        (b'"role":"assistant"', b'"x":1'),
        (b'"role":"assistant"', b'"role":"assistant","tool_calls":null'),
        (b'"role":"assistant"', b'"role":"assistant","tool_calls":[]'),
        (b'"role":"assistant"', b'"role":"assistant","tool_calls":{"a":1}'),
        (b'"role":"assistant"', b'"role":""'),
        (b'"content":"', b'"content":["a"],"c":"'),
        (b'"token_ids":[', b'"token_ids":"ab","t":['),
        (b'"token_ids":[', b'"token_ids":[1.5,'),
        (b'"finish_reason":"', b'"finish_reason":3,"f":"'),
        (b'"logprob":-', b'"logprob":"-'),
        (b'"index":0', b'"index":0.0'),
        (b'"choices":[', b'"choices":{},"c":['),
        (b'"usage":{', b'"usage":[],"u":{'),
        (b'"prompt_token_ids":[', b'"prompt_token_ids":{},"p":['),
    ]:
        if old in response:
            _same("chat.completions", [], response.replace(old, new, 1))
    # A response and a stream in one capture: the response first, as the dict path reads.
    _same("chat.completions", STREAMS["bench"], response)
    _same("chat.completions", [b"data: {,}\n\n"], response)
    for odd in (b"[]", b"null", b"", b"{}", b'{"choices":[{}]}', b'{"choices":[{"message":{}}]}'):
        _same("chat.completions", [], odd)


def test_completions_keep_the_dict_path() -> None:
    stream = [*map(sse_event, VLLM_COMPLETIONS_STREAM), b"data: [DONE]\n\n"]
    assert "raised" not in _same("completions", stream, redact=REDACT)
    assert "raised" not in _same("completions", [], VLLM_COMPLETIONS_WHOLE, REDACT)


def test_split_events_are_the_parsers() -> None:
    rng = random.Random(7)
    for stream in STREAMS.values():
        for sse in [[b"".join(stream)], *_mangled(stream, rng)]:
            data = b"".join(sse)
            parsed = [e for e in SSEParser().feed(data) if e != b"[DONE]"]
            assert capture_module._sse_payloads(data) == parsed
    for data in [b"", b"data: x\n\n", b"data: [DONE]\n\n", b"data: \n\n", b"data: x\n\n\n\n"]:
        assert capture_module._sse_payloads(data) == [
            e for e in SSEParser().feed(data) if e != b"[DONE]"
        ]


def _generated_ids() -> Iterator[str]:
    """The proxy's own request ids, random and with every run of digits the card and phone
    passes look at."""
    rng = random.Random(3)
    for _ in range(3000):
        yield "req-" + uuid.UUID(int=rng.getrandbits(128)).hex
    digits = "4111111111111111" + "5555551234567890"
    for length in range(6, 33):
        for start in range(0, 33 - length):
            run = (digits * 2)[start : start + length]
            yield "req-" + ("a" * start + run + "f" * 32)[:32]
            yield "req-" + (run + "e" * 32)[:32]
    yield "req-" + "0" * 32


def test_generated_session_ids_skip_only_what_the_redactor_leaves() -> None:
    called: list[str] = []

    def spy(value: Any) -> tuple[Any, dict[str, int]]:
        called.append(value)
        return REDACT(value)

    for value in _generated_ids():
        assert REDACT(value) == (value, {})  # what the skip relies on
        assert private_label(value, REDACT) == value
    assert private_label("req-" + "ab" * 16, spy) == "req-" + "ab" * 16 and called
    # Anything else is still redacted: other shapes, and redactors with other patterns.
    assert private_label("req-" + "ab" * 15 + "@x.io", REDACT).startswith("redacted-")
    assert private_label("REQ-" + "AB" * 16, REDACT) == "REQ-" + "AB" * 16
    custom = Redactor(custom_patterns=[CustomPattern(name="hex_id", regex=r"[0-9a-f]{32}")])
    assert private_label("req-" + "ab" * 16, custom.redact_obj).startswith("redacted-")

    class Stricter(Redactor):
        def redact_obj(self, obj: Any) -> tuple[Any, dict[str, int]]:
            return obj, {"stricter": 1}

    assert private_label("req-" + "ab" * 16, Stricter().redact_obj).startswith("redacted-")
    disabled = Redactor(enabled=False)
    assert private_label("req-" + "ab" * 16, disabled.redact_obj) == "req-" + "ab" * 16


def test_a_capture_built_twice_is_one_event() -> None:
    """The event id is fixed by the trajectory: the proxy building a capture its dead sink
    worker had built already makes the same event, which consumers keep once."""
    records = []
    for _ in range(2):
        capture = TrajectoryCapture(_context("chat.completions"))
        for block in _bench_stream():
            capture.add_sse(block)
        records.append(build_record(capture, "ok", Redactor().redact_obj))
    assert records[0]["event_id"] == records[1]["event_id"]
    assert records[0]["event_id"] == derived_event_id("trajectory", "t1")
    assert re.fullmatch(r"[0-9a-f]{32}", records[0]["event_id"])
    assert derived_event_id("trajectory", "t2") != records[0]["event_id"]


def _redact_record_before(record: dict[str, Any], redact: Redact) -> dict[str, Any]:
    """`redact_record` as it was, with one redactor call for the request and one for the
    choices."""
    for key in ("session_id", "group_id", "task"):
        if isinstance(record.get(key), str):
            record[key] = private_label(record[key], redact)
    request, request_counts = redact(record["request"])
    arrays = ("token_ids", "logprobs")
    choices, choice_counts = redact(
        [{k: v for k, v in choice.items() if k not in arrays} for choice in record["choices"]]
    )
    for redacted, original in zip(choices, record["choices"], strict=True):
        for key in arrays:
            if key in original:
                redacted[key] = original[key]
    counts: dict[str, int] = {}
    for source in (request_counts, choice_counts):
        for kind, hits in source.items():
            if hits:
                counts[kind] = counts.get(kind, 0) + int(hits)
    record["request"] = request
    record["choices"] = choices
    record["redactions"] = counts
    if counts:
        record["prompt_token_ids"] = []
        for choice in record["choices"]:
            choice["token_ids"] = []
        record["flags"] = [*record["flags"], "redacted"]
        record["trainable"] = False
    return record


_SECRETS = [
    "",
    "mail me at jane.doe@example.com",
    "key sk-proj-abcdefghijklmnopqrstuvwxyz0123456789",
    "card 4111 1111 1111 1111 and +1 (415) 555-0100",
    'password = "hunter22hunter22"',
    "AKIAIOSFODNN7EXAMPLE",
]


@pytest.mark.parametrize("redactor", ["builtin", "custom", "disabled"])
def test_one_redactor_call_redacts_as_two_did(redactor: str) -> None:
    """Request and choices now go through one redactor call: the records, their counts and
    their flags are those of the two calls before, wherever the secrets are."""
    redact = {
        "builtin": Redactor().redact_obj,
        "custom": Redactor(
            custom_patterns=[CustomPattern(name="ticket", regex=r"TICKET-\d+")]
        ).redact_obj,
        "disabled": Redactor(enabled=False).redact_obj,
    }[redactor]
    rng = random.Random(20261201)
    texts = _SECRETS + ["plain words"] * 12  # most texts hold no secret

    def text() -> str:
        return rng.choice(texts)

    redacted = 0
    for _ in range(120):
        capture = TrajectoryCapture(_context("chat.completions"))
        capture.context.request_body = {
            "model": "base",
            "messages": [{"role": "user", "content": text() + rng.choice(["", " TICKET-7"])}],
            "metadata": {text() or "k": text()},
        }
        stream = _bench_stream()
        at = rng.randrange(1, len(stream) - 2)  # one token's text
        stream[at] = stream[at].replace(b'"x"', json.dumps(text()).encode(), 1)
        for block in stream:
            capture.add_sse(block)
        record = capture.build("ok")
        copy = json.loads(json.dumps(record))
        after = redact_record(record, redact)
        assert after == _redact_record_before(copy, redact)
        redacted += bool(after["redactions"])
    # Secrets were found in some records and not in others (none with redaction off).
    assert (0 < redacted < 120) if redactor != "disabled" else redacted == 0


def _flags_before(capture: TrajectoryCapture, status: str) -> list[str]:
    """`check` as it was before its one-choice path (after the data was absorbed)."""
    flags: list[str] = []
    if status != "ok":
        flags.append(status)
    if capture.unparsable:
        flags.append("unparsable_upstream_data")
    prompt_ids, multiple_prompts = capture._prompt_ids()
    if multiple_prompts:
        flags.append("multiple_prompts")
    if prompt_ids is None:
        flags.append("missing_prompt_token_ids")
    choices = capture.choices.values()
    if not capture.choices:
        flags.append("no_choices")
    if any(c.token_ids is None for c in choices):
        flags.append("missing_token_ids")
    if any(len(c.token_ids or []) != len(c.logprobs or []) for c in choices):
        flags.append("logprob_count_mismatch")
    if any(not math.isfinite(v) for c in choices for v in (c.logprobs or [])):
        flags.append("nonfinite_logprob")
    if status == "ok" and any(c.finish_reason is None for c in choices):
        flags.append("missing_finish_reason")
    if any(c.finish_reason in ("abort", "error") for c in choices):
        flags.append("finish_reason_abort")
    if capture.usage is None:
        flags.append("missing_usage")
    else:
        completion = sum(len(c.token_ids or []) for c in choices)
        if completion != capture.usage.get("completion_tokens"):
            flags.append("token_count_mismatch")
        if (
            prompt_ids is not None
            and not multiple_prompts
            and capture._prompt_token_count(prompt_ids) != capture.usage.get("prompt_tokens")
        ):
            flags.append("prompt_token_count_mismatch")
    return flags


def _checked(check: Callable[[], list[str]]) -> list[str] | str:
    try:
        return check()
    except Exception as exc:
        return f"raised {type(exc).__name__}"


def test_check_flags_as_before() -> None:
    rng = random.Random(11)
    cases: list[tuple[list[bytes], bytes | None]] = []
    for stream in STREAMS.values():
        cases += [(sse, None) for sse in _mangled(stream, rng)]
    for response in RESPONSES.values():
        for old, new in [(b"", b""), (b'"token_ids":[', b'"token_ids":5,"t":[')]:
            cases.append(([], response.replace(old, new, 1)))
        cases.append(([], response.replace(b'"logprob":-0.5', b'"logprob":-Infinity', 1)))
        cases.append(([], response.replace(b'"logprob":-0.5', b'"logprob":NaN')))
    seen: set[str] = set()
    for sse, response in cases:
        for status in ("ok", "aborted"):
            capture = TrajectoryCapture(_context("chat.completions"))
            for block in sse:
                capture.add_sse(block)
            if response is not None:
                capture.add_raw_response(response)
            try:
                capture._absorb_raw()
            except Exception:  # the dict path raises on some odd data (as it did)
                continue
            flags = _checked(lambda: capture.check(status))  # noqa: B023 - called at once
            assert flags == _checked(lambda: _flags_before(capture, status))  # noqa: B023
            seen.update(flags if isinstance(flags, list) else [flags])
            for choice in capture.choices.values():
                clamped = [v if math.isfinite(v) else -1.0e9 for v in (choice.logprobs or [])]
                try:
                    logprobs = capture._choice_record(choice)["logprobs"]
                except TypeError:  # text that is no string, as the dict path keeps it
                    continue
                assert repr(logprobs) == repr(clamped)
    assert {"nonfinite_logprob", "logprob_count_mismatch", "missing_token_ids"} <= seen
    assert {"token_count_mismatch", "missing_finish_reason", "no_choices"} <= seen


def test_a_null_logprob_keeps_the_record_flagged_not_lost() -> None:
    """vLLM writes a NaN logprob (`max(nan, -9999.0)`) as null: `float(None)` raised in the
    build, and the capture was counted as a failure with no record at all."""
    stream = _bench_stream(tokens=2)
    stream[1] = stream[1].replace(b'"logprob":-0.5', b'"logprob":null', 1)
    capture = TrajectoryCapture(_context("chat.completions"))
    for block in stream:
        capture.add_sse(block)
    record = build_record(capture, "ok", Redactor().redact_obj)
    assert record["trainable"] is False and "nonfinite_logprob" in record["flags"]
    assert record["choices"][0]["logprobs"][0] == capture_module.NONFINITE_LOGPROB


def test_the_sampling_parameters_are_redacted_like_the_request() -> None:
    """`sampling` repeats request fields: a stop string kept an address the request lost."""
    capture = TrajectoryCapture(_context("chat.completions"))
    capture.context.sampling = {"max_tokens": 16, "stop": ["\nalice@example.com:"]}
    for block in _bench_stream():
        capture.add_sse(block)
    record = build_record(capture, "ok", Redactor().redact_obj)
    assert record["sampling"]["stop"] == ["\n[REDACTED:email]:"]
    assert record["trainable"] is False and record["redactions"] == {"email": 1}


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_reasoning_text_is_captured_and_redacted_with_its_token_ids(field: str) -> None:
    """vLLM's reasoning parser moves the model's thinking out of `content` (as `reasoning`,
    `reasoning_content` before vLLM renamed it) while its tokens stay in `token_ids`: the
    record kept the ids and lost the text, so an address in the thinking went out as ids."""
    thinking = [
        _event({"choices": [{"index": 0, "delta": {field: part}}]})
        for part in ("Mail bob", "@example.com first.")
    ]
    stream = _bench_stream()
    stream = [stream[0], *thinking, *stream[1:]]
    for path in (TrajectoryCapture, _DictPath):
        capture = path(_context("chat.completions"))
        for block in stream:
            capture.add_sse(block)
        plain = capture.build("ok")
        assert plain["choices"][0]["message"]["reasoning"] == "Mail bob@example.com first."
        capture = path(_context("chat.completions"))
        for block in stream:
            capture.add_sse(block)
        record = build_record(capture, "ok", REDACT)
        assert record["choices"][0]["message"]["reasoning"] == "Mail [REDACTED:email] first."
        assert record["choices"][0]["token_ids"] == [] and record["trainable"] is False
        validate_record(RecordKind.TRAJECTORY, {**record, "tenant": "ab" * 32})
    whole = json.loads(_bench_whole())
    whole["choices"][0]["message"][field] = "I think."
    raw = json.dumps(whole).encode()
    for path in (TrajectoryCapture, _DictPath):
        capture = path(_context("chat.completions"))
        capture.add_raw_response(raw)
        assert capture.build("ok")["choices"][0]["message"]["reasoning"] == "I think."
    # No reasoning, no key: records of models without a parser are as before.
    capture = TrajectoryCapture(_context("chat.completions"))
    for block in _bench_stream():
        capture.add_sse(block)
    assert "reasoning" not in capture.build("ok")["choices"][0]["message"]


def _completions_capture(prompt: Any, n: int, usage_prompt: int, finish: str) -> list[str]:
    """The flags of a completions capture of `prompt` (ids [1, 2, 3] each), `n` per prompt."""
    context = _context("completions")
    context.request_body = {"model": "base", "prompt": prompt, "n": n}
    context.sampling = {"max_tokens": 16, "n": n}
    capture = TrajectoryCapture(context)
    prompts = len(prompt) if isinstance(prompt, list) else 1
    choices = [
        {"index": i, "text": "x", "finish_reason": finish, "prompt_token_ids": [1, 2, 3],
         "token_ids": [7], "logprobs": {"token_logprobs": [-0.5], "tokens": ["x"]}}
        for i in range(prompts * n)
    ]  # fmt: skip
    chunks = [{"choices": [c]} for c in choices]
    usage = {"prompt_tokens": usage_prompt, "completion_tokens": len(choices)}
    chunks.append({"choices": [], "usage": usage})
    capture.add_sse(b"".join(_event(c) for c in chunks) + b"data: [DONE]\n\n")
    capture.finished_at = 3.0
    return build_record(capture, "ok", None)["flags"]


def test_a_batch_repeating_one_prompt_counts_it_once_per_prompt() -> None:
    """vLLM's usage counts every prompt: `["hi", "hi"]` (a group sent as a list, not as `n`)
    was flagged prompt_token_count_mismatch, untrainable, though consistent."""
    assert _completions_capture(["hi", "hi"], 1, 6, "stop") == []
    assert _completions_capture(["hi", "hi"], 2, 6, "stop") == []
    assert _completions_capture("hi", 2, 3, "stop") == []
    assert _completions_capture(["hi", "hi"], 1, 3, "stop") == ["prompt_token_count_mismatch"]


def test_a_choice_the_server_cut_off_is_not_trained_on() -> None:
    """vLLM ends what runs with finish_reason `abort` when its engine shuts down; the stream
    still ends with usage and [DONE], and the cut-off sample was recorded ok, trainable."""
    assert _completions_capture("hi", 1, 3, "abort") == ["finish_reason_abort"]
    assert _completions_capture("hi", 2, 3, "error") == ["finish_reason_abort"]
