"""What the proxy adds to a request for capture, and how it takes it out of the response again.

For a captured request the proxy asks upstream for sampling logprobs, token ids and (for
streams) a usage chunk. The client must not see any of that unless it asked: `strip_response`
and `strip_chunk` remove exactly what was added, so the response matches what the model
server would have sent for the client's own request.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

try:
    from proxy import _sse_strip  # the C pass of `strip_sse` and `strip_bytes`, built by pip
except ImportError:  # no C compiler where olp was installed: the same rules in Python
    _sse_strip = None

# Which implementation strips captured answers ("c" or "python"); the proxy logs it at start.
SSE_STRIP = "python" if _sse_strip is None else "c"

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


def capture_refusal(endpoint: Endpoint, body: dict[str, Any]) -> str | None:
    """Why a request of a training tenant cannot be captured, or None when it can.

    `echo`: the additions would break it. vLLM turns `echo` plus `logprobs` into prompt
    logprobs (which kill vLLM-CPU's engine next to LoRA requests, docs/architecture.md)
    and sends an empty prompt text when token ids are asked for, so the client would lose
    its echo. (Chat `echo` never gets here: validation refuses it.)

    `token_prompt`: a completions prompt given as token ids. The Redactor reads text, and
    numbers pass it: an e-mail or a key sent pre-tokenised reached the record twice (the
    prompt and its `prompt_token_ids`), trainable, where any reader with the tokenizer reads
    it back."""
    if endpoint == "completions":
        if body.get("echo"):
            return "echo"
        prompt = body.get("prompt")
        if isinstance(prompt, list) and any(not isinstance(part, str) for part in prompt):
            return "token_prompt"
    return None


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
        # vLLM refuses `top_logprobs` (or `logprob_token_ids`) without `logprobs` (400):
        # added, it served the request, and the client got a 200 its own request would not.
        # (A tuple of types: `int | float` builds a union object at every call.)
        top = body.get("top_logprobs")
        asks_top = (
            top is not None
            and isinstance(top, (int, float))
            and not isinstance(top, bool)
            and (top == -1 or top > 0)
        ) or bool(body.get("logprob_token_ids"))
        if not body.get("logprobs") and not asks_top:
            upstream["logprobs"] = True
            plan.added_logprobs = True
    elif body.get("logprobs") is None and not body.get("logprob_token_ids"):
        # vLLM refuses `logprob_token_ids` without `logprobs` on completions too (400).
        upstream["logprobs"] = 0
        plan.added_logprobs = True
    if not body.get("return_token_ids"):
        upstream["return_token_ids"] = True
        plan.added_token_ids = True
    if stream and not plan.client_wants_usage:
        upstream["stream_options"] = with_usage(options if isinstance(options, dict) else None)
        plan.added_usage = True
    return plan


def with_usage(options: dict[str, Any] | None) -> dict[str, Any]:
    """The client's `stream_options` asking for the usage chunk on the proxy's behalf.

    vLLM honours `continuous_usage_stats` only with `include_usage`: a client that sent it
    alone got no usage at all from vLLM, and through the proxy got usage in every chunk,
    each chunk then re-encoded to take it out (its floats spelt anew). Turned off, vLLM
    sends the chunks the client would have got and one usage chunk, which is dropped."""
    merged = dict(options) if options is not None else {}
    merged["include_usage"] = True
    if merged.get("continuous_usage_stats"):
        merged["continuous_usage_stats"] = False
    return merged


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
    """A chunk choice that exists only because token ids or logprobs were requested.

    vLLM's chat stream sends such a choice, with an empty delta (`{}`), when its tool or
    reasoning parser holds a token's text back; it sends `{"content": ""}` (a partial UTF-8
    character, text held back for a stop string) whatever was requested, and every
    completions chunk too, so those are kept. Logprobs or token ids still set after the
    strip are the client's own, and vLLM sends the empty delta for them too."""
    if plan.endpoint != "chat.completions" or choice.get("finish_reason") is not None:
        return False
    if choice.get("logprobs") is not None or choice.get("token_ids") is not None:
        return False
    return not choice.get("delta")


# ---- byte-level stripping (the relay's hot path) ---------------------------------------------
#
# Parsing every chunk, editing it and encoding it again costs more than the whole relay of an
# uncaptured request. vLLM's answers have a fixed shape, so the additions can be cut out of the
# bytes instead: in JSON a `"` inside a string is always escaped, so `,"logprobs":{` and
# `},"finish_reason":` can only be object keys, never text. Every cut is checked; whatever the
# checks cannot prove (another field order, a chunk that may become empty, a usage chunk) goes
# the parsing path (`strip_chunk` / `strip_response`), which handles any JSON. Hand-written
# because no JSON library edits a document without decoding it.

