"""An idempotent producer whose InitProducerId never succeeds: bounded, then non-idempotent.

kafka-python re-sends InitProducerId for ever on a retriable error or a dropped connection
(`InitProducerIdHandler.reenqueue`), and its sender sends no record until it has a producer
id; its batch expiry never runs either, so `delivery_timeout_ms` does not end the wait. The
real embedded broker always grants a producer id, so these tests put a small frame-level
proxy in front of it (the broker advertises the proxy, so every request passes through it)
that answers only InitProducerId itself: with a retriable error, or by dropping the
connection. Everything else reaches the real broker.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kafka.producer.sender import Sender
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from deploy.broker import broker_binary, kafka_answers
from deploy.ports import free_ports
from deploy.procs import ChildProcess
from replay.config import StreamConfig
from replay.producer import KafkaSink
from replay.synthetic import make_trajectory
from tests.replay.conftest import unique_prefix
from tests.replay.test_outage import _sample, _wait_for
from tests.replay.test_sink_process import _consume_ids

_INIT_PRODUCER_ID = 22
_COORDINATOR_LOAD_IN_PROGRESS = 14  # retriable: kafka-python re-sends the request


def _read_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def _hang_up(*sockets: socket.socket) -> None:
    """Shut down, then close. A bare `close` of a socket the other forwarding thread is
    reading from sends no FIN until that read returns, which it never did: the broker's
    graceful stop then waited 5 s for those connections at every teardown."""
    for sock in sockets:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _init_pid_error(request: bytes, error_code: int) -> bytes:
    """An InitProducerId response frame carrying `error_code` (flexible from v2 on)."""
    _, version, correlation_id = struct.unpack(">hhi", request[:8])
    flexible = version >= 2
    body = struct.pack(">ihqh", 0, error_code, -1, -1)
    if flexible:
        payload = struct.pack(">i", correlation_id) + b"\x00" + body + b"\x00"
    else:
        payload = struct.pack(">i", correlation_id) + body
    return struct.pack(">i", len(payload)) + payload


class InitProducerIdRefusingProxy:
    """Forwards Kafka frames to `upstream`; InitProducerId gets `mode`: an error answer
    ("error") or a dropped connection ("drop"). `refusals` counts them."""

    def __init__(self, port: int, upstream: int, mode: str) -> None:
        self.upstream, self.mode, self.refusals = upstream, mode, 0
        self.refusing = True
        self._server = socket.create_server(("127.0.0.1", port))
        self._closed = False
        self._connections: list[socket.socket] = []  # hung up by `close`
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                broker = socket.create_connection(("127.0.0.1", self.upstream))
            except OSError:
                client.close()
                continue
            self._connections += [client, broker]
            lock = threading.Lock()  # whole frames to the client, from either thread
            args = (client, broker, lock)
            threading.Thread(target=self._requests, args=args, daemon=True).start()
            threading.Thread(target=self._responses, args=args, daemon=True).start()

    def _requests(self, client: socket.socket, broker: socket.socket, lock: threading.Lock) -> None:
        try:
            while True:
                size = _read_exact(client, 4)
                request = _read_exact(client, struct.unpack(">i", size)[0])
                api_key = struct.unpack(">h", request[:2])[0]
                if api_key == _INIT_PRODUCER_ID and self.refusing:
                    self.refusals += 1
                    if self.mode == "drop":
                        raise ConnectionError("dropped")
                    with lock:
                        client.sendall(_init_pid_error(request, _COORDINATOR_LOAD_IN_PROGRESS))
                    continue
                broker.sendall(size + request)
        except OSError:
            pass
        finally:
            _hang_up(client, broker)

    def _responses(
        self, client: socket.socket, broker: socket.socket, lock: threading.Lock
    ) -> None:
        try:
            while True:
                size = _read_exact(broker, 4)
                response = _read_exact(broker, struct.unpack(">i", size)[0])
                with lock:
                    client.sendall(size + response)
        except OSError:
            pass
        finally:
            _hang_up(client, broker)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        _hang_up(*self._connections)


@pytest.fixture(params=["error", "drop"])
def refusing_broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """(bootstrap, proxy): the real embedded broker behind an InitProducerId-refusing proxy."""
    proxy_port, broker_port = free_ports(2)
    proxy = InitProducerIdRefusingProxy(proxy_port, broker_port, request.param)
    child = ChildProcess(
        "broker",
        [
            str(broker_binary()),
            "broker",
            "--listener-url",
            f"tcp://127.0.0.1:{broker_port}",
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{proxy_port}",
        ],
        log_file=tmp_path / "broker.log",
    )
    try:
        bootstrap = f"127.0.0.1:{proxy_port}"
        _wait_for(lambda: kafka_answers(bootstrap))
        yield bootstrap, proxy
    finally:
        proxy.close()
        child.stop(timeout_s=10)


def _kafka_senders() -> list[threading.Thread]:
    """kafka-python producer I/O threads still running."""
    return [t for t in threading.enumerate() if isinstance(t, Sender) and t.is_alive()]


def _config(bootstrap: str) -> StreamConfig:
    return StreamConfig(
        bootstrap_servers=bootstrap,
        topic_prefix=unique_prefix(),
        join_window_s=0.0,
        join_grace_s=0.0,
        reconnect_backoff_s=0.2,
        request_timeout_ms=1_500,
        delivery_timeout_ms=2_000,
        max_block_ms=1_500,
        bootstrap_timeout_ms=1_500,
        close_timeout_s=3.0,
    )


def test_init_producer_id_failing_for_ever_falls_back_to_a_plain_producer(
    refusing_broker: Any, tmp_path: Path
) -> None:
    bootstrap, proxy = refusing_broker
    config = _config(bootstrap)
    registry = CollectorRegistry()
    records = [make_trajectory(session_id=f"i{i}") for i in range(3)]
    senders_before = set(_kafka_senders())
    with capture_logs() as logs:
        sink = KafkaSink(config, tmp_path / "state", registry)
        try:
            for record in records:
                sink.put_trajectory(record)
            assert sink.wait_idle(60), [e["event"] for e in logs][-20:]
        finally:
            sink.close()
    assert proxy.refusals >= 1
    events = [e["event"] for e in logs]
    assert events.count("idempotence_unavailable_falling_back") == 1, events
    # Before, kafka-python's close() raised (its flush timed out) before it stopped its I/O
    # thread: a traceback per attempt, and each given-up producer retried for ever.
    assert [e["event"] for e in logs if e.get("exc_info")] == []
    _wait_for(lambda: not set(_kafka_senders()) - senders_before, timeout_s=10)
    assert _sample(registry, "olp_stream_sent_total", kind="trajectory") == 3
    proxy.refusing = False
    assert _consume_ids(config, 3) == {r["trajectory_id"] for r in records}
