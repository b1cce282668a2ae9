"""Typed configuration of the `stream` section: broker, topics, producer queue, spill, consumer."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

_DAY_MS = 24 * 3600 * 1000
# The package kafka-python needs for each codec but gzip (kafka.codec.has_<codec>()).
_CODEC_PACKAGES = {"snappy": "python-snappy", "lz4": "lz4", "zstd": "zstandard"}


class StreamConfig(BaseModel):
    """Everything the data layer needs; every field defaulted so the embedded stack runs as is."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    # Broker and topics.
    bootstrap_servers: str = "127.0.0.1:9092"
    topic_prefix: str = Field(default="olp", min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    partitions: int = Field(default=4, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    retention_ms: int = Field(default=7 * _DAY_MS, ge=-1)
    bootstrap_timeout_ms: int = Field(default=3_000, ge=100)

    @field_validator("bootstrap_servers")
    @classmethod
    def _host_port_list(cls, value: str) -> str:
        # The launchers split it; a bad value fails at start-up naming the key, not later.
        for address in value.split(","):
            host, _, port = address.strip().rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError("expected HOST:PORT[,HOST:PORT...]")
        return value

    # Producer: bounded in-memory queue drained by one background thread.
    queue_size: int = Field(default=10_000, ge=1)
    producer_batch_records: int = Field(default=500, ge=1)
    linger_ms: int = Field(default=5, ge=0)
    batch_size_bytes: int = Field(default=256 * 1024, ge=1024)
    max_request_size_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = None
    request_timeout_ms: int = Field(default=5_000, ge=100)
    delivery_timeout_ms: int = Field(default=10_000, ge=200)
    max_block_ms: int = Field(default=5_000, ge=100)
    idempotence: bool = True
    reconnect_backoff_s: float = Field(default=1.0, gt=0)
    close_timeout_s: float = Field(default=10.0, ge=0)
    sink_batch_wait_s: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="longest the sink's worker process holds the records it received "
        "before it builds and sends them together: fewer, larger bursts of its work cost the "
        "proxy's own process less CPU per request; records reach the broker up to this much "
        "later (the proxy still hands them to the worker every 0.1 s)",
    )
    sink_avoids_loop_cpu: bool = Field(
        default=True,
        description="keep the sink's worker process off the CPU the proxy's event loop last "
        "ran on (Linux, 2 or more CPUs allowed): the worker then does not push the loop's "
        "code and data out of that core's caches in the loop's idle gaps",
    )
    sink_hung_after_s: float = Field(
        default=10.0,
        gt=0,
        description="a sink child that reports nothing this long while records wait is "
        "killed and restarted (its records are spilled, none lost)",
    )

    @field_validator("compression_type")
    @classmethod
    def _codec_usable(cls, value: str | None) -> str | None:
        # KafkaProducer raises RuntimeError for a codec whose library is missing, which is
        # no KafkaError: every send would fail and every record stay in the spill. Here the
        # config fails to load instead, naming the key.
        if value is None:
            return value
        from kafka import codec

        if not getattr(codec, f"has_{value}")():
            package = _CODEC_PACKAGES.get(value, value)
            raise ValueError(
                f"{value} compression needs the {package} package, which is not installed "
                f"here (kafka.codec.has_{value}() is false): install it, or use gzip or null"
            )
        return value

    # Durable spill under <state_dir>/<spill_dir_name>/.
    spill_dir_name: str = Field(default="spill", min_length=1)
    spill_max_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024)
    spill_segment_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)

    # Consumer.
    dlq_max_ratio: float = Field(default=0.2, ge=0, le=1)
    dlq_window_records: int = Field(
        default=500, ge=1, description="the consumer's DLQ ratio is taken over this many records"
    )
    dlq_min_records: int = Field(
        default=20,
        ge=1,
        description="no DLQ-ratio stop before the window holds this many records (at most "
        "`dlq_window_records`)",
    )
    join_window_s: float = Field(
        default=30.0,
        ge=0,
        description="feedback joins a trajectory when its created_at is at most this long "
        "after the reply finished (the trajectory's created_at + timings.total_s)",
    )
    join_grace_s: float = Field(
        default=2.0,
        ge=0,
        description="extra wait for in-flight feedback: a trajectory is yielded this long "
        "after its join window ends, and at least this long after it was read (feedback a "
        "spill delivers just after its trajectory, after an outage)",
    )
    orphan_feedback_ttl_s: float = Field(default=600.0, ge=0)
    dedup_lookback_records: int = Field(default=10_000, ge=0)
    dedup_memory_records: int = Field(default=500_000, ge=1)
    closed_trajectory_memory: int = Field(default=200_000, ge=1)
    poll_max_records: int = Field(default=1_000, ge=1)
    fetch_max_bytes: int = Field(default=50 * 1024 * 1024, ge=1024)

    @model_validator(mode="after")
    def _consistent(self) -> StreamConfig:
        # kafka-python refuses such a producer when it is made, which the sink takes for a
        # broker it cannot reach: every record went to the spill, with a warning per
        # reconnect, for ever. Here the config fails to load instead.
        if self.dlq_min_records > self.dlq_window_records:
            # The window never holds that many: the DLQ-ratio stop was off, with 95% of the
            # stream rejected and the learner running on.
            raise ValueError(
                f"dlq_min_records ({self.dlq_min_records}) must not be above "
                f"dlq_window_records ({self.dlq_window_records}): the ratio's window never "
                "holds that many records, and the DLQ-ratio stop would never act"
            )
        least = self.linger_ms + self.request_timeout_ms
        if self.delivery_timeout_ms <= least:
            raise ValueError(
                f"delivery_timeout_ms ({self.delivery_timeout_ms}) must be above linger_ms + "
                f"request_timeout_ms ({least}): the Kafka producer refuses it"
            )
        return self


# The sink process's batching tick: its feeder hands records to the worker this often
# (replay/sink_process.py), so they reach it at most this late.
SINK_FEED_INTERVAL_S = 0.1

# Names the stream offsets count in (`olp up` sets a new one each time it starts the
# embedded broker, whose data lives in memory): the learner resumes no offsets saved under
# another name, and the proxy's operator page measures no lag against them.
STREAM_ID_ENV = "OLP_STREAM_ID"


def late_feedback_risk(config: StreamConfig) -> str | None:
    """Why feedback given inside a trajectory's join window may still count as late, or None.

    The sink's worker holds what it receives up to `sink_batch_wait_s` (after the feeder's
    tick) before sending it; the consumer yields a trajectory `join_grace_s` after its window
    ends. Feedback given in the window's last moments then reaches the broker after the
    trajectory was yielded, and is counted late and dropped (5 s of wait against 2 s of
    grace lost 4 of 10 such feedback events). Not an error: a learner fed by a proxy of
    another config, or no feedback at all (`join_window_s: 0`), is fine."""
    held = config.sink_batch_wait_s + SINK_FEED_INTERVAL_S
    if config.join_window_s <= 0 or config.join_grace_s >= held:
        return None
    return (
        f"stream.join_grace_s ({config.join_grace_s:g} s) is shorter than "
        f"stream.sink_batch_wait_s + the sink's {SINK_FEED_INTERVAL_S:g} s tick ({held:g} s): "
        "feedback given near the end of a trajectory's join window can reach the broker "
        "after the trajectory was yielded and be dropped as late; raise join_grace_s"
    )