_LOGPROBS_KEY = b',"logprobs":{'
_LOGPROBS_END = b'},"finish_reason":'
_IDS_KEY = b'token_ids":['  # `,"token_ids":[` or `,"prompt_token_ids":[`, checked at the cut
_ID_CHARS = b"0123456789,"
# Patterns that prove a stripped chunk still carries something the client sees.
_FINISHED = b'"finish_reason":"'
_TOOL_CALLS = b'"delta":{"tool_calls":[{'
_ROLE, _EMPTY_ROLE = b'"delta":{"role":"', b'"delta":{"role":""'
_TEXT_KEY: dict[Endpoint, bytes] = {
    "chat.completions": b'"delta":{"content":"',
    "completions": b'"text":"',
}


def _visible(endpoint: Endpoint, data: bytes) -> bool:
    """True when some choice has a finish reason, text, a role or a tool call (so
    `_is_empty_choice` is False for it); False when that cannot be seen from the bytes."""
    if _FINISHED in data:
        return True
    key = _TEXT_KEY[endpoint]
    at = data.find(key)
    if at >= 0 and data[at + len(key) : at + len(key) + 1] not in (b'"', b""):
        return True
    if endpoint != "chat.completions":
        return False
    if _TOOL_CALLS in data:
        return True
    at = data.find(_ROLE)
    return at >= 0 and data[at + len(_ROLE) : at + len(_ROLE) + 1] not in (b'"', b"")


def _additions_gone(plan: RelayPlan, data: bytes) -> bool:
    """Every key the proxy added is now null. The cuts only find vLLM's compact spelling:
    anything else (`"logprobs": {`, a key spelled in a text, a text ending in `_ids`)
    leaves a count unequal, and the caller parses instead."""
    count = data.count
    if plan.added_logprobs and count(b'logprobs"') != count(b'logprobs":null'):
        return False
    return not plan.added_token_ids or count(b'_ids"') == count(b'_ids":null')


def _cut_additions(plan: RelayPlan, data: bytes) -> bytes | None:
    """Replace each added `logprobs` object and token-id array with null, in one pass in
    document order; None when a cut is not provable. A logprobs cut must stay within one
    line and one choice; a token-id array must hold only ids."""
    find = data.find
    parts: list[bytes] = []
    done = 0
    lp_at = find(_LOGPROBS_KEY) if plan.added_logprobs else -1
    id_at = find(_IDS_KEY) if plan.added_token_ids else -1
    while lp_at >= 0 or id_at >= 0:
        if lp_at >= 0 and (id_at < 0 or lp_at < id_at):
            end = find(_LOGPROBS_END, lp_at)
            if (
                end < 0
                or find(b'"index":', lp_at, end) >= 0
                or find(b"\n", lp_at, end) >= 0
                # vLLM's logprobs value holds no `},"`: a field after it would go with the cut
                or find(b'},"', lp_at, end) >= 0
            ):
                return None
            parts += (data[done:lp_at], b',"logprobs":null')
            done = end + 1
            lp_at = find(_LOGPROBS_KEY, done)
            if 0 <= id_at < done:
                id_at = find(_IDS_KEY, done)
            continue
        if data[id_at - 2 : id_at] != b',"' and data[id_at - 9 : id_at] != b',"prompt_':
            return None  # another key ending in `token_ids`
        body = id_at + len(_IDS_KEY)
        end = find(b"]", body)
        if end < 0 or data[body:end].translate(None, _ID_CHARS):
            return None
        parts += (data[done : body - 1], b"null")
        done = end + 1
        id_at = find(_IDS_KEY, done)
    if not parts:
        return data
    parts.append(data[done:])
    return b"".join(parts)


def strip_bytes(plan: RelayPlan, data: bytes, whole: bool = False) -> bytes | None:
    """`strip_chunk` / `strip_response` on the raw JSON (or one `data: ...` event line), for
    the shapes vLLM sends; None when the bytes cannot be stripped provably, and the caller
    parses instead. `whole`: a non-streamed response (never dropped, no usage removal)."""
    if not plan.augmented:
        return data
    if whole and _sse_strip is not None:  # the same rules in one C pass
        return _sse_strip.strip_whole(data, plan.added_logprobs, plan.added_token_ids)
    if not whole and b'"usage":' in data:
        return None  # a usage chunk may be dropped or edited: the parsing path decides
    out = _cut_additions(plan, data)
    if out is None or not _additions_gone(plan, out):
        return None
    if whole:
        return out
    # A stream chunk whose choices all became empty is dropped; only one provably visible
    # keeps the fast path.
    return out if _visible(plan.endpoint, out) else None


