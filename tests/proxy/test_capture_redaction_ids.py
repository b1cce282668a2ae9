"""What a trajectory record carries of the client's `user` and `x-request-id`.

The record's `user` is the sha256 of the request's `user`; the copy of the request in the
record carried the raw value beside it (an e-mail as `user` was then redacted as free text,
which emptied the token ids of a record whose prompt and completion held no PII). A client's
`x-request-id` is the session id when there is no X-Session-Id: it was pseudonymised as
`session_id` and left raw as `request_id`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.capture import (
    CaptureContext,
    TrajectoryCapture,
    build_record,
    pack_capture,
    private_label,
    unpack_capture,
)
from proxy.config import sha256_hex
from replay.schemas import RecordKind, validate_record
from safety.redaction import Redactor

REDACT = Redactor().redact_obj
GENERATED = "req-" + "ab" * 16

# vLLM's whole chat response, with token ids and logprobs: a trainable record.
RESPONSE = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"base",'
    b'"choices":[{"index":0,"message":{"role":"assistant","content":"hello there"},'
    b'"logprobs":{"content":[{"token":"hello","logprob":-0.5},{"token":" there","logprob":-0.25}]},'
    b'"finish_reason":"stop","token_ids":[11,12]}],'
    b'"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},'
    b'"prompt_token_ids":[1,2,3]}'
)


def _capture(
    user: str | None,
    *,
    request_id: str = GENERATED,
    session_header: str | None = None,
    through_worker: bool = False,
) -> TrajectoryCapture:
    """A capture as `CompletionRelay._capture_for` makes it."""
    body: dict[str, Any] = {"model": "base", "messages": [{"role": "user", "content": "hi"}]}
    if user is not None:
        body["user"] = user
    raw = json.dumps(body).encode()
    context = CaptureContext(
        trajectory_id="t1",
        request_id=request_id,
        session_id=session_header or request_id,
        tenant_hash=sha256_hex("alice"),
        user_hash=sha256_hex(user) if isinstance(user, str) else None,
        endpoint="chat.completions",
        model_alias="base",
        policy_version="base",
        group_id=None,
        task=None,
        request_body=body,
        request_raw=raw,
        sampling={"max_tokens": 16},
    )
    capture = TrajectoryCapture(context)
    capture.add_raw_response(RESPONSE)
    if through_worker:  # a sink's worker process unpacks it and parses the raw body again
        capture = unpack_capture(pack_capture(capture))
    return capture


def _dumped(record: dict[str, Any]) -> str:
    return json.dumps(record)


@pytest.mark.parametrize("through_worker", [False, True])
@pytest.mark.parametrize("user", ["jane.doe@example.com", "jdoe-employee-4411"])
def test_the_request_copy_carries_the_users_hash_never_the_user(
    user: str, through_worker: bool
) -> None:
    record = build_record(_capture(user, through_worker=through_worker), "ok", REDACT)
    assert record["user"] == sha256_hex(user)
    assert record["request"]["user"] == sha256_hex(user)
    assert user not in _dumped(record)
    # The user alone is no PII in what the model saw: the record stays trainable.
    assert record["redactions"] == {}
    assert record["trainable"] is True, record["flags"]
    assert record["prompt_token_ids"] == [1, 2, 3]
    assert record["choices"][0]["token_ids"] == [11, 12]
    validate_record(RecordKind.TRAJECTORY, record)


def test_the_users_hash_is_there_without_redaction_too() -> None:
    record = build_record(_capture("jdoe-employee-4411"), "ok", None)
    assert record["request"]["user"] == sha256_hex("jdoe-employee-4411")
    assert "jdoe-employee-4411" not in _dumped(record)


def test_pii_in_the_prompt_is_still_redacted_beside_a_user() -> None:
    capture = _capture("jane.doe@example.com")
    capture.context.request_body["messages"][0]["content"] = "write to bob@example.org"
    record = build_record(capture, "ok", REDACT)
    assert record["redactions"] == {"email": 1}
    assert record["trainable"] is False and "redacted" in record["flags"]
    assert record["request"]["user"] == sha256_hex("jane.doe@example.com")
    assert "bob@example.org" not in _dumped(record)


def test_a_request_without_user_gets_none_added() -> None:
    record = build_record(_capture(None), "ok", REDACT)
    assert record["user"] is None and "user" not in record["request"]
    assert record["trainable"] is True


def test_the_captured_body_itself_is_not_changed() -> None:
    """The proxy's body dict (also what went upstream) keeps its user."""
    capture = _capture("jdoe-employee-4411")
    build_record(capture, "ok", REDACT)
    assert capture.context.request_body["user"] == "jdoe-employee-4411"


def test_a_generated_request_id_stays_as_feedback_and_logs_know_it() -> None:
    record = build_record(_capture(None), "ok", REDACT)
    assert record["request_id"] == record["session_id"] == GENERATED


def test_a_clients_plain_request_id_stays() -> None:
    record = build_record(_capture(None, request_id="client-42.retry:1"), "ok", REDACT)
    assert record["request_id"] == record["session_id"] == "client-42.retry:1"


def test_a_request_id_that_is_the_session_id_is_pseudonymised_as_the_session_id() -> None:
    card = "4111111111111111"  # fits x-request-id's characters
    record = build_record(_capture(None, request_id=card), "ok", REDACT)
    assert record["session_id"] == private_label(card, REDACT)
    assert record["session_id"].startswith("redacted-")
    assert record["request_id"] == record["session_id"]
    assert card not in _dumped(record)
    # A label is no text the model saw: nothing redacted, still trainable.
    assert record["redactions"] == {} and record["trainable"] is True
    validate_record(RecordKind.TRAJECTORY, record)


@pytest.mark.parametrize(
    "secret", ["4111111111111111", "sk-proj-abcdefghijklmnopqrstuvwxyz0123456789"]
)
def test_a_request_id_beside_a_session_header_is_pseudonymised_on_its_own(secret: str) -> None:
    record = build_record(_capture(None, request_id=secret, session_header="chat-7"), "ok", REDACT)
    assert record["session_id"] == "chat-7"
    assert record["request_id"] == private_label(secret, REDACT) != secret
    assert secret not in _dumped(record)
    assert record["redactions"] == {} and record["trainable"] is True


def test_a_request_id_is_left_as_it_came_with_redaction_off() -> None:
    record = build_record(_capture(None, request_id="4111111111111111"), "ok", None)
    assert record["request_id"] == "4111111111111111"
