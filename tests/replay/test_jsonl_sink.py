"""JsonlSink: the broker-less sink writes valid records per kind and invalid ones to dlq."""

from __future__ import annotations

import json
import subprocess
import sys
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


# Runs in a child process: RLIMIT_FSIZE makes the kernel refuse writes (EFBIG, a short write
# first) exactly as a full disk does, without limiting the test process's own files.
_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from replay.sink import JsonlSink
from replay.synthetic import make_trajectory

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
directory, recovers = Path(sys.argv[1]), sys.argv[2] == "recovers"
path = directory / "trajectories.jsonl"
sink = JsonlSink(directory) if recovers else JsonlSink(directory, max_pending=3)
records = [make_trajectory(session_id=f"s{i}") for i in range(6)]
sink.put_trajectory(records[0])
size = path.stat().st_size
resource.setrlimit(resource.RLIMIT_FSIZE, (size + 100, resource.RLIM_INFINITY))
raised = []
for record in records[1:4]:  # the first is torn by a short write, then refused
    try:
        sink.put_trajectory(record)
    except OSError as exc:
        raised.append(exc.errno)
if raised:  # what the sink did before: stop here, so the test names it
    print(json.dumps([raised, None, None, None]))
    sys.exit(0)
full = [path.stat().st_size == size, sink.pending_records(), sink.write_errors]
if recovers:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
for record in records[4:]:
    try:
        sink.put_trajectory(record)
    except OSError as exc:
        raised.append(exc.errno)
sink.close()
print(json.dumps([raised, full, sink.lost, [r["trajectory_id"] for r in records]]))
"""


@pytest.mark.parametrize("recovers", [True, False], ids=["disk_recovers", "disk_stays_full"])
def test_a_disk_error_never_raises_into_put_and_loses_nothing_silently(
    tmp_path: Path, recovers: bool
) -> None:
    """Before: the OSError of the write raised into `put_trajectory`, i.e. into the proxy."""
    done = subprocess.run(
        [sys.executable, "-c", _FULL_DISK, str(tmp_path), "recovers" if recovers else "full"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    raised, full, lost, ids = json.loads(done.stdout.strip().splitlines()[-1])
    assert raised == []
    torn_cut_off, pending, write_errors = full
    assert torn_cut_off  # no torn line in front of the records written later
    assert pending == 3
    assert write_errors >= 3
    written = [i["record"]["trajectory_id"] for i in read_export(tmp_path / "trajectories.jsonl")]
    if recovers:  # kept in memory, then written in order before the next record
        assert written == ids
        assert lost == {"trajectories": 0, "feedback": 0, "dlq": 0}
    else:  # two beyond the cap of three in memory, three more refused at close
        assert written == ids[:1]
        assert lost == {"trajectories": 5, "feedback": 0, "dlq": 0}


def test_a_torn_last_line_from_before_the_start_is_cut_not_glued_to_the_next(
    tmp_path: Path,
) -> None:
    """A crash mid-write left a last line without its newline; the first record after the
    restart was appended onto it, and both read as one unparsable line."""
    import structlog

    whole = make_trajectory(session_id="s")
    first = JsonlSink(tmp_path)
    first.put_trajectory(whole)
    first.close()
    path = tmp_path / "trajectories.jsonl"
    with path.open("ab") as handle:
        handle.write(b'{"trajectory_id": "torn", "cho')
    torn_size = len(b'{"trajectory_id": "torn", "cho')
    after = make_trajectory(session_id="s")
    with structlog.testing.capture_logs() as logs:
        sink = JsonlSink(tmp_path)
    sink.put_trajectory(after)
    sink.close()
    lines = path.read_bytes().splitlines()
    assert [json.loads(line)["trajectory_id"] for line in lines] == [
        whole["trajectory_id"],
        after["trajectory_id"],
    ]
    assert [(e["file"], e["bytes"]) for e in logs if e["event"] == "jsonl_torn_line_cut"] == [
        ("trajectories", torn_size)
    ]


def test_a_whole_last_record_without_its_newline_is_kept(tmp_path: Path) -> None:
    whole, after = make_trajectory(session_id="s"), make_trajectory(session_id="s")
    (tmp_path / "trajectories.jsonl").write_bytes(json.dumps(whole).encode())
    sink = JsonlSink(tmp_path)
    sink.put_trajectory(after)
    sink.close()
    lines = (tmp_path / "trajectories.jsonl").read_bytes().splitlines()
    assert [json.loads(line)["trajectory_id"] for line in lines] == [
        whole["trajectory_id"],
        after["trajectory_id"],
    ]
