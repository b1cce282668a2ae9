"""`POST /v1/feedback`: validate the body, check ownership, build the feedback event.

Ownership is checked against a bounded map of recent trajectory ids → (tenant, session):
feedback on another tenant's trajectory is refused (403); ids the proxy no longer (or never)
remembers are accepted, since feedback may arrive long after the trajectory.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.capture import Redact, private_label
from proxy.config import is_utf8_text
from proxy.errors import ProxyError, bad_request
from replay.schemas import dumps_json

FEEDBACK_KINDS = frozenset(
    {"accept", "reject", "thumbs_up", "thumbs_down", "score", "test_result", "edit_kept"}
)
ALLOWED_FIELDS = frozenset({"trajectory_id", "kind", "value", "metadata", "choice_index"})
MAX_ID_LENGTH = 256


class TrajectoryOwner(NamedTuple):
    """Whom a remembered trajectory belongs to, as `RecentTrajectories.get` returns it."""

    tenant: str
    session_id: str
    # The choices its answer has (`n`, times the prompts of a completions list): feedback
    # for a choice_index beyond them is refused while the proxy remembers the trajectory.
    choices: int = 1


class RecentTrajectories:
    """Least-recently-added map of trajectory ids with a fixed capacity.

    Kept as plain `(tenant, session_id, choices)` tuples, made into a TrajectoryOwner only
    when feedback reads one: every captured request adds an owner, and a NamedTuple's
    `__new__` is Python code (0.23 of the 0.5 us an add cost)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._owners: OrderedDict[str, tuple[str, str, int]] = OrderedDict()

    def add(self, trajectory_id: str, tenant: str, session_id: str, choices: int = 1) -> None:
        owners = self._owners
        if trajectory_id in owners:  # a client's repeated id: it becomes the newest again
            owners.move_to_end(trajectory_id)
        owners[trajectory_id] = (tenant, session_id, choices)
        if len(owners) > self.capacity:
            owners.popitem(last=False)

    def get(self, trajectory_id: str) -> TrajectoryOwner | None:
        owner = self._owners.get(trajectory_id)
        return None if owner is None else TrajectoryOwner(*owner)

    def __len__(self) -> int:
        return len(self._owners)


@dataclass(frozen=True)
class FeedbackRequest:
    trajectory_id: str
    kind: str
    value: float | None
    choice_index: int
    metadata: dict[str, Any]


def feedback_body_limit(max_metadata_bytes: int, max_body_bytes: int) -> int:
    """The most a feedback body is read: its metadata as a client may write it (escaped
    non-ASCII is up to 3× its UTF-8, indentation more) plus the other fields. At
    `max_body_bytes` (8 MiB), one key's 600 posts a minute could make the proxy buffer GBs,
    none of which can be a valid event."""
    return min(max_body_bytes, 64 * 1024 + 8 * max_metadata_bytes)


def parse_feedback(body: Any, max_metadata_bytes: int) -> FeedbackRequest:
    """Check the body's shape; raises a 400 ProxyError that names the bad field."""
    if not isinstance(body, dict):
        raise bad_request("The feedback body must be a JSON object.")
    unknown = sorted(set(body) - ALLOWED_FIELDS)
    if unknown:
        raise bad_request(
            f"Unknown field(s) {', '.join(unknown)}; allowed: {', '.join(sorted(ALLOWED_FIELDS))}.",
            param=unknown[0],
        )
    trajectory_id = body.get("trajectory_id")
    if not isinstance(trajectory_id, str) or not trajectory_id.strip():
        raise bad_request(
            "'trajectory_id' is required and must be a non-empty string.", param="trajectory_id"
        )
    if len(trajectory_id) > MAX_ID_LENGTH:
        raise bad_request(
            f"'trajectory_id' is longer than {MAX_ID_LENGTH} characters.", param="trajectory_id"
        )
    if not is_utf8_text(trajectory_id):
        raise bad_request("'trajectory_id' must be valid Unicode text.", param="trajectory_id")
    kind = body.get("kind")
    if not isinstance(kind, str) or kind not in FEEDBACK_KINDS:  # a list: unhashable
        raise bad_request(
            f"'kind' must be one of {', '.join(sorted(FEEDBACK_KINDS))}; got {kind!r}.",
            param="kind",
        )
    value = _finite_number(body.get("value"), "value")
    if kind in ("score", "test_result") and value is None:
        # test_result: its value says pass (> 0) or fail; without one the learner can only
        # count the event as invalid, after the client was told it was accepted.
        raise bad_request(f"Feedback of kind {kind!r} needs a numeric 'value'.", param="value")
    choice_index = body.get("choice_index", 0)
    if isinstance(choice_index, bool) or not isinstance(choice_index, int) or choice_index < 0:
        raise bad_request("'choice_index' must be a non-negative integer.", param="choice_index")
    metadata = body.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise bad_request("'metadata' must be a JSON object.", param="metadata")
    # Empty metadata is none: measured as `{}` (2 bytes), it made every post a 400 under
    # `max_feedback_metadata_bytes: 0`, the setting for "no metadata".
    if metadata and _json_size(metadata) > max_metadata_bytes:
        raise bad_request(
            f"'metadata' is larger than {max_metadata_bytes} bytes.", param="metadata"
        )
    return FeedbackRequest(trajectory_id, kind, value, choice_index, metadata)


