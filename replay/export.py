"""Export recorded trajectories and feedback from the topics to JSONL (or Parquet).

Bounds are offsets (topic kind → partition → offset, start inclusive, end exclusive) and/or
record times (`created_at`, unix seconds, start inclusive, end exclusive). Without an end
offset the export stops at the high watermark seen when it caught up. Records are validated
and de-duplicated by event_id (trajectories by trajectory_id too); each output line is
`{"kind", "partition", "offset", "record"}`. A start offset beyond the end of its partition
raises ResumeOffsetError, as the consumer does, instead of exporting from the beginning.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
from kafka import KafkaConsumer, TopicPartition

from replay.config import StreamConfig
from replay.consumer import check_start_offset, normalize_offsets, start_kept_by_retention
from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    decode_record,
    dumps_json,
    validate_record,
)
from replay.topics import TopicNames

log = structlog.get_logger(__name__)

ExportFormat = Literal["jsonl", "parquet"]
KIND_NAMES = {"trajectories": RecordKind.TRAJECTORY, "feedback": RecordKind.FEEDBACK}
# How long an export waits on a broker that sends nothing while records are left to read.
STALLED_TIMEOUT_S = 30.0


@dataclass
class ExportResult:
    path: Path
    format: ExportFormat
    counts: dict[str, int] = field(default_factory=dict)
    invalid: int = 0
    duplicates: int = 0
    tombstones: int = 0  # records without a value: skipped, none of ours and not invalid
    end_offsets: dict[str, dict[int, int]] = field(default_factory=dict)
    # kind → partition → records between the start asked for and the first one the broker
    # still keeps (retention deleted them): a hole in a chain of exports.
    skipped_by_retention: dict[str, dict[int, int]] = field(default_factory=dict)
    # kind → partition → records the broker holds below the end asked for that the export
    # did not get, the broker having sent nothing for `stalled_timeout_s` (a restart, a
    # network cut): the file ends short of them, and `end_offsets` says where. At least
    # that many: a partition no fetch answered for is counted by its listed end offset,
    # which the embedded broker gives as its last batch's base offset + 1.
    unread: dict[str, dict[int, int]] = field(default_factory=dict)


def parquet_available() -> bool:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        return False
    return True


def _format_for(out: Path, fmt: ExportFormat | None) -> ExportFormat:
    chosen: ExportFormat = fmt or ("parquet" if out.suffix == ".parquet" else "jsonl")
    if chosen == "parquet" and not parquet_available():
        raise ValueError("Parquet export needs pyarrow, which is not installed; use .jsonl")
    return chosen


def _offsets_by_kind(offsets: Any, names: TopicNames) -> dict[str, dict[int, int]]:
    """Accept keys as kinds ("trajectories") or full topic names ("olp.trajectories")."""
    result: dict[str, dict[int, int]] = {}
    for key, parts in normalize_offsets(offsets).items():
        kind = key.removeprefix(f"{names.trajectories.rsplit('.', 1)[0]}.")  # "<prefix>.x" → x
        if kind == "dlq":
            continue  # the learner's stored offsets hold its DLQ position: nothing to export
        if kind not in KIND_NAMES:
            raise ValueError(f"unknown topic in offsets: {key!r} (expected trajectories/feedback)")
        result[kind] = parts
    return result


def iter_records(
    config: StreamConfig,
    *,
    kinds: tuple[str, ...] = ("trajectories", "feedback"),
    from_offsets: Any = None,
    to_offsets: Any = None,
    from_time: float | None = None,
    to_time: float | None = None,
    idle_timeout_s: float = 2.0,
    stalled_timeout_s: float | None = None,
    result: ExportResult | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield `{"kind", "partition", "offset", "record"}` within the bounds, de-duplicated.

    A partition at its high watermark but short of an end bound (offsets beyond its last
    record) is given up after `idle_timeout_s` without a record. One with records left below
    its high watermark waits `stalled_timeout_s` (default `STALLED_TIMEOUT_S`): those exist,
    and a broker that stopped answering for 2 s (a restart) ended the export with them
    unread, a short file and exit 0. Given up, they are counted in `result.unread`."""
    names = TopicNames.from_prefix(config.topic_prefix)
    if stalled_timeout_s is None:
        stalled_timeout_s = STALLED_TIMEOUT_S
    for kind in kinds:
        if kind not in KIND_NAMES:
            raise ValueError(f"unknown kind {kind!r}: expected one of {sorted(KIND_NAMES)}")
    starts = _offsets_by_kind(from_offsets, names)
    ends = _offsets_by_kind(to_offsets, names)
    topic_of = {kind: getattr(names, kind) for kind in kinds}
    kind_of = {topic: kind for kind, topic in topic_of.items()}
    consumer = KafkaConsumer(
        bootstrap_servers=config.bootstrap_servers,
        client_id="olp-export",
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        bootstrap_timeout_ms=config.bootstrap_timeout_ms,
    )
    seen: set[str] = set()
    # Per partition, the first record left out as created at or after `to_time`: where the
    # next export must start (`created_at` is not ordered within a partition, so a record
    # after it may be older; the next export reads such ones again, and readers de-duplicate
    # by event_id). Ending at the high watermark lost these records from a chain of exports.
    held_back: dict[TopicPartition, int] = {}
    try:
        tps: list[TopicPartition] = []
        for topic in topic_of.values():
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                raise ValueError(f"topic {topic!r} does not exist on {config.bootstrap_servers}")
            tps.extend(TopicPartition(topic, p) for p in sorted(parts))
        consumer.assign(tps)
        beginnings = consumer.beginning_offsets(tps)
        stop_at: dict[TopicPartition, int | None] = {}
        seeked: dict[TopicPartition, int] = {}
        for tp in tps:
            kind = kind_of[tp.topic]
            beginning = beginnings.get(tp) or 0
            start = starts.get(kind, {}).get(tp.partition, beginning)
            # Exported from the first record kept; said, and counted in the result (it went
            # on from there in silence: a hole in a chain of exports).
            seeked[tp] = start_kept_by_retention(
                tp, start, beginning, "export_start_below_retention"
            )
            if result is not None and start < beginning:
                skipped = result.skipped_by_retention.setdefault(kind, {})
                skipped[tp.partition] = beginning - start
            consumer.seek(tp, seeked[tp])
            stop_at[tp] = ends.get(kind, {}).get(tp.partition)
        active = {tp for tp in tps if stop_at[tp] is None or consumer.position(tp) < stop_at[tp]}
        # Each partition's end when the export began: until its first fetch answers, the
        # consumer knows no high watermark, and a broker silent from the start looked like
        # one with nothing to send.
        known_ends = consumer.end_offsets(list(active)) if active else {}
        for tp in tps:
            if tp not in active:  # already at its end bound: it ends where it starts
                _record_end(result, kind_of[tp.topic], tp, consumer.position(tp), stop_at[tp])
        consumer.pause(*[tp for tp in tps if tp not in active])
        last_progress = time.monotonic()
        while active:
            batch = consumer.poll(timeout_ms=200)
            for tp in active:
                # A start beyond the partition's end (lost data, a wrong offsets file) makes
                # the client reset to the earliest offset: refuse, as the consumer does,
                # before anything read from the reset position is exported.
                check_start_offset(
                    tp,
                    seeked[tp],
                    seeked[tp],
                    consumer.position(tp),
                    consumer.highwater(tp),
                    what="export start offset (from_offsets)",
                )
            if any(batch.values()):
                last_progress = time.monotonic()
            for tp, records in batch.items():
                kind = kind_of[tp.topic]
                for rec in records:
                    end = stop_at[tp]
                    if end is not None and rec.offset >= end:
                        break
                    item = _parse(kind, tp, rec, from_time, to_time, seen, result, held_back)
                    if item is not None:
                        yield item
            for tp in list(active):
                end = stop_at[tp]
                position = consumer.position(tp)
                highwater = consumer.highwater(tp)
                done_by_offset = end is not None and position >= end
                done_by_end = end is None and highwater is not None and position >= highwater
                if done_by_offset or done_by_end:
                    active.discard(tp)
                    consumer.pause(tp)
                    _record_end(result, kind_of[tp.topic], tp, position, end, held_back.get(tp))
            if not active:
                break
            behind = _unread(consumer, active, stop_at, known_ends)
            idle_s = time.monotonic() - last_progress
            if idle_s > (stalled_timeout_s if behind else idle_timeout_s):
                log.warning(
                    "export_stopped_idle",
                    waiting_partitions=len(active),
                    unread_records=sum(behind.values()),
                    idle_s=round(idle_s, 1),
                )
                for tp in active:  # every record before the position was exported
                    position = consumer.position(tp)
                    _record_end(
                        result, kind_of[tp.topic], tp, position, stop_at[tp], held_back.get(tp)
                    )
                    if result is not None and behind.get(tp):
                        result.unread.setdefault(kind_of[tp.topic], {})[tp.partition] = behind[tp]
                break
    finally:
        consumer.close()


