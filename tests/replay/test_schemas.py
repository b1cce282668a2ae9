"""Schema validation: valid records pass, invalid ones fail with the offending field named."""

from __future__ import annotations

import copy
import enum
import json
import uuid
from collections.abc import Callable

import pytest

from replay.schemas import (
    SchemaValidationError,
    decode_record,
    derived_event_id,
    encode_record,
    load_schema,
    new_event_id,
    validate_feedback,
    validate_trajectory,
)
from replay.synthetic import make_feedback, make_trajectory


def test_synthetic_records_are_valid() -> None:
    trajectory = make_trajectory()
    validate_trajectory(trajectory)
    validate_feedback(make_feedback(trajectory, kind="score", value=0.5))
    assert decode_record(encode_record(trajectory)) == trajectory


@pytest.mark.parametrize(
    "record",
    [
        make_trajectory(prompt_tokens=50, completion_tokens=20),
        {"a": (1, 2), 3: "int key", "b": [-0.0, 1e16, 5e-324, 2**70, True, None, "é\u2028"]},
    ],
)
def test_encode_record_writes_what_json_writes(record: dict) -> None:
    expected = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert json.loads(encode_record(record)) == json.loads(expected)


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"logprobs": [-0.5, float("nan")]}, ValueError),  # the wire is strict JSON
        ({"a": {"b": float("-inf")}}, ValueError),
        ({"a": {1, 2}}, TypeError),
        ({"a": object()}, TypeError),
    ],
)
def test_encode_record_refuses_what_json_refuses(record: dict, error: type) -> None:
    with pytest.raises(error):
        encode_record(record)


def _long_trajectory() -> dict:
    """A record over the size from which `encode_record` checks its token arrays by type."""
    return make_trajectory(prompt_tokens=2000, completion_tokens=500)


class _TokenKind(enum.IntEnum):
    EOS = 2


