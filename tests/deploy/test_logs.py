"""What `configure_logging` writes: never a frame's local variables (keys, request bodies)."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.python_run import run_python

# Runs in a subprocess: configure_logging changes structlog's process-wide configuration.
SCRIPT = textwrap.dedent(
    """
    import structlog
    from deploy.logs import configure_logging

    configure_logging(FORMAT)
    log = structlog.get_logger("test")

    def handle(headers):
        api_key = "sk-local-secret-123"
        raise RuntimeError("upstream failed")

    try:
        handle({"authorization": "Bearer sk-header-secret-456"})
    except RuntimeError:
        log.exception("request_failed")
    """
)


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_logged_exceptions_show_no_local_variables(fmt: str) -> None:
    done = run_python("-c", SCRIPT.replace("FORMAT", repr(fmt)))
    assert done.returncode == 0, done.stderr
    assert "request_failed" in done.stderr
    assert "upstream failed" in done.stderr  # the traceback itself is still there
    assert "sk-local-secret-123" not in done.stderr
    assert "sk-header-secret-456" not in done.stderr


LIBRARY_SCRIPT = textwrap.dedent(
    """
    import logging
    import structlog
    from deploy.logs import configure_logging

    configure_logging(FORMAT)
    logging.getLogger("kafka.net.connection").error("Connection lost: %s", "ECONNREFUSED")
    logging.getLogger("aiohttp.access").info("below WARNING: not written")
    structlog.get_logger("olp").warning("olp_line", answer=42)
    """
)


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_library_lines_come_in_olps_format(fmt: str) -> None:
    """kafka-python and aiohttp log through stdlib `logging`; a collector reading olp's JSON
    lines must not get `ERROR:kafka.net.connection:...` text among them."""
    done = run_python("-c", LIBRARY_SCRIPT.replace("FORMAT", repr(fmt)))
    assert done.returncode == 0, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert "below WARNING" not in done.stderr
    if fmt == "json":
        library, own = (json.loads(line) for line in lines)
        assert library["event"] == "Connection lost: ECONNREFUSED"
        assert library["logger"] == "kafka.net.connection"
        assert library["level"] == "error"
        assert own["event"] == "olp_line" and own["answer"] == 42
        assert library.keys() >= {"timestamp"} and own.keys() >= {"timestamp"}
    else:
        assert "Connection lost: ECONNREFUSED" in lines[0]
        assert "kafka.net.connection" in lines[0] and "error" in lines[0]
        assert not lines[0].startswith("ERROR:")  # not stdlib's default format


@pytest.mark.parametrize(("fmt", "bars"), [("console", True), ("json", False)])
def test_progress_bars_only_on_a_console(fmt: str, bars: bool) -> None:
    """transformers' `Loading weights` bar wrote terminal art into the learner's JSON log."""
    script = (
        "from deploy.logs import configure_logging\n"
        f"configure_logging({fmt!r})\n"
        "import transformers.utils.logging as hf_logging\n"
        "print(hf_logging.is_progress_bar_enabled())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    done = run_python("-c", script, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(bars)


REQUEST_SCRIPT = textwrap.dedent(
    """
    import structlog
    from deploy.logs import configure_logging
    from proxy.log_context import bind_request, unbind_request

    configure_logging("json")
    log = structlog.get_logger("olp")
    log.warning("before")
    token = bind_request("req-1", "chat-7")
    log.warning("during")
    log.warning("own_id", request_id="given")
    unbind_request(token)
    log.warning("after")
    """
)


def test_lines_written_while_a_request_is_bound_carry_its_ids() -> None:
    """The proxy binds each request's (logged) request and session id; every line written in
    that context carries them, as configured in every olp process."""
    done = run_python("-c", REQUEST_SCRIPT)
    assert done.returncode == 0, done.stderr
    lines = {e["event"]: e for e in map(json.loads, done.stderr.splitlines())}
    assert "request_id" not in lines["before"] and "request_id" not in lines["after"]
    assert lines["during"]["request_id"] == "req-1"
    assert lines["during"]["session_id"] == "chat-7"
    assert lines["own_id"]["request_id"] == "given"  # a line's own value wins


PARSER_ERROR_SCRIPT = textwrap.dedent(
    """
    import asyncio
    import socket

    from aiohttp import web
    from deploy.logs import configure_logging
    from deploy.ports import free_port

    configure_logging(FORMAT)

    async def main():
        app = web.Application()
        app.router.add_get("/", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        for head in (
            b"Authorization: Bearer sk-abcdefghijklmnopqrstuvwxyz123456\\x01",
            b"X-Session-Id: alice@example.com\\x7f\\x01",
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\\r\\nHost: x\\r\\n" + head + b"\\r\\n\\r\\n")
            await writer.drain()
            await reader.read()
            writer.close()
        await runner.cleanup()

    asyncio.run(main())
    """
)


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_a_request_the_server_cannot_parse_is_logged_without_its_bytes(fmt: str) -> None:
    """aiohttp's server logged the parser's excerpt of the raw request: a tenant's key or a
    session id (an e-mail) from a header with a stray control byte, which any client could
    send, went to the log unredacted."""
    done = run_python("-c", PARSER_ERROR_SCRIPT.replace("FORMAT", repr(fmt)))
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("BadHttpMessage 400") == 2, done.stderr
    assert "sk-abcdefghijklmnopqrstuvwxyz123456" not in done.stderr
    assert "alice@example.com" not in done.stderr