def _unread(
    consumer: KafkaConsumer,
    active: set[TopicPartition],
    stop_at: dict[TopicPartition, int | None],
    known_ends: dict[TopicPartition, int],
) -> dict[TopicPartition, int]:
    """The records each partition holds below its end (the bound asked for, or its high
    watermark: the last fetch's, else the one when the export began) not read yet."""
    behind: dict[TopicPartition, int] = {}
    for tp in active:
        highwater = consumer.highwater(tp)
        if highwater is None:
            highwater = known_ends.get(tp)
        if highwater is None:
            continue
        end = stop_at[tp]
        left = (highwater if end is None else min(end, highwater)) - consumer.position(tp)
        if left > 0:
            behind[tp] = left
    return behind


def _record_end(
    result: ExportResult | None,
    kind: str,
    tp: TopicPartition,
    position: int,
    end: int | None,
    held_back: int | None = None,
) -> None:
    """Where this partition's export stopped: the next export's `from_offsets` for it (at
    the first record it left out for `to_time`, if any)."""
    if result is not None:
        bound = min(position, end) if end is not None else position
        if held_back is not None:
            bound = min(bound, held_back)
        result.end_offsets.setdefault(kind, {})[tp.partition] = bound


def _parse(
    kind: str,
    tp: TopicPartition,
    rec: Any,
    from_time: float | None,
    to_time: float | None,
    seen: set[str],
    result: ExportResult | None,
    held_back: dict[TopicPartition, int] | None = None,
) -> dict[str, Any] | None:
    if rec.value is None:  # a key's tombstone, written by a tool: not an invalid record
        log.info("export_skipped_tombstone", topic=tp.topic, offset=rec.offset)
        if result is not None:
            result.tombstones += 1
        return None
    try:
        record = decode_record(rec.value)
        validate_record(KIND_NAMES[kind], record)
    except (ValueError, SchemaValidationError) as exc:
        log.warning("export_skipped_invalid", topic=tp.topic, offset=rec.offset, reason=str(exc))
        if result is not None:
            result.invalid += 1
        return None
    # By event_id, and a trajectory by its id too, as the consumer does: a trajectory built
    # twice (its sink worker died before confirming it) had a new event_id the second time
    # before the worker derived it from the trajectory_id, and topics keep such records.
    keys = [record["event_id"]]
    if kind == "trajectories":
        keys.append(f"trajectory_id:{record['trajectory_id']}")
    if any(key in seen for key in keys):
        if result is not None:
            result.duplicates += 1
        return None
    seen.update(keys)
    created = float(record["created_at"])
    if to_time is not None and created >= to_time:
        if held_back is not None:
            held_back.setdefault(tp, rec.offset)  # the first one left out of this partition
        return None
    if from_time is not None and created < from_time:
        return None
    return {"kind": kind, "partition": tp.partition, "offset": rec.offset, "record": record}


