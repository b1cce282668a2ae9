"""Text a tool-call parser leaves out of the message is still in the token ids: searched.

vLLM's hermes parser returns the calls it parses and the text before the first
`<tool_call>`; text after `</tool_call>` (or between calls) is in no field of the answer,
while its token ids are. The record is built as the sink's worker builds it, from the raw
upstream bytes the relay keeps.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.capture import TrajectoryCapture, build_packed_record, pack_capture
from replay.schemas import validate_trajectory
from safety.redaction import Redactor
from tests.proxy.test_proxy_units import _capture as unit_capture

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOL_CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def _capture(stream: bool) -> TrajectoryCapture:
    capture = unit_capture()
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather"}}],
    }
    capture.context.request_body = {**body, "stream": stream}
    capture.context.request_raw = json.dumps(capture.context.request_body).encode()
    return capture


def _entries(tokens: list[str]) -> list[dict[str, Any]]:
    return [
        {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in tokens
    ]


def _usage(completion: int) -> dict[str, int]:
    return {"prompt_tokens": 3, "completion_tokens": completion, "total_tokens": 3 + completion}


def _response(tokens: list[str], message: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": {"content": _entries(tokens)},
                    "finish_reason": "tool_calls",
                    "token_ids": list(range(100, 100 + len(tokens))),
                }
            ],
            "usage": _usage(len(tokens)),
            "prompt_token_ids": [1, 2, 3],
        }
    ).encode()


def _stream(tokens: list[str], call_at: int | None) -> bytes:
    """vLLM's stream of a parsed call: one chunk per token, an empty delta while the parser
    holds text back, the call as one fragment at `call_at`, nothing for the dropped tail."""
    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
               "prompt_token_ids": [1, 2, 3]}]  # fmt: skip
    for position, token in enumerate(tokens):
        delta: dict[str, Any] = {}
        if position == call_at:
            delta = {"tool_calls": [{"index": 0, **TOOL_CALL}]}
        last = position == len(tokens) - 1
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": {"content": _entries([token])},
            "finish_reason": "tool_calls" if last else None,
            "token_ids": [100 + position],
        }
        events.append({"choices": [choice]})
    events.append({"choices": [], "usage": _usage(len(tokens))})
    lines = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events]
    return b"".join(lines) + b"data: [DONE]\n\n"


def _record(tokens: list[str], stream: bool) -> dict[str, Any]:
    capture = _capture(stream)
    if stream:
        capture.add_sse(_stream(tokens, call_at=len(tokens) // 2))
    else:
        capture.add_raw_response(
            _response(tokens, {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]})
        )
    record = build_packed_record(pack_capture(capture), "ok", Redactor().redact_obj)
    validate_trajectory(record)
    return record


def _tokens(text: str) -> list[str]:
    return [text[i : i + 3] for i in range(0, len(text), 3)]


@pytest.mark.parametrize("stream", [False, True])
def test_an_email_after_the_call_empties_the_token_ids(stream: bool) -> None:
    record = _record(_tokens(CALL + "\nOr mail jane.doe@example.com"), stream)
    assert record["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert record["redactions"] == {"email": 1}
    assert record["prompt_token_ids"] == [] and record["choices"][0]["token_ids"] == []
    assert record["trainable"] is False and "redacted" in record["flags"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_with_nothing_hidden_stays_trainable(stream: bool) -> None:
    tokens = _tokens(CALL)
    record = _record(tokens, stream)
    assert record["redactions"] == {} and record["flags"] == []
    assert record["trainable"] is True
    assert len(record["choices"][0]["token_ids"]) == len(tokens)


def test_tokens_split_inside_a_character_are_joined_by_their_bytes() -> None:
    """A token may be half of a UTF-8 character (its `token` text then unreadable); the
    hidden text is read from the entries' bytes."""
    tail = "\nclé: jane.doe@example.com"
    raw = (CALL + tail).encode()
    cut = raw.index("é".encode()) + 1  # inside the two bytes of é
    entries = [
        {"token": "bytes:x", "logprob": -0.5, "bytes": list(part), "top_logprobs": []}
        for part in (raw[:cut], raw[cut:])
    ]
    capture = _capture(False)
    body = json.loads(_response(["a", "b"], {"role": "assistant", "tool_calls": [TOOL_CALL]}))
    body["choices"][0]["logprobs"]["content"] = entries
    capture.add_raw_response(json.dumps(body).encode())
    record = build_packed_record(pack_capture(capture), "ok", Redactor().redact_obj)
    assert record["redactions"] == {"email": 1}
    assert record["choices"][0]["token_ids"] == []


def test_a_streamed_call_the_parser_cannot_read_is_searched_too() -> None:
    """Streamed, vLLM's parser sends nothing after a `<tool_call>` it cannot parse and no
    call: the answer has neither text nor calls, the token ids all of it."""
    capture = _capture(True)
    capture.add_sse(_stream(_tokens("<tool_call>Mail jane.doe@example.com"), call_at=None))
    record = build_packed_record(pack_capture(capture), "ok", Redactor().redact_obj)
    validate_trajectory(record)
    assert record["choices"][0]["message"]["tool_calls"] == []
    assert record["redactions"] == {"email": 1}
    assert record["choices"][0]["token_ids"] == [] and record["trainable"] is False
