"""The learner's trajectory source: replay's TrajectoryConsumer, one per rank."""

from __future__ import annotations

import inspect

from learner.checkpoint import Offsets
from learner.service import ConsumerFactory, TrajectorySource
from replay.config import StreamConfig
from replay.consumer import TrajectoryConsumer


def replay_consumer_factory(
    stream: StreamConfig, client_id: str = "olp-learner"
) -> ConsumerFactory:
    """Build TrajectoryConsumers from the stream config, resuming at the given offsets.

    Under torchrun each rank must read a disjoint set of partitions; that needs the
    consumer to accept a partition selection (`partitions=`), which is asked of replay/.
    """

    def make(offsets: Offsets | None, rank: int, world: int) -> TrajectorySource:
        if world == 1:
            return TrajectoryConsumer(stream, offsets, client_id=client_id)
        params = inspect.signature(TrajectoryConsumer).parameters
        if "partitions" not in params:
            raise NotImplementedError(
                "replay.TrajectoryConsumer cannot select partitions yet; "
                "multi-rank learning from Kafka needs TrajectoryConsumer(partitions=...)"
            )
        selection = {p for p in range(stream.partitions) if p % world == rank}
        return TrajectoryConsumer(  # type: ignore[call-arg]
            stream, offsets, client_id=f"{client_id}-{rank}", partitions=selection
        )

    return make
