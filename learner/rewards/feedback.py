"""Explicit feedback events (accept, reject, score, ...) mapped to reward values."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from learner.config import FeedbackValues


class FeedbackError(ValueError):
    """A feedback event that cannot be turned into a reward value."""


def feedback_value(event: dict[str, Any], values: FeedbackValues) -> float:
    """Reward value of one feedback event; raises FeedbackError on a malformed event."""
    kind = event.get("kind")
    value = event.get("value")
    if kind == "score":
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise FeedbackError(f"score feedback needs a numeric value, got {value!r}")
        return float(value)
    if kind == "test_result":
        if value is None:
            raise FeedbackError("test_result feedback needs a value (pass: truthy/1, fail: 0)")
        passed = bool(value) if not isinstance(value, int | float) else value > 0
        return values.test_pass if passed else values.test_fail
    if kind in ("accept", "reject", "thumbs_up", "thumbs_down", "edit_kept"):
        return float(getattr(values, kind))
    raise FeedbackError(f"unknown feedback kind {kind!r}")


def feedback_reward(
    events: Iterable[dict[str, Any]], choice_index: int, values: FeedbackValues
) -> tuple[float | None, int]:
    """Mean value of the valid events addressed to `choice_index`, and how many were invalid.

    Returns (None, invalid) when no valid event concerns the choice.
    """
    found: list[float] = []
    invalid = 0
    for event in events:
        if int(event.get("choice_index", 0) or 0) != choice_index:
            continue
        try:
            found.append(feedback_value(event, values))
        except FeedbackError:
            invalid += 1
    if not found:
        return None, invalid
    return sum(found) / len(found), invalid
