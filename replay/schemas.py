"""Versioned JSON Schemas of the stream records: load, validate with field-named errors, encode."""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
import uuid
from collections.abc import Callable
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Annotated, Any

import fastjsonschema
import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

SCHEMA_VERSION = 1


class RecordKind(StrEnum):
    """The two kinds of records that flow from the proxy to the learner."""

    TRAJECTORY = "trajectory"
    FEEDBACK = "feedback"


class SchemaValidationError(ValueError):
    """A record does not match its schema; `field` is the dotted path of the offending value."""

    def __init__(self, kind: str, field: str, message: str) -> None:
        super().__init__(f"invalid {kind} record: {field}: {message}")
        self.kind = kind
        self.field = field
        self.message = message


def new_event_id() -> str:
    """A fresh unique event id (uuid4 hex); duplicates from retries share it and are removed."""
    return uuid.uuid4().hex


# Namespace of the event ids `derived_event_id` makes (a fixed, random UUID).
_DERIVED_ID_NAMESPACE = uuid.UUID("6f1c2a4e-8d3b-4f57-9a0e-2b7d5c913e48").bytes


def derived_event_id(*parts: str) -> str:
    """An event id fixed by `parts` (uuid5 hex, the shape of `new_event_id`).

    For a record that may be made twice from the same source (a capture built again after
    its worker died, the DLQ envelope of a record rejected twice): both copies carry the
    same id, so a consumer that de-duplicates by event_id keeps one."""
    # uuid5 by hand: `uuid.uuid5` refuses a lone surrogate, which a refused record may hold;
    # and its version bits are set on the bytes, not through a UUID object (half the time,
    # on every record a sink worker builds).
    name = "\x1f".join(parts).encode("utf-8", "surrogatepass")
    digest = bytearray(hashlib.sha1(_DERIVED_ID_NAMESPACE + name, usedforsecurity=False).digest())
    digest[6] = (digest[6] & 0x0F) | 0x50  # version 5
    digest[8] = (digest[8] & 0x3F) | 0x80  # RFC 4122 variant
    return digest[:16].hex()


@cache
def load_schema(kind: RecordKind | str, version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The parsed JSON Schema document `<kind>.v<version>.json` shipped in replay/schemas/."""
    name = f"{RecordKind(kind).value}.v{version}.json"
    text = resources.files("replay").joinpath("schemas", name).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    Draft202012Validator.check_schema(schema)
    return schema


def _inline_refs(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline_refs(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline_refs(v, defs) for k, v in node.items() if k != "$defs"}
    if isinstance(node, list):
        return [_inline_refs(v, defs) for v in node]
    return node


@cache
def _validator(kind: RecordKind, version: int) -> Draft202012Validator:
    """A validator over the schema with local $refs inlined (a third faster to evaluate)."""
    schema = load_schema(kind, version)
    return Draft202012Validator(_inline_refs(schema, schema.get("$defs", {})))


@cache
def _fast_check(kind: RecordKind, version: int) -> Callable[[Any], Any]:
    """The same schema compiled to Python code by fastjsonschema (~20x faster than jsonschema
    on a trajectory record). It only answers "valid"; for anything else jsonschema, the
    reference implementation, decides and names the field. The schema's keywords (type,
    properties, required, items, enum, const, pattern, anyOf, oneOf, if/then, min/max) mean
    the same in the draft fastjsonschema implements, so its "valid" is jsonschema's."""
    schema = load_schema(kind, version)
    inlined = _inline_refs(schema, schema.get("$defs", {}))
    definition = {k: v for k, v in inlined.items() if k != "$schema"}
    return fastjsonschema.compile(definition, use_default=False)  # never edits the record


def _field_path(path: Any) -> str:
    parts: list[str] = []
    for item in path:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        else:
            parts.append(f".{item}" if parts else str(item))
    return "".join(parts) or "<record>"


def validate_record(kind: RecordKind | str, record: Any) -> None:
    """Raise SchemaValidationError naming the field when `record` is not a valid `kind` record."""
    kind = RecordKind(kind)
    if not isinstance(record, dict):
        raise SchemaValidationError(kind, "<record>", f"expected an object, got {type(record)}")
    version = record.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SchemaValidationError(
            kind, "schema_version", f"unsupported schema_version {version!r} (expected 1)"
        )
    if kind is RecordKind.TRAJECTORY:
        record = _check_bulk_arrays(record)
    try:
        _fast_check(kind, SCHEMA_VERSION)(record)
    except fastjsonschema.JsonSchemaException:
        _explain(kind, record)  # jsonschema decides, and names the field
    _check_times(kind, record)


