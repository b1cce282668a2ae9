"""KafkaSinkProcess: the KafkaSink in a child process loses nothing when the broker is down
or the child dies, and mirrors the child's metrics."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import socket
import textwrap
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from deploy.broker import start_broker
from deploy.ports import free_port
from replay.config import StreamConfig
from replay.consumer import TrajectoryConsumer
from replay.schemas import decode_record, derived_event_id
from replay.sink_process import KafkaSinkProcess
from replay.spill import read_segment
from replay.synthetic import make_trajectory
from tests.python_run import run_python
from tests.replay.conftest import consume_until
from tests.replay.test_outage import _config, _sample, _wait_for


def _consume_ids(config: StreamConfig, expected: int) -> set[str]:
    with TrajectoryConsumer(config) as consumer:  # de-duplicates by event_id
        scored = consume_until(consumer, lambda got: len(got) >= expected)
        assert consumer.poll(0.5) == []
    return {s.trajectory["trajectory_id"] for s in scored}


def test_process_sink_round_trip_and_metrics(stream_config: StreamConfig, tmp_path: Path) -> None:
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    try:
        records = [make_trajectory(session_id=f"s{i % 3}") for i in range(200)]
        for record in records:
            sink.put_trajectory(record)
        sink.put_trajectory({"schema_version": 1, "not": "a trajectory"})  # → DLQ
        assert sink.wait_idle(60)
        assert _sample(registry, "olp_stream_sent_total", kind="trajectory") == 200
        assert _sample(registry, "olp_stream_dlq_total", kind="trajectory") == 1
        assert _sample(registry, "olp_stream_broker_up") == 1
    finally:
        sink.close()
    assert _consume_ids(stream_config, 200) == {r["trajectory_id"] for r in records}


def test_a_record_sent_between_two_status_ticks_is_counted_in_the_parents_metrics(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """One record at a time into an idle worker (a proxy at a low request rate): it is
    queued, sent and acknowledged between two of the worker's status ticks, so no tick sees
    the worker busy. Before, the worker sent its metric values only on becoming idle after a
    busy tick, and the parent's counts (the proxy's /metrics) stayed at 0 for such records."""
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    try:
        for count in range(1, 6):
            assert sink.wait_idle(60)
            time.sleep(0.3)  # the worker has reported itself idle
            sink.put_trajectory(make_trajectory())
            assert sink.wait_idle(60)
            _wait_for(
                lambda count=count: (
                    _sample(registry, "olp_stream_queued_total", kind="trajectory") == count
                    and _sample(registry, "olp_stream_sent_total", kind="trajectory") == count
                ),
                timeout_s=5,
            )
    finally:
        sink.close()


def _count_writes(sink: KafkaSinkProcess) -> list[float]:
    """The times of the feeder's writes to the worker from now on."""
    writes: list[float] = []
    send_bytes = sink._conn.send_bytes

    def counting_send(data: bytes) -> None:
        writes.append(time.monotonic())
        send_bytes(data)

    sink._conn.send_bytes = counting_send
    return writes


