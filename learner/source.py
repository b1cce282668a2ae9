"""The learner's trajectory source: replay's TrajectoryConsumer, one per rank."""

from __future__ import annotations

from learner.checkpoint import Offsets
from learner.service import ConsumerFactory, TrajectorySource
from replay.config import StreamConfig
from replay.consumer import TrajectoryConsumer


def replay_consumer_factory(
    stream: StreamConfig, client_id: str = "olp-learner"
) -> ConsumerFactory:
    """Build TrajectoryConsumers from the stream config, resuming at the given offsets.

    Under torchrun each rank reads a disjoint share of the partitions the broker has
    (`p % world == rank`; both topics share the count, so a session's records stay on one
    rank)."""

    def make(offsets: Offsets | None, rank: int, world: int) -> TrajectorySource:
        if world == 1:
            return TrajectoryConsumer(stream, offsets, client_id=client_id)
        return TrajectoryConsumer(
            stream, offsets, client_id=f"{client_id}-{rank}", shard=(rank, world)
        )

    return make