def _explain(kind: RecordKind, record: dict[str, Any]) -> None:
    """Raise SchemaValidationError naming the field, unless jsonschema finds `record` valid."""
    validator = _validator(kind, SCHEMA_VERSION)
    if validator.is_valid(record):
        return
    error = best_match(validator.iter_errors(record))
    if error is None:
        return
    field = _field_path(error.absolute_path)
    prefix = f"{field}." if field != "<record>" else ""
    if error.validator == "required" and isinstance(error.instance, dict):
        missing = [k for k in error.validator_value if k not in error.instance]
        if missing:
            field = prefix + missing[0]
    elif error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = error.schema.get("properties", {})
        unexpected = [k for k in error.instance if k not in known]
        if unexpected:
            field = prefix + str(unexpected[0])
    raise SchemaValidationError(kind, field, error.message)


def is_finite_number(value: Any) -> bool:
    """Whether a JSON number is a finite float: JSON has no range, so 1e400 or a 400-digit
    integer is a valid "number" (and Python's json reads NaN and Infinity), but `float()`
    of such an integer raises OverflowError, and NaN compares false with every time."""
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _check_times(kind: RecordKind, record: dict[str, Any]) -> None:
    """The times the consumer and the export compute with must be finite floats (the
    schema's "number" admits any): otherwise every poll raised on the record."""
    fields: list[tuple[str, Any]] = [("created_at", record.get("created_at"))]
    if kind is RecordKind.TRAJECTORY:
        timings = record.get("timings") or {}
        fields += [(f"timings.{name}", timings.get(name)) for name in ("ttft_s", "total_s")]
    for field, value in fields:
        if value is None or is_finite_number(value):
            continue
        if isinstance(value, int):  # not its digits: str() of a huge int may itself raise
            raise SchemaValidationError(
                kind, field, f"an integer of {value.bit_length()} bits does not fit a float"
            )
        raise SchemaValidationError(kind, field, f"{value!r} is not a finite number")


def _bad_index(values: list[Any], ok: Callable[[Any], bool]) -> int | None:
    for index, value in enumerate(values):
        if not ok(value):
            return index
    return None


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# The token-id and logprob arrays as the schema has them ("integer" >= 0, "number": a bool
# is neither, as in jsonschema), checked by msgspec in one C pass at ~8 ns an element, where
# Python's passes over the elements' types and minimum took ~40 (a 9,000-token record: 63
# against 300 µs). A Struct, because msgspec keeps what it compiled of a Struct type but
# compiles a bare `list[...]` again on every call (~1 µs).
class _TokenIdList(msgspec.Struct, array_like=True):
    values: list[Annotated[int, msgspec.Meta(ge=0)]]


class _IntList(msgspec.Struct, array_like=True):
    values: list[int]


class _NumberList(msgspec.Struct, array_like=True):
    values: list[float]  # msgspec takes ints for floats, not bools


def _is_list_of(values: list[Any], of: type[msgspec.Struct]) -> bool:
    try:
        msgspec.convert((values,), of)
    except msgspec.ValidationError:
        return False
    return True


def _check_array(values: Any, field: str, ok: Callable[[Any], bool], what: str) -> None:
    if type(values) is not list:
        return  # the schema reports the wrong type
    # The usual case in one C pass; the element loop below only finds the culprit.
    if _is_list_of(values, _TokenIdList if ok is _is_token_id else _NumberList):
        return
    index = _bad_index(values, ok)
    if index is not None:
        raise SchemaValidationError(
            RecordKind.TRAJECTORY, f"{field}[{index}]", f"{values[index]!r} is not {what}"
        )


