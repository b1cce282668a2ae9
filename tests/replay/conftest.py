"""Fixtures of the replay tests: a private topic prefix per test on the shared broker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from replay.config import StreamConfig
from replay.consumer import ScoredTrajectory, TrajectoryConsumer


def unique_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def stream_config(kafka_bootstrap: str) -> StreamConfig:
    """Short timeouts and a zero join window so round trips finish quickly."""
    return StreamConfig(
        bootstrap_servers=kafka_bootstrap,
        topic_prefix=unique_prefix(),
        partitions=4,
        join_window_s=0.0,
        join_grace_s=0.0,
        reconnect_backoff_s=0.2,
        request_timeout_ms=2_000,
        delivery_timeout_ms=3_000,
        max_block_ms=2_000,
        bootstrap_timeout_ms=2_000,
        close_timeout_s=5.0,
    )


def consume_until(
    consumer: TrajectoryConsumer,
    done: Callable[[list[ScoredTrajectory]], bool],
    timeout_s: float = 60.0,
) -> list[ScoredTrajectory]:
    """Poll until `done(collected)` holds; fail the test with what arrived when it never does."""
    collected: list[ScoredTrajectory] = []
    deadline = time.monotonic() + timeout_s
    while not done(collected):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"gave up after {timeout_s}s with {len(collected)} trajectories, "
                f"stats={consumer.stats}"
            )
        collected.extend(consumer.poll(0.2))
    return collected
