"""Export from the real broker, then replay through a recording hop into the real vLLM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from replay.config import StreamConfig
from replay.consumer import ResumeOffsetError
from replay.export import (
    ExportResult,
    export_records,
    iter_records,
    parquet_available,
    read_export,
)
from replay.producer import KafkaSink
from replay.replayer import replay_file
from replay.schemas import encode_record
from replay.synthetic import make_feedback, make_trajectory
from tests.replay.test_stream_kafka import _send_raw

ROOT = Path(__file__).resolve().parents[2]

# The recording hop and the tests share the session's event loop.
on_session_loop = pytest.mark.asyncio(loop_scope="session")


def _completions_trajectory(created_at: float) -> dict[str, Any]:
    record = make_trajectory(session_id="s-completions", created_at=created_at, completion_tokens=4)
    record["endpoint"] = "completions"
    record["request"] = {
        "model": "policy",
        "prompt": "1, 2, 3,",
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
    }
    choice = record["choices"][0]
    del choice["message"]
    choice["text"] = " 4, 5"
    return record


def _recorded(t0: float) -> list[dict[str, Any]]:
    chat = [
        make_trajectory(
            session_id=f"s{i}",
            created_at=t0 + i,
            completion_tokens=4,
            prompt=f"Say the number {i}.",
        )
        for i in range(3)
    ]
    for record in chat:
        record["request"]["temperature"] = 0.0
        record["request"]["seed"] = 7
    return [*chat, _completions_trajectory(t0 + 3)]


def _produce(config: StreamConfig, state_dir: Path, trajectories: list, feedback: list) -> None:
    sink = KafkaSink(config, state_dir)
    for record in trajectories:
        sink.put_trajectory(record)
    for event in feedback:
        sink.put_feedback(event)
    assert sink.wait_idle(30)
    sink.close()


def test_export_bounds_by_offsets_and_times(stream_config: StreamConfig, tmp_path: Path) -> None:
    t0 = 1_700_000_000.0
    first = [make_trajectory(session_id="one", created_at=t0 + i) for i in range(5)]
    _produce(stream_config, tmp_path, first, [make_feedback(first[0], created_at=t0)])
    everything = export_records(stream_config, tmp_path / "all.jsonl")
    assert everything.counts == {"trajectories": 5, "feedback": 1}
    lines = list(read_export(tmp_path / "all.jsonl"))
    assert [item["record"] for item in lines if item["kind"] == "trajectories"] == first

    second = [make_trajectory(session_id="one", created_at=t0 + 100 + i) for i in range(3)]
    _produce(stream_config, tmp_path, second, [])
    newer = export_records(
        stream_config,
        tmp_path / "new.jsonl",
        kinds=("trajectories",),
        from_offsets={"trajectories": everything.end_offsets["trajectories"]},
    )
    assert [i["record"] for i in read_export(tmp_path / "new.jsonl")] == second
    assert newer.counts == {"trajectories": 3}

    export_records(
        stream_config,
        tmp_path / "old.jsonl",
        kinds=("trajectories",),
        to_offsets=everything.end_offsets,
    )
    assert [i["record"] for i in read_export(tmp_path / "old.jsonl")] == first

    timed = export_records(
        stream_config,
        tmp_path / "timed.jsonl",
        kinds=("trajectories",),
        from_time=t0 + 2,
        to_time=t0 + 101,
    )
    assert [i["record"] for i in read_export(tmp_path / "timed.jsonl")] == first[2:] + second[:1]
    assert timed.counts == {"trajectories": 4}
    # Chained on from where the timed export stopped, nothing is lost: it stopped at the
    # first record it left out for its `to_time`, not at the partition's end (which lost
    # second[1:] from both files). The learner's offsets, its DLQ position in them, are
    # taken as they are.
    prefix = stream_config.topic_prefix
    chained = export_records(
        stream_config,
        tmp_path / "chained.jsonl",
        kinds=("trajectories",),
        from_offsets={
            f"{prefix}.trajectories": timed.end_offsets["trajectories"],
            f"{prefix}.dlq": {0: 0},
        },
    )
    assert [i["record"] for i in read_export(tmp_path / "chained.jsonl")] == second[1:]
    assert chained.counts == {"trajectories": 2}

    with pytest.raises(ValueError, match="unknown kind"):
        export_records(stream_config, tmp_path / "x.jsonl", kinds=("bogus",))
    if parquet_available():
        export_records(stream_config, tmp_path / "all.parquet")
        assert [
            i["record"]
            for i in read_export(tmp_path / "all.parquet")
            if i["kind"] == "trajectories"
        ] == first + second
    else:
        with pytest.raises(ValueError, match="pyarrow"):
            export_records(stream_config, tmp_path / "all.parquet")


def test_end_offsets_cover_every_partition_so_the_next_export_repeats_nothing(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A partition already at its end bound, or one the export stopped waiting for, still
    gets an end offset: one missing from the next `from_offsets` starts from the beginning."""
    t0 = 1_700_000_000.0
    records = [make_trajectory(session_id="one", created_at=t0 + i) for i in range(4)]
    _produce(stream_config, tmp_path, records, [])  # one session: one partition of four
    first = export_records(stream_config, tmp_path / "1.jsonl", kinds=("trajectories",))
    assert first.counts == {"trajectories": 4}
    assert sorted(first.end_offsets["trajectories"]) == [0, 1, 2, 3]
    [partition] = [p for p, end in first.end_offsets["trajectories"].items() if end == 4]

    # Nothing new: every partition starts at its end bound and is never read.
    second = export_records(
        stream_config,
        tmp_path / "2.jsonl",
        kinds=("trajectories",),
        from_offsets=first.end_offsets,
        to_offsets=first.end_offsets,
    )
    assert second.counts == {}
    assert second.end_offsets == first.end_offsets
    third = export_records(
        stream_config,
        tmp_path / "3.jsonl",
        kinds=("trajectories",),
        from_offsets=second.end_offsets,
    )
    assert third.counts == {}

    # An end bound beyond the records: the export stops waiting, and says where it stopped.
    result = ExportResult(path=tmp_path / "4.jsonl", format="jsonl")
    items = list(
        iter_records(
            stream_config,
            kinds=("trajectories",),
            to_offsets={"trajectories": {partition: 100}},
            idle_timeout_s=0.5,
            result=result,
        )
    )
    assert [item["record"] for item in items] == records
    assert result.end_offsets["trajectories"][partition] == 4