def _check_bulk_arrays(record: dict[str, Any]) -> dict[str, Any]:
    """Check the long token-id / logprob arrays in plain Python (jsonschema takes ~5 ms for a
    4 KB record, almost all of it in these arrays) with the same rules as the schema, and
    return a view of the record with those arrays emptied for the schema to check the rest."""
    light = dict(record)
    _check_array(
        record.get("prompt_token_ids"), "prompt_token_ids", _is_token_id, "a non-negative integer"
    )
    if type(record.get("prompt_token_ids")) is list:
        light["prompt_token_ids"] = []
    choices = record.get("choices")
    if type(choices) is list:
        light_choices: list[Any] = []
        for index, choice in enumerate(choices):
            if type(choice) is not dict:
                light_choices.append(choice)
                continue
            light_choice = dict(choice)
            _check_array(
                choice.get("token_ids"),
                f"choices[{index}].token_ids",
                _is_token_id,
                "a non-negative integer",
            )
            _check_array(
                choice.get("logprobs"), f"choices[{index}].logprobs", _is_number, "a number"
            )
            for key in ("token_ids", "logprobs"):
                if type(choice.get(key)) is list:
                    light_choice[key] = []
            light_choices.append(light_choice)
        light["choices"] = light_choices
    return light


def validate_trajectory(record: Any) -> None:
    """Validate a trajectory record (see docs/interfaces.md)."""
    validate_record(RecordKind.TRAJECTORY, record)


def validate_feedback(event: Any) -> None:
    """Validate a feedback event (see docs/interfaces.md)."""
    validate_record(RecordKind.FEEDBACK, event)


_encode_fast = msgspec.json.Encoder().encode
_READ_BACK_WHOLE_BYTES = 2048
_decode_fast = msgspec.json.Decoder().decode


