"""Exactly-once resumption and the feedback join, on the real broker.

The consumer's clock is injected so windows open and close at chosen moments; everything
else (producer, broker, consumer) is real.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from replay.config import StreamConfig
from replay.consumer import ResumeOffsetError, ScoredTrajectory, TrajectoryConsumer
from replay.producer import KafkaSink
from replay.synthetic import make_feedback, make_trajectory, sha256_hex
from tests.replay.conftest import consume_until


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _drain(consumer: TrajectoryConsumer, rounds: int = 10) -> list[ScoredTrajectory]:
    """Poll until the consumer is caught up and a few polls in a row brought nothing."""
    out: list[ScoredTrajectory] = []
    quiet = 0
    while quiet < rounds:
        batch = consumer.poll(0.2)
        out.extend(batch)
        quiet = quiet + 1 if not batch and consumer.caught_up() else 0
    return out


def _produce(config: StreamConfig, state_dir: Path, trajectories: list, feedback: list) -> None:
    sink = KafkaSink(config, state_dir)
    for record in trajectories:
        sink.put_trajectory(record)
    for event in feedback:
        sink.put_feedback(event)
    assert sink.wait_idle(30)
    sink.close()


def test_killed_before_checkpoint_resumes_with_nothing_twice_or_skipped(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    t0 = 1_700_000_000.0
    config = stream_config.model_copy(update={"join_window_s": 5.0, "join_grace_s": 0.0})
    trajectories = [make_trajectory(session_id=f"s{i % 7}", created_at=t0 + i) for i in range(100)]
    feedback = [
        make_feedback(t, kind="score", value=float(i), created_at=t0 + i + 1.0)
        for i, t in enumerate(trajectories)
    ]
    _produce(config, tmp_path, trajectories, feedback)

    clock = FakeClock(t0 + 50)
    first = TrajectoryConsumer(config, clock=clock)
    trained_and_checkpointed = _drain(first)
    checkpoint = first.processed_offsets()
    assert 0 < len(trained_and_checkpointed) < 50
    assert first.waiting() > 0  # windows still open, their feedback already attached
    clock.now = t0 + 80
    trained_then_crashed = _drain(first)  # a training step whose checkpoint never lands
    assert trained_then_crashed
    first.close()

    # The checkpoint survives a JSON round trip (partition keys become strings).
    import json

    restored = json.loads(json.dumps(checkpoint))
    second = TrajectoryConsumer(config, restored, clock=FakeClock(t0 + 1_000))
    resumed = _drain(second)
    assert second.stats.late_feedback == 0
    second.close()

    ids = [s.trajectory["trajectory_id"] for s in trained_and_checkpointed + resumed]
    assert len(ids) == len(set(ids)) == 100
    crashed_ids = {s.trajectory["trajectory_id"] for s in trained_then_crashed}
    assert crashed_ids <= {s.trajectory["trajectory_id"] for s in resumed}
    for scored in trained_and_checkpointed + resumed:
        assert [f["trajectory_id"] for f in scored.feedback] == [scored.trajectory["trajectory_id"]]


def test_retried_duplicates_after_the_resume_point_are_dropped(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    trajectories = [make_trajectory(session_id="one-session") for _ in range(20)]
    _produce(stream_config, tmp_path, trajectories, [])
    first = TrajectoryConsumer(stream_config)
    yielded = consume_until(first, lambda got: len(got) >= 20)
    checkpoint = first.processed_offsets()
    first.close()
    # A producer retry delivers copies (same event ids) of records already trained on.
    _produce(stream_config, tmp_path, trajectories[:5], [])
    fresh = [make_trajectory(session_id="one-session") for _ in range(3)]
    _produce(stream_config, tmp_path, fresh, [])

    second = TrajectoryConsumer(stream_config, checkpoint)
    resumed = consume_until(second, lambda got: len(got) >= 3)
    assert second.poll(0.5) == []
    assert second.stats.duplicates == 5
    second.close()
    assert len(yielded) == 20
    assert [s.trajectory for s in resumed] == fresh


def test_feedback_joins_by_trajectory_id_and_late_feedback_is_counted(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    t0 = 1_700_000_000.0
    config = stream_config.model_copy(
        update={"join_window_s": 10.0, "join_grace_s": 1.0, "orphan_feedback_ttl_s": 60.0}
    )
    a = make_trajectory(session_id="sa", created_at=t0)
    b = make_trajectory(session_id="sb", created_at=t0 + 1)
    early = make_feedback(a, kind="accept", created_at=t0 + 2)
    before_its_trajectory = make_feedback(b, kind="thumbs_up", created_at=t0 + 3)
    after_window = make_feedback(a, kind="reject", created_at=t0 + 30)
    orphan = make_feedback(make_trajectory(session_id="sc"), kind="edit_kept", created_at=t0)
    # Feedback for b reaches the broker before b itself.
    _produce(config, tmp_path, [], [before_its_trajectory, orphan])
    _produce(config, tmp_path, [a, b], [early, after_window])

    clock = FakeClock(t0 + 5)
    consumer = TrajectoryConsumer(config, clock=clock)
    assert _drain(consumer, rounds=5) == []  # windows still open
    assert consumer.waiting() == 2
    clock.now = t0 + 12.0  # a finished at +0.9 s: its window (10 s + 1 s grace) closed
    scored = _drain(consumer, rounds=5)
    assert [s.trajectory["trajectory_id"] for s in scored] == [a["trajectory_id"]]
    assert scored[0].feedback == [early]
    assert consumer.stats.late_feedback == 1  # after_window: stamped 30 s after a
    clock.now = t0 + 13
    scored = _drain(consumer, rounds=5)
    assert [s.trajectory for s in scored] == [b]
    assert scored[0].feedback == [before_its_trajectory]

    # Feedback that arrives after its trajectory was yielded is late too.
    _produce(config, tmp_path, [], [make_feedback(b, kind="score", value=1.0, created_at=t0 + 5)])
    assert _drain(consumer, rounds=5) == []
    assert consumer.stats.late_feedback == 2

    # The orphan holds its offset until it expires, so a restart would still see it.
    offsets = consumer.processed_offsets()
    orphan_partition = {
        p for p, off in offsets[f"{config.topic_prefix}.feedback"].items() if off == 0
    }
    assert orphan_partition
    clock.now = t0 + 100
    assert _drain(consumer, rounds=5) == []
    assert consumer.stats.orphaned_feedback == 1
    assert consumer.waiting() == 0
    consumer.close()


def test_a_trajectory_read_after_its_window_waits_the_grace_for_its_feedback(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """After an outage the proxy's spill delivers a trajectory long after its window, and
    the feedback spilled after it a moment later: yielded at once, the trajectory went
    without it and the feedback was dropped as late."""
    t0 = 1_700_000_000.0
    config = stream_config.model_copy(update={"join_window_s": 10.0, "join_grace_s": 2.0})
    trajectory = make_trajectory(session_id="s", created_at=t0)
    _produce(config, tmp_path, [trajectory], [])
    clock = FakeClock(t0 + 600)  # read ten minutes after it was served
    consumer = TrajectoryConsumer(config, clock=clock)
    assert _drain(consumer, rounds=5) == [] and consumer.waiting() == 1
    _produce(config, tmp_path, [], [make_feedback(trajectory, kind="accept", created_at=t0 + 3)])
    clock.now = t0 + 601
    assert _drain(consumer, rounds=5) == []  # the feedback is read; the grace runs on
    clock.now = t0 + 602.5
    scored = _drain(consumer, rounds=5)
    assert [s.trajectory for s in scored] == [trajectory]
    assert [event["kind"] for event in scored[0].feedback] == ["accept"]
    assert consumer.stats.late_feedback == 0
    consumer.close()


def test_feedback_from_another_tenant_is_dropped_not_joined(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The proxy refuses feedback on another tenant's trajectory only while it remembers
    the id; the join refuses it always, whether it arrives before or after the trajectory."""
    t0 = 1_700_000_000.0
    config = stream_config.model_copy(update={"join_window_s": 10.0, "join_grace_s": 0.0})
    trajectory = make_trajectory(session_id="s", tenant="owner", created_at=t0)
    own = make_feedback(trajectory, kind="thumbs_up", created_at=t0 + 1)
    foreign = [
        {**make_feedback(trajectory, kind="thumbs_down", created_at=t0 + 2), "tenant": other}
        for other in (sha256_hex("intruder"), sha256_hex("intruder-2"))
    ]
    _produce(config, tmp_path, [], [foreign[0]])  # before its trajectory: waits, then dropped
    _produce(config, tmp_path, [trajectory], [own, foreign[1]])

    consumer = TrajectoryConsumer(config, clock=FakeClock(t0 + 20))
    try:
        scored = _drain(consumer, rounds=5)
        assert [s.trajectory for s in scored] == [trajectory]
        assert scored[0].feedback == [own]
        assert consumer.stats.foreign_feedback == 2
        assert consumer.stats.late_feedback == consumer.stats.orphaned_feedback == 0
        # Nothing dropped holds the resume point back: the three events share the session
        # key, so one partition, whose resume point is past all of them.
        feedback_offsets = consumer.processed_offsets()[f"{config.topic_prefix}.feedback"]
        assert max(feedback_offsets.values()) == 3
    finally:
        consumer.close()