def _set_in(record: dict, where: str, value: object) -> dict:
    record = copy.deepcopy(record)
    array = record["prompt_token_ids"] if where == "prompt" else record["choices"][0][where]
    array[7] = value
    return record


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("prompt", 2**70),  # past msgspec's integers: json writes it
        ("prompt", _TokenKind.EOS),
        ("token_ids", 0),
        ("logprobs", 3),  # an int among the floats
        ("logprobs", -0.0),
        ("logprobs", 5e-324),
        ("logprobs", -1.7976931348623157e308),
    ],
    ids=str,
)
def test_a_long_trajectory_reads_back_as_written(where: str, value: object) -> None:
    """A long record's token arrays are checked by type, not read back; what it holds must
    still reach the wire as `json` writes it and read back equal."""
    record = _set_in(_long_trajectory(), where, value)
    value_bytes = encode_record(record)
    expected = json.dumps(record, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    assert json.loads(value_bytes) == json.loads(expected)
    assert decode_record(value_bytes) == record


@pytest.mark.parametrize(
    ("where", "value", "error"),
    [
        ("logprobs", float("nan"), ValueError),  # msgspec would have written null
        ("logprobs", float("-inf"), ValueError),
        ("prompt", float("inf"), ValueError),
        ("token_ids", {1}, TypeError),
        ("prompt", b"\x00", TypeError),  # msgspec would have written base64
    ],
    ids=str,
)
def test_a_long_trajectory_refuses_what_json_refuses(
    where: str, value: object, error: type
) -> None:
    with pytest.raises(error):
        encode_record(_set_in(_long_trajectory(), where, value))


def test_a_long_trajectory_with_a_tuple_is_written_as_json_writes_it() -> None:
    record = _long_trajectory()
    record["prompt_token_ids"] = tuple(record["prompt_token_ids"])
    record["request"]["stop"] = ("\n", "END")
    assert json.loads(encode_record(record)) == json.loads(json.dumps(record))


@pytest.mark.parametrize(
    "text",
    [
        "abc\ud800",  # what json.loads makes of a client's "abc\\ud800"
        "\udfff\u00e9\u2028",  # a lone low surrogate before non-ASCII text
        "\ud800\ud800x",  # two high surrogates: no pair, both stay alone
    ],
)
def test_encode_record_writes_a_lone_surrogate_as_its_escape(text: str) -> None:
    """UTF-8 cannot carry a lone surrogate, JSON's `\\uXXXX` escape can: the record reaches
    its topic as it was (before: UnicodeEncodeError, and the record went to the DLQ)."""
    record = {"request": {"messages": [{"role": "user", "content": text}]}, text: [text]}
    value = encode_record(record)
    wire = value.decode("utf-8")  # strict: valid UTF-8
    assert "\\ud" in wire
    assert json.loads(wire) == record
    assert decode_record(value) == record


def test_encode_record_escapes_only_the_surrogates() -> None:
    value = encode_record({"a": "é\ud800€"})
    assert value == '{"a":"é\\ud800€"}'.encode()


@pytest.mark.parametrize(
    "wire",
    [
        b'{"a":[1,-0.0,1.5e-320,123456789012345678901234567890],"b":"\xc3\xa9","c":null}',
        b'{"logprob":NaN,"x":-Infinity}',  # only a foreign producer writes these
        b'{"a":1e400}',  # out of float range: json reads inf
        b'{"a":"\\ud800"}',  # a lone surrogate escape
        b'{"a":1,"a":2}',  # the last duplicate wins, as in json
    ],
)
def test_decode_record_reads_what_json_reads(wire: bytes) -> None:
    decoded, expected = decode_record(wire), json.loads(wire.decode("utf-8"))
    # json.dumps tells 1 from 1.0 and writes NaN/Infinity, which == cannot compare
    assert json.dumps(decoded) == json.dumps(expected)


@pytest.mark.parametrize("wire", [b'{"a":1', b"\xff\xfe{}", b"", b'{"a":1}x', None])
def test_decode_record_refuses_what_json_refuses(wire: bytes | None) -> None:
    """ValueError, the one error callers expect; a value-less record (a tombstone) included
    (before: TypeError, which crashed the consumer's poll)."""
    with pytest.raises(ValueError):
        decode_record(wire)


@pytest.mark.parametrize("wire", [b"[" * 200_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000])
def test_decode_record_refuses_nesting_too_deep_to_parse_with_a_value_error(wire: bytes) -> None:
    """Before: json's RecursionError, which the consumer's `except ValueError` let through,
    so `poll` raised on the record again after every rewind and the learner was stuck."""
    with pytest.raises(ValueError):
        decode_record(wire)


def test_schemas_list_exactly_the_documented_fields() -> None:
    trajectory = load_schema("trajectory")
    assert set(trajectory["properties"]) == set(trajectory["required"])
    assert len(trajectory["required"]) == 23
    feedback = load_schema("feedback")
    assert set(feedback["properties"]) == {
        "schema_version",
        "event_id",
        "trajectory_id",
        "session_id",
        "tenant",
        "kind",
        "value",
        "choice_index",
        "metadata",
        "created_at",
    }


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda r: r.pop("session_id"), "session_id"),
        (lambda r: r.update(schema_version=2), "schema_version"),
        (lambda r: r["choices"][0]["token_ids"].__setitem__(1, "x"), "choices[0].token_ids[1]"),
        (lambda r: r["choices"][0].pop("logprobs"), "choices[0].logprobs"),
        (lambda r: r["choices"][0]["logprobs"].__setitem__(2, None), "choices[0].logprobs[2]"),
        (lambda r: r["prompt_token_ids"].__setitem__(3, -1), "prompt_token_ids[3]"),
        (lambda r: r["prompt_token_ids"].__setitem__(0, True), "prompt_token_ids[0]"),
        (lambda r: r.update(prompt_token_ids="1 2 3"), "prompt_token_ids"),
        (lambda r: r["choices"].append("not a choice"), "choices[1]"),
        (lambda r: r.update(endpoint="embeddings"), "endpoint"),
        (lambda r: r.update(tenant="plain-tenant-name"), "tenant"),
        (lambda r: r.update(extra_field=1), "extra_field"),
        (lambda r: r["usage"].pop("total_tokens"), "usage.total_tokens"),
    ],
)
def test_invalid_trajectory_names_the_field(mutate: Callable[[dict], object], field: str) -> None:
    record = copy.deepcopy(make_trajectory())
    mutate(record)
    with pytest.raises(SchemaValidationError) as info:
        validate_trajectory(record)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize("number", [10**400, float("nan"), float("inf")], ids=str)
