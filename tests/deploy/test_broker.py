import logging
import socket
import uuid
from collections import defaultdict
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.admin import KafkaAdminClient, NewTopic

from deploy.broker import start_broker


def test_thousand_keyed_records_round_trip_in_order(kafka_bootstrap: str) -> None:
    topic = f"olp-test-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
    admin.close()

    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    sent: dict[int, list[bytes]] = defaultdict(list)
    futures = []
    for i in range(1000):
        key = f"session-{i % 7}".encode()
        futures.append((producer.send(topic, key=key, value=f"{i}".encode()), f"{i}".encode()))
    producer.flush()
    for future, value in futures:
        meta = future.get(timeout=10)
        sent[meta.partition].append(value)
    producer.close()
    assert sum(len(v) for v in sent.values()) == 1000

    consumer = KafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False)
    parts = [TopicPartition(topic, p) for p in range(3)]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    got: dict[int, list[bytes]] = defaultdict(list)
    keys_per_partition: dict[bytes, set[int]] = defaultdict(set)
    for _ in range(50):
        for tp, records in consumer.poll(timeout_ms=500).items():
            for record in records:
                got[tp.partition].append(record.value)
                keys_per_partition[record.key].add(tp.partition)
        if sum(len(v) for v in got.values()) >= 1000:
            break
    consumer.close()
    assert dict(got) == dict(sent)  # every record, in order within each partition
    assert all(len(p) == 1 for p in keys_per_partition.values())  # a key stays on one partition


def test_a_broker_port_in_use_is_refused_before_starting(tmp_path: Path) -> None:
    """`olp broker` must not start a second broker onto a taken port: one that answers
    Kafka there (another broker) would be reported as ours, ready, while ours dies."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} is already in use"):
            start_broker("127.0.0.1", port, tmp_path / "broker.log")
    assert not (tmp_path / "broker.log").exists()  # no broker was started at all


def test_starting_the_broker_logs_no_connection_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`olp up` printed kafka-python's `ERROR ... Connection failed: ECONNREFUSED` on every
    start: the readiness check spoke Kafka before the broker listened. An operator reading
    the start-up lines must not see errors when nothing is wrong."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with caplog.at_level(logging.DEBUG, logger="kafka"):
        broker = start_broker("127.0.0.1", port, tmp_path / "broker.log")
    try:
        noisy = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert noisy == []
    finally:
        broker.stop()


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port` (Linux /proc/net)."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, port_hex = local.partition(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            # /proc writes each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            found.add(str(ipaddress.ip_address(raw)))
    return found


def test_a_broker_configured_as_localhost_listens_on_loopback_only(tmp_path: Path) -> None:
    """Given `localhost`, which olp counts as loopback, the broker listened on every
    interface: anyone on the network could read and write the trajectories."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    broker = start_broker("localhost", port, tmp_path / "broker.log")
    try:
        assert broker.bootstrap == f"localhost:{port}"
        assert _listening_addresses(port) == {"127.0.0.1"}
        admin = KafkaAdminClient(bootstrap_servers=broker.bootstrap)
        admin.close()
    finally:
        broker.stop()
