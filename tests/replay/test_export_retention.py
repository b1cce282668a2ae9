"""An export whose start offset retention has deleted says so (the embedded broker cannot
delete records, so a stand-in consumer holds the partition: pure logic)."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
from kafka import TopicPartition
from structlog.testing import capture_logs

import replay.export as export
from replay.config import StreamConfig
from replay.schemas import encode_record
from replay.synthetic import make_trajectory

Message = namedtuple("Message", "topic partition offset key value timestamp")
TOPIC = "olp.trajectories"
KEPT_FROM = 12  # retention deleted offsets 0..11


class RetainedConsumer:
    """One partition of 20 trajectories, the first 12 deleted by retention."""

    def __init__(self, **_: Any) -> None:
        self.records = [
            Message(TOPIC, 0, offset, b"s", encode_record(make_trajectory(session_id="s")), 0)
            for offset in range(20)
        ]
        self.position_of: dict[TopicPartition, int] = {}

    def partitions_for_topic(self, topic: str) -> set[int] | None:
        return {0} if topic == TOPIC else None

    def assign(self, tps: list[TopicPartition]) -> None:
        pass

    def beginning_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, KEPT_FROM)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.position_of[tp] = offset

    def position(self, tp: TopicPartition) -> int:
        return self.position_of[tp]

    def highwater(self, tp: TopicPartition) -> int:
        return len(self.records)

    def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, len(self.records))

    def pause(self, *tps: TopicPartition) -> None:
        pass

    def poll(self, timeout_ms: int = 0) -> dict[TopicPartition, list[Message]]:
        tp = TopicPartition(TOPIC, 0)
        start = self.position_of[tp]
        self.position_of[tp] = len(self.records)
        return {tp: self.records[start:]} if start < len(self.records) else {}

    def close(self) -> None:
        pass


def test_an_export_from_offsets_retention_deleted_names_the_hole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chain of exports (each `--from` the previous one's end) whose start retention had
    deleted went on from the first record kept, with no word: a hole in the chain."""
    monkeypatch.setattr(export, "KafkaConsumer", RetainedConsumer)
    out = tmp_path / "chain-2.jsonl"
    with capture_logs() as logs:
        result = export.export_records(
            StreamConfig(),
            out,
            kinds=("trajectories",),
            from_offsets={"trajectories": {"0": 5}},
        )
    offsets = [json.loads(line)["offset"] for line in out.read_text().splitlines()]
    assert offsets == list(range(KEPT_FROM, 20))
    assert result.skipped_by_retention == {"trajectories": {0: KEPT_FROM - 5}}
    errors = [e for e in logs if e["event"] == "export_start_below_retention"]
    assert [(e["offset"], e["earliest"]) for e in errors] == [(5, KEPT_FROM)]
    # From the start kept, or with no start at all: nothing skipped.
    again = export.export_records(StreamConfig(), tmp_path / "whole.jsonl", kinds=("trajectories",))
    assert again.skipped_by_retention == {}
