"""The reward trend chart of the operator page: inline SVG drawn on the server.

No chart library and no script: the page keeps a strict Content-Security-Policy and works
in any browser. Every plotted point carries `data-*` attributes so tests (and curious
operators) can read the numbers back from the DOM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from html import escape

WIDTH, HEIGHT = 760, 280
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 40
# Values are plotted within ±this: the widest bounds the learner can clamp a `score` to
# (learner.rewards.feedback.score_min/max). Any tenant may send a score of 1e308, and the
# scale's range overflowed: every dot and the mean line were drawn at NaN, a blank chart.
PLOT_LIMIT = 1e6


@dataclass(frozen=True)
class Point:
    t: float  # unix seconds
    value: float
    label: str  # feedback kind, or adapter version


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Mean of the last `window` values at each position (fewer at the start), each window
    summed anew: a running total lost small values for good once a large one had passed
    through it (0.5s read as 0.0 after a 1e17)."""
    return [
        math.fsum(values[max(0, i + 1 - window) : i + 1]) / min(i + 1, window)
        for i in range(len(values))
    ]


def _plotted(value: float) -> float:
    return min(max(value, -PLOT_LIMIT), PLOT_LIMIT)


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class _Scale:
    def __init__(self, points: Sequence[Point]) -> None:
        ts = [p.t for p in points]
        vs = [p.value for p in points]
        self.t0, self.t1 = min(ts), max(ts)
        if self.t1 - self.t0 < 1e-9:
            self.t0, self.t1 = self.t0 - 1, self.t1 + 1
        margin = (self.t1 - self.t0) * 0.03  # keep the first and last dots off the axes
        self.t0, self.t1 = self.t0 - margin, self.t1 + margin
        self.v0, self.v1 = min(vs), max(vs)
        pad = (self.v1 - self.v0) * 0.08 or 0.5
        self.v0, self.v1 = self.v0 - pad, self.v1 + pad

    def x(self, t: float) -> float:
        return LEFT + (t - self.t0) / (self.t1 - self.t0) * (WIDTH - LEFT - RIGHT)

    def y(self, v: float) -> float:
        return TOP + (self.v1 - v) / (self.v1 - self.v0) * (HEIGHT - TOP - BOTTOM)


def _polyline(scale: _Scale, points: Sequence[tuple[float, float]], cls: str, color: str) -> str:
    coords = " ".join(f"{scale.x(t):.1f},{scale.y(v):.1f}" for t, v in points)
    return (
        f'<polyline class="{cls}" data-points="{len(points)}" points="{coords}" '
        f'fill="none" stroke="{color}" stroke-width="2"/>'
    )


def _axes(scale: _Scale) -> str:
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = [
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}" stroke="#888"/>',
        f'<line x1="{LEFT}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#888"/>',
    ]
    for v in (scale.v0, (scale.v0 + scale.v1) / 2, scale.v1):
        y = scale.y(v)
        parts.append(
            f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">'
            f"{_fmt(v)}</text>"
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{right}" y2="{y:.1f}" stroke="#eee"/>'
        )
    for t, anchor in ((scale.t0, "start"), (scale.t1, "end")):
        parts.append(
            f'<text x="{scale.x(t):.1f}" y="{bottom + 16}" text-anchor="{anchor}" '
            f'font-size="11">{_clock(t)} UTC</text>'
        )
    return "".join(parts)


def reward_chart(
    feedback: Sequence[Point],
    learner: Sequence[Point],
    markers: Sequence[tuple[float, str]],
    window: int = 10,
) -> str:
    """Feedback values (dots) with their rolling mean (line), the learner's reward mean per
    adapter version, and vertical markers where the serving version changed."""
    head = (
        f'<svg id="reward-chart" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'data-feedback-points="{len(feedback)}" data-learner-points="{len(learner)}" '
        f'aria-label="reward trend">'
    )
    # `data-value` and the titles keep the values as sent; positions use `_plotted`.
    finite = [
        Point(p.t, _plotted(p.value), p.label)
        for p in (*feedback, *learner)
        if math.isfinite(p.value)
    ]
    if not finite:
        return (
            f'{head}<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle" '
            'font-size="14">no rewards yet: no numeric feedback received and no adapter '
            "trained</text></svg>"
        )
    scale = _Scale(finite)
    parts = [head, _axes(scale)]
    for t, label in markers:
        if scale.t0 <= t <= scale.t1:
            x = scale.x(t)
            parts.append(
                f'<line class="version-marker" data-version="{escape(label)}" x1="{x:.1f}" '
                f'y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" stroke="#b07" '
                'stroke-dasharray="4 3"/>'
                f'<text x="{x + 3:.1f}" y="{TOP + 10}" font-size="10" fill="#b07">'
                f"{escape(label)}</text>"
            )
    fb = [p for p in feedback if math.isfinite(p.value)]
    if fb:
        means = rolling_mean([_plotted(p.value) for p in fb], window)
        parts.append(
            _polyline(
                scale, [(p.t, m) for p, m in zip(fb, means, strict=True)], "fb-mean", "#1565c0"
            )
        )
    for p in fb:
        parts.append(
            f'<circle class="fb-point" data-value="{_fmt(p.value)}" data-t="{p.t:.3f}" '
            f'cx="{scale.x(p.t):.1f}" cy="{scale.y(_plotted(p.value)):.1f}" r="3" '
            'fill="#90caf9">'
            f"<title>{escape(p.label)} {_fmt(p.value)} at {_clock(p.t)} UTC</title></circle>"
        )
    lp = [p for p in learner if math.isfinite(p.value)]
    if lp:
        plotted = [(p.t, _plotted(p.value)) for p in lp]
        parts.append(_polyline(scale, plotted, "learner-mean", "#2e7d32"))
    for p in lp:
        parts.append(
            f'<circle class="learner-point" data-version="{escape(p.label)}" '
            f'data-value="{_fmt(p.value)}" cx="{scale.x(p.t):.1f}" '
            f'cy="{scale.y(_plotted(p.value)):.1f}" '
            f'r="4" fill="#2e7d32"><title>{escape(p.label)} reward_mean {_fmt(p.value)}'
            "</title></circle>"
        )
    legend_y = HEIGHT - 6
    parts.append(
        f'<text x="{LEFT}" y="{legend_y}" font-size="11" fill="#1565c0">'
        f"● feedback value, — rolling mean of {window}</text>"
        f'<text x="{LEFT + 300}" y="{legend_y}" font-size="11" fill="#2e7d32">'
        "● learner reward_mean per version</text>"
        f'<text x="{LEFT + 540}" y="{legend_y}" font-size="11" fill="#b07">'
        "┆ serving version change</text></svg>"
    )
    return "".join(parts)