# A block of whole SSE events (all of one upstream read) is stripped with a few passes of
# C-level `find`/`split` over the block rather than a parse per event: each Python-level step
# per event costs about as much as relaying the event. Same rules and proofs as
# `strip_bytes`, checked for the block; any doubt and the block goes event by event.
_USAGE_KEY = b'"usage":{'
_DONE_LINE = b"data: [DONE]"
_NO_CHOICES = b'"choices":[]'
_EMPTY_TEXT: dict[Endpoint, bytes] = {
    "chat.completions": b'"delta":{"content":""',
    "completions": b'"text":""',
}


def _checked_usage(plan: RelayPlan, payload: bytes) -> tuple[bool, dict[str, Any] | None]:
    """Whether the byte path may take a usage event, and its usage object. Not when it is not
    a JSON object, or it carries choices although the proxy asked for the usage on its own:
    the event-by-event path decides (and reports what is not JSON)."""
    try:
        chunk, _ = parse_json(payload, allow_nonfinite=True)
    except ValueError:
        return False, None
    if not isinstance(chunk, dict) or (plan.added_usage and chunk.get("choices")):
        return False, None
    usage = chunk.get("usage")
    return True, usage if isinstance(usage, dict) else None


def _take_usage_events(plan: RelayPlan, block: bytes) -> tuple[bytes, dict[str, Any] | None] | None:
    """The usage object of the block's usage chunk(s); those chunks removed when the proxy
    asked for usage on its own. None when a usage chunk also carries choices."""
    usage: dict[str, Any] | None = None
    parts, done = [], 0
    at = block.find(_USAGE_KEY)
    while at >= 0:
        start = block.rfind(b"\n", 0, at) + 1  # the event's `data: ` line
        end = block.find(b"\n\n", at)
        if not block.startswith(b"data: ", start):
            return None
        taken, found = _checked_usage(plan, block[start + 6 : end])
        if not taken:
            return None
        usage = found if found is not None else usage
        if plan.added_usage:
            parts.append(block[done:start])
            done = end + 2
        at = block.find(_USAGE_KEY, end)
    parts.append(block[done:])
    return b"".join(parts), usage


def strip_sse(plan: RelayPlan, block: bytes) -> tuple[bytes, dict[str, Any] | None] | None:
    """Strip a block of whole `data: <json>` events; returns the client's bytes and the usage
    object of a usage chunk in it, or None when the block must go event by event.

    The rules below run in C (`proxy/_sse_strip.c`) where the extension was built, else in
    Python (`strip_sse_python`); `SSE_STRIP` names which."""
    if _sse_strip is None or not plan.augmented:
        return strip_sse_python(plan, block)
    cut = _sse_strip.strip_events(
        block,
        plan.endpoint == "chat.completions",
        plan.added_logprobs,
        plan.added_token_ids,
        plan.added_usage,
    )
    if cut is None:
        return None
    stripped, usage_events = cut
    usage: dict[str, Any] | None = None
    for payload in usage_events:
        taken, found = _checked_usage(plan, payload)
        if not taken:
            return None
        usage = found if found is not None else usage
    return stripped, usage


def strip_sse_python(plan: RelayPlan, block: bytes) -> tuple[bytes, dict[str, Any] | None] | None:
    """`strip_sse` in Python: the reference for the C pass, and the path where it is not
    built."""
    newlines = block.count(b"\n")
    if newlines == 2 and block.startswith(b"data: ") and b'"usage":' not in block:
        # One event per read, the usual case with a real model server (tokens arrive
        # milliseconds apart): the per-event cut is cheaper than the block's checks.
        if block == b"data: [DONE]\n\n":
            return block, None
        stripped = strip_bytes(plan, block)  # the cuts work on the event line as it is
        return None if stripped is None else (stripped, None)
    if b"\r" in block or newlines != 2 * block.count(b"\n\n"):
        return None  # not one-line events
    usage: dict[str, Any] | None = None
    if _USAGE_KEY in block:
        taken = _take_usage_events(plan, block)
        if taken is None:
            return None
        block, usage = taken
    if not plan.augmented:
        return block, usage
    cut = _cut_additions(plan, block)
    if cut is None or not _additions_gone(plan, cut):
        return None
    block = cut
    # Every event must keep a choice the client sees (see `_is_empty_choice`), unless it has
    # no choices at all (kept as it is), like [DONE].
    text_key, empty_text = _TEXT_KEY[plan.endpoint], _EMPTY_TEXT[plan.endpoint]
    chat = plan.endpoint == "chat.completions"
    for line in block.split(b"\n\n")[:-1]:
        if not line.startswith(b"data: "):
            return None
        if (
            _FINISHED in line
            or (text_key in line and empty_text not in line)
            or line == _DONE_LINE
            or _NO_CHOICES in line
            or (chat and (_TOOL_CALLS in line or (_ROLE in line and _EMPTY_ROLE not in line)))
        ):
            continue
        return None  # an event may have become empty: the parsing path decides
    return block, usage