@pytest.mark.parametrize("field", ["created_at", "timings.ttft_s", "timings.total_s"])
def test_a_time_must_be_a_finite_float(number: float, field: str) -> None:
    """JSON numbers have no range (and Python's json reads NaN and Infinity): the schema took
    these, and the consumer's and the export's float() raised OverflowError on every poll."""
    record = make_trajectory()
    *path, name = field.split(".")
    (record[path[0]] if path else record)[name] = number
    with pytest.raises(SchemaValidationError) as info:
        validate_trajectory(decode_record(json.dumps(record).encode()))  # as read from a topic
    assert info.value.field == field
    event = make_feedback(make_trajectory(), created_at=1.0)
    event["created_at"] = number
    with pytest.raises(SchemaValidationError, match="created_at"):
        validate_feedback(event)


def test_score_feedback_needs_a_value() -> None:
    event = make_feedback(make_trajectory(), kind="score", value=None)
    with pytest.raises(SchemaValidationError) as info:
        validate_feedback(event)
    assert info.value.field == "value"
    event["value"] = 1.0
    validate_feedback(event)


def test_unknown_feedback_kind_is_rejected() -> None:
    event = make_feedback(make_trajectory(), kind="like")
    with pytest.raises(SchemaValidationError, match="kind"):
        validate_feedback(event)


def test_non_object_record_is_rejected() -> None:
    with pytest.raises(SchemaValidationError, match="expected an object"):
        validate_trajectory(["not", "a", "record"])


def test_event_ids_are_unique_hex() -> None:
    ids = {new_event_id() for _ in range(1000)}
    assert len(ids) == 1000
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_derived_event_ids_are_uuid5_of_the_parts() -> None:
    namespace = uuid.UUID("6f1c2a4e-8d3b-4f57-9a0e-2b7d5c913e48")
    for parts in [("trajectory", "t1"), ("trajectory", "a" * 32), ("dlq", "x", "ünï")]:
        expected = uuid.uuid5(namespace, "\x1f".join(parts)).hex
        assert derived_event_id(*parts) == expected
    # A lone surrogate (which `uuid.uuid5` refuses) still gives a stable id of that shape.
    odd = derived_event_id("trajectory", "\ud800")
    assert odd == derived_event_id("trajectory", "\ud800") and len(odd) == 32
    assert uuid.UUID(hex=odd).version == 5


def _mutations(record: dict) -> list[dict]:
    """Every top-level and choice field replaced by values of other JSON types, plus
    removals and an unknown field: the cases where two validators could disagree."""
    odd_values = [None, True, 1, 1.0, -1, "x", "", [], {}, [1, "a"], {"a": 1}]
    out = []
    for key in record:
        for value in odd_values:
            out.append({**record, key: value})
        out.append({k: v for k, v in record.items() if k != key})
    choice = record["choices"][0]
    for key in choice:
        for value in odd_values:
            out.append({**record, "choices": [{**choice, key: value}]})
    out.append({**record, "unexpected": 1})
    return out


@pytest.mark.parametrize("where", ["prompt", "token_ids", "logprobs"])
def test_the_token_array_check_never_passes_what_jsonschema_rejects(where: str) -> None:
    """The token-id and logprob arrays are checked outside the schema (msgspec, then an
    element loop that names the culprit): what that check lets through, the reference
    validator must accept too."""
    from replay.schemas import RecordKind, _validator

    reference = _validator(RecordKind.TRAJECTORY, 1)
    odd = [None, True, False, 0, -1, 1.0, 1.5, -0.0, "1", [], {}, 2**70, _TokenKind.EOS]
    odd += [float("nan"), float("inf")]
    passed = 0
    for value in odd:
        record = _set_in(make_trajectory(prompt_tokens=16, completion_tokens=16), where, value)
        try:
            validate_trajectory(record)
        except SchemaValidationError as exc:
            expected = "prompt_token_ids[7]" if where == "prompt" else f"choices[0].{where}[7]"
            assert exc.field == expected, (value, exc)
            continue
        passed += 1
        assert reference.is_valid(record), value
    assert passed >= 3  # 0, 2**70 and the IntEnum, at least


