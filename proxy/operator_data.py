"""What the operator page (and `/admin/status`) shows, read from the state dir, the audit log
and the sink.

Every reader here is synchronous file or network I/O: the page runs them in worker threads
(never on the event loop) and shows each reader's failure next to its section instead of
failing the whole page.
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from kafka import KafkaConsumer, TopicPartition

from replay.producer import ProducerMetrics, tcp_reachable
from safety.audit import iter_records

log = structlog.get_logger(__name__)

_VERSION_FILE = re.compile(r"policy-v([0-9]+)")  # fullmatch: `$` passes a final newline
# How long the broker may hold a fetch at a partition's end before answering it empty.
_FETCH_WAIT_MS = 50


@dataclass
class Loaded:
    """Items read from disk plus one message per file that could not be read."""

    items: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _versioned(paths: list[Path]) -> list[tuple[int, Path]]:
    found = []
    for path in paths:
        match = _VERSION_FILE.fullmatch(path.stem if path.suffix == ".json" else path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


@dataclass
class GateFile:
    """One `gates/policy-v<N>.json`: its report, or why it could not be read."""

    version: int
    path: Path
    report: dict[str, Any] | None = None
    error: str | None = None


def load_gate_files(state_dir: Path, limit: int) -> list[GateFile]:
    """The newest `limit` gate reports, newest version first.

    The learner prunes a version's report with its directory, so a file can vanish between
    the listing and the read: it is skipped (the next older one takes its place), not an
    error. `.tmp` files (writes in progress) are never listed."""
    gates = state_dir / "gates"
    files = _versioned(list(gates.glob("policy-v*.json"))) if gates.is_dir() else []
    out: list[GateFile] = []
    for number, path in reversed(files):
        if len(out) >= limit:
            break
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(report, dict):
                raise ValueError("not a JSON object")
            out.append(GateFile(number, path, report=report))
        except FileNotFoundError:
            continue
        # UnicodeDecodeError is a ValueError; RecursionError: nested too deeply.
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("operator_gate_report_unreadable", file=str(path), error=str(exc))
            out.append(GateFile(number, path, error=str(exc)))
    return out


def read_gate_reports(state_dir: Path, limit: int = 10) -> Loaded:
    """The newest `limit` gate reports (`gates/policy-v<N>.json`), newest version first."""
    out = Loaded()
    for gate_file in load_gate_files(state_dir, limit):
        if gate_file.report is not None:
            out.items.append({"file": gate_file.path.name, **gate_file.report})
        else:
            out.errors.append(f"{gate_file.path.name}: {gate_file.error}")
    return out


MAX_REASON_CHARS = 120  # a failed-closed gate's reason, as `/admin/status` shows it


def _finite(value: Any) -> float | None:
    """A JSON number that strict JSON can carry back out (json.loads reads NaN, Infinity)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _short(text: Any) -> str | None:
    """The first line of `text`, cut to MAX_REASON_CHARS: a status line, not a traceback."""
    if not isinstance(text, str) or not text.strip():
        return None
    line = text.strip().splitlines()[0]
    return line if len(line) <= MAX_REASON_CHARS else line[: MAX_REASON_CHARS - 3] + "..."


def gate_decision(gate_file: GateFile) -> dict[str, Any]:
    """A gate report cut down to the decision: which gates failed and by how much, or, for a
    gate that could not measure, its reason; never the details. Every field is checked:
    the file is the learner's, and one odd value must not break `/admin/status`."""
    report = gate_file.report or {}
    results = report.get("results")
    failed = []
    for result in results if isinstance(results, list) else []:
        if not isinstance(result, dict) or result.get("verdict") == "pass":
            continue
        details = result.get("details")
        comparison = result.get("comparison")
        failed.append(
            {
                "name": _short(result.get("name")) or "?",
                "metric": _finite(result.get("metric")),
                "comparison": comparison if comparison in ("<=", ">=") else None,
                "threshold": _finite(result.get("threshold")),
                "reason": _short(details.get("reason")) if isinstance(details, dict) else None,
            }
        )
    return {
        "version": f"policy-v{gate_file.version}",
        # Anything but a literal true is not a pass; None: the report could not be read.
        "passed": None if gate_file.report is None else report.get("passed") is True,
        "started_at": _finite(report.get("started_at")),
        "duration_s": _finite(report.get("duration_s")),
        "failed": failed,
        "error": _short(gate_file.error),
    }