def encode_record(record: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON, the wire format of every topic; ValueError for NaN or Infinity
    (the wire is strict JSON), TypeError for what JSON cannot hold.

    msgspec writes and reads back a 4 KB trajectory in ~35 µs, where `json.dumps` takes ~100
    µs. It writes NaN as null, takes types `json` refuses (sets, tuples, int keys) and
    refuses lone surrogates, so its bytes are used only when they read back equal to the
    record (a long trajectory's token-id and logprob arrays: when they hold only ints and
    finite floats, which read back as written); anything else is written by `json`
    (`dumps_json`), which raises as before."""
    try:
        value = _encode_fast(record)
        # A small record reads back whole as fast as its light copy is made.
        light = _without_plain_arrays(record) if len(value) > _READ_BACK_WHOLE_BYTES else None
        if light is None:
            if _decode_fast(value) == record:
                return value
        elif _decode_fast(_encode_fast(light)) == light:
            return value
    except (msgspec.EncodeError, msgspec.DecodeError, TypeError, ValueError, OverflowError):
        pass  # json decides, and says why
    return dumps_json(record, separators=(",", ":"), allow_nan=False).encode()


def _without_plain_arrays(record: Any) -> dict[str, Any] | None:
    """A trajectory with its token-id and logprob arrays emptied, when those hold only ints
    and finite floats (which msgspec writes as `json` does and reads back equal); else None.

    The arrays are most of a record's bytes: reading them back to compare took ~60 % of
    `encode_record` (a 9,000-token record: 390 of 494 µs). msgspec writes a dict as its
    items one after another, so the record reads back equal when the rest does."""
    if type(record) is not dict:
        return None
    prompt_ids, choices = record.get("prompt_token_ids"), record.get("choices")
    if type(prompt_ids) is not list or type(choices) is not list:
        return None
    if not _is_list_of(prompt_ids, _IntList):
        return None
    light_choices: list[Any] = []
    for choice in choices:
        if type(choice) is not dict:
            return None
        light_choice = dict(choice)
        for key, of in (("token_ids", _IntList), ("logprobs", _NumberList)):
            values = choice.get(key)
            if values is None:
                continue
            if type(values) is not list or not _is_list_of(values, of):
                return None
            light_choice[key] = []
        logprobs = choice.get("logprobs")
        if logprobs:
            try:
                # The sum is finite only when every element is (msgspec writes NaN and
                # infinities as null).
                if not math.isfinite(sum(logprobs)):
                    return None
            except OverflowError:  # an int too large for a float
                return None
        light_choices.append(light_choice)
    return {**record, "prompt_token_ids": [], "choices": light_choices}


# A UTF-16 surrogate code point. In a str it can only be a lone one (a pair is one code
# point), and `json.dumps(ensure_ascii=False)` writes it as it is, inside a JSON string.
_SURROGATE = re.compile("[\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def dumps_json(
    value: Any, *, separators: tuple[str, str] | None = None, allow_nan: bool = True
) -> str:
    """`json.dumps(ensure_ascii=False)` whose text always encodes as UTF-8.

    A client's JSON may hold `"\\ud800"`, which json.loads turns into a lone surrogate that
    UTF-8 cannot carry. It is written back as that same `\\udXXX` escape (other text stays
    UTF-8), which json.loads reads as the same string: the record keeps the exact text the
    upstream was sent and tokenised, so its request, its token ids and a replay of it agree
    (replacing the surrogate with U+FFFD would lose that and change what a replay sends).
    Only a high and a low surrogate held as two code points (CESU-8 bytes a lenient decoder
    let through) read back as the one character their escapes spell, as in every JSON reader.
    """
    text = json.dumps(value, separators=separators, ensure_ascii=False, allow_nan=allow_nan)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATE.sub(_escape, text)
    return text


def decode_record(value: bytes | None) -> Any:
    """Parse a wire value; raises ValueError (json.JSONDecodeError / UnicodeDecodeError, or
    nesting too deep to parse), also for a record without a value (None: a tombstone), which
    is no record of ours.

    msgspec parses a trajectory ~3x faster than `json` (23 vs 78 µs for 4 KB) and gives the
    same values; what it refuses (NaN, numbers out of float range, lone surrogates, invalid
    UTF-8: only a foreign producer writes them) goes to `json`, which decides as before."""
    if value is None:
        raise ValueError("the record has no value (a tombstone)")
    try:
        try:
            return _decode_fast(value)
        except msgspec.DecodeError:
            return json.loads(value.decode("utf-8"))
    except RecursionError as exc:
        # Nesting deeper than either parser goes (only a foreign producer writes it): invalid
        # like any other unparsable value. Before, it escaped the callers' `except
        # ValueError`, and a consumer raised on the same record at every poll.
        raise ValueError("the record nests too deeply to parse") from exc


# A DLQ envelope's `reason` keeps this many characters: jsonschema's message repeats the
# offending value, which may be megabytes, and an envelope over the topic's request size
# would be refused (on every poll of a consumer, which rewinds to the record and raises).
DLQ_REASON_CHARS = 4096


def cut_reason(reason: str) -> str:
    """`reason`, cut to DLQ_REASON_CHARS characters (saying so) when longer."""
    if len(reason) <= DLQ_REASON_CHARS:
        return reason
    return f"{reason[:DLQ_REASON_CHARS]}... (cut: {len(reason)} characters in all)"


def dlq_envelope(
    *,
    reason: str,
    source_topic: str,
    origin: str,
    kind: str | None,
    raw: bytes | None = None,
    record: Any = None,
    source_partition: int | None = None,
    source_offset: int | None = None,
    event_id: str | None = None,
) -> dict[str, Any]:
    """The record written to `<prefix>.dlq`: why, where from, and the original payload.

    `origin` is "producer" (rejected before it reached the topic) or "consumer" (read from the
    topic and rejected); the original is kept as parsed JSON when it parsed, else as text.
    `event_id` (see `dlq_event_id`) gives the envelopes of one record rejected twice the
    same id; without it the envelope gets a fresh one. `reason` is cut (`cut_reason`).
    """
    envelope: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "event_id": event_id or new_event_id(),
        "created_at": time.time(),
        "origin": origin,
        "kind": kind,
        "reason": cut_reason(reason),
        "source_topic": source_topic,
        "source_partition": source_partition,
        "source_offset": source_offset,
    }
    if record is not None:
        envelope["record"] = record
    elif raw is not None:
        envelope["raw"] = raw.decode("utf-8", errors="replace")
    return envelope


def dlq_event_id(
    origin: str,
    source_topic: str,
    *,
    record: Any = None,
    source_partition: int | None = None,
    source_offset: int | None = None,
    value: bytes | None = None,
) -> str | None:
    """The event id of the DLQ envelope of one rejected record, the same each time that
    record is rejected again (a resent spill segment, a worker that died before confirming,
    a consumer that resumes before its last rejection); None when nothing identifies it.

    A record read from a topic is identified by where it lies and its bytes (`value`: a
    topic made again reuses offsets), one of ours by its event_id."""
    if source_partition is not None and source_offset is not None:
        where = f"{source_partition}:{source_offset}"
        digest = hashlib.sha256(value or b"").hexdigest()
        return derived_event_id("dlq", origin, source_topic, where, digest)
    record_id = record.get("event_id") if isinstance(record, dict) else None
    if isinstance(record_id, str) and record_id:
        return derived_event_id("dlq", origin, source_topic, record_id)
    return None
