"""Trajectory capture: turn one proxied request into a trajectory record, off the response path.

`TrajectoryCapture` keeps the raw bytes upstream sent (a whole response or stream events,
before the client-facing stripping) and parses them only when the record is built;
`CaptureService.submit` has the record built, checked and redacted after the response, and
handed to the sink. A sink that builds records in its own worker process (`put_capture`,
KafkaSinkProcess) receives the capture packed into bytes (`pack_capture`), so none of that
work runs on the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import math
import pickle
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from proxy.relay import Endpoint, SSEParser, parse_json
from replay.schemas import derived_event_id
from safety import redaction
from safety.pseudonym import pseudonym

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 1

# Request fields that describe the sampling distribution (copied as sent upstream; the plan
# never changes them, so the client's body holds the same values: `plan_request`).
SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "stop_token_ids",
    "seed",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "ignore_eos",
    "min_tokens",
    "best_of",
    "use_beam_search",
)
_SAMPLING_KEY_SET = frozenset(SAMPLING_KEYS)


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling parameters of an upstream request body, in the body's order. Walking the
    body's few keys, not the 19 names (~10k instructions a captured request)."""
    return {key: value for key, value in body.items() if key in _SAMPLING_KEY_SET}


# A redactor returns a redacted copy of a JSON-like value and the number of hits per kind.
Redact = Callable[[Any], tuple[Any, dict[str, int]]]


class CaptureContext(msgspec.Struct):
    """What is known about a request before upstream answers. A msgspec Struct, made in C
    for every captured request (0.09 us against a slotted dataclass's 0.24: its `__init__`
    is Python code). The relay passes the fields positionally, in this order
    (`CompletionRelay._capture_for`): a new one goes there too. Types are not checked."""

    trajectory_id: str
    request_id: str
    session_id: str
    tenant_hash: str
    user_hash: str | None
    endpoint: Endpoint
    model_alias: str
    policy_version: str
    group_id: str | None
    task: str | None
    request_body: dict[str, Any]
    # None: read from `request_body` when the record is built (`sampling_params`), which
    # is what the proxy does: in a sink's worker process, not on the request's path (~9k
    # instructions of the proxy's per captured request, with pickling the dict).
    sampling: dict[str, Any] | None = None
    created_at: float = msgspec.field(default_factory=time.time)
    started: float = msgspec.field(default_factory=time.monotonic)
    # The client's body as it came, which `request_body` was parsed from. A context sent to
    # a sink's worker process carries these bytes instead of the dict, and the worker parses
    # them again: the proxy's feeder pickled a capture in 8.8 µs instead of 14.9 µs for the
    # bench's small request, and 33.5 instead of 53.4 µs for a 33 KB agent request.
    request_raw: bytes | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        return (_unpickle_context, _context_state(self))

    def sampling_params(self) -> dict[str, Any]:
        """`sampling`, read from the request body the first time when it was not given."""
        if self.sampling is None:
            body = self.request_body
            self.sampling = sampling_of(body) if isinstance(body, dict) else {}
        return self.sampling


def _message_record(message: dict[str, Any]) -> dict[str, Any]:
    """A whole response's message as the record keeps it. Its reasoning (vLLM's reasoning
    parser moves the text of the model's thinking out of `content`, its token ids stay in
    `token_ids`) is kept too: without it the record's text did not match its ids, and the
    reasoning escaped redaction while its ids went out."""
    record = {
        "role": message.get("role", "assistant"),
        "content": message.get("content"),
        "tool_calls": message.get("tool_calls") or [],
    }
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        record["reasoning"] = reasoning
    return record


@dataclass
class _Choice:
    index: int
    role: str | None = None
    content: list[str] = field(default_factory=list)
    # A reasoning parser's text (vLLM `--reasoning-parser`), whose tokens are in token_ids.
    reasoning: list[str] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    message: dict[str, Any] | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None


NONFINITE_LOGPROB = -1.0e9


_USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _token_count(value: Any) -> int:
    """A usage count as the record keeps it: 0 for anything but a count. `int("abc")` from a
    broken upstream failed the whole build (the record lost, the text in the log's
    traceback); `check` flags such usage `missing_usage`."""
    return value if _is_count(value) else 0


def _calls_tools(choice: _Choice) -> bool:
    message = choice.message
    return bool(choice.tool_calls or (message is not None and message.get("tool_calls")))


class _SampledEntry(msgspec.Struct, gc=False):
    token: str | None = None
    bytes: list[int] | None = None


class _SampledLogprobs(msgspec.Struct, gc=False):
    content: list[_SampledEntry] | None = None


class _SampledChoice(msgspec.Struct, gc=False):
    index: int = 0
    logprobs: _SampledLogprobs | None = None


class _SampledPayload(msgspec.Struct, gc=False):
    """A chat response or chunk: only its choices' logprob entries."""

    choices: list[_SampledChoice] | None = None


_decode_sampled = msgspec.json.Decoder(_SampledPayload).decode


