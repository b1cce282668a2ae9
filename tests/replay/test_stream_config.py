"""StreamConfig at load: refuses what cannot work, naming the key, and names a join grace the
sink outlasts.

A compression codec kafka-python cannot use was accepted before: KafkaProducer then raised
(RuntimeError for a codec whose library is not installed, ValueError for a typo), neither a
KafkaError, so every send step failed and every record went to the spill and never left it
while the broker was up."""

from __future__ import annotations

import kafka.codec
import pytest
from pydantic import ValidationError

from deploy.config import ConfigError, load_config
from replay.config import StreamConfig, late_feedback_risk


@pytest.mark.parametrize("codec", ["gzp", "none", "GZIP", ""])
def test_an_unknown_codec_is_refused_naming_the_key(codec: str) -> None:
    with pytest.raises(ValidationError, match="compression_type"):
        StreamConfig(compression_type=codec)


@pytest.mark.parametrize("codec", ["snappy", "lz4", "zstd"])
def test_a_codec_whose_library_is_missing_is_refused_naming_the_library(
    codec: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kafka.codec, f"has_{codec}", lambda: False)
    with pytest.raises(ValidationError, match="compression_type") as raised:
        StreamConfig(compression_type=codec)
    assert "not installed" in str(raised.value)


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd", None])
def test_a_codec_kafka_python_can_use_is_accepted(
    codec: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if codec is not None:
        monkeypatch.setattr(kafka.codec, f"has_{codec}", lambda: True)
    assert StreamConfig(compression_type=codec).compression_type == codec


def test_olp_refuses_to_start_with_a_codec_it_cannot_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kafka.codec, "has_lz4", lambda: False)
    with pytest.raises(ConfigError, match=r"stream\.compression_type"):
        load_config(environ={"OLP_STREAM__COMPRESSION_TYPE": "lz4"})
    with pytest.raises(ConfigError, match=r"stream\.compression_type"):
        load_config(environ={"OLP_STREAM__COMPRESSION_TYPE": "lz44"})


def test_a_delivery_timeout_the_producer_refuses_fails_at_load() -> None:
    """kafka-python refuses such a producer when it is made, which the sink took for a broker
    it could not reach: every record went to the spill, with a warning per reconnect."""
    with pytest.raises(ValidationError, match=r"delivery_timeout_ms \(20000\) must be above"):
        StreamConfig(request_timeout_ms=20_000, delivery_timeout_ms=20_000)
    assert StreamConfig(request_timeout_ms=20_000, delivery_timeout_ms=20_006)


def test_a_dlq_minimum_above_its_window_is_refused() -> None:
    """The window never held that many: the DLQ-ratio stop was off, in silence."""
    with pytest.raises(ValidationError, match=r"dlq_min_records \(20\) must not be above"):
        StreamConfig(dlq_window_records=10)
    assert StreamConfig(dlq_window_records=10, dlq_min_records=10).dlq_min_records == 10


@pytest.mark.parametrize(
    ("settings", "risky"),
    [
        ({}, False),  # the defaults: 2 s of grace against 1.1 s of holding
        ({"sink_batch_wait_s": 5.0}, True),
        ({"sink_batch_wait_s": 5.0, "join_grace_s": 6.0}, False),
        ({"sink_batch_wait_s": 5.0, "join_window_s": 0.0}, False),  # no feedback joined
    ],
)
def test_a_grace_shorter_than_the_sinks_holding_is_named(
    settings: dict[str, float], risky: bool
) -> None:
    risk = late_feedback_risk(StreamConfig(**settings))
    assert (risk is not None) == risky, risk
    if risky:
        assert "stream.join_grace_s (2 s)" in risk and "(5.1 s)" in risk
