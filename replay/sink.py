"""Where the proxy puts finished trajectories and feedback events: the RecordSink contract."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog

from replay.schemas import (
    RecordKind,
    SchemaValidationError,
    encode_record,
    validate_record,
)

log = structlog.get_logger(__name__)


@runtime_checkable
class RecordSink(Protocol):
    """Accepts records from the request path; must never block the event loop nor raise on
    broker trouble. The caller hands the dict over and must not mutate it afterwards."""

    def put_trajectory(self, record: dict[str, Any]) -> None: ...

    def put_feedback(self, event: dict[str, Any]) -> None: ...

    async def aclose(self) -> None: ...


class JsonlSink:
    """One JSON line per record in `<directory>/trajectories.jsonl` and `feedback.jsonl`.

    For development and tests without a broker. Invalid records go to `dlq.jsonl` with the
    reason, like KafkaSink does, so both sinks reject the same inputs the same way.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files = {
            name: open(self.directory / f"{name}.jsonl", "ab")  # noqa: SIM115 - long-lived
            for name in ("trajectories", "feedback", "dlq")
        }

    def _put(self, kind: RecordKind, name: str, record: dict[str, Any]) -> None:
        try:
            validate_record(kind, record)
            line = encode_record(record)
            target = name
        except (SchemaValidationError, TypeError, ValueError) as exc:
            log.warning("record_rejected", kind=kind.value, reason=str(exc))
            line = encode_record({"kind": kind.value, "reason": str(exc), "raw": repr(record)})
            target = "dlq"
        with self._lock:
            handle = self._files[target]
            handle.write(line + b"\n")
            handle.flush()

    def put_trajectory(self, record: dict[str, Any]) -> None:
        self._put(RecordKind.TRAJECTORY, "trajectories", record)

    def put_feedback(self, event: dict[str, Any]) -> None:
        self._put(RecordKind.FEEDBACK, "feedback", event)

    def close(self) -> None:
        with self._lock:
            for handle in self._files.values():
                handle.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)
