"""The sink's partitioner: kafka-python's DefaultPartitioner's choice, computed faster."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kafka import KafkaProducer
from kafka.partitioner import DefaultPartitioner
from kafka.partitioner.default import murmur2 as kafka_murmur2

from replay.partitioner import KeyHashPartitioner, murmur2, producer_options


class _Cluster:
    """The two ClusterMetadata calls a partitioner makes (the real ones run in the broker
    tests: tests/replay/test_stream_kafka.py)."""

    def __init__(self, partitions: dict[str, set[int]], down: frozenset[int] = frozenset()) -> None:
        self._partitions = partitions
        self._down = down

    def topics(self) -> set[str]:
        return set(self._partitions)

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return set(self._partitions[topic]) if topic in self._partitions else None

    def available_partitions_for_topic(self, topic: str) -> set[int] | None:
        found = self.partitions_for_topic(topic)
        return None if found is None else found - self._down


def test_murmur2_equals_kafka_pythons_for_every_length_and_byte() -> None:
    rng = random.Random(7)
    keys = [bytes(rng.randrange(256) for _ in range(length)) for length in range(70)]
    keys += [bytes(rng.randrange(256) for _ in range(rng.randrange(200))) for _ in range(2000)]
    keys += [b"", b"\xff" * 9, "séssion-é\U0001f600".encode(), b"req-" + b"0" * 32]
    for key in keys:
        assert murmur2(key) == kafka_murmur2(key), key


@pytest.mark.parametrize("count", [1, 3, 4, 12])
def test_a_keyed_record_goes_where_the_default_partitioner_sends_it(count: int) -> None:
    # Partition ids out of order and not 0..n-1: both sort them first.
    cluster = _Cluster({"t": set(range(100, 100 + 2 * count, 2))}, down=frozenset({100}))
    ours, theirs = KeyHashPartitioner(), DefaultPartitioner()
    rng = random.Random(count)
    for _ in range(500):
        key = f"session-{rng.random()}".encode()
        chosen = ours.partition("t", key.decode(), key, {}, b"{}", cluster)
        assert chosen == theirs.partition("t", key.decode(), key, {}, b"{}", cluster)
        assert isinstance(chosen, int)


def test_a_record_without_a_key_goes_to_an_available_partition() -> None:
    cluster = _Cluster({"t": {0, 1, 2, 3}}, down=frozenset({0, 2}))
    partitioner = KeyHashPartitioner()
    chosen = {partitioner.partition("t", None, None, {}, b"{}", cluster) for _ in range(200)}
    assert chosen == {1, 3}


def test_a_topic_the_cluster_does_not_know_is_refused() -> None:
    with pytest.raises(ValueError, match="Topic other not found"):
        KeyHashPartitioner().partition("other", "k", b"k", {}, b"{}", _Cluster({"t": {0}}))


def test_the_producer_options_turn_off_unread_sensors_and_set_the_partitioner() -> None:
    options: dict[str, Any] = producer_options()
    assert options["metrics_enabled"] is False
    assert isinstance(options["partitioner"], KeyHashPartitioner)


def test_a_kafka_python_without_those_options_gets_its_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # kafka-python 2.2 (pyproject's floor): no `metrics_enabled` setting, and a partitioner
    # option that takes a callable of another shape; neither may be passed there.
    import replay.partitioner as partitioner

    config = {k: v for k, v in KafkaProducer.DEFAULT_CONFIG.items() if k != "metrics_enabled"}
    monkeypatch.setattr(partitioner.KafkaProducer, "DEFAULT_CONFIG", config)
    monkeypatch.setattr(partitioner, "Partitioner", None)
    assert producer_options() == {}