def test_the_fast_validator_never_passes_what_jsonschema_rejects() -> None:
    """validate_record trusts fastjsonschema's "valid" and asks jsonschema otherwise: the
    fast check must never accept a record the reference validator rejects."""
    from replay.schemas import RecordKind, _fast_check, _validator

    record = make_trajectory()
    trajectory_fast = _fast_check(RecordKind.TRAJECTORY, 1)
    reference = _validator(RecordKind.TRAJECTORY, 1)
    accepted = rejected = 0
    for candidate in _mutations(record):
        try:
            trajectory_fast(copy.deepcopy(candidate))
        except Exception:
            rejected += 1
            continue
        accepted += 1
        assert reference.is_valid(candidate), candidate
    assert accepted > 10 and rejected > 100  # both verdicts were exercised
    feedback = make_feedback(record, kind="score", value=0.5)
    feedback_fast = _fast_check(RecordKind.FEEDBACK, 1)
    accepted = rejected = 0
    for key in feedback:
        for value in (None, True, 1, "x", [], {}):
            candidate = {**feedback, key: value}
            try:
                feedback_fast(copy.deepcopy(candidate))
            except Exception:
                rejected += 1
                continue
            accepted += 1
            assert _validator(RecordKind.FEEDBACK, 1).is_valid(candidate), candidate
    assert accepted > 5 and rejected > 30, (accepted, rejected)


@pytest.mark.parametrize(
    "user",
    [
        None,
        "a" * 64,
        "0123456789abcdef" * 4,
        "A" * 64,
        "a" * 63,
        "a" * 65,
        "a" * 64 + "\n",
        "g" * 64,
        "",
        0,
        True,
        ["a" * 64],
        {"a": 1},
    ],
)
def test_user_takes_exactly_what_its_one_of_took(user: object) -> None:
    """`user` was `oneOf: [sha256, null]`; it is written `type: [string, null]` with the
    sha256 pattern, which reads alike (a pattern does not apply to null) without the
    generated validator raising and catching an exception in every record's oneOf. The
    reference validator and validate_trajectory give each value the verdict the oneOf
    gave, but for a trailing newline, which Python's `$` let through (JSON Schema's regex
    dialect does not): `maxLength: 64` refuses it now. The fast check never accepts what
    the reference refuses."""
    from jsonschema import Draft202012Validator

    from replay.schemas import RecordKind, _fast_check

    schema = load_schema("trajectory")
    assert schema["properties"]["user"] == {
        "type": ["string", "null"],
        "pattern": "^[0-9a-f]{64}$",
        "maxLength": 64,
    }
    before = copy.deepcopy(schema)
    before["$defs"]["sha256"] = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
    before["properties"]["user"] = {"oneOf": [{"$ref": "#/$defs/sha256"}, {"type": "null"}]}
    record = {**make_trajectory(), "user": user}
    expected = Draft202012Validator(before).is_valid(record) and user != "a" * 64 + "\n"
    assert Draft202012Validator(schema).is_valid(record) == expected
    try:
        _fast_check(RecordKind.TRAJECTORY, 1)(copy.deepcopy(record))
    except Exception:
        fast = False
    else:
        fast = True
    assert expected or not fast
    if expected:
        validate_trajectory(record)
    else:
        with pytest.raises(SchemaValidationError, match="user"):
            validate_trajectory(record)


@pytest.mark.parametrize("kind", ["trajectory_tenant", "feedback_tenant"])
def test_a_sha256_field_refuses_a_trailing_newline(kind: str) -> None:
    """Every sha256 field's pattern ends in `$`, which in Python's regex (jsonschema's) also
    matches before a final newline; `maxLength: 64` makes every validator refuse it, as the
    pattern alone does in JSON Schema's own regex dialect."""
    digest = "0123456789abcdef" * 4
    if kind == "trajectory_tenant":
        record, validate = {**make_trajectory(), "tenant": digest + "\n"}, validate_trajectory
    else:
        record = {**make_feedback(make_trajectory()), "tenant": digest + "\n"}
        validate = validate_feedback
    with pytest.raises(SchemaValidationError, match="tenant"):
        validate(record)
    validate({**record, "tenant": digest})


def test_validation_leaves_the_record_unchanged() -> None:
    record = make_trajectory()
    before = copy.deepcopy(record)
    validate_trajectory(record)
    assert record == before