class SSEParser:
    """Splits an SSE byte stream into events' `data:` payloads (bytes), across chunk borders."""

    def __init__(self) -> None:
        self._buffer = b""  # `feed`'s unfinished event
        # `complete`'s: appended to, and searched only where the new bytes came (a large
        # event in 64 KiB reads was copied and searched whole at each read: 2.8 s of CPU on
        # the event loop for a 20 MB event). A parser is used by one of the two only.
        self._tail = bytearray()

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

    def complete(self, data: bytes) -> bytes:
        """Everything up to the last event border (whole events, `\\n` framing); keeps the
        rest for the next call."""
        tail = self._tail
        if not tail and data.endswith(b"\n\n") and b"\r" not in data:
            return data  # the usual read: whole events
        if b"\r" in data:
            if tail.endswith(b"\r") and data.startswith(b"\n"):
                del tail[-1]  # a `\r\n` split between two reads
            data = data.replace(b"\r\n", b"\n")
        searched_from = max(0, len(tail) - 1)  # a border may span the two
        tail += data
        end = tail.rfind(b"\n\n", searched_from) + 2
        if end < 2:
            return b""
        whole = bytes(tail[:end])
        del tail[:end]
        return whole

    def rest(self) -> bytes:
        return bytes(self._tail) if self._tail else self._buffer


# vLLM's in-band error event, at the start of an event: `{"error"` alone also occurs in a
# chunk, as the top logprobs of a sampled token `error` (completions: `[{"error": -0.1}]`).
_ERROR_EVENT = re.compile(rb'(?:\A|\n)data: ?\{"error"')
_ERROR_SPLIT = len(b'data: {"error"')
# The pattern's one literal run: `in` finds it with a fast substring search, while the
# regex, starting with an alternation, gets no literal prefix and tries every position
# (52 µs for the bench's 4.6 kB streamed answer against 2 µs, once per stream).
_ERROR_NEEDLE = b'{"error"'


def ends_with_error_event(before_last: bytes, last: bytes) -> bool:
    """Whether a stream's last two upstream reads hold vLLM's in-band error event
    (`data: {"error": {...}}`): when a generation fails mid-stream vLLM sends it as the
    stream's last event, before `[DONE]`. Checked once a stream ended, not on every read.
    In a JSON string a quote is escaped and vLLM's chunk objects begin with "id", so these
    bytes at an event's start are an error object: searches, no parsing."""
    return any(
        _ERROR_NEEDLE in part and _ERROR_EVENT.search(part) is not None
        for part in (last, before_last, before_last[-_ERROR_SPLIT:] + last[:_ERROR_SPLIT])
    )


# `[DONE]`, then only line ends or comment lines (`: bye`, a keep-alive) to the end.
_DONE_AT_END = re.compile(rb"(?:^|\n)data: ?\[DONE\][ \t]*(?:\r?\n|:[^\n]*\n)*\Z")
_DONE_SPLIT = 32  # enough of the two reads to hold a `data: [DONE]` split between them
# A read this short is a fragment (vLLM writes each event whole, a token's event is longer):
# it is joined to the read before (`last_reads`), so that `[DONE]` or an error event split
# over several reads is still in the last two. The join keeps this much of the read before.
_FRAGMENT_KEEP = 16 * 1024


def last_reads(before_last: bytes, last: bytes, data: bytes) -> tuple[bytes, bytes]:
    """The stream's last two reads once `data` arrived, for `ends_with_done` and
    `ends_with_error_event`: references, no copies, but for a fragment shorter than
    `_DONE_SPLIT`, which is joined to the read before it."""
    if len(data) < _DONE_SPLIT:
        return before_last, last[-_FRAGMENT_KEEP:] + data
    return last, data


