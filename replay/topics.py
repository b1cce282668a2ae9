"""Topic names from the configured prefix, and idempotent creation of the topics."""

from __future__ import annotations

from dataclasses import dataclass

import structlog
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import TopicAlreadyExistsError

from replay.config import StreamConfig

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class TopicNames:
    """`<prefix>.trajectories` and `<prefix>.feedback` (keyed by session id) and `<prefix>.dlq`."""

    trajectories: str
    feedback: str
    dlq: str

    @classmethod
    def from_prefix(cls, prefix: str) -> TopicNames:
        return cls(f"{prefix}.trajectories", f"{prefix}.feedback", f"{prefix}.dlq")

    def all(self) -> list[str]:
        return [self.trajectories, self.feedback, self.dlq]


def ensure_topics(config: StreamConfig, timeout_ms: int = 10_000) -> list[str]:
    """Create whichever of the three topics is missing; return the names created.

    Safe to call from several processes at once: a topic created by someone else in between
    counts as present. Existing topics are left as they are (partitions are never changed).
    """
    names = TopicNames.from_prefix(config.topic_prefix)
    admin = KafkaAdminClient(
        bootstrap_servers=config.bootstrap_servers,
        request_timeout_ms=timeout_ms,
        bootstrap_timeout_ms=config.bootstrap_timeout_ms,
        client_id="olp-replay-admin",
    )
    try:
        existing = set(admin.list_topics())
        created: list[str] = []
        for name in names.all():
            if name in existing:
                continue
            topic = NewTopic(
                name=name,
                num_partitions=config.partitions,
                replication_factor=config.replication_factor,
                topic_configs={
                    "retention.ms": str(config.retention_ms),
                    # Long prompts make large records: let the topic take what the
                    # producer may send (a stock broker's default is 1 MiB).
                    "max.message.bytes": str(config.max_request_size_bytes),
                },
            )
            try:
                admin.create_topics([topic], timeout_ms=timeout_ms)
            except TopicAlreadyExistsError:
                log.info("topic_created_concurrently", topic=name)
                continue
            created.append(name)
            log.info("topic_created", topic=name, partitions=config.partitions)
        return created
    finally:
        admin.close()
