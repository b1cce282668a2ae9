"""The byte-level stripping (`strip_bytes`) gives exactly what the parsing path gives
(`strip_chunk` / `strip_response`) whenever it answers, and answers for vLLM's usual shapes.

The corpus is what vLLM 0.32 sent for captured requests (copied from a real server) plus
shapes built to trip a byte-level cut: key-like text inside strings, completions whose
top_logprobs hold tokens named like the keys, several choices, tool calls, empty deltas."""

from __future__ import annotations

import itertools
import json
import random
from typing import Any

import pytest

from proxy import relay
from proxy.capture import CaptureContext, TrajectoryCapture
from proxy.relay import (
    RelayPlan,
    SSEParser,
    plan_request,
    sse_event,
    strip_bytes,
    strip_chunk,
    strip_response,
    strip_sse,
    strip_sse_python,
)

NATIVE = relay._sse_strip


@pytest.fixture(params=["c", "python"])
def sse_strip(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Runs a test with each implementation of `strip_sse`: the C pass and the Python rules."""
    if request.param == "python":
        monkeypatch.setattr(relay, "_sse_strip", None)
    return request.param


# Verbatim from vLLM (chat and completions, streamed and not; logprobs, token ids and
# usage requested by the proxy).
VLLM_CHAT_STREAM = [
    b'{"id":"chatcmpl-8047","object":"chat.completion.chunk","created":1796006507,"model":"base",'
    b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
    b'"finish_reason":null}],"prompt_token_ids":[1,9690,198,2683],"prompt_text":null}',
    b'{"id":"chatcmpl-8047","object":"chat.completion.chunk","created":1796006507,"model":"base",'
    b'"choices":[{"index":0,"delta":{"content":"M"},"logprobs":{"content":[{"token":"M",'
    b'"logprob":-4.90709114074707,"bytes":[77],"top_logprobs":[]}]},"finish_reason":null,'
    b'"token_ids":[61]}]}',
    b'{"id":"chatcmpl-8047","object":"chat.completion.chunk","created":1796006507,"model":"base",'
    b'"choices":[{"index":0,"delta":{"content":" How"},"logprobs":{"content":[{"token":" How",'
    b'"logprob":-2.3268487453460693,"bytes":[32,72,111,119],"top_logprobs":[]}]},'
    b'"finish_reason":"length","stop_reason":null,"token_ids":[1073]}]}',
    b'{"id":"chatcmpl-8047","object":"chat.completion.chunk","created":1796006507,"model":"base",'
    b'"choices":[],"usage":{"prompt_tokens":31,"total_tokens":35,"completion_tokens":4},'
    b'"system_fingerprint":"vllm-0.32.0-a5ad03c4"}',
]
VLLM_COMPLETIONS_STREAM = [
    b'{"id":"cmpl-90e1","object":"text_completion","created":1796006510,"model":"base",'
    b'"choices":[{"index":0,"text":" ready","logprobs":{"text_offset":[0],'
    b'"token_logprobs":[-9.921793937683105],"tokens":[" ready"],"top_logprobs":[{" ready":'
    b'-9.921793937683105}]},"finish_reason":null,"stop_reason":null,"prompt_token_ids":[6004],'
    b'"token_ids":[4421]}]}',
    b'{"id":"cmpl-90e1","object":"text_completion","created":1796006510,"model":"base",'
    b'"choices":[{"index":0,"text":" share","logprobs":{"text_offset":[9],'
    b'"token_logprobs":[-2.9211220741271973],"tokens":[" share"],"top_logprobs":[{" share":'
    b'-2.9211220741271973}]},"finish_reason":"length","stop_reason":null,'
    b'"prompt_token_ids":null,"token_ids":[2419]}]}',
]
VLLM_CHAT_WHOLE = (
    b'{"id":"chatcmpl-8ae1","object":"chat.completion","created":1796006510,"model":"base",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"Wow, great","refusal":null,'
    b'"annotations":null,"audio":null,"function_call":null,"reasoning":null},"logprobs":'
    b'{"content":[{"token":"Wow","logprob":-7.15709114074707,"bytes":[87,111,119],'
    b'"top_logprobs":[]},{"token":",","logprob":-0.09758689254522324,"bytes":[44],'
    b'"top_logprobs":[]}]},"finish_reason":"length","stop_reason":null,"token_ids":[32373,28],'
    b'"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0",'
    b'"usage":{"prompt_tokens":31,"total_tokens":34,"completion_tokens":3,'
    b'"prompt_tokens_details":null,"completion_tokens_details":null},"prompt_logprobs":null,'
    b'"prompt_token_ids":[1,9690,198],"prompt_text":null,"kv_transfer_params":null}'
)
VLLM_COMPLETIONS_WHOLE = (
    b'{"id":"cmpl-a16d","object":"text_completion","created":1796006510,"model":"base",'
    b'"choices":[{"index":0,"text":"-install.","logprobs":{"text_offset":[0,1,8],'
    b'"token_logprobs":[-0.796794056892395,-12.285116195678711,-3.466102123260498],'
    b'"tokens":["-","install","."],"top_logprobs":[{"-":-0.796794056892395},'
    b'{"install":-12.285116195678711},{".":-3.466102123260498}]},"finish_reason":"length",'
    b'"stop_reason":null,"token_ids":[29,21928,30],"prompt_logprobs":null,'
    b'"prompt_token_ids":[6004],"routed_experts":null}],"usage":{"prompt_tokens":1,'
    b'"total_tokens":4,"completion_tokens":3}}'
)

TRICKY_TEXT = [
    "x",
    '},"finish_reason":"stop"',
    ',"logprobs":{"content":[]}',
    ',"token_ids":[1,2]',
    '"index":7',
    "",
    'é 中文 \\ " \n',
]


def _chat_chunk(choices: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": choices, **top}  # fmt: skip


def _chat_choice(index: int, delta: dict, lp: bool, ids: bool, finish: str | None) -> dict:
    logprobs = None
    if lp:
        logprobs = {
            "content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}]
        }
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish}  # fmt: skip
    if finish is not None:
        choice["stop_reason"] = None
    if ids:
        choice["token_ids"] = [100 + index]
    return choice


def _completion_choice(index: int, text: str, token: str, finish: str | None) -> dict:
    return {
        "index": index,
        "text": text,
        "logprobs": {
            "text_offset": [0],
            "token_logprobs": [-0.5],
            "tokens": [token],
            "top_logprobs": [{token: -0.5, "logprobs": -1.0, "finish_reason": -2.0}],
        },
        "finish_reason": finish,
        "stop_reason": None,
        "prompt_token_ids": None,
        "token_ids": [7],
    }


def _generated_chunks() -> list[tuple[str, bytes]]:
    chunks: list[tuple[str, bytes]] = []
    for text, finish, n in itertools.product(TRICKY_TEXT, (None, "stop"), (1, 2)):
        deltas = [{"content": text}, {"role": "assistant", "content": text}]
        for delta in deltas:
            choices = [_chat_choice(i, delta, True, True, finish) for i in range(n)]
            chunks.append(("chat.completions", json.dumps(_chat_chunk(choices)).encode()))
        tool = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                "function": {"name": "f", "arguments": text}}]}  # fmt: skip
        choices = [_chat_choice(i, tool, True, True, finish) for i in range(n)]
        compact = json.dumps(_chat_chunk(choices), separators=(",", ":"), ensure_ascii=False)
        chunks.append(("chat.completions", compact.encode()))
        for token in ("x", "index", "finish_reason", "token_ids", "logprobs", text):
            choices = [_completion_choice(i, text, token, finish) for i in range(n)]
            chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
                     "choices": choices}  # fmt: skip
            compact = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
            chunks.append(("completions", compact.encode()))
    # Empty deltas (dropped by the parsing path) and a reordered choice.
    empty = _chat_chunk([_chat_choice(0, {}, True, True, None)])
    chunks.append(("chat.completions", json.dumps(empty, separators=(",", ":")).encode()))
    reordered = _chat_chunk([{"index": 0, "finish_reason": None, "delta": {"content": "a"},
                              "token_ids": [1], "logprobs": {"content": []}}])  # fmt: skip
    chunks.append(("chat.completions", json.dumps(reordered, separators=(",", ":")).encode()))
    return chunks


def _plans(endpoint: str, stream: bool) -> list[RelayPlan]:
    """Every mix of what the client asked for itself (the proxy adds the rest)."""
    plans = []
    for logprobs, ids, usage in itertools.product((False, True), repeat=3):
        body: dict[str, Any] = {"model": "m", "stream": stream}
        if logprobs:
            body["logprobs"] = True if endpoint == "chat.completions" else 0
        if ids:
            body["return_token_ids"] = True
        if usage and stream:
            body["stream_options"] = {"include_usage": True}
        plans.append(plan_request(endpoint, body, "m", capture=True))  # type: ignore[arg-type]
    return plans


STREAM_CASES = [("chat.completions", c) for c in VLLM_CHAT_STREAM]
STREAM_CASES += [("completions", c) for c in VLLM_COMPLETIONS_STREAM] + _generated_chunks()


@pytest.mark.parametrize(("endpoint", "raw"), STREAM_CASES)
def test_stream_chunk_bytes_strip_like_the_parsed_chunk(endpoint: str, raw: bytes) -> None:
    taken = 0  # declining is allowed (the parsed path then runs), but not for every plan
    for plan in _plans(endpoint, stream=True):
        fast = strip_bytes(plan, raw)
        slow = strip_chunk(plan, json.loads(raw))
        if fast is not None:
            taken += 1
            assert slow is not None, (plan, raw)
            assert json.loads(fast) == slow, (plan, raw)
    assert taken, raw


@pytest.mark.parametrize(
    ("endpoint", "raw"),
    [("chat.completions", VLLM_CHAT_WHOLE), ("completions", VLLM_COMPLETIONS_WHOLE)],
)
def test_whole_response_bytes_strip_like_the_parsed_response(
    endpoint: str, raw: bytes, sse_strip: str
) -> None:
    for plan in _plans(endpoint, stream=False):
        fast = strip_bytes(plan, raw, whole=True)
        assert fast is not None  # vLLM's own shape always takes the byte path
        assert json.loads(fast) == strip_response(plan, json.loads(raw))


def test_the_byte_path_takes_vllms_token_chunks_and_leaves_the_rest() -> None:
    """The point of the byte path: the role chunk and every token chunk of a captured stream
    take it (a real model server sends each in a read of its own); the usage chunk (dropped)
    and odd shapes are parsed."""
    chat = plan_request("chat.completions", {"model": "m", "stream": True}, "m", capture=True)
    assert [strip_bytes(chat, c) is not None for c in VLLM_CHAT_STREAM] == [
        True,
        True,
        True,
        False,
    ]
    role = strip_bytes(chat, sse_event(VLLM_CHAT_STREAM[0]))  # a whole event line works too
    assert role is not None and b'"prompt_token_ids":null' in role and role.startswith(b"data: ")
    done = strip_bytes(chat, VLLM_CHAT_STREAM[2])
    assert done is not None and b'"logprobs":null' in done and b'"token_ids":null' in done
    completions = plan_request("completions", {"model": "m", "stream": True}, "m", capture=True)
    assert all(strip_bytes(completions, c) is not None for c in VLLM_COMPLETIONS_STREAM)
    taken = sum(
        strip_bytes(chat, raw) is not None
        for e, raw in _generated_chunks()
        if e == "chat.completions"
    )
    assert taken > 0
    reordered = _generated_chunks()[-1][1]
    assert strip_bytes(chat, reordered) is None


def _capture() -> TrajectoryCapture:
    return TrajectoryCapture(
        CaptureContext(
            trajectory_id="t1",
            request_id="r1",
            session_id="s1",
            tenant_hash="h",
            user_hash=None,
            endpoint="chat.completions",
            model_alias="policy",
            policy_version="base",
            group_id=None,
            task=None,
            request_body={"model": "policy", "messages": [{"role": "user", "content": "hi"}]},
            sampling={},
        )
    )


def test_raw_events_build_the_same_record_as_parsed_chunks() -> None:
    raw, parsed = _capture(), _capture()
    block = b"".join(sse_event(event) for event in VLLM_CHAT_STREAM) + b"data: [DONE]\n\n"
    raw.add_sse(block[:100])  # blocks need not end at an event border
    raw.add_sse(block[100:])
    for event in VLLM_CHAT_STREAM:
        parsed.add_chunk(json.loads(event))
    built, expected = raw.build("ok"), parsed.build("ok")
    for record in (built, expected):
        record.pop("event_id")
        record.pop("timings")
        record.pop("created_at")
    assert built == expected
    assert built["choices"][0]["token_ids"] == [61, 1073]
    assert built["choices"][0]["message"]["content"] == "M How"
    broken = _capture()
    for event in [*VLLM_CHAT_STREAM[:2], b"not json", *VLLM_CHAT_STREAM[2:]]:
        broken.add_sse(sse_event(event))
    record = broken.build("ok")
    assert "unparsable_upstream_data" in record["flags"] and not record["trainable"]


def _slow_block(plan: RelayPlan, block: bytes) -> tuple[list[Any], dict | None]:
    """The parsing path, event by event: what the client gets, and the usage seen."""
    out: list[Any] = []
    usage = None
    for event in SSEParser().feed(block):
        if event == b"[DONE]":
            out.append("[DONE]")
            continue
        chunk = json.loads(event)
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        stripped = strip_chunk(plan, chunk)
        if stripped is not None:
            out.append(stripped)
    return out, usage


def _events_of(block: bytes) -> list[Any]:
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in SSEParser().feed(block)]


def _blocks() -> list[tuple[str, bytes]]:
    def block(events: list[bytes], done: bool = False) -> bytes:
        return b"".join(sse_event(e) for e in events) + (b"data: [DONE]\n\n" if done else b"")

    blocks = [
        ("chat.completions", block(VLLM_CHAT_STREAM, done=True)),
        ("chat.completions", block(VLLM_CHAT_STREAM[1:3])),
        ("chat.completions", block(VLLM_CHAT_STREAM[2:], done=True)),
        ("completions", block(VLLM_COMPLETIONS_STREAM, done=True)),
        ("chat.completions", block([VLLM_CHAT_STREAM[1], b'{"choices":[],"usage":null}'])),
    ]
    generated = _generated_chunks()
    for size in (1, 3, 5):
        for start in range(0, len(generated) - size, size):
            group = generated[start : start + size]
            if len({endpoint for endpoint, _ in group}) == 1:
                blocks.append((group[0][0], block([raw for _, raw in group])))
    return blocks


@pytest.mark.parametrize(("endpoint", "block"), _blocks())
def test_sse_blocks_strip_like_event_by_event(endpoint: str, block: bytes, sse_strip: str) -> None:
    taken = 0  # declining is allowed (event by event then runs), but not for every plan
    for plan in _plans(endpoint, stream=True):
        fast = strip_sse(plan, block)
        if fast is None:
            continue
        taken += 1
        out, usage = fast
        expected, expected_usage = _slow_block(plan, block)
        assert _events_of(out) == expected, (plan, block)
        assert usage == expected_usage
    assert taken, block


def test_sse_block_path_takes_vllm_streams_and_refuses_doubt(sse_strip: str) -> None:
    chat = plan_request("chat.completions", {"model": "m", "stream": True}, "m", capture=True)
    whole = b"".join(sse_event(e) for e in VLLM_CHAT_STREAM) + b"data: [DONE]\n\n"
    fast = strip_sse(chat, whole)
    assert fast is not None
    out, usage = fast
    assert usage == {"prompt_tokens": 31, "total_tokens": 35, "completion_tokens": 4}
    assert b"usage" not in out and b'logprob":{' not in out and out.endswith(b"[DONE]\n\n")
    # One event per read, as a model server streams: each takes the byte path too.
    for event in [*VLLM_CHAT_STREAM, b"[DONE]"]:
        alone = strip_sse(chat, sse_event(event))
        assert alone is not None and (alone[0] == b"") == (b'"usage":{' in event), event
    completions = plan_request("completions", {"model": "m", "stream": True}, "m", capture=True)
    assert strip_sse(completions, b"".join(sse_event(e) for e in VLLM_COMPLETIONS_STREAM))
    # Doubt → None: \r framing, an empty delta, multi-line data.
    assert strip_sse(chat, whole.replace(b"\n", b"\r\n")) is None
    # `data: ` inside a text is still one event line.
    texty = sse_event(VLLM_CHAT_STREAM[1].replace(b'"M"', b'"data: x\\n\\n"'))
    fast = strip_sse(chat, texty)
    assert fast is not None and _events_of(fast[0]) == _slow_block(chat, texty)[0]
    empty = _chat_chunk([_chat_choice(0, {}, True, True, None)])
    assert strip_sse(chat, sse_event(json.dumps(empty, separators=(",", ":")).encode())) is None
    assert strip_sse(chat, b"data: {\ndata: }\n\n") is None
    # JSON spelled with spaces: nothing is cut, so nothing may pass unstripped.
    spaced = json.dumps(json.loads(VLLM_CHAT_STREAM[1])).encode()
    assert strip_sse(chat, sse_event(spaced)) is None
    assert strip_bytes(chat, spaced) is None
    whole = plan_request("chat.completions", {"model": "m"}, "m", capture=True)
    assert strip_bytes(whole, json.dumps(json.loads(VLLM_CHAT_WHOLE)).encode(), whole=True) is None
    empty_role = VLLM_CHAT_STREAM[0].replace(b'"role":"assistant","content":""', b'"role":""')
    assert strip_sse(chat, sse_event(empty_role)) is None
    assert strip_sse(chat, b'data: {"usage":{"oops"\n\n') is None  # parsed event by event


def test_a_field_between_logprobs_and_finish_reason_is_never_cut_with_them(
    sse_strip: str,
) -> None:
    """The cut ran from `,"logprobs":{` to the first `},"finish_reason":`: an object-valued
    field after the logprobs (another upstream's, a later vLLM's) went with them, in the C
    and the Python strip alike. Now the bytes decline, and the parsing path keeps it."""
    chat = plan_request("chat.completions", {"model": "m", "stream": True}, "m", capture=True)
    event = (
        b'{"id":"x","object":"chat.completion.chunk","created":1,"model":"base","choices":'
        b'[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[]},'
        b'"extra":{"kept":true},"finish_reason":null,"token_ids":[5]}]}'
    )
    assert strip_sse(chat, sse_event(event)) is None
    assert strip_bytes(chat, event) is None
    whole_plan = plan_request("chat.completions", {"model": "m"}, "m", capture=True)
    whole = (
        b'{"id":"x","object":"chat.completion","created":1,"model":"base","choices":[{"index":0,'
        b'"message":{"role":"assistant","content":"Hi"},"logprobs":{"content":[]},'
        b'"extra":{"a":1},"finish_reason":"stop","token_ids":[5]}]}'
    )
    assert strip_bytes(whole_plan, whole, whole=True) is None
    stripped = strip_response(whole_plan, json.loads(whole))
    assert stripped["choices"][0]["extra"] == {"a": 1}


def test_the_c_strip_is_built_here() -> None:
    """The install builds the C pass wherever a compiler exists, as in CI; a broken build
    must fail here rather than quietly leave the proxy on the slower Python path."""
    assert relay.SSE_STRIP == "c" and NATIVE is not None, (
        "proxy/_sse_strip.c was not built: install a C compiler and Python's headers "
        "(Debian: gcc python3.11-dev) and run ./olpw again, which rebuilds it"
    )


_NOISE = [b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b"\n", b"\r", b"0", b"x", b" ", b"null"]


def _mutations(rng: random.Random, block: bytes, count: int) -> list[bytes]:
    """Blocks with a byte dropped, a JSON-significant byte inserted, or cut short."""
    out = []
    for _ in range(count):
        at = rng.randrange(len(block) + 1)
        kind = rng.randrange(3)
        if kind == 0:
            out.append(block[:at] + block[at + 1 :])
        elif kind == 1:
            out.append(block[:at] + rng.choice(_NOISE) + block[at:])
        else:
            out.append(block[:at])
    return out


def test_c_and_python_strips_agree_on_mangled_blocks() -> None:
    """The C pass reads upstream bytes: on thousands of damaged blocks it must not crash,
    must answer as the Python rules do where both answer, and where only one answers (the
    Python path sends a lone event through `strip_bytes`, whose checks differ: it passes a
    stray `\r`, and refuses a chunk without choices) that answer must be the parsing path's."""
    rng = random.Random(20261130)
    both = only_one = 0
    for endpoint, block in _blocks():
        for mangled in [block, *_mutations(rng, block, 40)]:
            for plan in _plans(endpoint, stream=True):
                if not plan.augmented:
                    continue
                native = relay.strip_sse(plan, mangled)
                if not mangled.endswith(b"\n\n"):
                    # Not whole events, which the relay never passes (`SSEParser.complete`);
                    # the C pass refuses them.
                    assert native is None, (plan, mangled)
                    continue
                python = strip_sse_python(plan, mangled)
                if native is not None and python is not None:
                    assert native == python, (plan, mangled)
                    both += 1
                    continue
                answer = native or python
                if answer is None:
                    continue
                only_one += 1
                try:
                    expected = _slow_block(plan, mangled)
                except ValueError:
                    continue  # not JSON: relayed as it came, on either byte path
                assert (_events_of(answer[0]), answer[1]) == expected, (plan, mangled)
    assert both > 2_000 and only_one < both / 10, (both, only_one)


def test_c_and_python_strips_agree_wherever_the_quotes_fall() -> None:
    """The C pass finds an event's quotes 16 bytes at a time and the last few bytes one by
    one: with the events shifted by 0-31 bytes (a longer id), every pattern it reads starts
    at every offset of those blocks and in the tail, and both strips answer alike."""
    taken = 0
    for endpoint, events in (
        ("chat.completions", VLLM_CHAT_STREAM),
        ("completions", VLLM_COMPLETIONS_STREAM),
    ):
        for pad in range(32):
            shifted = [event.replace(b'"id":"', b'"id":"' + b"x" * pad, 1) for event in events]
            block = b"".join(sse_event(e) for e in shifted) + b"data: [DONE]\n\n"
            for plan in _plans(endpoint, stream=True):
                if not plan.augmented:
                    continue
                native = relay.strip_sse(plan, block)
                assert native == strip_sse_python(plan, block), (plan, pad)
                taken += native is not None
    assert taken >= 64


def test_c_and_python_whole_strips_agree_on_mangled_responses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same for a non-streamed response: the C pass answers exactly as the Python rules
    (including across a raw newline, where both refuse a logprobs cut), and never crashes."""
    broken_line = VLLM_CHAT_WHOLE.replace(b'"top_logprobs":[]}', b'"top_logprobs":[]}\n', 1)
    plan = plan_request("chat.completions", {"model": "m"}, "m", capture=True)
    assert strip_bytes(plan, broken_line, whole=True) is None  # a cut must stay on one line
    rng = random.Random(20261201)
    taken = refused = 0
    for endpoint, raw in [
        ("chat.completions", VLLM_CHAT_WHOLE),
        ("completions", VLLM_COMPLETIONS_WHOLE),
    ]:
        pretty = json.dumps(json.loads(raw), indent=1).encode()  # raw newlines everywhere
        for mangled in [raw, pretty, *_mutations(rng, raw, 300)]:
            for plan in _plans(endpoint, stream=False):
                native = strip_bytes(plan, mangled, whole=True)
                with monkeypatch.context() as patch:
                    patch.setattr(relay, "_sse_strip", None)
                    python = strip_bytes(plan, mangled, whole=True)
                assert native == python, (plan, mangled)
                if plan.augmented:
                    taken += native is not None
                    refused += native is None
    assert taken > 1_000 and refused > 100, (taken, refused)


def test_the_whole_strip_declines_logprobs_holding_what_vllm_never_writes_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A line break, an `"index":` or a `},"` inside the logprobs value (another choice or a
    field after it would go with the cut): each is put at every offset of the value, and
    both strips decline it."""
    plan = plan_request("chat.completions", {"model": "m"}, "m", capture=True)
    assert strip_bytes(plan, VLLM_CHAT_WHOLE, whole=True) is not None
    start = VLLM_CHAT_WHOLE.index(b',"logprobs":{') + len(b',"logprobs":{')
    stop = VLLM_CHAT_WHOLE.index(b'},"finish_reason":', start)
    for pattern in (b"\n", b'"index":', b'},"'):
        for at in range(start, stop + 1):
            mangled = VLLM_CHAT_WHOLE[:at] + pattern + VLLM_CHAT_WHOLE[at:]
            assert strip_bytes(plan, mangled, whole=True) is None, (pattern, at)
            with monkeypatch.context() as patch:
                patch.setattr(relay, "_sse_strip", None)
                assert strip_bytes(plan, mangled, whole=True) is None, (pattern, at)


def test_sse_parser_complete_keeps_partial_events() -> None:
    parser = SSEParser()
    whole = b"".join(sse_event(e) for e in VLLM_CHAT_STREAM)
    got = [parser.complete(whole[i : i + 50]) for i in range(0, len(whole), 50)]
    assert b"".join(got) == whole and parser.rest() == b""
    crlf = SSEParser()
    assert crlf.complete(b"data: 1\r\n\r\ndata: 2\r") == b"data: 1\n\n"
    assert crlf.complete(b"\n\r\n") == b"data: 2\n\n"
    # A border split between two reads, and a large event over many reads: searched only
    # where the new bytes came (each read copied and searched the whole event before).
    split = SSEParser()
    assert split.complete(b"data: 3\n") == b"" and split.complete(b"\ndata: 4") == b"data: 3\n\n"
    assert split.rest() == b"data: 4"
    large, event = SSEParser(), b"data: " + b"x" * 1_000_000 + b"\n\n"
    got = [large.complete(event[i : i + 65536]) for i in range(0, len(event), 65536)]
    assert b"".join(got) == event and large.rest() == b""
