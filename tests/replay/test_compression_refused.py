"""A `stream.compression_type` the broker cannot take: one clear error, records spilled.

kafka-python refuses lz4/zstd for a broker too old for them (ValueError when the producer is
made), and a broker may refuse a codec on produce (UnsupportedCompressionTypeError) or the
record builder refuse it (UnsupportedCodecError). Before, the sink took the ValueError for a
broker outage and logged a full traceback at every reconnect backoff, for ever; the send
errors were warnings that never named the setting.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import kafka.codec
import pytest
from kafka import KafkaProducer
from kafka.errors import KafkaError, UnsupportedCodecError, UnsupportedCompressionTypeError
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

import replay.producer as producer_module
from replay.config import StreamConfig
from replay.producer import KafkaSink
from replay.synthetic import make_trajectory
from replay.topics import TopicNames
from tests.replay.test_outage import _sample, _wait_for
from tests.replay.test_producer_faults import _FailingSends
from tests.replay.test_sink_process import _consume_ids


def _zstd_config(config: StreamConfig, monkeypatch: pytest.MonkeyPatch) -> StreamConfig:
    """`config` with zstd (its library need not be here: the broker refuses it first)."""
    monkeypatch.setattr(kafka.codec, "has_zstd", lambda: True)
    return StreamConfig.model_validate({**config.model_dump(), "compression_type": "zstd"})


def _compression_errors(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "stream_compression_unsupported"]


def _tracebacks(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e.get("exc_info")]


def test_zstd_against_a_broker_too_old_for_it_logs_once_and_spills(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kafka-python is told the (real) broker is 2.0, which cannot take zstd: its own
    check raises ValueError when the producer is made, as against such a broker."""
    config = _zstd_config(stream_config, monkeypatch)
    attempts = []

    def old_broker_producer(**options: Any) -> KafkaProducer:
        attempts.append(options["compression_type"])
        return KafkaProducer(api_version=(2, 0), **options)

    monkeypatch.setattr(producer_module, "KafkaProducer", old_broker_producer)
    registry = CollectorRegistry()
    records = [make_trajectory(session_id=f"z{i}") for i in range(3)]
    with capture_logs() as logs:
        sink = KafkaSink(config, tmp_path, registry)
        try:
            for record in records:
                sink.put_trajectory(record)
            _wait_for(lambda: len(attempts) >= 4)  # several reconnect backoffs
            _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 3)
        finally:
            sink.close()
    assert [e["event"] for e in _tracebacks(logs)] == []
    errors = _compression_errors(logs)
    assert len(errors) == 1, errors
    assert errors[0]["setting"] == "stream.compression_type"
    assert errors[0]["compression_type"] == "zstd"
    assert "Zstd" in errors[0]["error"]
    assert "stream.compression_type" in errors[0]["fix"]
    assert _sample(registry, "olp_stream_failed_total", kind="trajectory", reason="rejected") == 0
    assert _sample(registry, "olp_stream_dlq_total", kind="trajectory") == 0
    # The operator's fix: no compression. The next sink sends what the spill kept.
    monkeypatch.undo()
    fixed = StreamConfig.model_validate({**config.model_dump(), "compression_type": None})
    sink = KafkaSink(fixed, tmp_path, CollectorRegistry())
    try:
        assert sink.wait_idle(30)
    finally:
        sink.close()
    assert _consume_ids(fixed, 3) == {r["trajectory_id"] for r in records}


class _CodecRefusingSends(_FailingSends):
    """Producers whose sends raise `error` at once (the record builder refusing the codec)."""

    def wrap(self, real: Any) -> Any:
        failing = self

        class Producer:
            def send(self, topic: str, key: bytes | None = None, value: bytes = b"") -> Any:
                if topic == failing.topic and failing.left > 0:
                    failing.left -= 1
                    raise failing.error
                return real.send(topic, key=key, value=value)

            def __getattr__(self, name: str) -> Any:
                return getattr(real, name)

        return Producer()


@pytest.mark.parametrize(
    ("sends", "error"),
    [
        (_FailingSends, UnsupportedCompressionTypeError()),
        (_CodecRefusingSends, UnsupportedCodecError("Libraries for zstd compression not found")),
    ],
    ids=["broker_refuses_codec", "builder_refuses_codec"],
)
def test_a_codec_refused_on_send_is_named_once_and_the_records_are_kept(
    stream_config: StreamConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    sends: type[_FailingSends],
    error: KafkaError,
) -> None:
    config = StreamConfig.model_validate({**stream_config.model_dump(), "compression_type": "gzip"})
    topics = TopicNames.from_prefix(config.topic_prefix)
    failing = sends(topics.trajectories, error, times=6)
    new_producer = KafkaSink._new_producer
    monkeypatch.setattr(KafkaSink, "_new_producer", lambda self: failing.wrap(new_producer(self)))
    registry = CollectorRegistry()
    records = [make_trajectory(session_id=f"c{i}") for i in range(2)]
    with capture_logs() as logs:
        sink = KafkaSink(config, tmp_path, registry)
        try:
            for record in records:
                sink.put_trajectory(record)
            deadline = time.monotonic() + 60
            while failing.left > 0 and time.monotonic() < deadline:  # refused several times
                time.sleep(0.05)
            assert sink.wait_idle(30)  # the codec is taken again: the spill drains
        finally:
            sink.close()
    errors = _compression_errors(logs)
    assert len(errors) == 1, errors
    assert errors[0]["compression_type"] == "gzip"
    assert "stream.compression_type" in errors[0]["fix"]
    assert _tracebacks(logs) == []
    assert _sample(registry, "olp_stream_spilled_total", kind="trajectory") >= 2
    assert _sample(registry, "olp_stream_dlq_total", kind="trajectory") == 0
    assert _consume_ids(config, 2) == {r["trajectory_id"] for r in records}
