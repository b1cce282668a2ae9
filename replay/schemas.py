"""Versioned JSON Schemas of the stream records: load, validate with field-named errors, encode."""

from __future__ import annotations

import json
import time
import uuid
from enum import StrEnum
from functools import cache
from importlib import resources
from typing import Any

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


@cache
def load_schema(kind: RecordKind | str, version: int = SCHEMA_VERSION) -> dict[str, Any]:
    """The parsed JSON Schema document `<kind>.v<version>.json` shipped in replay/schemas/."""
    name = f"{RecordKind(kind).value}.v{version}.json"
    text = resources.files("replay").joinpath("schemas", name).read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    Draft202012Validator.check_schema(schema)
    return schema


@cache
def _validator(kind: RecordKind, version: int) -> Draft202012Validator:
    return Draft202012Validator(load_schema(kind, version))


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
    error = best_match(_validator(kind, SCHEMA_VERSION).iter_errors(record))
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


def validate_trajectory(record: Any) -> None:
    """Validate a trajectory record (see docs/interfaces.md)."""
    validate_record(RecordKind.TRAJECTORY, record)


def validate_feedback(event: Any) -> None:
    """Validate a feedback event (see docs/interfaces.md)."""
    validate_record(RecordKind.FEEDBACK, event)


def encode_record(record: dict[str, Any]) -> bytes:
    """Compact UTF-8 JSON, the wire format of every topic."""
    return json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def decode_record(value: bytes) -> Any:
    """Parse a wire value; raises ValueError (json.JSONDecodeError / UnicodeDecodeError)."""
    return json.loads(value.decode("utf-8"))


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
) -> dict[str, Any]:
    """The record written to `<prefix>.dlq`: why, where from, and the original payload.

    `origin` is "producer" (rejected before it reached the topic) or "consumer" (read from the
    topic and rejected); the original is kept as parsed JSON when it parsed, else as text.
    """
    envelope: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "event_id": new_event_id(),
        "created_at": time.time(),
        "origin": origin,
        "kind": kind,
        "reason": reason,
        "source_topic": source_topic,
        "source_partition": source_partition,
        "source_offset": source_offset,
    }
    if record is not None:
        envelope["record"] = record
    elif raw is not None:
        envelope["raw"] = raw.decode("utf-8", errors="replace")
    return envelope
