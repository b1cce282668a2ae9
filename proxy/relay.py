"""What the proxy adds to a request for capture, and how it takes it out of the response again.

For a captured request the proxy asks upstream for sampling logprobs, token ids and (for
streams) a usage chunk. The client must not see any of that unless it asked: `strip_response`
and `strip_chunk` remove exactly what was added, so the response matches what the model
server would have sent for the client's own request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Endpoint = Literal["chat.completions", "completions"]

ENDPOINT_PATHS: dict[Endpoint, str] = {
    "chat.completions": "/v1/chat/completions",
    "completions": "/v1/completions",
}


@dataclass
class RelayPlan:
    """The body to send upstream and the list of additions to strip from the answer."""

    endpoint: Endpoint
    stream: bool
    upstream_body: dict[str, Any]
    added_logprobs: bool = False
    added_token_ids: bool = False
    added_usage: bool = False
    client_wants_usage: bool = field(default=False)

    @property
    def augmented(self) -> bool:
        return self.added_logprobs or self.added_token_ids or self.added_usage


def plan_request(
    endpoint: Endpoint, body: dict[str, Any], served_model: str, capture: bool
) -> RelayPlan:
    """Copy the client's body, point it at the served model and, if capturing, ask for more."""
    upstream = dict(body)
    upstream["model"] = served_model
    stream = bool(body.get("stream", False))
    plan = RelayPlan(endpoint=endpoint, stream=stream, upstream_body=upstream)
    options = body.get("stream_options")
    plan.client_wants_usage = bool(isinstance(options, dict) and options.get("include_usage"))
    if not capture:
        return plan
    if endpoint == "chat.completions":
        if not body.get("logprobs"):
            upstream["logprobs"] = True
            plan.added_logprobs = True
    elif body.get("logprobs") is None:
        upstream["logprobs"] = 0
        plan.added_logprobs = True
    if not body.get("return_token_ids"):
        upstream["return_token_ids"] = True
        plan.added_token_ids = True
    if stream and not plan.client_wants_usage:
        merged = dict(options) if isinstance(options, dict) else {}
        merged["include_usage"] = True
        upstream["stream_options"] = merged
        plan.added_usage = True
    return plan


def _null_if_present(obj: dict[str, Any], key: str) -> None:
    """vLLM sends `key: null` when a field was not requested; mirror that exactly."""
    if key in obj:
        obj[key] = None


def strip_response(plan: RelayPlan, payload: dict[str, Any]) -> dict[str, Any]:
    """Remove from a non-streamed response what the proxy asked for on its own behalf."""
    if not plan.augmented:
        return payload
    out = dict(payload)
    if plan.added_token_ids:
        _null_if_present(out, "prompt_token_ids")
    choices = []
    for choice in payload.get("choices") or []:
        choice = dict(choice)
        if plan.added_logprobs:
            _null_if_present(choice, "logprobs")
        if plan.added_token_ids:
            _null_if_present(choice, "token_ids")
            _null_if_present(choice, "prompt_token_ids")
        choices.append(choice)
    out["choices"] = choices
    return out


def strip_chunk(
    plan: RelayPlan, chunk: dict[str, Any], in_place: bool = False
) -> dict[str, Any] | None:
    """Strip one stream chunk; None when the chunk exists only because of the additions.

    `in_place` edits `chunk` and its choices instead of copying them (the relay's hot path,
    once the capture took what it needs from the chunk)."""
    if not plan.augmented:
        return chunk
    choices = chunk.get("choices")
    if plan.added_usage and not choices and chunk.get("usage") is not None:
        return None
    out = chunk if in_place else dict(chunk)
    added_ids, added_logprobs = plan.added_token_ids, plan.added_logprobs
    if added_ids and "prompt_token_ids" in out:
        out["prompt_token_ids"] = None  # vLLM sends null for what was not asked: mirror it
    if plan.added_usage and "usage" in out and choices:
        out.pop("usage")
    if choices:
        stripped = []
        empty = True
        for choice in choices:
            if not in_place:
                choice = dict(choice)
            if added_logprobs and "logprobs" in choice:
                choice["logprobs"] = None
            if added_ids:
                if "token_ids" in choice:
                    choice["token_ids"] = None
                if "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
            stripped.append(choice)
            if empty and not _is_empty_choice(plan, choice):
                empty = False
        if empty:
            return None
        out["choices"] = stripped
    return out


def _is_empty_choice(plan: RelayPlan, choice: dict[str, Any]) -> bool:
    """A chunk choice that carries nothing the client would see (vLLM sends these only when
    token ids or logprobs are requested)."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    if plan.endpoint == "chat.completions":
        delta = choice.get("delta")
        if delta:
            for value in delta.values():
                if value is not None and value != "" and value != []:
                    return False
        return True
    return not choice.get("text")


class SSEParser:
    """Splits an SSE byte stream into events' `data:` payloads (bytes), across chunk borders."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> Iterator[bytes]:
        buffer = self._buffer + data if self._buffer else data
        if b"\r" in buffer:
            buffer = buffer.replace(b"\r\n", b"\n")
        events = buffer.split(b"\n\n")
        self._buffer = events.pop()
        for event in events:
            if event.startswith(b"data:") and b"\n" not in event:
                yield event[5:].lstrip(b" ")  # the usual one-line event
                continue
            lines = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if lines:
                yield b"\n".join(lines)

    def rest(self) -> bytes:
        return self._buffer


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


def dumps(obj: Any) -> bytes:
    """Compact JSON, the way vLLM serialises its chunks."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


try:  # msgspec comes with vLLM; without it the standard library does the same, slower
    import msgspec

    _fast_decode = msgspec.json.Decoder().decode
    _fast_encode = msgspec.json.Encoder().encode
    _FastDecodeError: type[Exception] = msgspec.DecodeError
except ImportError:  # pragma: no cover - every supported install has msgspec
    _fast_decode, _fast_encode, _FastDecodeError = json.loads, dumps, json.JSONDecodeError


def parse_json(data: bytes) -> tuple[Any, Callable[[Any], bytes]]:
    """Parse upstream JSON; return it and the encoder that writes it back faithfully.

    The fast decoder (msgspec, ~4x faster than `json`) rejects what only Python's `json`
    accepts (NaN/Infinity literals, lone surrogates, numbers out of float range); such input
    is parsed and re-encoded by `json` so non-finite values round-trip as they came. Raises
    ValueError (json.JSONDecodeError / UnicodeDecodeError) when the data is not JSON.
    """
    try:
        return _fast_decode(data), _fast_encode
    except _FastDecodeError:
        return json.loads(data), dumps
