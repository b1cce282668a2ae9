"""`olp replay export` then `olp replay run`, through the real broker and vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

from replay.config import StreamConfig
from replay.producer import KafkaSink
from replay.synthetic import make_trajectory


def olp(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_export_then_replay_reproduces_request_bodies(
    kafka_bootstrap: str, vllm_server, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    stream = StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    sink = KafkaSink(stream, tmp_path / "state")
    records = [make_trajectory(session_id=f"s{i}", prompt=f"Say {i}.") for i in range(3)]
    for record in records:
        sink.put_trajectory(record)
    sink.close()
    time.sleep(0.5)

    env = {
        **os.environ,
        "OLP_STATE_DIR": str(tmp_path / "state"),
        "OLP_STREAM__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "OLP_STREAM__TOPIC_PREFIX": prefix,
        "OLP_POLICY__EXTERNAL_URLS": f"[{vllm_server.base_url}]",
    }
    export = tmp_path / "export.jsonl"
    done = olp(["replay", "export", "--out", str(export), "--kinds", "trajectories"], env)
    assert done.returncode == 0, done.stderr
    exported = [json.loads(line) for line in export.read_text().splitlines()]
    assert {item["kind"] for item in exported} == {"trajectories"}
    by_id = {item["record"]["trajectory_id"]: item["record"]["request"] for item in exported}
    assert by_id == {r["trajectory_id"]: r["request"] for r in records}
    # The printed resume point chains exports: the next one holds only what came since.
    [resume] = [line for line in done.stdout.splitlines() if line.startswith("next --from: ")]
    bound = resume.removeprefix("next --from: ")
    assert sum(json.loads(bound)["trajectories"].values()) == 3
    sink = KafkaSink(stream, tmp_path / "state")
    sink.put_trajectory(make_trajectory(session_id="s9", prompt="Say 9."))
    sink.close()
    later = tmp_path / "later.jsonl"
    done = olp(
        ["replay", "export", "--out", str(later), "--kinds", "trajectories", "--from", bound], env
    )
    assert done.returncode == 0, done.stderr
    [added] = [json.loads(line) for line in later.read_text().splitlines()]
    assert added["record"]["session_id"] == "s9"

    out = tmp_path / "replayed.jsonl"
    done = olp(
        [
            "replay",
            "run",
            str(export),
            "--model",
            vllm_server.model_name,
            "--direct",
            "--out",
            str(out),
        ],
        env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3
    assert all(line["replayed"]["http_status"] == 200 for line in lines)
    # A model vLLM does not serve: one line before anything is sent, not one 404 a record.
    missing = tmp_path / "missing.jsonl"
    done = olp(
        ["replay", "run", str(export), "--model", "policy-v99", "--direct", "--out", str(missing)],
        env,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "serves no model 'policy-v99' (it serves: " in done.stderr
    assert vllm_server.model_name in done.stderr and not missing.exists()


def test_export_from_past_a_partitions_end_is_one_line(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    stream = StreamConfig(bootstrap_servers=kafka_bootstrap, topic_prefix=prefix)
    sink = KafkaSink(stream, tmp_path / "state")
    sink.put_trajectory(make_trajectory(session_id="s"))
    sink.close()
    env = {
        **os.environ,
        "OLP_STATE_DIR": str(tmp_path / "state"),
        "OLP_STREAM__BOOTSTRAP_SERVERS": kafka_bootstrap,
        "OLP_STREAM__TOPIC_PREFIX": prefix,
    }
    export = tmp_path / "export.jsonl"
    beyond = json.dumps({"trajectories": {str(p): 50 for p in range(stream.partitions)}})
    done = olp(["replay", "export", "--out", str(export), "--from", beyond], env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "beyond the end of the partition" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not export.exists()
