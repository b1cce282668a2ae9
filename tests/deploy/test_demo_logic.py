from __future__ import annotations

import http.server
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.demo import (
    DemoLog,
    DemoSettings,
    Sample,
    _session_loop,
    format_table,
    grade,
    plot,
    run_demo,
    summarise,
)
from tests.http_stub import serving


def test_grade_orders_bare_number_over_leading_number_over_text() -> None:
    bare = grade("42", "stop", 2, 16, expected=42)
    bare_wrong = grade("41", "stop", 2, 16, expected=42)
    leading = grade("42 is the answer", "stop", 5, 16, expected=42)
    text = grade("The answer is 42", "stop", 5, 16, expected=42)
    assert bare > bare_wrong > leading > text >= 0


def test_truncated_digit_runs_earn_nothing() -> None:
    assert grade("1111111111111111", "length", 16, 16, expected=42) == 0.0


def test_shorter_replies_earn_more() -> None:
    assert grade("42", "stop", 2, 16, expected=0) > grade("42", "stop", 8, 16, expected=0)


def test_summary_and_plot(tmp_path: Path) -> None:
    demo = DemoLog()
    demo.add([Sample(1.0, "s", "base", 0.1, False), Sample(2.0, "s", "base", 0.3, False)])
    demo.add([Sample(3.0, "s", "policy-v1", 1.2, True)])
    rows = summarise(demo)
    assert rows == [
        {"version": "base", "samples": 2, "mean_reward": 0.2, "bare_number_rate": 0.0},
        {"version": "policy-v1", "samples": 1, "mean_reward": 1.2, "bare_number_rate": 1.0},
    ]
    assert "policy-v1" in format_table(rows)
    events = [{"event": "gate_result", "at": 2.5, "payload": {"passed": True}}]
    png = plot(demo, events, tmp_path / "reward.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ a misbehaving proxy
class _FakeProxy(http.server.BaseHTTPRequestHandler):
    """Answers chat completions properly (or with `chat` = "html"); feedback per `feedback`."""

    chat = "ok"  # or "html", "odd" (always), "flaky" (every other request)
    feedback = "drop"
    posts = 0
    chats = 0

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path.endswith("/chat/completions"):
            type(self).chats += 1
            if self.chat == "html" or (self.chat == "flaky" and self.chats % 2):
                self._send(200, b"<html>a captive portal</html>", "text/html")
                return
            if self.chat == "odd":  # JSON, but no usable choice
                self._send(200, b'{"choices": [{"index": 0}]}', "application/json")
                return
            n = json.loads(body).get("n", 1)
            cut = self.chat == "cut"  # digits the token limit cut off
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": "4242424242" if cut else "42"},
                    "finish_reason": "length" if cut else "stop",
                }
                for i in range(n)
            ]
            reply = {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": choices,
                "usage": {"prompt_tokens": 30, "completion_tokens": 9, "total_tokens": 39},
            }
            headers = {"x-olp-policy-version": "base"}
            if self.chat != "flaky":
                headers["x-olp-trajectory-id"] = "t-1"
            self._send(200, json.dumps(reply).encode(), "application/json", headers)
            return
        type(self).posts += 1
        if self.feedback == "drop":
            self.close_connection = True  # no status line at all: httpx.RemoteProtocolError
            return
        if self.feedback == "ok":
            self._send(202, b'{"status": "accepted"}', "application/json")
            return
        self._send(500, b'{"error": "broker down"}', "application/json")

    def _send(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_proxy() -> Iterator[tuple[str, type[_FakeProxy]]]:
    handler = type("Handler", (_FakeProxy,), {"posts": 0, "chats": 0})
    with serving(handler) as url:
        yield url, handler


@pytest.mark.parametrize("mode", ["drop", "500"])
def test_failed_feedback_posts_are_counted_not_fatal(
    fake_proxy: tuple[str, type[_FakeProxy]], mode: str, tmp_path: Path
) -> None:
    """A feedback post that errors or is refused used to kill the session's thread; now
    each is counted, the session goes on, and the summary says how many failed."""
    url, handler = fake_proxy
    handler.feedback = mode
    settings = DemoSettings(
        proxy_url=url,
        api_key="k",
        sessions=1,
        samples_per_request=2,
        max_requests=3,
        out_dir=tmp_path,
        max_consecutive_failures=100,
    )
    demo = DemoLog()
    _session_loop(settings, "s0", demo, threading.Event(), random.Random(0))  # no raise
    assert demo.requests == 3 and len(demo.samples) == 6
    assert demo.feedback_failed == 6 == handler.posts and demo.feedback_posted == 0
    assert demo.stopped_because is None


def test_demo_stops_with_a_reason_when_every_post_fails(
    fake_proxy: tuple[str, type[_FakeProxy]], tmp_path: Path
) -> None:
    url, _ = fake_proxy
    settings = DemoSettings(
        proxy_url=url,
        api_key="k",
        sessions=2,
        samples_per_request=2,
        duration_s=60,
        out_dir=tmp_path,
        max_consecutive_failures=3,
    )
    summary = run_demo(settings)
    assert summary["feedback_failed"] >= 3
    assert summary["feedback_posted"] == 0
    assert "failed 3 times in a row" in summary["stopped_because"]
    assert url in summary["stopped_because"]
    assert json.loads((tmp_path / "summary.json").read_text())["feedback_failed"] >= 3


@pytest.mark.parametrize("mode", ["html", "odd"])
def test_a_proxy_answering_something_else_is_a_counted_error(
    fake_proxy: tuple[str, type[_FakeProxy]], tmp_path: Path, mode: str
) -> None:
    url, handler = fake_proxy
    handler.chat = mode
    settings = DemoSettings(
        proxy_url=url, api_key="k", sessions=1, out_dir=tmp_path, max_consecutive_failures=2
    )
    demo = DemoLog()
    stop = threading.Event()
    _session_loop(settings, "s0", demo, stop, random.Random(0))  # no AttributeError
    assert demo.errors == 2 and demo.requests == 0 and stop.is_set()
    assert demo.stopped_because is not None and "not a chat completion" in demo.stopped_because


def test_answered_requests_reset_the_failure_run(
    fake_proxy: tuple[str, type[_FakeProxy]], tmp_path: Path
) -> None:
    """Failures must come in a row to stop the demo: requests answered and graded (here
    without a trajectory id, so nothing to post) in between start the count again."""
    url, handler = fake_proxy
    handler.chat = "flaky"  # every other request fails
    settings = DemoSettings(
        proxy_url=url,
        api_key="k",
        sessions=1,
        samples_per_request=1,
        max_requests=4,
        out_dir=tmp_path,
        max_consecutive_failures=2,
    )
    demo = DemoLog()
    stop = threading.Event()
    stop.wait = lambda timeout=None: stop.is_set()  # type: ignore[method-assign]  # no 2 s pauses
    _session_loop(settings, "s0", demo, stop, random.Random(0))
    assert demo.requests == 4 and demo.errors == 4 and demo.stopped_because is None


def test_several_sessions_never_send_more_than_requests(
    fake_proxy: tuple[str, type[_FakeProxy]], tmp_path: Path
) -> None:
    """Checked after each answer, every session's request in flight went past it:
    `--requests 1` with 4 sessions sent 4."""
    url, handler = fake_proxy
    handler.feedback = "ok"
    settings = DemoSettings(
        proxy_url=url, api_key="k", sessions=4, max_requests=1, out_dir=tmp_path
    )
    summary = run_demo(settings)
    assert handler.chats == 1 and summary["requests"] == 1


def test_a_cut_off_digit_run_is_not_a_bare_number_and_tokens_come_from_usage(
    fake_proxy: tuple[str, type[_FakeProxy]], tmp_path: Path
) -> None:
    """A digit run cut at the token limit is graded 0, yet counted as a bare number (a
    100 % column beside a mean of 0); and the brevity bonus counted words, since the proxy
    strips the token ids it asked for itself: with one choice, the usage counts them."""
    url, handler = fake_proxy
    settings = DemoSettings(
        proxy_url=url,
        api_key="k",
        sessions=1,
        samples_per_request=1,
        max_requests=1,
        out_dir=tmp_path,
    )
    handler.chat, handler.feedback = "cut", "ok"
    demo = DemoLog()
    _session_loop(settings, "s0", demo, threading.Event(), random.Random(0))
    [cut] = demo.samples
    assert cut.reward == 0 and cut.bare_number is False
    handler.chat = "ok"
    demo = DemoLog()
    _session_loop(settings, "s0", demo, threading.Event(), random.Random(0))
    rng = random.Random(0)
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    [ok] = demo.samples
    assert ok.bare_number is True
    assert ok.reward == grade("42", "stop", 9, settings.max_tokens, a + b)


def test_an_unreadable_audit_log_leaves_the_demos_own_figures(tmp_path: Path) -> None:
    from deploy.demo import gate_events
    from safety.audit import AuditLog

    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, fsync=False)
    log.append("olp-learner", "gate_result", {"version": "policy-v1", "passed": True})
    with path.open("ab") as handle:
        handle.write(b"not a record\n")
    events = gate_events(path, since=0.0)
    assert [e["payload"]["version"] for e in events] == ["policy-v1"]
