"""Explicit feedback events (accept, reject, score, ...) mapped to reward values."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, NamedTuple

from learner.config import FeedbackValues


class FeedbackError(ValueError):
    """A feedback event that cannot be turned into a reward value."""


class FeedbackReward(NamedTuple):
    """The reward of one choice from its feedback, and what was left out or bounded."""

    value: float | None  # None: no valid event concerns the choice
    invalid: int  # malformed events (counted as invalid_feedback)
    clamped: int  # `score` values outside [score_min, score_max] (counted as score_clamped)


def _score(value: Any, values: FeedbackValues) -> tuple[float, bool]:
    """A score clamped to the configured range, and whether it had to be."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise FeedbackError(f"score feedback needs a numeric value, got {value!r}")
    try:
        number = float(value)
    except OverflowError as exc:  # an int too large for a float
        raise FeedbackError("score feedback value does not fit a float") from exc
    if not math.isfinite(number):
        raise FeedbackError(f"score feedback needs a finite value, got {number!r}")
    bounded = min(max(number, values.score_min), values.score_max)
    return bounded, bounded != number


def _value(event: dict[str, Any], values: FeedbackValues) -> tuple[float, bool]:
    kind = event.get("kind")
    value = event.get("value")
    if kind == "score":
        return _score(value, values)
    if kind == "test_result":
        if value is None:
            raise FeedbackError("test_result feedback needs a value (pass: truthy/1, fail: 0)")
        passed = bool(value) if not isinstance(value, int | float) else value > 0
        return (values.test_pass if passed else values.test_fail), False
    if kind in ("accept", "reject", "thumbs_up", "thumbs_down", "edit_kept"):
        return float(getattr(values, kind)), False
    raise FeedbackError(f"unknown feedback kind {kind!r}")


def feedback_value(event: dict[str, Any], values: FeedbackValues) -> float:
    """Reward value of one feedback event; raises FeedbackError on a malformed event."""
    return _value(event, values)[0]


def event_choice(event: dict[str, Any]) -> int:
    """The choice an event is addressed to (the proxy checks it is an integer; 0 if absent)."""
    return int(event.get("choice_index", 0) or 0)


def unmatched(events: Iterable[dict[str, Any]], choice_indexes: Iterable[int]) -> int:
    """How many events are addressed to none of `choice_indexes` (a wrong `choice_index`, or
    a record without choices): they reward nothing, and are counted, not lost."""
    indexes = set(choice_indexes)
    return sum(1 for event in events if event_choice(event) not in indexes)


# Kinds that answer the same question: within one, a later event replaces an earlier one.
_FAMILY = {
    "accept": "verdict",
    "reject": "verdict",
    "thumbs_up": "rating",
    "thumbs_down": "rating",
    "edit_kept": "edit",
    "test_result": "test",
    "score": "score",
}


def _when(event: dict[str, Any]) -> float:
    created = event.get("created_at")
    usable = isinstance(created, int | float) and not isinstance(created, bool)
    return float(created) if usable and math.isfinite(created) else -math.inf


def feedback_reward(
    events: Iterable[dict[str, Any]], choice_index: int, values: FeedbackValues
) -> FeedbackReward:
    """The feedback part of `choice_index`'s reward, with the counts of invalid events and of
    clamped scores: per family of kinds (accept/reject, thumbs up/down, edit_kept,
    test_result, score) the latest valid event (by `created_at`, then arrival), summed over
    the families (each bounded already: a kind's configured value, a score clamped to
    [`score_min`, `score_max`]; clamping the sum to those too made a reject count 0 where
    `score_min` is 0).

    Averaged over every event, more evidence of the same sign lowered a reward (a passing
    test 1.0, with an accept 0.875, so a sibling with only the test ranked above the reply
    also accepted), and a change of mind did not count (accept then reject +0.25; a
    client's retried accept outweighed the reject after it)."""
    latest: dict[str, tuple[float, int, float]] = {}
    invalid = clamped = 0
    for position, event in enumerate(events):
        if event_choice(event) != choice_index:
            continue
        try:
            value, was_clamped = _value(event, values)
        except FeedbackError:
            invalid += 1
            continue
        clamped += int(was_clamped)
        family = _FAMILY[str(event.get("kind"))]
        key = (_when(event), position, value)
        if family not in latest or key[:2] >= latest[family][:2]:
            latest[family] = key
    if not latest:
        return FeedbackReward(None, invalid, clamped)
    return FeedbackReward(sum(value for _, _, value in latest.values()), invalid, clamped)