def recent_gate_decisions(state_dir: Path, limit: int) -> list[dict[str, Any]]:
    """The gate's last `limit` decisions, newest version last (the order of `history`)."""
    return [gate_decision(f) for f in reversed(load_gate_files(state_dir, limit))]


def read_adapter_metas(state_dir: Path) -> Loaded:
    """`olp_meta.json` of every adapter version, oldest first, with `created_at` filled in
    from the directory's mtime when the learner did not record it."""
    out = Loaded()
    root = state_dir / "adapters"
    dirs = _versioned([p for p in root.iterdir() if p.is_dir()]) if root.is_dir() else []
    for number, path in dirs:
        meta_file = path / "olp_meta.json"
        if not meta_file.is_file():
            continue
        try:
            meta = json.loads(meta_file.read_text(encoding="utf-8"))
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
            meta.setdefault("created_at", meta_file.stat().st_mtime)
            out.items.append({**meta, "name": path.name, "version": number})
        # UnicodeDecodeError is a ValueError; RecursionError: nested too deeply.
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("operator_adapter_meta_unreadable", dir=str(path), error=str(exc))
            out.errors.append(f"{path.name}: {exc}")
    return out


@dataclass
class AuditPage:
    records: list[dict[str, Any]]  # newest first
    has_more: bool
    events: list[str]  # every event name seen, for the filter
    total: int  # records in the log


def _event_name(record: Any) -> str:
    return str(record.get("event", "")) if isinstance(record, dict) else ""


def read_audit_page(audit_path: Path, event: str | None, page: int, size: int) -> AuditPage:
    """Records `page*size` .. `(page+1)*size` of the log, newest first, optionally one event.

    Two passes over the log, holding at most one page: the first counts the records and
    the matches, the second keeps the page's matches among the records the first counted
    (appends in between are left for the next view). Every page is reachable, the oldest
    last: keeping the newest matches of one pass in memory had to stop somewhere, and the
    pages beyond came back empty."""
    events: set[str] = set()
    total = matched = 0
    for record in iter_records(audit_path):
        total += 1
        name = _event_name(record)
        events.add(name)
        matched += event is None or name == event
    # The page in chain order (oldest first): matches [first, end) of the `matched`.
    end = max(matched - page * size, 0)
    first = max(end - size, 0)
    records: list[dict[str, Any]] = []
    index = 0
    for count, record in enumerate(iter_records(audit_path), start=1):
        if index >= end or count > total:
            break
        if event is None or _event_name(record) == event:
            if index >= first:
                records.append(record if isinstance(record, dict) else {"payload": record})
            index += 1
    return AuditPage(
        records=records[::-1],
        has_more=first > 0,
        events=sorted(events),
        total=total,
    )


def _samples(metric: Any) -> dict[str, float]:
    """A prometheus counter or gauge's current values by their label values ('' if none)."""
    values: dict[str, float] = {}
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            label = "/".join(sample.labels.values())
            values[label] = values.get(label, 0.0) + sample.value
    return values


def sink_metrics(sink: Any) -> dict[str, dict[str, float]] | None:
    """The KafkaSink's counters and gauges, or None for another sink kind."""
    metrics = getattr(sink, "metrics", None)
    if not isinstance(metrics, ProducerMetrics):
        return None
    names = ("queued", "sent", "spilled", "failed", "dlq", "spill_bytes", "queue_depth")
    names += ("queue_bytes",)
    return {name: _samples(getattr(metrics, name)) for name in (*names, "broker_up")}