@pytest.mark.parametrize("served", [10, 0], ids=["after 10 records", "from the start"])
def test_an_export_whose_broker_stops_sending_says_what_it_did_not_read(
    stream_config: StreamConfig,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    served: int,
) -> None:
    """The broker sends 10 records, then nothing (a restart, a network cut): `olp replay
    export` gave up after 2 s, wrote 10 of 30 and exited 0. Now it waits out
    `STALLED_TIMEOUT_S` for records the broker holds, counts what it did not get, says so and
    exits 1; its `next --from` gets the rest."""
    import replay.export as export_module
    from deploy.cli_ops import cmd_replay_export
    from deploy.config import load_config

    records = [make_trajectory(session_id="one") for _ in range(30)]
    _produce(stream_config, tmp_path, records, [])

    class StallingConsumer(export_module.KafkaConsumer):  # type: ignore[misc, name-defined]
        served = 0

        def poll(self, timeout_ms: int = 0, max_records: int | None = None, **kwargs: Any):
            if self.served >= served:
                time.sleep(timeout_ms / 1000)  # the broker's silence
                return {}
            batch = super().poll(timeout_ms=timeout_ms, max_records=served - self.served)
            self.served += sum(len(got) for got in batch.values())
            return batch

    monkeypatch.setattr(export_module, "KafkaConsumer", StallingConsumer)
    monkeypatch.setattr(export_module, "STALLED_TIMEOUT_S", 3.0)  # 30 s in use
    cfg = load_config(
        None,
        environ={
            "OLP_STREAM__BOOTSTRAP_SERVERS": stream_config.bootstrap_servers,
            "OLP_STREAM__TOPIC_PREFIX": stream_config.topic_prefix,
            "OLP_STATE_DIR": str(tmp_path / "state"),
        },
    )
    out = tmp_path / "stall.jsonl"
    args = argparse.Namespace(from_=None, to=None, kinds="trajectories", out=str(out))
    started = time.monotonic()
    assert cmd_replay_export(args, cfg) == 1
    assert time.monotonic() - started >= 3.0  # not the 2 s of an export at its end
    printed = capsys.readouterr()
    said = re.search(
        r"stopped with at least (\d+) records unread: the broker sent nothing for 3 s", printed.err
    )
    assert said, printed.err
    # Counted from the fetches' high watermark; from the listed end where no fetch answered,
    # which the embedded broker gives as its last batch's base offset + 1 (docs/stream.md).
    assert int(said.group(1)) == 20 if served else 1 <= int(said.group(1)) <= 30
    assert [item["record"] for item in read_export(out)] == records[:served]
    [next_from] = [line for line in printed.out.splitlines() if line.startswith("next --from")]
    monkeypatch.undo()  # the broker answers again
    rest = export_records(
        stream_config,
        tmp_path / "rest.jsonl",
        kinds=("trajectories",),
        from_offsets=json.loads(next_from.removeprefix("next --from: ")),
    )
    assert rest.counts == {"trajectories": 30 - served} and rest.unread == {}  # none lost