def export_records(
    config: StreamConfig,
    out: Path,
    *,
    kinds: tuple[str, ...] = ("trajectories", "feedback"),
    from_offsets: Any = None,
    to_offsets: Any = None,
    from_time: float | None = None,
    to_time: float | None = None,
    fmt: ExportFormat | None = None,
) -> ExportResult:
    """Write the selected records to `out` (JSONL, or Parquet for a .parquet name)."""
    out = Path(out)
    chosen = _format_for(out, fmt)
    result = ExportResult(path=out, format=chosen)
    out.parent.mkdir(parents=True, exist_ok=True)
    items = iter_records(
        config,
        kinds=kinds,
        from_offsets=from_offsets,
        to_offsets=to_offsets,
        from_time=from_time,
        to_time=to_time,
        result=result,
    )
    tmp = out.with_name(out.name + ".partial")
    if out.is_dir():  # else found only when the whole export was written
        raise ValueError(f"{out} is a directory; name the export file to write")
    try:
        if chosen == "jsonl":
            with tmp.open("w", encoding="utf-8") as handle:
                for item in items:
                    line = dumps_json(item, separators=(",", ":"))  # lone surrogates escaped
                    handle.write(line + "\n")
                    result.counts[item["kind"]] = result.counts.get(item["kind"], 0) + 1
        else:
            _write_parquet(tmp, items, result)
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a failed export leaves no half-written file behind
        raise
    log.info(
        "export_written",
        path=str(out),
        counts=result.counts,
        invalid=result.invalid,
        duplicates=result.duplicates,
        tombstones=result.tombstones,
    )
    return result