def test_the_worker_builds_what_came_within_its_batch_wait_in_one_burst(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The feeder hands records to the worker on its 0.1 s tick (a proxy killed outright
    loses at most a tick's), and the worker holds them for sink_batch_wait_s, then builds
    and sends them together (each burst of its work costs the proxy's process CPU too).
    Once the worker is idle the feeder stops polling it."""
    config = stream_config.model_copy(update={"sink_batch_wait_s": 1.0})
    sink = KafkaSinkProcess(config, tmp_path, CollectorRegistry())
    records = [make_trajectory(session_id=f"t{i % 4}") for i in range(25)]
    try:
        assert sink.wait_idle(60)
        writes = _count_writes(sink)
        polls: list[float] = []
        read_statuses = sink._read_statuses

        def counting_read(block_s: float) -> bool:
            polls.append(time.monotonic())
            return read_statuses(block_s)

        sink._read_statuses = counting_read  # type: ignore[method-assign]
        base = sink._confirmed
        first_put = time.monotonic()
        for record in records:  # a trickle, 50 records/s, over half the wait
            sink.put_trajectory(record)
            time.sleep(0.02)
        confirmed: list[tuple[float, int]] = []
        while not (sink._idle and not sink._pending and not sink._outbox):
            confirmed.append((time.monotonic(), sink._confirmed))
            assert time.monotonic() - first_put < 30, "not confirmed in time"
            time.sleep(0.02)
        assert time.monotonic() - first_put >= 0.9
        assert 2 <= len(writes) <= 10, writes  # on the tick: neither each record nor one
        early = [count for at, count in confirmed if at - first_put < 0.9]
        assert early and all(count == base for count in early), confirmed
        polls.clear()
        time.sleep(0.6)
        assert len(polls) <= 1, polls  # idle: one check a second, not one per tick
    finally:
        sink.close()
    assert _consume_ids(config, 25) == {r["trajectory_id"] for r in records}


def test_wait_idle_and_a_queues_worth_do_not_wait_for_the_batch(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """`wait_idle` (a drain, a test) has the worker build what it holds at once, and so
    does a queue_size's worth of records (the worker's memory stays bounded however long
    the wait)."""
    config = stream_config.model_copy(
        update={"sink_batch_wait_s": 60.0, "queue_size": 10, "producer_batch_records": 5}
    )
    sink = KafkaSinkProcess(config, tmp_path, CollectorRegistry())
    records = [make_trajectory(session_id=f"w{i % 2}") for i in range(13)]
    try:
        assert sink.wait_idle(60)
        for record in records[:3]:
            sink.put_trajectory(record)
        assert sink.wait_idle(20)  # well inside the 60 s wait
        for record in records[3:]:  # two messages of 5: a queue's worth, no wait_idle
            sink.put_trajectory(record)
        _wait_for(lambda: sink._confirmed == 13, timeout_s=20)
    finally:
        sink.close()
    assert _consume_ids(config, 13) == {r["trajectory_id"] for r in records}


_KILLED = textwrap.dedent(
    """
    import json
    import os
    import signal
    import sys
    import time
    from pathlib import Path

    from replay.config import StreamConfig
    from replay.sink_process import KafkaSinkProcess

    if __name__ == "__main__":
        config = StreamConfig.model_validate_json(sys.argv[1])
        sink = KafkaSinkProcess(config, Path(sys.argv[2]))
        assert sink.wait_idle(60)
        for line in sys.argv[3:]:
            sink.put_trajectory(json.loads(line))
        while sink._outbox:  # handed to the worker, which holds them for its wait
            time.sleep(0.01)
        print(sink._proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_records_the_worker_holds_are_sent_when_its_parent_is_killed(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A proxy killed outright while the worker holds records for its batch wait: the
    worker finds the pipe closed, builds and sends them, and exits."""
    script = tmp_path / "killed.py"  # a file: the spawned worker re-imports __main__
    script.write_text(_KILLED)
    config = stream_config.model_copy(update={"sink_batch_wait_s": 60.0})
    records = [make_trajectory(session_id="killed") for _ in range(5)]
    done = run_python(
        str(script),
        config.model_dump_json(),
        str(tmp_path / "state"),
        *(json.dumps(r) for r in records),
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    worker = int(done.stdout.split()[0])
    _wait_for(lambda: not _alive(worker), timeout_s=30)  # well inside its 60 s wait
    assert _consume_ids(config, 5) == {r["trajectory_id"] for r in records}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):  # a zombie until its (killed) parent is reaped
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    return False


def test_process_sink_spills_while_the_broker_is_down(tmp_path: Path) -> None:
    port = free_port()
    config = _config(f"127.0.0.1:{port}")
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(config, tmp_path / "state", registry)
    records = [make_trajectory(session_id=f"s{i % 4}") for i in range(40)]
    started = time.perf_counter()
    for record in records:
        sink.put_trajectory(record)
    assert time.perf_counter() - started < 0.05  # put_* only appends
    _wait_for(lambda: _sample(registry, "olp_stream_spilled_total", kind="trajectory") == 40)
    assert _sample(registry, "olp_stream_spill_bytes") > 0
    broker = start_broker("127.0.0.1", port, tmp_path / "broker.log")
    try:
        assert sink.wait_idle(60)  # drained from the spill once the broker answers
        sink.close()
        assert _consume_ids(config, 40) == {r["trajectory_id"] for r in records}
    finally:
        sink.close()
        broker.stop()


def test_a_spill_directory_that_cannot_be_made_is_refused_at_start(tmp_path: Path) -> None:
    """A file where the spill directory goes killed every worker at its start, restarted
    every 1.5 s for ever, and nothing reached a healthy broker. Now the sink refuses to
    start, naming the path (`olp proxy` exits 3 on it: an unusable state dir)."""
    import pytest

    state = tmp_path / "state"
    state.mkdir()
    (state / "spill").write_text("not a directory")
    config = _config(f"127.0.0.1:{free_port()}")
    with pytest.raises(FileExistsError) as err:
        KafkaSinkProcess(config, state, CollectorRegistry())
    assert err.value.filename == str(state / "spill")


def test_records_of_a_killed_sink_process_are_spilled_and_delivered(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    try:
        first = [make_trajectory(session_id="a") for _ in range(50)]
        for record in first:
            sink.put_trajectory(record)
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # it receives but confirms nothing more
        second = [make_trajectory(session_id="b") for _ in range(50)]
        for record in second:
            sink.put_trajectory(record)
        _wait_for(lambda: len(sink._pending) == 50)
        os.kill(sink._proc.pid, signal.SIGKILL)
        _wait_for(lambda: sink.child_restarts == 1)
        assert _sample(registry, "olp_stream_spilled_total", kind="trajectory") >= 50
        assert sink.wait_idle(60)  # the new child drained the parent's spill
    finally:
        sink.close()
    expected = {r["trajectory_id"] for r in first + second}
    assert _consume_ids(stream_config, 100) == expected


def test_a_hung_sink_process_is_killed_and_nothing_is_lost(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """A child that stops reading (SIGSTOP) must not let the parent's outbox grow forever."""
    config = stream_config.model_copy(update={"queue_size": 20, "sink_hung_after_s": 1.0})
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(config, tmp_path, registry)
    try:
        os.kill(sink._proc.pid, signal.SIGSTOP)
        records = [make_trajectory(session_id=f"h{i % 2}") for i in range(60)]
        for record in records[:30]:
            sink.put_trajectory(record)
        time.sleep(1.5)  # silent for longer than sink_hung_after_s
        for record in records[30:]:
            sink.put_trajectory(record)
        _wait_for(lambda: sink.child_restarts == 1)
        assert sink.wait_idle(60)
    finally:
        sink.close()
    assert _consume_ids(config, 60) == {r["trajectory_id"] for r in records}


def test_the_queue_depth_counts_each_waiting_record_once_while_the_worker_is_starved(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """`olp_stream_queue_depth` is read when scraped: records wait in the outbox, then with
    the worker unconfirmed, and each counts once. Before, the gauge was the worker's
    reported queue plus the parent's outbox and unconfirmed records (the worker's queue
    twice), refreshed only by the worker's reports: it froze while the worker was starved,
    the very time the backlog grows."""
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    records = [make_trajectory(session_id=f"d{i % 2}") for i in range(7)]
    try:
        assert sink.wait_idle(60)
        assert _sample(registry, "olp_stream_queue_depth") == 0
        os.kill(sink._proc.pid, signal.SIGSTOP)  # no reports, no confirmations
        for record in records:
            sink.put_trajectory(record)
        assert _sample(registry, "olp_stream_queue_depth") == 7
        _wait_for(lambda: not sink._outbox)  # handed to the stopped worker's pipe
        time.sleep(0.3)
        assert _sample(registry, "olp_stream_queue_depth") == 7
        os.kill(sink._proc.pid, signal.SIGCONT)
        assert sink.wait_idle(60)
        assert _sample(registry, "olp_stream_queue_depth") == 0
        assert sink.child_restarts == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sink._proc.pid, signal.SIGCONT)
        sink.close()
    assert _consume_ids(stream_config, 7) == {r["trajectory_id"] for r in records}


def test_an_idle_worker_stays_quiet_and_is_not_taken_for_hung_when_work_resumes(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """An idle child sends nothing (it sent two status messages a second, each waking the
    proxy's feeder), and its quiet is not silence: a burst after an idle spell longer than
    sink_hung_after_s keeps the same child."""
    # The worker runs at idle priority: a hang limit of a second or two could starve on a
    # loaded machine, so the idle spell is made older than a roomy limit instead (below).
    config = stream_config.model_copy(update={"queue_size": 10, "sink_hung_after_s": 10.0})
    sink = KafkaSinkProcess(config, tmp_path, CollectorRegistry())
    records = [make_trajectory(session_id=f"q{i % 3}") for i in range(40)]
    try:
        assert sink.wait_idle(60)
        time.sleep(0.3)  # the status that said idle is read
        sink._read_statuses(block_s=0.0)
        received: list[object] = []
        recv = sink._conn.recv

        def counting_recv() -> object:
            message = recv()
            received.append(message)
            return message

        sink._conn.recv = counting_recv
        time.sleep(2.5)
        assert received == []
        sink._progress_at -= 60  # the last report is now far older than sink_hung_after_s
        for record in records:  # over queue_size at once: put_* checks for a hung child
            sink.put_trajectory(record)
        assert sink.wait_idle(60)
        assert sink.child_restarts == 0
        assert received, "a busy child reports its progress"
    finally:
        sink.close()
    assert _consume_ids(config, 40) == {r["trajectory_id"] for r in records}


def test_a_silent_worker_with_one_record_in_flight_is_killed_and_nothing_is_lost(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The rule is silence while records wait, however few: a working child reports every
    100 ms while it has work (docs/stream.md said the outbox had to hold over queue_size
    records first; the feeder checks on every tick, and the code is what was meant)."""
    config = stream_config.model_copy(update={"sink_hung_after_s": 1.0})
    assert config.queue_size > 1
    sink = KafkaSinkProcess(config, tmp_path, CollectorRegistry())
    record = make_trajectory(session_id="one")
    try:
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # it receives but reports nothing more
        sink.put_trajectory(record)
        _wait_for(lambda: sink.child_restarts == 1, timeout_s=15)
        assert sink.wait_idle(60)
    finally:
        sink.close()
    assert _consume_ids(config, 1) == {record["trajectory_id"]}


def test_a_worker_that_died_before_close_does_not_hang_it(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The worker dies and the sink closes before the feeder noticed: close() returns, no
    new worker is needed for an empty outbox. Before, the feeder read the closed pipe and
    failed to restart the worker once a second, for ever (the proxy never exited, and each
    failure logged a traceback)."""
    sink = KafkaSinkProcess(stream_config, tmp_path, CollectorRegistry())
    records = [make_trajectory(session_id="closing") for _ in range(20)]
    for record in records:
        sink.put_trajectory(record)
    assert sink.wait_idle(60)  # every record durable; the feeder waits on its idle poll
    worker = sink._proc
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    closer = threading.Thread(target=sink.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive(), "close() hung after its worker died"
    assert not sink._thread.is_alive()
    assert _consume_ids(stream_config, 20) == {r["trajectory_id"] for r in records}


_LEFT_OPEN = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    from replay.config import StreamConfig
    from replay.sink_process import KafkaSinkProcess

    if __name__ == "__main__":
        config = StreamConfig.model_validate_json(sys.argv[1])
        sink = KafkaSinkProcess(config, Path(sys.argv[2]))
        assert sink.wait_idle(60)  # the worker runs (it ignores SIGTERM from here on)
        sink.put_trajectory(json.loads(sys.argv[3]))
        print("leaving without close", flush=True)
    """
)


def test_a_program_that_exits_without_closing_its_sink_still_exits_and_delivers(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The worker ignores SIGTERM and waits for its parent's close, and multiprocessing's
    exit handler joins it: a program that never called close (a test that failed before
    it) hung at exit for ever. The sink now closes itself at exit."""
    script = tmp_path / "left_open.py"  # a file: the spawned worker re-imports __main__
    script.write_text(_LEFT_OPEN)
    record = make_trajectory(session_id="left-open")
    done = run_python(
        str(script),
        stream_config.model_dump_json(),
        str(tmp_path / "state"),
        json.dumps(record),
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "leaving without close"
    assert "kafka_sink_closed_at_exit" in done.stdout + done.stderr
    assert _consume_ids(stream_config, 1) == {record["trajectory_id"]}


def test_a_sigterm_to_the_process_group_leaves_the_worker_to_its_parent(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """`olp up` stops the proxy with a SIGTERM to its process group, the worker included:
    the worker lives on until the proxy closes it, and then ends cleanly (before, it died
    with the records it had not sent yet, and the proxy started a new one)."""
    sink = KafkaSinkProcess(stream_config, tmp_path, CollectorRegistry())
    worker = sink._proc
    try:
        assert sink.wait_idle(60)  # the worker runs (a signal during its start-up kills it)
        os.kill(worker.pid, signal.SIGTERM)
        os.kill(worker.pid, signal.SIGINT)
        records = [make_trajectory(session_id="term") for _ in range(20)]
        for record in records:
            sink.put_trajectory(record)
        assert sink.wait_idle(60)
        assert worker.is_alive() and sink._proc is worker and sink.child_restarts == 0
    finally:
        sink.close()
    assert worker.exitcode == 0
    assert _consume_ids(stream_config, 20) == {r["trajectory_id"] for r in records}


def test_the_worker_and_all_its_threads_run_at_idle_priority(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The worker is background work: a request handler waking up on a busy machine takes
    the CPU from it at once. Every thread (kafka-python's sender among them) inherits the
    policy the worker sets before it starts any, and records still flow."""
    sink = KafkaSinkProcess(stream_config, tmp_path, CollectorRegistry())
    try:
        records = [make_trajectory(session_id="idle") for _ in range(20)]
        for record in records:
            sink.put_trajectory(record)
        assert sink.wait_idle(60)
        threads = [int(tid) for tid in os.listdir(f"/proc/{sink._proc.pid}/task")]
        assert len(threads) >= 3  # the receiving main thread, the sink's, kafka-python's
        assert {tid: os.sched_getscheduler(tid) for tid in threads} == dict.fromkeys(
            threads, os.SCHED_IDLE
        )
        assert os.getpriority(os.PRIO_PROCESS, sink._proc.pid) == 10  # where IDLE is missing
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the parent is left as it was
    finally:
        sink.close()
    assert _consume_ids(stream_config, 20) == {r["trajectory_id"] for r in records}


def build_from_capture(capture: dict[str, Any], status: str) -> dict[str, Any]:
    """A picklable record builder, as the proxy passes `proxy.capture.build_record`."""
    if capture.get("broken"):
        raise ValueError("this capture cannot be built")
    record = make_trajectory(session_id=capture["session"], trajectory_id=capture["id"])
    record["status"] = status
    return record


def test_process_sink_builds_records_from_captures_and_counts_them(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """Captures are built in the worker, a failed build is counted, and a killed worker's
    unconfirmed captures are built and spilled by the parent; a new worker gets the builder."""
    sink = KafkaSinkProcess(stream_config, tmp_path, CollectorRegistry())
    outcomes: collections.Counter[tuple[str, bool]] = collections.Counter()
    failures: list[int] = []
    lock = threading.Lock()

    def on_outcome(status: str, trainable: bool, count: int) -> None:
        with lock:
            outcomes[(status, trainable)] += count

    sink.build_records_with(build_from_capture, on_outcome, failures.append)

    def captures(n: int, session: str) -> list[dict[str, Any]]:
        return [{"id": uuid.uuid4().hex, "session": session} for _ in range(n)]

    first, second, third = captures(30, "c1"), captures(20, "c2"), captures(10, "c3")
    try:
        for capture in first:
            sink.put_capture(capture, "ok")
        sink.put_capture({"broken": True}, "ok")
        assert sink.wait_idle(60)
        _wait_for(lambda: outcomes[("ok", True)] == 30 and sum(failures) == 1)
        os.kill(sink._proc.pid, signal.SIGSTOP)
        for capture in second:
            sink.put_capture(capture, "aborted")
        _wait_for(lambda: len(sink._pending) == 20)
        os.kill(sink._proc.pid, signal.SIGKILL)
        _wait_for(lambda: sink.child_restarts == 1)
        assert outcomes[("aborted", True)] == 20  # built by the parent, then spilled
        for capture in third:
            sink.put_capture(capture, "ok")
        assert sink.wait_idle(60)
        _wait_for(lambda: outcomes[("ok", True)] == 40)
    finally:
        sink.close()
    assert sum(failures) == 1
    expected = {c["id"] for c in first + second + third}
    assert _consume_ids(stream_config, 60) == expected


def test_a_capture_its_dead_worker_had_built_is_counted_once_under_one_event_id(
    tmp_path: Path,
) -> None:
    """The worker builds captures (and, before, counted them at once) but never makes them
    durable: its sender waits on a broker that accepts connections and never answers. It is
    killed; the parent builds the captures again and spills them. Before: every outcome was
    counted twice (the worker's report, then the parent's build), and the parent's copy had
    a new event_id, so a consumer de-duplicating by event_id took a sent copy and the
    rebuilt one for two records."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes connections; nobody ever answers them
    config = _config(f"127.0.0.1:{silent.getsockname()[1]}", bootstrap_timeout_ms=30_000)
    sink = KafkaSinkProcess(config, tmp_path, CollectorRegistry())
    outcomes: collections.Counter[tuple[str, bool]] = collections.Counter()
    failures: list[int] = []
    lock = threading.Lock()

    def on_outcome(status: str, trainable: bool, count: int) -> None:
        with lock:
            outcomes[(status, trainable)] += count

    sink.build_records_with(build_from_capture, on_outcome, failures.append)
    captures = [{"id": uuid.uuid4().hex, "session": f"k{i % 2}"} for i in range(10)]
    try:
        assert sink.wait_idle(60)  # the worker runs; its sender is stuck connecting
        for capture in captures:
            sink.put_capture(capture, "ok")
        _wait_for(lambda: len(sink._pending) == 10)
        time.sleep(1.5)  # built by the worker, reported within 0.1 s (before: counted)
        assert len(sink._pending) == 10  # none of them durable
        os.kill(sink._proc.pid, signal.SIGKILL)
        silent.close()  # the next worker finds no broker and keeps the spill as it is
        _wait_for(lambda: sink.child_restarts == 1)
        assert outcomes == {("ok", True): 10}
    finally:
        sink.close()
        silent.close()
    assert outcomes == {("ok", True): 10}
    assert failures == []
    spill_dir = tmp_path / config.spill_dir_name
    spilled = [
        decode_record(entry.value)
        for segment in sorted(spill_dir.glob("seg-*.spill"))
        for entry in read_segment(segment)
    ]
    assert {r["trajectory_id"]: r["event_id"] for r in spilled} == {
        c["id"]: derived_event_id("trajectory", c["id"]) for c in captures
    }


def test_a_capture_built_in_the_parent_as_it_does_not_pickle_is_counted_once(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """The feeder builds (and counts) a capture that does not pickle, and hands the worker
    the record. Before: it kept the capture as unconfirmed, so when the worker died the
    capture was built and counted a second time."""
    sink = KafkaSinkProcess(stream_config, tmp_path, CollectorRegistry())
    outcomes: collections.Counter[tuple[str, bool]] = collections.Counter()
    lock = threading.Lock()

    def on_outcome(status: str, trainable: bool, count: int) -> None:
        with lock:
            outcomes[(status, trainable)] += count

    sink.build_records_with(build_from_capture, on_outcome)
    capture = {"id": uuid.uuid4().hex, "session": "u", "handle": threading.Lock()}
    try:
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # it receives but confirms nothing more
        sink.put_capture(capture, "ok")
        _wait_for(lambda: outcomes == {("ok", True): 1})  # built in the parent, at once
        assert len(sink._pending) == 1
        os.kill(sink._proc.pid, signal.SIGKILL)
        _wait_for(lambda: sink.child_restarts == 1)
        assert sink.wait_idle(60)
    finally:
        sink.close()
    assert outcomes == {("ok", True): 1}
    assert _consume_ids(stream_config, 1) == {capture["id"]}


def build_from_packed(capture: bytes, status: str) -> dict[str, Any]:
    """A picklable builder of captures packed as bytes, as the proxy packs its own."""
    fields = json.loads(capture)
    return build_from_capture(fields, status)


def test_the_captures_bytes_are_held_until_confirmed_and_none_once_the_worker_is_gone(
    stream_config: StreamConfig, tmp_path: Path
) -> None:
    """`backlog_bytes` (and `olp_stream_queue_bytes`) weigh the packed captures in the outbox
    and with the worker until it confirms them, or until its parent spilled them when it
    died: the proxy pauses capture on it (`proxy.capture_backlog_bytes`), so a count that
    only grew would pause capture for good. Records other than captures weigh nothing."""
    registry = CollectorRegistry()
    sink = KafkaSinkProcess(stream_config, tmp_path, registry)
    sink.build_records_with(build_from_packed, lambda *_: None)

    def packed(n: int, session: str) -> list[bytes]:
        return [
            json.dumps(
                {"id": uuid.uuid4().hex, "session": session, "pad": "x" * (100 * i)}
            ).encode()
            for i in range(n)
        ]

    def weight() -> tuple[int, float]:
        return sink.backlog_bytes(), _sample(registry, "olp_stream_queue_bytes")

    confirmed, killed, after = packed(5, "w1"), packed(3, "w2"), packed(2, "w3")
    trajectory = make_trajectory(session_id="w1")
    try:
        assert sink.wait_idle(60)
        assert weight() == (0, 0)
        os.kill(sink._proc.pid, signal.SIGSTOP)  # it receives but confirms nothing
        for capture in confirmed:
            sink.put_capture(capture, "ok")
        sink.put_trajectory(trajectory)
        total = sum(map(len, confirmed))
        assert weight() == (total, total)
        assert sink.backlog() == 6
        _wait_for(lambda: not sink._outbox)  # handed to the stopped worker's pipe
        assert weight() == (total, total)
        os.kill(sink._proc.pid, signal.SIGCONT)
        assert sink.wait_idle(60)
        assert weight() == (0, 0)
        os.kill(sink._proc.pid, signal.SIGSTOP)
        for capture in killed:
            sink.put_capture(capture, "aborted")
        _wait_for(lambda: len(sink._pending) == 3)
        assert weight() == (sum(map(len, killed)),) * 2
        os.kill(sink._proc.pid, signal.SIGKILL)  # the parent builds and spills those three
        _wait_for(lambda: sink.child_restarts == 1)
        assert weight() == (0, 0)
        for capture in after:
            sink.put_capture(capture, "ok")
        assert sink.wait_idle(60)
        assert weight() == (0, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sink._proc.pid, signal.SIGCONT)
        sink.close()
    expected = {json.loads(c)["id"] for c in confirmed + killed + after}
    assert _consume_ids(stream_config, 11) == expected | {trajectory["trajectory_id"]}


def test_a_worker_that_stopped_reading_is_killed_when_asked_though_the_feeder_is_stuck(
    stream_config: StreamConfig, tmp_path: Path, monkeypatch: Any
) -> None:
    """A worker that stops reading its pipe blocks the feeder in its write: the feeder's own
    check at each tick never runs, and the outbox grows. A put over `stream.queue_size`
    checked, but the proxy pauses capture at `proxy.capture_backlog_bytes` first (a few
    hundred large captures), so no put came and the hung worker held capture paused for
    good. `kill_if_hung()` (which the paused proxy calls) frees it; nothing is lost.

    A worker that reads slowly (its own queue full behind a slow broker) also leaves the
    feeder stuck, but goes on reporting: its statuses wait unread in the pipe, and count as
    heard until they stop growing."""
    config = stream_config.model_copy(update={"sink_hung_after_s": 1.0})
    sink = KafkaSinkProcess(config, tmp_path, CollectorRegistry())
    sink.build_records_with(build_from_packed, lambda *_: None)
    captures = [
        json.dumps({"id": uuid.uuid4().hex, "session": "k", "pad": "x" * 200_000}).encode()
        for _ in range(40)
    ]
    try:
        assert sink.wait_idle(60)
        os.kill(sink._proc.pid, signal.SIGSTOP)
        for capture in captures:
            sink.put_capture(capture, "ok")
        _wait_for(lambda: len(sink._pending) == len(captures))  # the feeder is writing them
        time.sleep(1.2)  # silent for longer than sink_hung_after_s
        assert sink.child_restarts == 0  # the feeder, stuck in its write, cannot see to it
        assert sink.backlog_bytes() >= 40 * 200_000
        assert sink._unread_status_bytes() == 0  # the stopped worker reports nothing
        unread = [0]
        monkeypatch.setattr(sink, "_unread_status_bytes", lambda: unread[0])
        for reported in (120, 240):  # as if it went on reporting, unheard
            unread[0] = reported
            sink.kill_if_hung()
            assert sink.child_restarts == 0
            time.sleep(1.2)
        sink.kill_if_hung()  # nothing more for longer than sink_hung_after_s
        _wait_for(lambda: sink.child_restarts == 1)
        assert sink.wait_idle(60)
        assert sink.backlog_bytes() == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(sink._proc.pid, signal.SIGCONT)
        sink.close()
    assert _consume_ids(stream_config, len(captures)) == {json.loads(c)["id"] for c in captures}


def _failed_counts(sink: KafkaSinkProcess) -> dict[tuple[str, ...], float]:
    return {
        tuple(sample.labels.values()): sample.value
        for family in sink.metrics.failed.collect()
        for sample in family.samples
        if not sample.name.endswith("_created") and sample.value
    }


def test_a_record_the_full_spill_refuses_is_counted_once_as_spill_full(tmp_path: Path) -> None:
    """Refused by the spill's size cap in the parent (after close, or a dead worker's), a
    record was taken for one the disk refused: counted again as `disk_error` (logged as
    lost to a disk error), and retried for the whole close timeout."""
    config = StreamConfig(
        bootstrap_servers=f"127.0.0.1:{free_port()}",  # the broker is down: all is spilled
        close_timeout_s=60,  # a close that retried the refused records would take this
        reconnect_backoff_s=0.2,
        spill_max_bytes=20_000,
        spill_segment_bytes=4096,
    )
    sink = KafkaSinkProcess(config, tmp_path)
    assert sink.wait_idle(60)  # the worker's start-up is not part of the close timed below
    for _ in range(40):  # more than the cap holds
        sink.put_trajectory(make_trajectory())
    started = time.monotonic()
    sink.close()
    assert time.monotonic() - started < 20  # no retrying a cap that cannot change
    before = _failed_counts(sink)
    assert set(before) == {("any", "spill_full")}, before
    sink.put_trajectory(make_trajectory())  # after close: the parent spills it itself
    after = _failed_counts(sink)
    assert after == {("any", "spill_full"): before[("any", "spill_full")] + 1}
