"""Re-send recorded requests to an OpenAI-compatible server and keep old and new side by side.

The base for shadow evaluation: replay an export through the proxy (or straight to vLLM)
against any model name / adapter version. Each recorded request body is sent as recorded,
with only `model` replaced and streaming turned off; the output line holds the exact body
sent, the recorded completion and the new one. Replayed traffic carries `X-OLP-Train: 0`
so the proxy does not record it as training data again.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import structlog

from replay.export import read_export
from replay.schemas import SchemaValidationError, dumps_json, validate_trajectory

log = structlog.get_logger(__name__)

_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass
class ReplayResult:
    path: Path
    sent: int = 0
    ok: int = 0
    errors: int = 0


def iter_trajectories(path: Path) -> Iterator[dict[str, Any]]:
    """The trajectory records of an export file in order, each validated (errors name the
    record)."""
    for number, item in enumerate(read_export(path), start=1):
        if item["kind"] != "trajectories":
            continue
        try:
            validate_trajectory(item["record"])
        except SchemaValidationError as exc:
            raise ValueError(f"{path}: record {number}: {exc}") from exc
        yield item["record"]


def check_trajectories(path: Path) -> int:
    """How many trajectories the file holds, every one validated and none kept: a bad record
    anywhere refuses the run before anything is sent."""
    return sum(1 for _ in iter_trajectories(path))


def replay_body(record: dict[str, Any], model: str) -> dict[str, Any]:
    """The recorded client body with the chosen model and streaming off."""
    body = json.loads(json.dumps(record["request"]))
    body["model"] = model
    body.pop("stream_options", None)
    body["stream"] = False
    return body


def _summarise(record: dict[str, Any]) -> dict[str, Any]:
    return {
        "policy_version": record["policy_version"],
        "model_alias": record["model_alias"],
        "choices": [
            {k: c.get(k) for k in ("index", "message", "text", "finish_reason")}
            for c in record["choices"]
        ],
        "usage": record["usage"],
    }


def _parse_answer(body: bytes) -> tuple[Any, bool]:
    """The answer's JSON and True, or its text (cut short) and False when it is not UTF-8
    JSON."""
    try:
        return json.loads(body.decode("utf-8")), True
    except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deeply
        return body[:2000].decode("utf-8", "replace"), False


async def _replay_one(
    session: aiohttp.ClientSession,
    base_url: str,
    record: dict[str, Any],
    model: str,
    semaphore: asyncio.Semaphore,
) -> dict[str, Any]:
    body = replay_body(record, model)
    url = base_url.rstrip("/") + _PATHS[record["endpoint"]]
    async with semaphore:
        started = time.monotonic()
        replayed: dict[str, Any]
        try:
            async with session.post(url, json=body) as response:
                payload, parsed = _parse_answer(await response.read())
                replayed = {"http_status": response.status}
                if response.status != 200:
                    replayed["error"] = payload if parsed else {"raw": payload}
                elif not isinstance(payload, dict):
                    # One odd answer must not end the run: it is written as an error.
                    replayed["error"] = f"the answer is not a JSON object: {str(payload)[:2000]}"
                else:
                    replayed["choices"] = payload.get("choices", [])
                    replayed["usage"] = payload.get("usage")
                    replayed["policy_version"] = response.headers.get("x-olp-policy-version")
        except (aiohttp.ClientError, TimeoutError) as exc:
            replayed = {"http_status": None, "error": repr(exc)}
        latency = time.monotonic() - started
    return {
        "trajectory_id": record["trajectory_id"],
        "request_id": record["request_id"],
        "endpoint": record["endpoint"],
        "model": model,
        "request": body,
        "recorded": _summarise(record),
        "replayed": replayed,
        "latency_s": round(latency, 4),
    }


async def replay_file(
    source: Path,
    out: Path,
    *,
    base_url: str,
    model: str,
    api_key: str | None = None,
    concurrency: int = 1,
    timeout_s: float = 300.0,
    headers: dict[str, str] | None = None,
) -> ReplayResult:
    """Replay every trajectory of `source` against `base_url` (no /v1) as `model`.

    Writes one JSON line per trajectory to `out`, in the order of `source`, each flushed as
    soon as it and the ones before it are done: a run that crashes keeps what it finished.
    HTTP errors are recorded in the line (and counted), never raised: a shadow run should see
    them all.
    """
    # A file is checked whole first, then read again as the requests go: a list of every
    # record took about six times the file's size before the first request (787 MiB for a
    # 117 MiB export of agent traffic), and a day's export could not be replayed at all. A
    # pipe (`/dev/stdin`, `<(zcat ...)`) cannot be read twice: it is held as before.
    source = Path(source)
    if Path(out).exists() and Path(out).resolve() == source.resolve():
        # Opened for writing, it was emptied before the second read: the export was lost.
        raise ValueError(f"{out}: the output file is the export being replayed; name another")
    if source.is_file():
        expected = check_trajectories(source)
        todo: Iterator[dict[str, Any]] = iter_trajectories(source)
    else:
        held = list(iter_trajectories(source))
        expected, todo = len(held), iter(held)
    all_headers = {"X-OLP-Train": "0", **(headers or {})}
    if api_key:
        all_headers["Authorization"] = f"Bearer {api_key}"
    result = ReplayResult(path=Path(out))
    width = max(1, concurrency)
    semaphore = asyncio.Semaphore(width)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Requests start at most 2 * concurrency lines ahead of the oldest unwritten one: the
    # lines come out in the order of `source`, and memory (and what a crash loses) is bounded.
    window: deque[asyncio.Task[dict[str, Any]]] = deque()
    async with aiohttp.ClientSession(headers=all_headers, timeout=timeout) as session:
        with out.open("w", encoding="utf-8") as handle:
            try:
                while True:
                    while len(window) < 2 * width and (record := next(todo, None)) is not None:
                        window.append(
                            asyncio.create_task(
                                _replay_one(session, base_url, record, model, semaphore)
                            )
                        )
                    if not window:
                        break
                    line = await window.popleft()
                    handle.write(dumps_json(line) + "\n")  # a recorded lone surrogate escaped
                    handle.flush()
                    result.sent += 1
                    replayed = line["replayed"]
                    if replayed.get("http_status") == 200 and "error" not in replayed:
                        result.ok += 1
                    else:
                        result.errors += 1
            finally:
                if isinstance(todo, Generator):
                    todo.close()  # its file
                for task in window:  # a crash or a cancel: stop the requests in flight
                    task.cancel()
                await asyncio.gather(*window, return_exceptions=True)
    if result.sent != expected:
        raise ValueError(
            f"{source} changed while it was replayed: {expected} trajectories checked, "
            f"{result.sent} sent (the lines in {out} are the ones sent)"
        )
    log.info(
        "replay_written",
        path=str(out),
        sent=result.sent,
        ok=result.ok,
        errors=result.errors,
        model=model,
    )
    return result