def finite_float(value: Any) -> float | None:
    """`value` as a finite float; None when it is no number (bools are none) or does not
    fit one (an int of 400 digits, NaN, Infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _finite_number(value: Any, field: str) -> float | None:
    if value is None:
        return None
    number = finite_float(value)
    if number is None:
        raise bad_request(f"'{field}' must be a finite number or null.", param=field)
    return number


def _json_size(metadata: dict[str, Any]) -> int:
    """The metadata's size as the sink writes it (compact UTF-8 JSON, a lone surrogate as
    its `\\udXXX` escape); 400 when it is not strict JSON (NaN, Infinity, nesting too deep),
    which the sink would refuse after a 202."""
    try:
        return len(dumps_json(metadata, separators=(",", ":"), allow_nan=False).encode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise bad_request(
            "'metadata' must be strict JSON: finite numbers, nested at most a few hundred levels.",
            param="metadata",
        ) from exc


def not_recorded_reason(
    not_captured: RecentTrajectories, request: FeedbackRequest, tenant: Any
) -> str | None:
    """Why feedback on this id must not be recorded (None: record it). A tenant with
    training off gave feedback that went to the feedback topic all the same, metadata (a
    user's rewrite) included, though its consent was not there; and so did feedback on a
    request that was not captured (`X-OLP-Train: 0`, a capture skipped), remembered in
    `not_captured`. Neither can ever join a trajectory."""
    if not tenant.training_enabled:
        return "online training is off for this tenant: feedback is not recorded"
    owner = not_captured.get(request.trajectory_id)
    if owner is not None and owner.tenant == tenant.name_hash:
        return (
            "that request was not recorded for training (X-OLP-Train: 0, or its capture was "
            "skipped): feedback on it is not recorded"
        )
    return None


def check_owner(
    recent: RecentTrajectories, request: FeedbackRequest, tenant_hash: str
) -> str | None:
    """The trajectory's session id if known; 403 when it belongs to another tenant, 400
    for a choice it does not have."""
    owner = recent.get(request.trajectory_id)
    if owner is None:
        return None
    if owner.tenant != tenant_hash:
        raise ProxyError(
            403,
            "This trajectory belongs to another tenant.",
            type_="permission_error",
            code="forbidden",
            param="trajectory_id",
        )
    if request.choice_index >= owner.choices:
        # Accepted, it joined no choice: the learner counted it `feedback_unmatched`.
        raise bad_request(
            f"'choice_index' {request.choice_index} is out of range: this trajectory has "
            f"{owner.choices} choice{'s' if owner.choices != 1 else ''} (0-{owner.choices - 1}).",
            param="choice_index",
        )
    return owner.session_id


# The trajectory ids the proxy issues: its own request id (`req-` and 32 hex, for a request
# without x-request-id) or 32 random hex digits. The Redactor's built-in passes find nothing
# in either (a card number needs a digit run touching no letter, at most 19 digits).
_ISSUED_ID = re.compile(r"(?:req-)?[0-9a-f]{32}")


def event_trajectory_id(
    trajectory_id: str, known: bool, redact: Redact, key: bytes | None = None
) -> str:
    """The trajectory id as the feedback event carries it. Ids the proxy issued leave as
    issued, or the event would not join its trajectory: one it remembers, or one in the
    shape it issues (after a restart it remembers none). Any other is the client's own
    text (an e-mail, a ticket with a card number) and leaves as the records' labels do
    (`capture.private_label`): as it came when the Redactor finds nothing in it, else as
    its pseudonym."""
    if known or _ISSUED_ID.fullmatch(trajectory_id) is not None:
        return trajectory_id
    return private_label(trajectory_id, redact, key) or trajectory_id


def build_event(
    request: FeedbackRequest,
    tenant_hash: str,
    session_id: str,
    metadata: dict[str, Any],
    trajectory_id: str | None = None,
) -> dict[str, Any]:
    """The feedback event of docs/interfaces.md (`trajectory_id`: as the event carries it,
    `event_trajectory_id`; the request's by default)."""
    return {
        "schema_version": 1,
        "event_id": uuid.uuid4().hex,
        "trajectory_id": request.trajectory_id if trajectory_id is None else trajectory_id,
        "session_id": session_id,
        "tenant": tenant_hash,
        "kind": request.kind,
        "value": request.value,
        "choice_index": request.choice_index,
        "metadata": metadata,
        "created_at": time.time(),
    }