def test_an_export_from_beyond_a_partitions_end_refuses_instead_of_starting_over(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """Offsets past the end (the broker lost data, a wrong offsets file): before, the client
    reset to the earliest offset and the export silently started over from there."""
    t0 = 1_700_000_000.0
    records = [make_trajectory(session_id="one", created_at=t0 + i) for i in range(4)]
    _produce(stream_config, tmp_path, records, [])
    first = export_records(stream_config, tmp_path / "1.jsonl", kinds=("trajectories",))
    [partition] = [p for p, end in first.end_offsets["trajectories"].items() if end == 4]

    out = tmp_path / "2.jsonl"
    with pytest.raises(ResumeOffsetError, match=r"export start offset \(from_offsets\) 100 .*"):
        export_records(
            stream_config,
            out,
            kinds=("trajectories",),
            from_offsets={"trajectories": {partition: 100}},
        )
    assert not out.exists()
    assert not out.with_name(out.name + ".partial").exists()
    # The generator refuses before yielding anything read from a reset position.
    items = iter_records(
        stream_config, kinds=("trajectories",), from_offsets={"trajectories": {partition: 5}}
    )
    with pytest.raises(ResumeOffsetError, match="beyond the end of the partition"):
        next(items)


def test_export_drops_a_trajectory_rebuilt_under_a_new_event_id(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A sink worker that dies after sending a trajectory it built, before confirming it, has
    the parent build the capture again, with a fresh event_id: the export keeps one copy,
    as the consumer does (before: both, the event_ids differing)."""
    t0 = 1_700_000_000.0
    first = make_trajectory(session_id="one", created_at=t0)
    rebuilt = dict(first, event_id="f" * 32)
    other = make_trajectory(session_id="one", created_at=t0 + 1)
    _produce(stream_config, tmp_path, [first, rebuilt, other], [make_feedback(first)])
    result = export_records(stream_config, tmp_path / "all.jsonl")
    assert result.counts == {"trajectories": 2, "feedback": 1}
    assert result.duplicates == 1
    assert [i["record"] for i in read_export(result.path) if i["kind"] == "trajectories"] == [
        first,
        other,
    ]


def test_export_skips_a_created_at_too_large_for_a_float(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """Before: the schema took the 400-digit number and float() of it raised OverflowError,
    which ended the export."""
    good = make_trajectory(session_id="one", created_at=1_700_000_000.0)
    huge = dict(make_trajectory(session_id="one"), created_at=10**400)
    _send_raw(stream_config, [encode_record(huge), encode_record(good)])
    result = export_records(stream_config, tmp_path / "all.jsonl", kinds=("trajectories",))
    assert result.counts == {"trajectories": 1} and result.invalid == 1
    assert [i["record"] for i in read_export(result.path)] == [good]


@pytest.mark.parametrize(
    ("offsets", "says"),
    [
        ({"trajectories": 5}, "offsets of 'trajectories' must be an object"),
        ({"trajectories": {"0": None}}, "offsets of 'trajectories': offset must be"),
        ({"trajectories": {"0": -1}}, "offsets of 'trajectories': offset must be"),
        ({"trajectories": {"first": 1}}, "offsets of 'trajectories': partition must be"),
        ([5], "offsets must be an object of topics"),
    ],
)
def test_offsets_of_the_wrong_shape_are_refused_naming_the_topic(
    stream_config: StreamConfig, tmp_path: Path, offsets: Any, says: str
) -> None:
    """Before: AttributeError or TypeError (`olp replay export` exited 1 with a traceback)."""
    out = tmp_path / "x.jsonl"
    with pytest.raises(ValueError, match=re.escape(says)):
        export_records(stream_config, out, from_offsets=offsets)
    assert list(tmp_path.glob("x.jsonl*")) == []


def test_the_cli_exits_2_on_offsets_of_the_wrong_shape(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OLP_STREAM__BOOTSTRAP_SERVERS": "127.0.0.1:1",
        "OLP_STATE_DIR": str(tmp_path),
    }
    bounds = ["--out", str(tmp_path / "x.jsonl"), "--from", '{"trajectories": 5}']
    done = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "replay", "export", *bounds],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert "olp: replay export: offsets of 'trajectories' must be an object" in done.stderr


@contextlib.asynccontextmanager
async def _serving(
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    paths: tuple[str, ...] = ("/v1/chat/completions",),
) -> AsyncIterator[str]:
    """A local OpenAI-shaped upstream answering `paths` with `handler`; yields its URL."""
    app = web.Application()
    for path in paths:
        app.router.add_post(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.fixture
async def recording_hop(vllm_server: Any):
    """A real HTTP hop that records what arrives and forwards it to vLLM."""
    seen: list[tuple[str, dict[str, str], dict[str, Any]]] = []

    async def forward(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((request.path, dict(request.headers), body))
        async with (
            aiohttp.ClientSession() as client,
            client.post(vllm_server.base_url + request.path, json=body) as upstream,
        ):
            return web.Response(
                status=upstream.status, body=await upstream.read(), content_type="application/json"
            )

    async with _serving(forward, ("/v1/chat/completions", "/v1/completions")) as url:
        yield url, seen


@on_session_loop
async def test_export_then_replay_reproduces_the_recorded_bodies(
    stream_config: StreamConfig, tmp_path: Path, recording_hop: Any, vllm_server: Any
) -> None:
    base_url, seen = recording_hop
    recorded = _recorded(1_700_000_000.0)
    _produce(stream_config, tmp_path, recorded, [make_feedback(recorded[0])])
    exported = tmp_path / "export.jsonl"
    export_records(stream_config, exported)

    out = tmp_path / "replay.jsonl"
    result = await replay_file(
        exported,
        out,
        base_url=base_url,
        model=vllm_server.model_name,
        api_key="sk-test",
        concurrency=2,
    )
    assert (result.sent, result.ok, result.errors) == (4, 4, 0)

    by_request = {
        body.get("messages", [{}])[0].get("content", body.get("prompt")): (p, h, body)
        for p, h, body in seen
    }
    assert len(seen) == 4
    for record in recorded:
        expected = dict(record["request"], model=vllm_server.model_name, stream=False)
        key = (record["request"].get("messages") or [{}])[0].get(
            "content", record["request"].get("prompt")
        )
        path, headers, body = by_request[key]
        assert body == expected
        assert path == (
            "/v1/completions" if record["endpoint"] == "completions" else "/v1/chat/completions"
        )
        assert headers["X-OLP-Train"] == "0"
        assert headers["Authorization"] == "Bearer sk-test"

    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["trajectory_id"] for line in lines] == [r["trajectory_id"] for r in recorded]
    for line, record in zip(lines, recorded, strict=True):
        assert line["recorded"]["choices"][0]["finish_reason"] == "stop"
        assert line["replayed"]["http_status"] == 200
        new_choice = line["replayed"]["choices"][0]
        if record["endpoint"] == "completions":
            assert line["recorded"]["choices"][0]["text"] == " 4, 5"
            assert isinstance(new_choice["text"], str)
        else:
            assert line["recorded"]["choices"][0]["message"]["content"] == "42"
            assert isinstance(new_choice["message"]["content"], str)
        assert line["replayed"]["usage"]["completion_tokens"] <= 4


@on_session_loop
async def test_replay_records_http_errors_and_rejects_bad_input(
    tmp_path: Path, vllm_server: Any
) -> None:
    source = tmp_path / "bare.jsonl"
    record = make_trajectory(completion_tokens=2)
    source.write_text(json.dumps(record) + "\n")
    out = tmp_path / "out.jsonl"
    result = await replay_file(source, out, base_url=vllm_server.base_url, model="no-such-model")
    assert (result.sent, result.ok, result.errors) == (1, 0, 1)
    line = json.loads(out.read_text())
    assert line["replayed"]["http_status"] == 404
    assert "no-such-model" in json.dumps(line["replayed"]["error"])

    broken = tmp_path / "broken.jsonl"
    bad = dict(record)
    del bad["choices"]
    broken.write_text(json.dumps(record) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match="record 2"):
        await replay_file(broken, out, base_url=vllm_server.base_url, model="base")


@on_session_loop
async def test_replay_writes_a_recorded_lone_surrogate_as_its_escape(tmp_path: Path) -> None:
    """A recorded body may hold a lone surrogate (a client's `"\\ud800"`): it is sent and
    written with its JSON escape (before: the output line failed to encode as UTF-8)."""
    odd = "x\ud800y"
    seen: list[dict[str, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        content = body["messages"][0]["content"]
        return web.json_response(
            {
                "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        )

    record = make_trajectory(prompt=odd)
    source = tmp_path / "source.jsonl"
    source.write_text(json.dumps(record) + "\n")  # ensure_ascii: the escape, as exported
    out = tmp_path / "out.jsonl"
    async with _serving(answer) as url:
        result = await replay_file(source, out, base_url=url, model="m")
    assert (result.sent, result.ok, result.errors) == (1, 1, 0)
    assert seen[0]["messages"][0]["content"] == odd
    text = out.read_bytes().decode("utf-8")  # strict: valid UTF-8
    line = json.loads(text)
    assert line["request"]["messages"][0]["content"] == odd
    assert line["replayed"]["choices"][0]["message"]["content"] == odd


@on_session_loop
async def test_replay_records_an_odd_answer_and_carries_on(tmp_path: Path) -> None:
    """A 200 whose body is not a JSON object, or not UTF-8, is written and counted as an
    error (before: AttributeError / UnicodeDecodeError ended the run with nothing written)."""
    answers = {
        "list": web.Response(body=b"[1, 2]", content_type="application/json"),
        "bytes": web.Response(body=b'{"x": "\xff"}', content_type="application/json"),
        "fine": web.json_response({"choices": [], "usage": None}),
    }

    async def answer(request: web.Request) -> web.Response:
        body = await request.json()
        return answers[body["messages"][0]["content"]]

    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(make_trajectory(prompt=p)) + "\n" for p in answers))
    out = tmp_path / "out.jsonl"
    async with _serving(answer) as url:
        result = await replay_file(source, out, base_url=url, model="m")
    assert (result.sent, result.ok, result.errors) == (3, 1, 2)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["replayed"]["http_status"] for line in lines] == [200, 200, 200]
    assert "not a JSON object" in lines[0]["replayed"]["error"]
    assert "not a JSON object" in lines[1]["replayed"]["error"]
    assert "error" not in lines[2]["replayed"]


@on_session_loop
async def test_replay_writes_each_line_as_it_is_done_so_a_crash_keeps_them(
    tmp_path: Path,
) -> None:
    """Before: every line was held in memory and written at the end; a crash (here: the
    run is cancelled while one answer never comes) left no output at all."""
    never = asyncio.Event()
    requested: list[str] = []

    async def answer(request: web.Request) -> web.Response:
        prompt = (await request.json())["messages"][0]["content"]
        requested.append(prompt)
        if prompt == "hang":
            await never.wait()
        return web.json_response({"choices": [], "usage": None})

    prompts = ["a", "b", "hang", "d"]
    records = [make_trajectory(prompt=p) for p in prompts]
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.jsonl"

    def written() -> list[str]:
        text = out.read_text() if out.exists() else ""
        return [json.loads(line)["trajectory_id"] for line in text.splitlines()]

    async with _serving(answer) as url:
        run = asyncio.create_task(replay_file(source, out, base_url=url, model="m", concurrency=2))
        try:
            for _ in range(200):
                if len(written()) >= 2 and "d" in requested:
                    break
                await asyncio.sleep(0.05)
            # Written as done and in the order of the source: "d" was answered, but waits
            # behind the request that hangs.
            assert written() == [r["trajectory_id"] for r in records[:2]]
            assert "d" in requested
            assert not run.done()
            run.cancel()  # the crash
            with pytest.raises(asyncio.CancelledError):
                await run
        finally:
            never.set()
    assert written() == [r["trajectory_id"] for r in records[:2]]
    assert out.read_text().endswith("\n")  # whole lines only


async def test_replay_reads_the_file_as_it_sends_not_all_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every record was loaded into a list before the first request: a 117 MiB export took
    787 MiB. Now the file is checked whole (keeping nothing), then read again as requests
    go, at most 2 x concurrency records ahead of the oldest line not written."""
    import replay.replayer as replayer

    passes: list[int] = []  # records read so far, per pass over the file

    def counting(path: Path):
        passes.append(0)
        for item in read_export(path):
            passes[-1] += 1
            yield item

    monkeypatch.setattr(replayer, "read_export", counting)
    read_when_first_sent: list[list[int]] = []

    async def answer(request: web.Request) -> web.Response:
        if not read_when_first_sent:
            read_when_first_sent.append(list(passes))
        return web.json_response({"choices": [], "usage": None})

    records = [make_trajectory(prompt=f"p{i}") for i in range(50)]
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    async with _serving(answer) as url:
        result = await replay_file(source, tmp_path / "out.jsonl", base_url=url, model="m")
    assert result.sent == result.ok == 50
    [[checked, sending]] = read_when_first_sent
    assert checked == 50  # the check read every record first
    assert sending <= 2  # the send pass only what its window holds (2 x concurrency 1)


async def test_replay_of_a_pipe_sends_every_record(tmp_path: Path) -> None:
    """A pipe cannot be read twice: checked on a first pass, the second pass found it empty
    and the run sent nothing, exiting 0. A pipe is held whole, as every file was before."""
    import threading

    records = [make_trajectory(prompt=f"p{i}") for i in range(5)]
    fifo = tmp_path / "source.fifo"
    os.mkfifo(fifo)
    text = "".join(json.dumps(r) + "\n" for r in records)
    writer = threading.Thread(target=fifo.write_text, args=(text,), daemon=True)
    writer.start()

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"choices": [], "usage": None})

    async with _serving(answer) as url:
        result = await replay_file(fifo, tmp_path / "out.jsonl", base_url=url, model="m")
    writer.join(5)
    assert result.sent == result.ok == 5


async def test_replay_of_a_file_cut_short_while_it_ran_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read twice, a file rewritten between the check and the sending would otherwise end
    the run as if every record was sent."""
    import replay.replayer as replayer

    records = [make_trajectory(prompt=f"p{i}") for i in range(3)]
    source = tmp_path / "source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    checked = replayer.check_trajectories

    def check_then_cut(path: Path) -> int:
        count = checked(path)
        path.write_text(json.dumps(records[0]) + "\n")  # an export rewritten meanwhile
        return count

    monkeypatch.setattr(replayer, "check_trajectories", check_then_cut)

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"choices": [], "usage": None})

    async with _serving(answer) as url:
        with pytest.raises(ValueError, match="changed while it was replayed: 3 trajectories"):
            await replay_file(source, tmp_path / "out.jsonl", base_url=url, model="m")
