"""structlog, configured once per process: JSON lines in production, console in a terminal.

The proxy binds each request's request and session id (`proxy.log_context`); they are
merged into every line logged while the request runs.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Literal

import msgspec
import structlog

from proxy.log_context import merge_request_context

LogFormat = Literal["auto", "json", "console"]

# A value JSON cannot hold is written as its repr, as structlog's own JSON fallback does.
_JSON_ENCODER = msgspec.json.Encoder(enc_hook=repr)


def _json_line(event: dict[str, Any], **_: Any) -> bytes:
    """structlog's JSON serializer: msgspec instead of `json.dumps`. The proxy writes a
    line per request, and this halves what a line costs (with the bytes logger below)."""
    return _JSON_ENCODER.encode(event)


def configure_logging(fmt: LogFormat = "auto", level: str = "INFO") -> None:
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        merge_request_context,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: structlog.typing.Processor
    # What renders the lines of libraries that log through stdlib `logging` (it must
    # return text, where the structlog path below may write bytes).
    text_renderer: structlog.typing.Processor
    factory: Any = structlog.PrintLoggerFactory(file=sys.stderr)
    if use_console:
        # structlog's default (rich) traceback prints every frame's local variables: a
        # `log.exception` in the proxy would write request headers (keys) and bodies.
        renderer = text_renderer = structlog.dev.ConsoleRenderer(
            colors=sys.stderr.isatty(), exception_formatter=structlog.dev.plain_traceback
        )
    else:
        shared.append(structlog.processors.format_exc_info)
        # Progress bars (transformers' "Loading weights", hub downloads) are terminal art:
        # in a log of JSON lines they are lines no collector can read. Read at import.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        text_renderer = structlog.processors.JSONRenderer(
            serializer=lambda event, **_: _JSON_ENCODER.encode(event).decode()
        )
        binary = getattr(sys.stderr, "buffer", None)
        if binary is not None:
            renderer = structlog.processors.JSONRenderer(serializer=_json_line)
            factory = structlog.BytesLoggerFactory(file=binary)
        else:  # a text-only stderr (some embedding hosts)
            renderer = text_renderer
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
    _route_stdlib_logging(shared, text_renderer, max(numeric, logging.WARNING))


def _without_request_bytes(record: logging.LogRecord) -> bool:
    """aiohttp's server logs a request it cannot parse with the parser's excerpt of its raw
    bytes: an Authorization line with a tenant's key, an X-Session-Id, a whole prompt after
    a Content-Length that was too short. Any client could write secrets and PII into the log
    that way, unredacted. An aiohttp exception keeps its type and status code, not its text
    (a Redactor pass is not enough: a prompt holds PII no pattern knows)."""
    if record.name.startswith("aiohttp") and record.exc_info and record.exc_info[1] is not None:
        exc = record.exc_info[1]
        code = getattr(exc, "code", None)
        detail = type(exc).__name__ + (f" {code}" if isinstance(code, int) else "")
        record.msg, record.args = f"{record.getMessage()} ({detail})", None
        record.exc_info, record.exc_text = None, None
    return True


def _route_stdlib_logging(
    shared: list[structlog.typing.Processor], renderer: structlog.typing.Processor, level: int
) -> None:
    """Libraries that log through stdlib `logging` (aiohttp, kafka-python, vLLM's client
    side) write the same lines as olp, at WARNING and above: in JSON mode a log collector
    would otherwise get `ERROR:kafka.net.connection:...` text among the JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_without_request_bytes)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level)