def ends_with_done(before_last: bytes, last: bytes) -> bool:
    """Whether a stream's last two upstream reads end with its `data: [DONE]` event: a
    stream the model server closed without it was cut short (a crash, a balancer's cut),
    however cleanly the connection ended."""
    tail = last[-_DONE_SPLIT:]
    if len(tail) < _DONE_SPLIT:
        tail = before_last[len(tail) - _DONE_SPLIT :] + tail
    return _DONE_AT_END.search(tail) is not None


def sse_event(data: bytes) -> bytes:
    """One SSE event of `data`: a line of it per `data:` field, as the client's parser joins
    them back (an upstream may spread one event's JSON over several lines; written as one
    field, every line after the first was lost to the client)."""
    return b"data: " + data.replace(b"\n", b"\ndata: ") + b"\n\n"


def dumps(obj: Any) -> bytes:
    """Compact JSON, the way vLLM serialises its chunks (a lone surrogate, which UTF-8
    cannot carry, is written as its `\\u` escape, as it came)."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


class NestedTooDeeply(ValueError):
    """JSON nested deeper than the parsers recurse (a small body can be: `[[[[...`); both
    msgspec and `json` raise RecursionError there, which is no ValueError."""

    def __init__(self) -> None:
        super().__init__("JSON nested too deeply")


class NonFiniteNumber(ValueError):
    """A NaN, Infinity or -Infinity literal, or a number out of float range (1e400), which
    Python's `json` reads (as nan or inf) and strict JSON cannot carry: a body holding one
    would reach the record, fail the sink's `allow_nan=False` encoding and go to the DLQ."""

    def __init__(self, literal: str) -> None:
        shown = literal if len(literal) <= 32 else literal[:16] + "..." + literal[-8:]
        super().__init__(f"{shown} is not a finite number, which strict JSON cannot carry")


def _refuse_constant(literal: str) -> Any:
    raise NonFiniteNumber(literal)


def _finite_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):  # a literal out of range: float() makes it inf
        raise NonFiniteNumber(literal)
    return value


def _json_loads(data: bytes, allow_nonfinite: bool = True) -> Any:
    try:
        if allow_nonfinite:
            return json.loads(data)
        return json.loads(data, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError as exc:
        raise NestedTooDeeply() from exc


_fast_decode = msgspec.json.Decoder().decode
_fast_encode = msgspec.json.Encoder().encode
_FastDecodeError: type[Exception] = msgspec.DecodeError


class _UsageOnly(msgspec.Struct):
    usage: dict[str, Any] | None = None


_decode_usage = msgspec.json.Decoder(_UsageOnly).decode


def usage_of(data: bytes) -> dict[str, Any] | None:
    """The `usage` object of a whole upstream response, without building the rest of it.
    Raises ValueError when the data is not JSON (like `parse_json`)."""
    try:
        return _decode_usage(data).usage
    except RecursionError as exc:
        raise NestedTooDeeply() from exc
    except msgspec.ValidationError:
        payload, _ = parse_json(data, allow_nonfinite=True)  # valid JSON of another shape
    except msgspec.DecodeError:
        payload = _json_loads(data)  # NaN and what only `json` reads, or a ValueError
    usage = payload.get("usage") if isinstance(payload, dict) else None
    return usage if isinstance(usage, dict) else None


def parse_json(data: bytes, *, allow_nonfinite: bool = False) -> tuple[Any, Callable[[Any], bytes]]:
    """Parse JSON (a client's body, or upstream data); return it and the encoder that writes
    it back faithfully.

    msgspec (~4x faster than `json`) rejects what only Python's `json`
    accepts (NaN/Infinity literals, lone surrogates, numbers out of float range, ints beyond
    64 bits); such input is parsed and re-encoded by `json`. Neither parser lets a
    non-finite number through (NonFiniteNumber) unless `allow_nonfinite`: then, for upstream
    data read as it came, they round-trip as they came. Raises ValueError
    (json.JSONDecodeError / UnicodeDecodeError / NestedTooDeeply / NonFiniteNumber) when the
    data is not JSON the proxy reads.
    """
    try:
        return _fast_decode(data), _fast_encode  # never a non-finite number
    except _FastDecodeError:
        return _json_loads(data, allow_nonfinite), dumps
    except RecursionError as exc:
        raise NestedTooDeeply() from exc