def _sampled_texts(raw_response: bytes | None, raw_events: list[bytes]) -> dict[int, str]:
    """Each chat choice's sampled text, joined from its logprob entries' `bytes` (the
    token's exact UTF-8, where `token` may be half a character), else their `token`. A
    payload of another shape adds nothing (`check` flags its record already)."""
    pieces: dict[int, list[bytes]] = {}
    for data in ([raw_response] if raw_response is not None else []) + raw_events:
        try:
            payload = _decode_sampled(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            try:  # JSON only `json` reads (a lone surrogate, a non-finite logprob)
                payload = msgspec.convert(
                    parse_json(data, allow_nonfinite=True)[0], _SampledPayload
                )
            except (ValueError, msgspec.ValidationError):
                continue
        for choice in payload.choices or []:
            content = choice.logprobs.content if choice.logprobs is not None else None
            if content is None:
                continue
            out = pieces.setdefault(choice.index, [])
            for entry in content:
                raw = entry.bytes
                if raw is not None and all(0 <= b < 256 for b in raw):
                    out.append(bytes(raw))
                elif entry.token is not None:
                    out.append(entry.token.encode("utf-8", "surrogatepass"))
    return {index: b"".join(parts).decode("utf-8", "replace") for index, parts in pieces.items()}


def _logprob_values(endpoint: Endpoint, logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    if endpoint == "chat.completions":
        content = logprobs.get("content")
        if content is None:
            return None
        return [_logprob(entry["logprob"]) for entry in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else [_logprob(v) for v in values]


def _logprob(value: Any) -> float:
    """A logprob as sent; null is vLLM's NaN (`max(nan, -9999.0)` is nan, which its encoder
    writes as null): NaN here, so that the record is kept and flagged `nonfinite_logprob`
    (`float(None)` raised, and the record was lost)."""
    return math.nan if value is None else float(value)


# Typed views of vLLM's chat output holding only what a record reads: msgspec skips the
# rest (ids, `object`, each logprob entry's token, bytes and top_logprobs) instead of
# building dicts of it. For the bench's 16-token stream (in a worker-like loop), parsing
# took 55 µs of a 98 µs record as dicts through `add_chunk`, and takes 24 through these
# views, `_sse_payloads` and `_add_chat_chunks`; the whole record 49 µs.
# A field's type is what the dict path reads without raising or coercing; anything else
# (a float index, a logprob as a string, a non-finite number, JSON only `json` reads)
# fails validation, and the whole capture is then parsed by the dict path, which decides
# exactly as it always did. Where the dict path copies a value into the record as it
# came (usage, prompt ids, a whole response's message), the view keeps it as `Any`.
# `gc=False`: they hold JSON values only, never a cycle; untracked, they decode 10% faster.
class _Function(msgspec.Struct, gc=False):
    name: str | None = None
    arguments: str | None = None


class _ToolCallFragment(msgspec.Struct, gc=False):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: _Function | None = None


class _Delta(msgspec.Struct, gc=False):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None  # vLLM's name for it before `reasoning`
    tool_calls: list[_ToolCallFragment] | None = None


class _LogprobEntry(msgspec.Struct, gc=False):
    logprob: float


class _ChatLogprobs(msgspec.Struct, gc=False):
    content: list[_LogprobEntry] | None = None


class _ChatChunkChoice(msgspec.Struct, gc=False):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    logprobs: _ChatLogprobs | None = None


class _ChatChunk(msgspec.Struct, gc=False):
    choices: list[_ChatChunkChoice] | None = None
    usage: Any = None
    prompt_token_ids: Any = None


class _ChatChoice(msgspec.Struct, gc=False):
    index: int = 0
    message: dict[str, Any] | None = None
    finish_reason: Any = None
    token_ids: Any = None
    logprobs: _ChatLogprobs | None = None


class _ChatResponse(msgspec.Struct, gc=False):
    choices: list[_ChatChoice] | None = None
    usage: Any = None
    prompt_token_ids: Any = None


_decode_chat_chunk = msgspec.json.Decoder(_ChatChunk).decode
_decode_chat_response = msgspec.json.Decoder(_ChatResponse).decode


# A choice vLLM ended itself mid-generation (its engine shutting down, a paused engine
# aborting what ran): the stream still ends with usage and [DONE], and the cut-off sample
# was recorded `ok` and trained on.
# (A tuple: compared, not hashed, as a mangled event's reason may be a list.)
_CUT_BY_THE_SERVER = ("abort", "error")


def _sse_payloads(data: bytes) -> list[bytes]:
    """The `data:` payloads of whole SSE events, `[DONE]` left out: what
    `SSEParser().feed(data)` yields (a partial event at the end is dropped).

    vLLM's stream (`data: <one line>` events, `\n\n` after each) is split on the event
    borders at once: 2.7 µs for the bench's 18 events, where the parser's slicing took 13.
    Anything else (comments, multi-line events, `\r`, a cut-off end) goes to the parser."""
    if (
        data.startswith(b"data: ")
        and data.endswith(b"\n\n")
        and b"\r" not in data
        and b"data:  " not in data  # the parser strips every space after `data:`
    ):
        payloads = data[6:-2].split(b"\n\ndata: ")
        # Only the borders' newlines: each payload is one whole line.
        if data.count(b"\n") == 2 * len(payloads):
            if payloads[-1] == b"[DONE]":
                payloads.pop()
            if b"[DONE]" in payloads:
                payloads = [payload for payload in payloads if payload != b"[DONE]"]
            return payloads
    return [event for event in SSEParser().feed(data) if event != b"[DONE]"]


# The context's fields but its parsed body, which a pickled context leaves out when it has
# the raw bytes (the worker parses them again: `_unpickle_context`).
_CONTEXT_FIELDS = tuple(f for f in CaptureContext.__struct_fields__ if f != "request_body")
# TrajectoryCapture's fields but its context.
_CAPTURE_FIELDS = (
    "choices",
    "prompt_token_ids",
    "usage",
    "ttft_s",
    "finished_at",
    "unparsable",
    "_raw_sse",
    "_raw_response",
)


# This function and `TrajectoryCapture.__reduce__` read each field by name, in
# `_CONTEXT_FIELDS` / `_CAPTURE_FIELDS` order (a test holds them to it), rather than through
# `operator.attrgetter(*fields)`: the interpreter specialises attribute loads in bytecode, and
# attrgetter's generic lookups, with the capture's `__dict__` that the old check made the
# interpreter build, cost the feeder ~9k more instructions per pickled capture (callgrind:
# 23.6k against 14.5k).
def _context_values(c: CaptureContext) -> tuple[Any, ...]:
    return (
        c.trajectory_id,
        c.request_id,
        c.session_id,
        c.tenant_hash,
        c.user_hash,
        c.endpoint,
        c.model_alias,
        c.policy_version,
        c.group_id,
        c.task,
        c.sampling,
        c.created_at,
        c.started,
        c.request_raw,
    )


def _context_state(context: CaptureContext) -> tuple[tuple[Any, ...], dict[str, Any] | None]:
    """A context's values, and its parsed body only when the raw bytes are missing."""
    body = None if context.request_raw is not None else context.request_body
    return _context_values(context), body


def _unpickle_context(
    context_values: tuple[Any, ...], request_body: dict[str, Any] | None
) -> CaptureContext:
    """`_context_state`'s inverse, in the sink's worker: the body parsed from its bytes."""
    state = dict(zip(_CONTEXT_FIELDS, context_values, strict=True))
    if request_body is None and state["request_raw"] is not None:
        request_body, _ = parse_json(state["request_raw"])
    return CaptureContext(request_body=request_body, **state)


def _unpickle_capture(
    context_values: tuple[Any, ...],
    request_body: dict[str, Any] | None,
    capture_values: tuple[Any, ...],
) -> TrajectoryCapture:
    """`TrajectoryCapture.__reduce__`'s inverse, in the sink's worker."""
    capture = TrajectoryCapture(_unpickle_context(context_values, request_body))
    for name, value in zip(_CAPTURE_FIELDS, capture_values, strict=True):
        setattr(capture, name, value)
    return capture


# A finished capture crosses to the sink's worker as one bytes object: MessagePack of its
# values (`pack_capture`, on the event loop at submit) or, for what MessagePack cannot hold
# (a lone surrogate, an integer over 64 bits, a parsed choice), a pickle. Packed with
# msgspec in ~2 µs, the capture leaves the proxy's memory at once, and the sink's feeder
# pickles one bytes object instead of walking the capture through `__reduce__`.
_PACKED_MSGPACK = b"m"
_PACKED_PICKLE = b"p"
_encode_msgpack_into = msgspec.msgpack.Encoder().encode_into
_decode_msgpack = msgspec.msgpack.Decoder().decode
# Room for the tag and the context's values besides the raw request and answer.
_PACK_HEADROOM = 1024


def pack_capture(capture: TrajectoryCapture) -> bytes | bytearray:
    """The capture as bytes for another process (`unpack_capture` reads them).

    Encoded into a buffer sized for the raw request and answer, after the tag: msgspec's own
    buffer starts small and grows by copying, and prefixing the tag copied it all once more
    (the bench's answer encoded in 0.29 µs this way, 0.36 that way)."""
    if not capture.choices:  # the relay's captures: raw bytes, parsed only when built
        context = capture.context
        body = None if context.request_raw is not None else context.request_body
        packed = bytearray(
            _PACK_HEADROOM + len(context.request_raw or b"") + len(capture._raw_response or b"")
        )
        packed[0] = _PACKED_MSGPACK[0]
        try:
            _encode_msgpack_into(
                (
                    _context_values(context),
                    body,
                    capture.prompt_token_ids,
                    capture.usage,
                    capture.ttft_s,
                    capture.finished_at,
                    capture.unparsable,
                    capture._raw_sse,
                    capture._raw_response,
                ),
                packed,
                1,
            )
            return packed
        except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
            pass  # a value MessagePack cannot hold: pickled below
    return _PACKED_PICKLE + pickle.dumps(capture, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_capture(data: bytes | bytearray) -> TrajectoryCapture:
    """`pack_capture`'s inverse, in the sink's worker."""
    if data[:1] == _PACKED_PICKLE:
        capture: TrajectoryCapture = pickle.loads(data[1:])
        return capture
    if data[:1] != _PACKED_MSGPACK:
        raise ValueError(f"not a packed capture: tag {data[:1]!r}")
    context_values, body, *values = _decode_msgpack(memoryview(data)[1:])
    return _unpickle_capture(tuple(context_values), body, ({}, *values))


class TrajectoryCapture(msgspec.Struct, eq=False):
    """Accumulates one request's upstream output; `build()` makes the trajectory record.

    The relay hands over raw bytes (`add_sse`, `add_raw_response`): appending them is all
    the response path pays; they are parsed in `build()`. Picklable, so a sink can build the
    record in another process. A msgspec Struct like its context, made in C (0.18 us
    against 0.30 for a slotted class's Python `__init__`); compared by identity."""

    context: CaptureContext
    choices: dict[int, _Choice] = msgspec.field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    usage: dict[str, Any] | None = None
    ttft_s: float | None = None
    finished_at: float | None = None  # monotonic; set by `CaptureService.submit`, once
    unparsable: int = 0  # raw events or responses not JSON objects, or not of their shape
    _raw_sse: list[bytes] = msgspec.field(default_factory=list)
    _raw_response: bytes | None = None
    # Set when built (never packed or pickled): `sampled_texts`.
    _sampled: dict[int, str] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        """The capture and its context as two tuples of values (the proxy packs a capture
        with `pack_capture`, which pickles only what MessagePack cannot hold). Pickled as
        objects, each was
        a state dict with its keys (the context's made by its Python `__getstate__`): the
        proxy's sink feeder spent ~38k instructions per capture on that, 3/10 of what capture
        adds to a request, against ~14.5k this way in a micro-benchmark (batches of 12;
        ~17k in the serving proxy, callgrind)."""
        context = self.context
        body = None if context.request_raw is not None else context.request_body
        values = (
            self.choices,
            self.prompt_token_ids,
            self.usage,
            self.ttft_s,
            self.finished_at,
            self.unparsable,
            self._raw_sse,
            self._raw_response,
        )
        return (_unpickle_capture, (_context_values(context), body, values))

    def add_sse(self, block: bytes) -> None:
        """Whole upstream SSE events (`data: ...` lines, `[DONE]` included), parsed at build
        time."""
        self._raw_sse.append(block)

    def add_raw_response(self, data: bytes) -> None:
        """A whole (non-streamed) upstream response body, parsed at build time."""
        self._raw_response = data

    def _absorb_raw(self) -> None:
        raw_response, raw_sse = self._raw_response, self._raw_sse
        self._raw_response, self._raw_sse = None, []
        raw_events = _sse_payloads(b"".join(raw_sse)) if raw_sse else []
        chat = self.context.endpoint == "chat.completions"
        if not (chat and self._absorb_chat(raw_response, raw_events)):
            self._absorb_each(raw_response, raw_events)
        if chat and (self._offers_tools() or any(map(_calls_tools, self.choices.values()))):
            self._sampled = _sampled_texts(raw_response, raw_events)

    def _offers_tools(self) -> bool:
        body = self.context.request_body
        return isinstance(body, dict) and bool(body.get("tools"))

    def sampled_texts(self) -> list[str]:
        """The text each chat choice of a request offering tools sampled, read from its
        logprobs' tokens (after `build`): vLLM's tool-call parser (hermes) leaves out of the
        message what it does not parse as a call (text after `</tool_call>`, between two
        calls; streamed, all that follows a `<tool_call>` it cannot parse), while the token
        ids still spell all of it. `redact_record` searches it too."""
        return list((self._sampled or {}).values())

    def _absorb_chat(self, raw_response: bytes | None, raw_events: list[bytes]) -> bool:
        """Parse chat output through the typed views; False (nothing absorbed) when any of
        it is not what they read, for `_absorb_each` to parse it all instead."""
        try:
            response = None if raw_response is None else _decode_chat_response(raw_response)
            chunks = [_decode_chat_chunk(event) for event in raw_events]
        except Exception:  # any failure: the dict path decides, as it always did
            return False
        if response is not None:
            self._add_chat_response(response)
        self._add_chat_chunks(chunks)
        return True

    def _absorb_each(self, raw_response: bytes | None, raw_events: list[bytes]) -> None:
        """The dict path: each event (or the response) parsed on its own, so one that is
        not a JSON object counts once in `unparsable` and the others still count."""
        for data, add in (
            *(((raw_response, self.add_response),) if raw_response is not None else ()),
            *((event, self.add_chunk) for event in raw_events),
        ):
            try:
                # Upstream data as it came: a non-finite logprob is flagged, not unparsable.
                parsed, _ = parse_json(data, allow_nonfinite=True)
            except ValueError:
                self.unparsable += 1
                continue
            if not isinstance(parsed, dict):
                self.unparsable += 1
                continue
            try:
                add(parsed)
            except (AttributeError, ArithmeticError, KeyError, TypeError, ValueError):
                # An object of another shape (`"choices": 5`, a choice that is a list): the
                # whole record failed to build and was lost; it is kept, flagged.
                self.unparsable += 1

    def _add_chat_response(self, payload: _ChatResponse) -> None:
        """`add_response` of a chat response's typed view."""
        prompt_ids, usage = payload.prompt_token_ids, payload.usage
        if isinstance(prompt_ids, list):
            self.prompt_token_ids = prompt_ids
        if isinstance(usage, dict):
            self.usage = usage
        for raw in payload.choices or []:
            choice = self._choice(raw.index)
            choice.finish_reason = raw.finish_reason
            choice.token_ids = raw.token_ids
            logprobs = raw.logprobs
            content = None if logprobs is None else logprobs.content
            choice.logprobs = None if content is None else [entry.logprob for entry in content]
            choice.message = _message_record(raw.message or {})

    def _add_chat_chunks(self, chunks: list[_ChatChunk]) -> None:
        """`add_chunk` of each chat chunk's typed view, in order."""
        choices = self.choices
        for chunk in chunks:
            prompt_ids = chunk.prompt_token_ids
            if (
                prompt_ids is not None
                and self.prompt_token_ids is None
                and isinstance(prompt_ids, list)
            ):
                self.prompt_token_ids = prompt_ids
            usage = chunk.usage
            if usage is not None and isinstance(usage, dict):
                self.usage = usage
            raws = chunk.choices
            if not raws:
                continue
            for raw in raws:
                choice = choices.get(raw.index)
                if choice is None:
                    choice = self._choice(raw.index)
                if raw.finish_reason is not None:
                    choice.finish_reason = raw.finish_reason
                ids = raw.token_ids
                if ids is not None:
                    if choice.token_ids is None:
                        choice.token_ids = ids  # the decoded list is this capture's own
                    else:
                        choice.token_ids += ids
                logprobs = raw.logprobs
                if logprobs is not None:
                    content = logprobs.content
                    if content is not None:
                        values = choice.logprobs
                        if values is None:
                            values = choice.logprobs = []
                        for entry in content:  # mostly one: a loop, not a comprehension
                            values.append(entry.logprob)
                delta = raw.delta
                if delta is not None:
                    if delta.role:
                        choice.role = delta.role
                    if delta.content:
                        choice.content.append(delta.content)
                    reasoning = delta.reasoning or delta.reasoning_content
                    if reasoning:
                        choice.reasoning.append(reasoning)
                    if delta.tool_calls:
                        self._add_tool_call_fragments(choice, delta.tool_calls)

    @staticmethod
    def _add_tool_call_fragments(choice: _Choice, fragments: list[_ToolCallFragment]) -> None:
        """`_add_delta`'s merge of tool-call fragments, for typed fragments."""
        for fragment in fragments:
            slot = choice.tool_calls.setdefault(
                fragment.index,
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if fragment.id:
                slot["id"] = fragment.id
            if fragment.type:
                slot["type"] = fragment.type
            function = fragment.function
            if function is not None:
                if function.name:
                    slot["function"]["name"] += function.name
                if function.arguments:
                    slot["function"]["arguments"] += function.arguments

    def _choice(self, index: int) -> _Choice:
        if index not in self.choices:
            self.choices[index] = _Choice(index=index)
        return self.choices[index]

    def mark_first_token(self) -> None:
        if self.ttft_s is None:
            self.ttft_s = time.monotonic() - self.context.started

    def add_response(self, payload: dict[str, Any]) -> None:
        """A whole (non-streamed) upstream response."""
        endpoint = self.context.endpoint
        if isinstance(payload.get("prompt_token_ids"), list):
            self.prompt_token_ids = payload["prompt_token_ids"]
        if isinstance(payload.get("usage"), dict):
            self.usage = payload["usage"]
        for raw in payload.get("choices") or []:
            choice = self._choice(int(raw.get("index", 0)))
            choice.finish_reason = raw.get("finish_reason")
            choice.token_ids = raw.get("token_ids")
            choice.logprobs = _logprob_values(endpoint, raw.get("logprobs"))
            if endpoint == "chat.completions":
                choice.message = _message_record(raw.get("message") or {})
            else:
                choice.text.append(raw.get("text") or "")
                if isinstance(raw.get("prompt_token_ids"), list):
                    choice.prompt_token_ids = raw["prompt_token_ids"]

    def add_chunk(self, chunk: dict[str, Any]) -> None:
        """One upstream stream chunk (called for every chunk: kept lean)."""
        prompt_ids = chunk.get("prompt_token_ids")
        if (
            prompt_ids is not None
            and self.prompt_token_ids is None
            and isinstance(prompt_ids, list)
        ):
            self.prompt_token_ids = prompt_ids
        usage = chunk.get("usage")
        if usage is not None and isinstance(usage, dict):
            self.usage = usage
        choices = chunk.get("choices")
        if not choices:
            return
        endpoint = self.context.endpoint
        chat = endpoint == "chat.completions"
        for raw in choices:
            index = raw.get("index", 0)
            choice = self.choices.get(index)
            if choice is None:
                choice = self._choice(int(index))
            finish = raw.get("finish_reason")
            if finish is not None:
                choice.finish_reason = finish
            ids = raw.get("token_ids")
            if ids is not None and isinstance(ids, list):
                if choice.token_ids is None:
                    choice.token_ids = []
                choice.token_ids.extend(ids)
            logprobs = raw.get("logprobs")
            if logprobs is not None:
                values = _logprob_values(endpoint, logprobs)
                if values is not None:
                    if choice.logprobs is None:
                        choice.logprobs = []
                    choice.logprobs.extend(values)
            if chat:
                delta = raw.get("delta")
                if delta:
                    self._add_delta(choice, delta)
            else:
                if raw.get("text"):
                    choice.text.append(raw["text"])
                if isinstance(raw.get("prompt_token_ids"), list):
                    choice.prompt_token_ids = raw["prompt_token_ids"]

    @staticmethod
    def _add_delta(choice: _Choice, delta: dict[str, Any]) -> None:
        if delta.get("role"):
            choice.role = delta["role"]
        if delta.get("content"):
            choice.content.append(delta["content"])
        reasoning = delta.get("reasoning") or delta.get("reasoning_content")
        if reasoning and isinstance(reasoning, str):
            choice.reasoning.append(reasoning)
        for fragment in delta.get("tool_calls") or []:
            slot = choice.tool_calls.setdefault(
                int(fragment.get("index", 0)),
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
            )
            if fragment.get("id"):
                slot["id"] = fragment["id"]
            if fragment.get("type"):
                slot["type"] = fragment["type"]
            function = fragment.get("function") or {}
            if function.get("name"):
                slot["function"]["name"] += function["name"]
            if function.get("arguments"):
                slot["function"]["arguments"] += function["arguments"]

    def _choice_record(self, choice: _Choice) -> dict[str, Any]:
        record: dict[str, Any] = {"index": choice.index}
        if self.context.endpoint == "chat.completions":
            if choice.message is not None:
                record["message"] = choice.message
            else:
                record["message"] = {
                    "role": choice.role or "assistant",
                    "content": "".join(choice.content) if choice.content else None,
                    "tool_calls": [choice.tool_calls[i] for i in sorted(choice.tool_calls)],
                }
                if choice.reasoning:
                    record["message"]["reasoning"] = "".join(choice.reasoning)
        else:
            record["text"] = "".join(choice.text)
        record["finish_reason"] = choice.finish_reason
        record["token_ids"] = choice.token_ids if choice.token_ids is not None else []
        # JSON has no -inf/NaN: a non-finite logprob is clamped here and the record is
        # flagged untrainable in check(), so the record still reaches the stream.
        values = choice.logprobs or []
        record["logprobs"] = (
            list(values)
            if all(map(math.isfinite, values))
            else [v if math.isfinite(v) else NONFINITE_LOGPROB for v in values]
        )
        return record

    def _prompt_ids(self) -> tuple[list[int] | None, bool]:
        """The prompt's token ids, and whether the request held several different prompts."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids, False
        per_choice = [c.prompt_token_ids for c in self.choices.values() if c.prompt_token_ids]
        if not per_choice:
            return None, False
        distinct = {tuple(ids) for ids in per_choice}
        return per_choice[0], len(distinct) > 1

    def check(self, status: str) -> list[str]:
        """Why this record must not be trained on (empty list = consistent)."""
        self._absorb_raw()
        flags: list[str] = []
        if status != "ok":
            flags.append(status)
        if self.unparsable:
            flags.append("unparsable_upstream_data")
        if self.context.sampling_params().get("use_beam_search"):
            # vLLM's beam search keeps the likeliest beams: its tokens are not samples of the
            # distribution their logprobs describe, so no importance ratio corrects for them.
            flags.append("beam_search")
        prompt_ids, multiple_prompts = self._prompt_ids()
        if multiple_prompts:
            flags.append("multiple_prompts")
        if prompt_ids is None:
            flags.append("missing_prompt_token_ids")
        if not self.choices:
            flags.append("no_choices")
        completion: int | None = None
        if len(self.choices) == 1:
            # Nearly every record: the checks below on the one choice, in the same order,
            # without a generator each (2.9 -> 1.6 µs).
            (only,) = self.choices.values()
            completion = len(only.token_ids or [])
            if only.token_ids is None:
                flags.append("missing_token_ids")
            if completion != len(only.logprobs or []):
                flags.append("logprob_count_mismatch")
            if not all(map(math.isfinite, only.logprobs or [])):
                flags.append("nonfinite_logprob")
            if status == "ok" and only.finish_reason is None:
                flags.append("missing_finish_reason")
            if only.finish_reason in _CUT_BY_THE_SERVER:
                flags.append("finish_reason_abort")
        else:
            if any(c.token_ids is None for c in self.choices.values()):
                flags.append("missing_token_ids")
            if any(len(c.token_ids or []) != len(c.logprobs or []) for c in self.choices.values()):
                flags.append("logprob_count_mismatch")
            if any(not math.isfinite(v) for c in self.choices.values() for v in (c.logprobs or [])):
                flags.append("nonfinite_logprob")
            if status == "ok" and any(c.finish_reason is None for c in self.choices.values()):
                flags.append("missing_finish_reason")
            if any(c.finish_reason in _CUT_BY_THE_SERVER for c in self.choices.values()):
                flags.append("finish_reason_abort")
        usage = self.usage
        if usage is None or any(k in usage and not _is_count(usage[k]) for k in _USAGE_COUNTS):
            flags.append("missing_usage")  # none, or a count that is none (`"12"`, `12.0`)
        else:
            if completion is None:
                completion = sum(len(c.token_ids or []) for c in self.choices.values())
            if completion != self.usage.get("completion_tokens"):
                flags.append("token_count_mismatch")
            if (
                prompt_ids is not None
                and not multiple_prompts
                and self._prompt_token_count(prompt_ids) != self.usage.get("prompt_tokens")
            ):
                flags.append("prompt_token_count_mismatch")
        return flags

    def _prompt_token_count(self, prompt_ids: list[int]) -> int:
        """What vLLM's `usage.prompt_tokens` counts: the tokens of every prompt. A completions
        batch of one prompt repeated (`["hi", "hi"]`, a group sent as a list rather than as
        `n`) holds it once per prompt, and was flagged a mismatch though consistent."""
        if self.prompt_token_ids is not None:  # one prompt (chat)
            return len(prompt_ids)
        n = self.context.sampling_params().get("n")
        per_prompt = int(n) if isinstance(n, int | float) and n >= 1 else 1
        firsts = [c for c in self.choices.values() if c.index % per_prompt == 0]
        return sum(len(c.prompt_token_ids or []) for c in firsts)

    def build(self, status: str) -> dict[str, Any]:
        """The trajectory record (docs/interfaces.md), before redaction."""
        ctx = self.context
        flags = self.check(status)  # parses the raw data first
        prompt_ids, _ = self._prompt_ids()
        usage = self.usage or {}
        request = ctx.request_body
        if isinstance(request, dict) and "user" in request:
            # The copy of the request carries the record's hash of `user`, never the
            # client's value (a copy: the proxy's body dict is what went upstream).
            request = {**request, "user": ctx.user_hash}
        record: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            # Fixed by the trajectory: a capture built twice (by a sink worker that died
            # before its record was durable, then by the proxy) is one event.
            "event_id": derived_event_id("trajectory", ctx.trajectory_id),
            "trajectory_id": ctx.trajectory_id,
            "request_id": ctx.request_id,
            "session_id": ctx.session_id,
            "tenant": ctx.tenant_hash,
            "user": ctx.user_hash,
            "created_at": ctx.created_at,
            "endpoint": ctx.endpoint,
            "model_alias": ctx.model_alias,
            "policy_version": ctx.policy_version,
            "group_id": ctx.group_id,
            "task": ctx.task,
            "request": request,
            "sampling": ctx.sampling_params(),
            "prompt_token_ids": prompt_ids or [],
            "choices": [self._choice_record(self.choices[i]) for i in sorted(self.choices)],
            "usage": {
                "prompt_tokens": _token_count(usage.get("prompt_tokens")),
                "completion_tokens": _token_count(usage.get("completion_tokens")),
                "total_tokens": _token_count(usage.get("total_tokens")),
            },
            "timings": {
                "ttft_s": self.ttft_s,
                "total_s": (self.finished_at or time.monotonic()) - ctx.started,
            },
            "status": status,
            "trainable": not flags,
            "flags": flags,
            "redactions": {},
        }
        return record


# The ids the proxy makes for requests without a usable x-request-id (`proxy.app`), which
# are also the session ids of requests without an X-Session-Id: most records carry one.
_GENERATED_ID = re.compile(r"req-[0-9a-f]{32}")


def passes_generated_ids(redact: Redact) -> bool:
    """Whether `redact` is the `redact_obj` of a `Redactor` with built-in passes only, which
    find nothing in `req-` and 32 lower-case hex digits: none of their literal or case-blind
    needles is spelt with `r`, `e`, `q`, `-`, `a`-`f` and digits alone, so only a run of 8
    or more digits makes one look (the card and phone passes); a card number may not follow
    a letter, a digit or `q-`, and a phone number needs a `+`, a `(` or a `.`/`-` after its
    first 3 digits. An operator's pattern could match anything: with one, each id is
    redacted as before. (tests/proxy/test_capture_fast_path.py holds the redactor to this
    for ids with every digit run.)

    Redacting a generated session id took 9.8 µs a record on average (23 µs for the 24% of
    ids that hold 8 digits in a row and so run the card and phone passes)."""
    owner = getattr(redact, "__self__", None)
    return (
        type(owner) is redaction.Redactor
        and getattr(redact, "__func__", None) is redaction.Redactor.redact_obj
        and owner.builtin_only
    )


def private_label(value: str | None, redact: Redact, key: bytes | None = None) -> str | None:
    """A client's label (X-Session-Id, X-OLP-Group-Id, X-OLP-Task) as it may leave the process.

    Clients put e-mail addresses and the like in them. Replacing the match with
    `[REDACTED:kind]` would merge every such session (or group, or task) into one; a keyed
    hash (`safety.pseudonym`, the deployment's `key`) keeps each one apart, and the same
    label gives the same pseudonym in trajectories and feedback, so they still join and
    stay on one Kafka partition, while nobody without the key can test guessed addresses."""
    if value is None:
        return None
    if _GENERATED_ID.fullmatch(value) is not None and passes_generated_ids(redact):
        return value  # what `redact` would find nothing in (`passes_generated_ids`)
    _, counts = redact(value)
    if not any(counts.values()):
        return value
    return "redacted-" + pseudonym(key, value)[:32]


def redact_record(
    record: dict[str, Any],
    redact: Redact,
    key: bytes | None = None,
    hidden: list[str] | None = None,
) -> dict[str, Any]:
    """Redact the free text of a record (request and outputs) and pseudonymise the client's
    labels (`private_label`).

    When the text had anything redacted, the token ids still spell the secret out, so they
    are dropped and the record is flagged untrainable: nothing identifying leaves the
    process. A pseudonymised label alone changes nothing the model saw. `hidden`: sampled
    text the record's choices do not show (`TrajectoryCapture.sampled_texts`), searched
    too when the rest held nothing; its finds count as the rest's.

    The request's `user` is not text the model saw: the request carries the record's
    `user` (its pseudonym, `TrajectoryCapture.build`), which is not searched, so a user alone
    never makes a record untrainable.

    `request_id` is a label too: the client's `x-request-id` when it sent a usable one, and
    then also the session id of a request without X-Session-Id. It gets the session id's
    pseudonym when it is the session id, else its own (`private_label`): the proxy's own
    `req-` ids and clean client ids stay as they came, and the hash of one that held PII
    still finds it in the proxy's logs.
    """
    session_id = record.get("session_id")
    for field_ in ("session_id", "group_id", "task"):
        if isinstance(record.get(field_), str):
            record[field_] = private_label(record[field_], redact, key)
    request_id = record.get("request_id")
    if isinstance(request_id, str):
        if request_id == session_id:
            record["request_id"] = record["session_id"]
        else:
            record["request_id"] = private_label(request_id, redact, key)
    # The token-id and logprob arrays hold no text: only the rest of each choice is walked.
    # Request and choices go through one call: one encoding and one needle search.
    arrays = ("token_ids", "logprobs")
    texts = [{k: v for k, v in choice.items() if k not in arrays} for choice in record["choices"]]
    request = record["request"]
    has_user = isinstance(request, dict) and "user" in request
    if has_user:
        request = {k: v for k, v in request.items() if k != "user"}
    # `sampling` repeats request fields (`stop` strings may hold what `request` loses).
    (request, sampling, choices), found = redact([request, record["sampling"], texts])
    for redacted, original in zip(choices, record["choices"], strict=True):
        for array in arrays:
            if array in original:
                redacted[array] = original[array]
    counts = {kind: int(hits) for kind, hits in found.items() if hits}
    if not counts and hidden:
        _, found = redact(hidden)
        counts = {kind: int(hits) for kind, hits in found.items() if hits}
    if has_user:
        request["user"] = record.get("user")
    record["request"] = request
    record["sampling"] = sampling
    record["choices"] = choices
    record["redactions"] = counts
    if counts:
        record["prompt_token_ids"] = []
        for choice in record["choices"]:
            choice["token_ids"] = []
        record["flags"] = [*record["flags"], "redacted"]
        record["trainable"] = False
    return record


def build_record(
    capture: TrajectoryCapture, status: str, redact: Redact | None, key: bytes | None = None
) -> dict[str, Any]:
    """The finished, checked and redacted trajectory record of one capture (runs in the proxy
    or in a sink's worker process); `key`: the pseudonyms' (`private_label`)."""
    record = capture.build(status)
    if redact is not None:
        record = redact_record(record, redact, key, capture.sampled_texts())
    return record


def build_packed_record(
    packed: bytes | bytearray, status: str, redact: Redact | None, key: bytes | None = None
) -> dict[str, Any]:
    """`build_record` of a capture `pack_capture` packed (in a sink's worker process)."""
    return build_record(unpack_capture(packed), status, redact, key)


# Called with (status, trainable, count) for built records and (count) for failed builds.
OnOutcome = Callable[[str, bool, int], None]
OnFailures = Callable[[int], None]


class CaptureService:
    """Has each finished capture built into a record and handed to the sink.

    A sink with `build_records_with` (KafkaSinkProcess) takes the capture packed into bytes
    (`pack_capture`) and builds the record in its worker process (`build_packed_record`); any
    other sink gets the record built here, in a loop callback after the response."""

    def __init__(
        self,
        sink: Any,
        redact: Redact | None,
        on_outcome: OnOutcome | None = None,
        on_failures: OnFailures | None = None,
        backlog_limit: int | None = None,
        label_key: bytes | None = None,
        backlog_bytes_limit: int | None = None,
    ) -> None:
        self.sink = sink
        self.build = functools.partial(build_record, redact=redact, key=label_key)
        self.on_outcome = on_outcome
        self.on_failures = on_failures
        self.failures = 0
        self._scheduled = 0
        self._open: set[str] = set()
        self._put_capture: Callable[[bytes | bytearray, str], None] | None = None
        backlog = getattr(sink, "backlog", None)
        self._backlog: Callable[[], int] | None = backlog if callable(backlog) else None
        held = getattr(sink, "backlog_bytes", None)
        self._backlog_bytes: Callable[[], int] | None = held if callable(held) else None
        hung = getattr(sink, "kill_if_hung", None)
        self._kill_if_hung: Callable[[], None] | None = hung if callable(hung) else None
        # A request body over half of what the sink's topic takes in one record is not
        # captured: its record (the request, and the answer's text, token ids and logprobs
        # on top) would go to the dead-letter topic, a 64 KiB excerpt of it at most, while
        # the client got a trajectory id its feedback could never join.
        max_record = getattr(sink, "max_record_bytes", None)
        self.max_body_bytes: int | None = max_record // 2 if isinstance(max_record, int) else None
        # Unlimited as the largest int: `has_room` runs for every captured request.
        self.backlog_limit = sys.maxsize if backlog_limit is None else backlog_limit
        self.backlog_bytes_limit = (
            sys.maxsize if backlog_bytes_limit is None else backlog_bytes_limit
        )
        self.paused = False  # new captures wait for the sink's backlog to shrink
        delegate = getattr(sink, "build_records_with", None)
        if callable(delegate):
            build_packed = functools.partial(build_packed_record, redact=redact, key=label_key)
            delegate(build_packed, self._outcome, self._failed)
            self._put_capture = sink.put_capture

    def _outcome(self, status: str, trainable: bool, count: int) -> None:
        if self.on_outcome is not None:
            self.on_outcome(status, trainable, count)

    def _failed(self, count: int) -> None:
        self.failures += count
        if self.on_failures is not None:
            self.on_failures(count)

    def has_room(self) -> bool:
        """False while the sink holds `backlog_limit` records or `backlog_bytes_limit` bytes
        of captures or more in memory, until both are down to half of their limit.

        The sink's worker runs at idle priority: while the cores are busy (overload, or a
        vLLM on CPU next to it) it gets almost no time, and without this bound the captures
        waiting for it would grow until the proxy ran out of memory. A request refused here
        is served as usual, only not recorded; the caller counts it. While paused, each call
        also has the sink kill a worker that went silent (`kill_if_hung`)."""
        backlog_of, held_of = self._backlog, self._backlog_bytes
        if backlog_of is None:
            return True  # the sink holds nothing in memory (or does not say)
        backlog = backlog_of()
        held = 0 if held_of is None else held_of()
        limit, byte_limit = self.backlog_limit, self.backlog_bytes_limit
        if not self.paused and backlog < limit and held < byte_limit:
            return True  # the usual answer, first
        counts = {"backlog": backlog, "limit": limit, "bytes": held, "bytes_limit": byte_limit}
        if not self.paused:
            self.paused = True
            log.warning("capture_paused_backlog", **counts)
        elif backlog <= limit // 2 and held <= byte_limit // 2:
            self.paused = False
            log.warning("capture_resumed", **counts)
            return True
        if self._kill_if_hung is not None:
            # A worker that stopped reading blocks the sink's feeder, which then cannot see
            # to it, and while paused nothing else puts: the backlog would never shrink.
            self._kill_if_hung()
        return False

    def open(self, capture: TrajectoryCapture) -> None:
        """Note a capture whose request is still running, so `drain()` waits for it too."""
        self._open.add(capture.context.trajectory_id)

    def submit(self, capture: TrajectoryCapture, status: str) -> None:
        """Hand the capture on; returns at once.

        A worker-building sink gets it now (an append). Otherwise the record is built in a
        plain callback two loop iterations later (the response path finishes first), not a
        task: a task per request costs more than a third of the record's own building."""
        self._open.discard(capture.context.trajectory_id)
        capture.finished_at = time.monotonic()
        if self._put_capture is not None:
            try:
                packed = pack_capture(capture)
            except Exception:
                # Not for what the relay captures (JSON values and bytes); should a capture
                # neither pack nor pickle, its record is built here instead, as for a sink
                # without a worker, rather than lost.
                log.exception("capture_pack_failed", trajectory_id=capture.context.trajectory_id)
            else:
                self._put_capture(packed, status)
                return
        self._scheduled += 1
        loop = asyncio.get_running_loop()
        loop.call_soon(loop.call_soon, self._emit, capture, status)

    def _emit(self, capture: TrajectoryCapture, status: str) -> None:
        try:
            self._build_and_hand_over(capture, status)
        finally:
            self._scheduled -= 1

    def _build_and_hand_over(self, capture: TrajectoryCapture, status: str) -> None:
        try:
            record = self.build(capture, status)
            self.sink.put_trajectory(record)
        except Exception:
            # Losing one record must not take the proxy down; it is logged and counted.
            log.exception("trajectory_capture_failed", trajectory_id=capture.context.trajectory_id)
            self._failed(1)
            return
        self._outcome(record["status"], record["trainable"], 1)

    async def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until every running request's record reached the sink (shutdown and tests)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._open or self._scheduled:
            if self._scheduled:
                await asyncio.sleep(0)  # scheduled records run within two loop iterations
            elif asyncio.get_running_loop().time() > deadline:
                log.warning("capture_drain_timeout", open_requests=len(self._open))
                return
            else:
                await asyncio.sleep(0.01)
