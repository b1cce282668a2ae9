"""JsonlSink: the broker-less sink writes valid records per kind and invalid ones to dlq."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.ports import free_port
from replay.config import StreamConfig
from replay.export import read_export
from replay.producer import KafkaSink
from replay.sink import JsonlSink, RecordSink
from replay.synthetic import make_feedback, make_trajectory


async def test_jsonl_sink_writes_per_kind_and_rejects_invalid(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    assert isinstance(sink, RecordSink)
    trajectory = make_trajectory()
    event = make_feedback(trajectory, kind="thumbs_up")
    sink.put_trajectory(trajectory)
    sink.put_feedback(event)
    sink.put_feedback({"trajectory_id": "t", "kind": "thumbs_up"})
    await sink.aclose()

    lines = {
        name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        for name in ("trajectories", "feedback", "dlq")
    }
    assert lines["trajectories"] == [trajectory]
    assert lines["feedback"] == [event]
    assert len(lines["dlq"]) == 1
    assert lines["dlq"][0]["kind"] == "feedback"
    assert "schema_version" in lines["dlq"][0]["reason"]
    # The files read back as an export, so they can be replayed too.
    assert [i["record"] for i in read_export(tmp_path / "trajectories.jsonl")] == [trajectory]
    assert [i["kind"] for i in read_export(tmp_path / "feedback.jsonl")] == ["feedback"]


async def test_jsonl_sink_keeps_a_lone_surrogate_as_its_escape(tmp_path: Path) -> None:
    """Before: the record went to dlq.jsonl (UTF-8 cannot carry a lone surrogate)."""
    sink = JsonlSink(tmp_path)
    trajectory = make_trajectory(prompt="say \ud800")
    sink.put_trajectory(trajectory)
    await sink.aclose()
    assert (tmp_path / "dlq.jsonl").read_bytes() == b""
    assert b"say \\ud800" in (tmp_path / "trajectories.jsonl").read_bytes()
    assert [i["record"] for i in read_export(tmp_path / "trajectories.jsonl")] == [trajectory]


def test_read_export_names_a_line_that_is_not_utf8(tmp_path: Path) -> None:
    """Before: a bare UnicodeDecodeError from somewhere in the file."""
    path = tmp_path / "trajectories.jsonl"
    path.write_bytes(json.dumps(make_trajectory()).encode() + b"\n" + b'{"x": "\xff"}\n')
    with pytest.raises(ValueError, match=r"trajectories\.jsonl:2: not UTF-8"):
        list(read_export(path))


async def test_kafka_sink_implements_the_protocol(tmp_path: Path) -> None:
    config = StreamConfig(bootstrap_servers=f"127.0.0.1:{free_port()}", close_timeout_s=0.5)
    sink = KafkaSink(config, tmp_path)
    assert isinstance(sink, RecordSink)
    sink.put_trajectory(make_trajectory())
    await sink.aclose()  # nothing listens on that port: the record stays in the spill
    assert sink.spill.total_bytes() > 0
