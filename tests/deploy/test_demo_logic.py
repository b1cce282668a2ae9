from pathlib import Path

from deploy.demo import DemoLog, Sample, format_table, grade, plot, summarise


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