def topic_end_offsets(
    bootstrap_servers: str, topics: list[str], timeout_s: float
) -> dict[str, dict[int, int]]:
    """topic → partition → end offset (the next offset to be written).

    The end offset is the high watermark a fetch returns, not only the ListOffsets answer:
    the embedded broker (Tansu) answers ListOffsets with its last batch's base offset + 1,
    so a batch of several records counts as one there, for good. A fetch from the listed
    end costs at most that last batch per partition; on Apache Kafka it returns no records.
    """
    if not tcp_reachable(bootstrap_servers, timeout_s=min(timeout_s, 1.0)):
        raise ConnectionError(f"no broker answers at {bootstrap_servers}")
    deadline = time.monotonic() + timeout_s
    timeout_ms = int(timeout_s * 1000)
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        client_id="olp-operator-page",
        enable_auto_commit=False,
        request_timeout_ms=max(timeout_ms, 1000),
        bootstrap_timeout_ms=timeout_ms,
        fetch_max_wait_ms=_FETCH_WAIT_MS,
    )
    try:
        known = consumer.topics()  # one metadata round trip for every topic
        partitions = [
            TopicPartition(topic, partition)
            for topic in topics
            if topic in known
            for partition in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        ends = consumer.end_offsets(partitions, timeout_ms=timeout_ms) if partitions else {}
        ends.update(_fetched_high_watermarks(consumer, ends, deadline))
    finally:
        consumer.close(autocommit=False)
    result: dict[str, dict[int, int]] = {topic: {} for topic in topics}
    for tp, offset in ends.items():
        result[tp.topic][tp.partition] = int(offset)
    return result


def _fetched_high_watermarks(
    consumer: KafkaConsumer, listed: dict[TopicPartition, int], deadline: float
) -> dict[TopicPartition, int]:
    """The high watermark of each partition whose fetch from its listed end answered before
    the deadline (never below the listed end); a partition without an answer keeps the
    listed one."""
    if not listed:
        return {}
    consumer.assign(list(listed))
    for tp, offset in listed.items():
        consumer.seek(tp, offset)
    while time.monotonic() < deadline:
        if all(consumer.highwater(tp) is not None for tp in listed):
            break
        consumer.poll(timeout_ms=_FETCH_WAIT_MS)
    found = {}
    for tp, offset in listed.items():
        highwater = consumer.highwater(tp)
        if highwater is not None:
            found[tp] = max(int(highwater), int(offset))
    return found


def _consumed_offsets(consumed: Any) -> dict[str, dict[int, int]]:
    """An adapter's `consumed_offsets` ({topic: {partition: offset}}, from the learner's
    file); ValueError naming the field when it has another shape."""
    shape = "consumed_offsets is not {topic: {partition: offset}}"
    if not isinstance(consumed, dict):
        raise ValueError(f"{shape}: {type(consumed).__name__}")
    out = {}
    for topic, parts in consumed.items():
        if parts is None:
            continue
        if not isinstance(parts, dict):
            raise ValueError(f"{shape}: {topic!r} holds a {type(parts).__name__}")
        try:
            out[str(topic)] = {int(p): int(o) for p, o in parts.items()}
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"{shape}: {topic!r}: {exc}") from exc
    return out


def consumer_lag(
    ends: dict[str, dict[int, int]], consumed: dict[str, Any] | None
) -> list[dict[str, Any]]:
    """One row per topic partition: end offset, the learner's next offset, and the lag."""
    rows = []
    consumed = _consumed_offsets(consumed or {})
    for topic, parts in sorted(ends.items()):
        learner = consumed.get(topic, {})
        for partition, end in sorted(parts.items()):
            at = learner.get(partition)
            rows.append(
                {
                    "topic": topic,
                    "partition": partition,
                    "end": end,
                    "consumed": at,
                    # A listed end can trail the writes (docs/stream.md): never show a learner
                    # ahead of the log as a negative lag.
                    "lag": max(end - (at or 0), 0),
                }
            )
    return rows
