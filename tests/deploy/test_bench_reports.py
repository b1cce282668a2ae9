"""The benchmarks' report logic (the benchmarks themselves do not run in CI): how ratios
are taken from alternating rounds, and how a rerun writes its page."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_capture_cpu  # noqa: E402
import bench_proxy  # noqa: E402
from generated_block import markers, without_markers, write_generated  # noqa: E402


def test_a_ratio_target_reads_the_rounds_own_ratios() -> None:
    """Each round runs its targets seconds apart; the ratio of two medians took them from
    different rounds (the page's added p50 1.61 against a median of the rounds' own 1.44)."""
    olp = [3.0, 1.0, 2.0]
    floor = [2.0, 0.5, 1.6]  # round by round: 1.5, 2.0, 1.25
    assert bench_proxy.median_ratio(olp, floor) == pytest.approx(1.5)
    assert bench_proxy.median_ratio([1.0, 2.0], [0.0, -1.0]) is None
    assert bench_proxy.shown(1.10009) == "1.100" and bench_proxy.shown(1.1004) == "1.100"
    assert bench_proxy.shown(1.1006) == "1.101"  # at 2 decimals it read 1.10: met
    assert bench_proxy.ratio(1.0, -0.04) == "n/a" and bench_proxy.ratio(1.0, 0.0) == "n/a"


def _segments(loops: list[float], workers: list[float]) -> list:
    """Alternating off/on segments of 100 requests each, the sink threads idle."""
    return [
        bench_capture_cpu.Segment("off" if i % 2 == 0 else "on", 100, loop, 0.0, worker)
        for i, (loop, worker) in enumerate(zip(loops, workers, strict=True))
    ]


def test_segments_charge_the_loop_to_their_side_and_the_sink_threads_to_training_on() -> None:
    segments = _segments([0.040, 0.044] * 4, [0.0] * 8)
    segments[1].sink_threads_s = 0.004  # the feeder works for captures only
    figures = bench_capture_cpu.summarize(segments)
    assert figures["off_ms"] == pytest.approx(0.4)
    assert figures["on_ms"] == pytest.approx((4 * 0.044 + 0.004) / 400 * 1e3)
    assert figures["ratio"] == pytest.approx(0.180 / 0.160)
    assert figures["burst_share"] == 0
    assert figures["charged_ratio"] == pytest.approx(figures["ratio"])  # no burst: no move


def test_a_bursts_excess_in_an_off_segment_is_charged_to_training_on() -> None:
    """Segment 4 (off) ran while the worker burst: 20 % more loop CPU per request than its
    quiet off neighbours (segments 0, 2, 6, 8). The charged ratio moves that excess to on."""
    loops = [0.040, 0.044, 0.040, 0.044, 0.048, 0.044, 0.040, 0.044, 0.040, 0.044]
    workers = [0.0] * 10
    workers[4] = 0.1
    segments = _segments(loops, workers)
    excess = bench_capture_cpu.burst_excess(segments)
    assert excess[4] == pytest.approx(1.2)
    assert [e for i, e in enumerate(excess) if i != 4] == [None] * 9
    figures = bench_capture_cpu.summarize(segments)
    assert figures["burst_share"] == pytest.approx(0.1)
    assert figures["burst_off"] == pytest.approx(1.2)
    off_plain = (4 * 0.040 + 0.048) / 500
    assert figures["ratio"] == pytest.approx(0.044 / 100 / off_plain)
    moved = 0.048 - 0.040
    charged = ((5 * 0.044 + moved) / 500) / ((4 * 0.040 + 0.048 - moved) / 500)
    assert figures["charged_ratio"] == pytest.approx(charged)


def test_a_rerun_replaces_its_tables_and_keeps_the_readings(tmp_path: Path) -> None:
    """Written whole, a rerun dropped the readings below the tables (832 of 975 lines)."""
    page = tmp_path / "perf" / "proxy.md"
    write_generated(page, "## Tables\n\n| a |\n", "bench_proxy.py")
    with page.open("a") as handle:
        handle.write("\n### Reading this run\n\nwritten by hand\n")
    write_generated(page, "## Tables\n\n| b |\n", "bench_proxy.py")
    text = page.read_text()
    begin, end = markers("bench_proxy.py")
    assert text.count(begin) == 1 and text.count(end) == 1
    assert "| b |" in text and "| a |" not in text
    assert text.endswith("### Reading this run\n\nwritten by hand\n")
    assert without_markers(text).startswith("## Tables\n\n| b |\n\n### Reading")
    # A page from before the markers keeps its text below the new block.
    old = tmp_path / "old.md"
    old.write_text("an older page\n")
    write_generated(old, "new tables\n", "bench_swap.py")
    assert old.read_text().endswith("\nan older page\n")


def test_the_performance_page_is_the_perf_pages_without_their_markers() -> None:
    page = (BENCH.parent / "docs" / "performance.md").read_text()
    assert "<!--" not in page
    assert "## Proxy overhead (bench/bench_proxy.py)" in page


def test_the_proxy_bench_reports_skipped_captures_apart_from_lost_records() -> None:
    """A proxy that paused capture at its sink's backlog limit served those requests without
    a record: the arrival line says so, with the count read from the proxy's /metrics."""
    import http.server
    import threading

    metrics = (
        b"# HELP olp_proxy_captures_skipped_total Requests not captured.\n"
        b"# TYPE olp_proxy_captures_skipped_total counter\n"
        b'olp_proxy_captures_skipped_total{reason="backlog",tenant="on"} 12.0\n'
        b'olp_proxy_captures_skipped_total{reason="too_large",tenant="on"} 3.0\n'
        b'olp_proxy_captures_skipped_created{reason="backlog",tenant="on"} 1.7e+09\n'
    )

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(metrics)))
            self.end_headers()
            self.wfile.write(metrics)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert bench_proxy.captures_skipped(f"http://127.0.0.1:{server.server_port}") == 15
    finally:
        server.shutdown()
        thread.join()
    assert bench_proxy._skipped_note(100, 100, 0) == ""
    note = bench_proxy._skipped_note(85, 100, 15)
    assert "15 of those requests were served without a capture" in note
    assert note.endswith("the records of 85 of 85 captured requests arrived")


def test_one_percentile_for_every_bench() -> None:
    """Two definitions, one of them a rank high at multiples of 100 (the maximum at 100)."""
    from percentile import nearest_rank

    assert nearest_rank(list(range(1, 101)), 0.99) == 99
    assert nearest_rank(list(range(1, 401)), 0.99) == 396
    assert nearest_rank(list(range(1, 11)), 0.5) == 5
    assert nearest_rank([7.0], 0.99) == 7.0


def test_the_sustained_rounds_settle_on_the_sinks_backlog_not_a_still_count() -> None:
    """The count of sent records held still for 0.3 s while the busy worker (it reports once
    a second) still had older records to send: they counted towards the next round, whose
    catch-up read short."""
    import http.server
    import threading

    reads = {"n": 0}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            reads["n"] += 1
            backlog = 5000 if reads["n"] < 6 else 0  # the worker still sending at first
            body = (
                f'olp_stream_sent_total{{kind="trajectory"}} 100.0\n'
                f"olp_stream_queue_depth {backlog}.0\n"
            ).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert bench_proxy.settled_sent_trajectories(url) == 100.0
        assert reads["n"] >= 6  # it waited for the backlog, not only for a still count
    finally:
        server.shutdown()
        thread.join()