def _write_parquet(path: Path, items: Iterator[dict[str, Any]], result: ExportResult) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, list[Any]] = {
        "kind": [],
        "partition": [],
        "offset": [],
        "event_id": [],
        "trajectory_id": [],
        "session_id": [],
        "created_at": [],
        "record_json": [],
    }
    for item in items:
        record = item["record"]
        columns["kind"].append(item["kind"])
        columns["partition"].append(item["partition"])
        columns["offset"].append(item["offset"])
        columns["event_id"].append(record["event_id"])
        columns["trajectory_id"].append(record["trajectory_id"])
        columns["session_id"].append(record["session_id"])
        columns["created_at"].append(float(record["created_at"]))
        columns["record_json"].append(json.dumps(record, separators=(",", ":")))
        result.counts[item["kind"]] = result.counts.get(item["kind"], 0) + 1
    pq.write_table(pa.table(columns), path)


def read_export(path: Path) -> Iterator[dict[str, Any]]:
    """Read back an export (JSONL or Parquet) as `{"kind", "partition", "offset", "record"}`."""
    path = Path(path)
    if path.suffix == ".parquet":
        if not parquet_available():
            raise ValueError(f"{path}: reading Parquet needs pyarrow, which is not installed")
        import pyarrow.parquet as pq

        # A batch at a time: the whole table as Python objects held several times the file.
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                yield {
                    "kind": row["kind"],
                    "partition": row["partition"],
                    "offset": row["offset"],
                    "record": json.loads(row["record_json"]),
                }
        return
    with path.open("rb") as handle:  # decoded per line, so an error names its line
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}:{number}: not UTF-8: {exc}") from exc
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON: {exc}") from exc
            if isinstance(item, dict) and "record" not in item and "trajectory_id" in item:
                # A bare record, e.g. a line of JsonlSink's output.
                is_feedback = "kind" in item and "request" not in item
                kind = "feedback" if is_feedback else "trajectories"
                item = {"kind": kind, "partition": None, "offset": None, "record": item}
            if not isinstance(item, dict) or not isinstance(item.get("record"), dict):
                raise ValueError(f"{path}:{number}: expected an export line with a 'record'")
            if item.get("kind") not in KIND_NAMES:
                raise ValueError(
                    f"{path}:{number}: expected an export line whose 'kind' is one of "
                    f"{sorted(KIND_NAMES)}"
                )
            yield item