def test_resume_offset_beyond_the_partition_end_stops_loudly(stream_config: StreamConfig) -> None:
    topic = f"{stream_config.topic_prefix}.trajectories"
    with (
        TrajectoryConsumer(stream_config, {topic: {0: 1000}}) as consumer,
        pytest.raises(ResumeOffsetError, match="beyond the end"),
    ):
        for _ in range(50):
            consumer.poll(0.2)


def test_feedback_waiting_for_its_trajectory_survives_a_restart(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    t0 = 1_700_000_000.0
    config = stream_config.model_copy(update={"join_window_s": 10.0, "join_grace_s": 0.0})
    done = make_trajectory(session_id="s1", created_at=t0)
    later = make_trajectory(session_id="s2", created_at=t0 + 1)
    early_feedback = make_feedback(later, kind="test_result", value=1.0, created_at=t0 + 2)
    _produce(config, tmp_path, [done], [early_feedback])

    first = TrajectoryConsumer(config, clock=FakeClock(t0 + 20))
    assert [s.trajectory for s in _drain(first, rounds=5)] == [done]
    checkpoint = first.processed_offsets()
    first.close()

    _produce(config, tmp_path, [later], [])  # the trajectory arrives after the restart
    second = TrajectoryConsumer(config, checkpoint, clock=FakeClock(t0 + 20))
    resumed = _drain(second, rounds=5)
    second.close()
    assert [s.trajectory for s in resumed] == [later]
    assert resumed[0].feedback == [early_feedback]


def test_a_trajectory_stamped_in_the_future_does_not_hold_back_its_partition(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """Windows close in offset order; one timed from a day-ahead `created_at` (clock skew,
    ms for s) is timed from when it was read instead, and its feedback still joins."""
    now = 1_700_000_000.0
    config = stream_config.model_copy(update={"join_window_s": 5.0, "join_grace_s": 1.0})
    skewed = make_trajectory(session_id="one", created_at=now + 86_400)
    behind = [make_trajectory(session_id="one", created_at=now - 60 + i) for i in range(3)]
    feedback = make_feedback(skewed, created_at=now + 86_400 + 2)  # the same skewed clock
    _produce(config, tmp_path, [skewed, *behind], [feedback])

    clock = FakeClock(now)
    consumer = TrajectoryConsumer(config, clock=clock)
    try:
        assert _drain(consumer) == []  # the skewed window is open for 6 s from now
        clock.now = now + 6
        scored = _drain(consumer)
        assert [s.trajectory for s in scored] == [skewed, *behind]
        assert scored[0].feedback == [feedback]
        assert consumer.stats.future_created_at == 1
        assert consumer.stats.late_feedback == 0
    finally:
        consumer.close()


def test_waiting_feedback_stamped_in_the_future_still_expires(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """Feedback waiting for a trajectory that never comes pins its partition's resume point
    until it expires; a day-ahead `created_at` is timed from when it was read instead, so it
    expires after `orphan_feedback_ttl_s` like any other."""
    now = 1_700_000_000.0
    config = stream_config.model_copy(update={"orphan_feedback_ttl_s": 60.0})
    skewed = make_feedback(make_trajectory(session_id="gone"), created_at=now + 86_400)
    _produce(config, tmp_path, [], [skewed])
    feedback_topic = f"{config.topic_prefix}.feedback"

    clock = FakeClock(now)
    consumer = TrajectoryConsumer(config, clock=clock)
    try:
        assert _drain(consumer, rounds=5) == []
        # Its one record is read, but its partition resumes before it (it is still needed).
        assert sum(consumer.processed_offsets()[feedback_topic].values()) == 0
        clock.now = now + 61  # the TTL has passed since it was read
        assert _drain(consumer, rounds=5) == []
        assert consumer.stats.orphaned_feedback == 1
        assert sum(consumer.processed_offsets()[feedback_topic].values()) == 1
        assert consumer.stats.future_created_at == 1  # counted and logged when read
    finally:
        consumer.close()


def test_a_copy_under_a_new_event_id_after_the_resume_point_is_not_trained_again(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A trajectory built twice (a sink worker's parent rebuilt it under a new event_id) is
    dropped by trajectory_id. A resumed consumer rebuilds that memory from the look-back
    (`_closed_before_start`) but did not consult it: the copy was yielded, trained twice."""
    t0 = 1_700_000_000.0
    config = stream_config.model_copy(update={"join_window_s": 3.0, "join_grace_s": 0.0})
    first = make_trajectory(session_id="one", created_at=t0 - 100)  # window long closed
    waiting = make_trajectory(session_id="one", created_at=t0)  # window open at t0 + 1
    copy = dict(first, event_id="c" * 32)
    _produce(config, tmp_path, [first, waiting, copy], [])

    consumer = TrajectoryConsumer(config, clock=FakeClock(t0 + 1))
    assert [s.trajectory for s in _drain(consumer)] == [first]
    assert consumer.stats.duplicates == 1
    offsets = consumer.processed_offsets()
    consumer.close()

    clock = FakeClock(t0 + 1)
    resumed = TrajectoryConsumer(config, offsets, clock=clock)
    try:
        assert _drain(resumed) == []
        assert resumed.stats.duplicates == 1
        clock.now = t0 + 100
        assert [s.trajectory for s in _drain(resumed)] == [waiting]
    finally:
        resumed.close()


def test_a_bare_offset_where_the_partitions_belong_is_refused_naming_the_topic(
    stream_config: StreamConfig,
) -> None:
    """Before: AttributeError ('int' object has no attribute 'items')."""
    topic = f"{stream_config.topic_prefix}.trajectories"
    with pytest.raises(ValueError, match=f"offsets of '{topic}' must be an object"):
        TrajectoryConsumer(stream_config, {topic: 5})
    with pytest.raises(ValueError, match=f"offsets of '{topic}': offset must be"):
        TrajectoryConsumer(stream_config, {topic: {"0": None}})


def test_feedback_read_before_its_looked_back_trajectory_is_not_an_orphan(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """One orphan keeps the feedback topic's resume point at its start, so a resumed consumer
    reads every feedback event again, interleaved with the trajectories' look-back. Those
    read before their trajectory waited as orphans, held the feedback partition back for
    the orphan TTL and were then dropped as orphaned."""
    config = stream_config.model_copy(update={"join_window_s": 0.0, "join_grace_s": 0.0})
    ghost = make_trajectory(session_id="s")  # its feedback waits: the trajectory comes later
    trajectories = [make_trajectory(session_id="s") for _ in range(50)]
    _produce(
        config, tmp_path, trajectories, [make_feedback(ghost), *map(make_feedback, trajectories)]
    )
    first = TrajectoryConsumer(config)
    assert len(_drain(first)) == 50
    offsets = first.processed_offsets()
    first.close()
    feedback_topic = f"{config.topic_prefix}.feedback"
    assert sum(offsets[feedback_topic].values()) == 0  # held at the ghost's feedback

    _produce(config, tmp_path / "late", [ghost], [])
    resumed = TrajectoryConsumer(config, offsets)
    try:
        # The feedback read first, as a fetch of small feedback records beside large
        # trajectories does: the client's own pause, so the order is certain.
        looked_back = [
            tp for tp in resumed._consumer.assignment() if tp.topic.endswith(".trajectories")
        ]
        resumed._consumer.pause(*looked_back)
        deadline = time.monotonic() + 30
        while sum(resumed.processed_offsets()[feedback_topic].values()) < 51:
            assert resumed.poll(0.2) == []
            if sum(len(o) for o in resumed._orphans.values()) == 51:
                break
            assert time.monotonic() < deadline, "the feedback was not read"
        resumed._consumer.resume(*looked_back)
        assert [s.trajectory["event_id"] for s in _drain(resumed)] == [ghost["event_id"]]
        assert resumed.stats.orphaned_feedback == 0
        assert resumed.stats.feedback_before_resume == 50
        assert sum(resumed.processed_offsets()[feedback_topic].values()) == 51
        assert resumed.waiting() == 0
    finally:
        resumed.close()
