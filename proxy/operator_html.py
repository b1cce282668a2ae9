"""HTML of the operator page, rendered on the server with every value escaped.

Plain string building with `html.escape` keeps the page dependency-free and makes the
escaping visible at each interpolation (`_e`). The only style block carries a per-response
nonce, so the Content-Security-Policy allows no inline script and no other style.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Any
from urllib.parse import urlencode

import structlog

from proxy.operator_chart import Point, reward_chart
from proxy.operator_data import AuditPage, Loaded
from safety.audit import VerifyResult, format_record

log = structlog.get_logger(__name__)

HISTORY_ROWS = 50

_STYLE = """
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { margin: 0 0 .2em; } h2 { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: .4em 0; }
td, th { border: 1px solid #ddd; padding: .2em .5em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } code, .mono { font-family: ui-monospace, monospace; }
.pass { color: #1b5e20; font-weight: bold; } .fail, .error { color: #b71c1c; font-weight: bold; }
.ok { color: #1b5e20; font-weight: bold; } .muted { color: #777; }
.banner { padding: .6em 1em; border: 1px solid #ccc; background: #fafafa; margin: 1em 0; }
form.inline { display: inline; } input, select, button { font: inherit; }
"""


def _e(value: Any) -> str:
    """Escape anything for HTML text and attribute values."""
    return escape("" if value is None else str(value), quote=True)


def _when(t: Any) -> str:
    if _plottable(t):
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return _e(t)


# Timestamps a clock can show (years 1970-9999): files the learner wrote may hold anything,
# and one NaN or 1e300 must not take the whole page down.
_LATEST_TIMESTAMP = 253402300799.0


def _plottable(t: Any) -> bool:
    return (
        isinstance(t, int | float)
        and not isinstance(t, bool)
        and math.isfinite(t)
        and 0 <= t <= _LATEST_TIMESTAMP
    )


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _e(value)
    return _e(f"{value:.4g}")


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], cls: str = "") -> str:
    """A table; cells are already-escaped HTML."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    attr = f' class="{cls}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _errors(errors: Iterable[str]) -> str:
    return "".join(f'<p class="error">{_e(err)}</p>' for err in errors)


def document(title: str, body: str, nonce: str) -> str:
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f'<title>{_e(title)}</title><style nonce="{_e(nonce)}">{_STYLE}</style></head>'
        f"<body>{body}</body></html>"
    )


def login_page(message: str, nonce: str) -> str:
    """The refusal: a sign-in form and nothing else from the proxy's state."""
    body = (
        '<h1>olp operator</h1><div class="banner" id="refused">'
        f'<p class="error">{_e(message)}</p>'
        "<p>Sign in with the admin key, or open a one-time link from "
        "<code>POST /admin/ui/link</code> (Bearer admin key).</p></div>"
        '<form method="post" action="/admin/ui/login" id="login">'
        '<label>Admin key <input type="password" name="key" autocomplete="off" '
        'required size="40"></label> '
        '<label>Actor <input name="actor" value="operator" size="16"></label> '
        '<button type="submit">Sign in</button></form>'
    )
    return document("olp operator: sign in", body, nonce)


def confirm_link_page(actor: str, token: str, nonce: str) -> str:
    """A one-time link opened by something other than a browser's own navigation (a chat's
    link preview, a mail scanner): one button, so that only a person spends the link."""
    body = (
        '<h1>olp operator</h1><div class="banner" id="confirm">'
        f"<p>Sign in to the operator page as <strong>{_e(actor)}</strong>?</p></div>"
        '<form method="post" action="/admin/ui/login/link" id="confirm-login">'
        f'<input type="hidden" name="token" value="{_e(token)}">'
        '<button type="submit">Sign in</button></form>'
    )
    return document("olp operator: confirm sign-in", body, nonce)


@dataclass
class StreamView:
    sink_kind: str
    metrics: dict[str, dict[str, float]] | None
    lag: list[dict[str, Any]] | None = None
    lag_error: str | None = None
    consumed_from: str | None = None
    other_stream: str | None = None  # the stream `consumed_from` was trained on, not this one


@dataclass
class PageData:
    status: dict[str, Any]
    gates: Loaded
    adapters: Loaded
    feedback: list[Point]
    stream: StreamView
    audit: AuditPage | None
    audit_error: str | None
    audit_event: str | None
    audit_page: int
    audit_size: int
    actor: str
    csrf: str | None
    verify: VerifyResult | None = None
    verify_error: str | None = None
    errors: list[str] = field(default_factory=list)


def _serving(status: dict[str, Any]) -> str:
    frozen = "yes" if status.get("frozen") else "no"
    learning = "yes" if status.get("learning_frozen") else "no"
    canaries = status.get("canaries") or {}

    def canary(alias: str) -> str:
        running = canaries.get(alias)
        if not isinstance(running, dict):
            return '<span class="muted">none</span>'
        return (
            f"<code>{_e(running.get('target'))}</code> for "
            f"{_e(running.get('share'))} of training traffic "
            f"since {_when(running.get('started_at'))}"
        )

    aliases = _table(
        ("alias", "target", "canary"),
        (
            (f"<code>{_e(a)}</code>", f"<code>{_e(t)}</code>", canary(a))
            for a, t in sorted(status.get("aliases", {}).items())
        ),
    )
    history = list(reversed(status.get("history") or []))[:HISTORY_ROWS]
    known = {"kind", "actor", "at", "alias", "target", "previous"}
    rows = (
        (
            _when(h.get("at")),
            _e(h.get("kind")),
            _e(h.get("actor")),
            _e(h.get("alias")),
            f"<code>{_e(h.get('target'))}</code>",
            f"<code>{_e(h.get('previous'))}</code>",
            _e(json.dumps({k: v for k, v in h.items() if k not in known}, sort_keys=True)),
        )
        for h in history
        if isinstance(h, dict)
    )
    return (
        '<h2 id="serving">Serving</h2>'
        f"<p>Serving version of <code>{_e(status.get('policy_alias'))}</code>: "
        f'<strong id="serving-version">{_e(status.get("serving_version"))}</strong> · '
        f"serving frozen: <strong>{frozen}</strong> · learning frozen: "
        f"<strong>{learning}</strong> · upstreams: "
        f"{_e(', '.join(status.get('upstreams') or []))}</p>"
        f"{aliases}<h3>Alias and promotion history (newest first)</h3>"
        + (
            _table(("at", "kind", "actor", "alias", "target", "previous", "details"), rows)
            if history
            else '<p class="muted">no alias changes yet</p>'
        )
    )


def _tenants(status: dict[str, Any]) -> str:
    rows = (
        (
            _e(t.get("name")),
            '<span class="ok">on</span>' if t.get("training_enabled") else "off",
            # Why it trains (or not): a run-time switch overrides the config, as `olp
            # status` says; the page showed both alike.
            "config" if t.get("training_switch") is None else "run time",
            _e(t.get("in_flight")),
        )
        for t in status.get("tenants") or []
    )
    return '<h2 id="tenants">Tenants</h2>' + _table(
        ("tenant", "training", "set by", "in flight"), rows
    )


def _verdict(passed: Any) -> str:
    return '<span class="pass">pass</span>' if passed else '<span class="fail">fail</span>'


def _reason(details: Any) -> Any:
    """A gate result's reason; a report from elsewhere may hold details of any shape."""
    return details.get("reason", "") if isinstance(details, dict) else ""


def _gates(gates: Loaded) -> str:
    parts = ['<h2 id="gates">Recent gate results (newest first)</h2>', _errors(gates.errors)]
    if not gates.items and not gates.errors:
        parts.append('<p class="muted">no gate reports yet (<code>gates/*.json</code>)</p>')
    for report in gates.items:
        results = report.get("results")
        if results is not None and not isinstance(results, list):
            name = report.get("file")
            parts.append(_errors([f"{name}: 'results' is not a list: {_shape(results)}"]))
            results = []
        results = [r for r in results or [] if isinstance(r, dict)]
        rows = (
            (
                _e(r.get("name")),
                _num(r.get("metric")),
                _e(r.get("comparison", "")),
                _num(r.get("threshold")),
                _verdict(r.get("verdict") == "pass"),
                _e(_reason(r.get("details"))),
            )
            for r in results
        )
        parts.append(
            f'<h3 class="gate-report">{_e(report.get("candidate") or report.get("file"))} '
            f"vs {_e(report.get('incumbent'))}: {_verdict(report.get('passed'))}</h3>"
            f'<p class="muted">{_when(report.get("started_at"))}, '
            f"{_num(report.get('duration_s'))} s</p>"
            + _table(("gate", "metric", "", "threshold", "verdict", "reason"), rows)
        )
    return "".join(parts)


def _shape(value: Any) -> str:
    """What a value of the wrong shape is, for an error line (never the value itself)."""
    return type(value).__name__


def _step_metrics(meta: dict[str, Any]) -> dict[str, Any]:
    """An adapter's `step_metrics`, or {} when absent or not an object."""
    metrics = meta.get("step_metrics")
    return metrics if isinstance(metrics, dict) else {}


def _chart(data: PageData) -> str:
    adapters = data.adapters.items
    odd = [
        f"{m['name']}: 'step_metrics' is not an object: {_shape(m['step_metrics'])}"
        for m in adapters
        if m.get("step_metrics") is not None and not isinstance(m["step_metrics"], dict)
    ]
    learner = [
        Point(float(m["created_at"]), float(_step_metrics(m)["reward_mean"]), m["name"])
        for m in adapters
        if _finite(_step_metrics(m).get("reward_mean")) and _plottable(m.get("created_at"))
    ]
    policy = data.status.get("policy_alias")
    markers = [
        (float(h["at"]), str(h.get("target")))
        for h in data.status.get("history") or []
        if isinstance(h, dict) and h.get("alias") == policy and _plottable(h.get("at"))
    ]
    rows = (
        (
            _e(m["name"]),
            _e(m.get("parent_version")),
            _when(m.get("created_at")),
            _num(_step_metrics(m).get("reward_mean")),
            _num(_step_metrics(m).get("kl")),
            _num(_step_metrics(m).get("samples")),
        )
        for m in reversed(adapters)
    )
    return (
        '<h2 id="rewards">Reward trend</h2>'
        f"<p>{len(data.feedback)} feedback scores received by this proxy since it "
        f"started; {len(learner)} adapter versions with a reward mean.</p>"
        + reward_chart(data.feedback, learner, markers)
        + _errors([*data.adapters.errors, *odd])
        + (
            _table(("adapter", "parent", "created", "reward_mean", "kl", "samples"), rows)
            if adapters
            else ""
        )
    )


def _stream(stream: StreamView) -> str:
    parts = ['<h2 id="stream">Stream</h2>', f"<p>Sink: <code>{_e(stream.sink_kind)}</code></p>"]
    if stream.metrics is None:
        parts.append('<p class="muted">metrics unavailable: this sink is not a KafkaSink</p>')
    else:
        rows = []
        for name, values in stream.metrics.items():
            total = sum(values.values())
            detail = ", ".join(f"{k or 'all'}: {_num(v)}" for k, v in sorted(values.items()))
            rows.append((_e(name), _num(total), _e(detail)))
        parts.append(_table(("metric", "total", "by label"), rows, cls="stream-metrics"))
    parts.append("<h3>Learner lag</h3>")
    if stream.lag_error is not None:
        reason = _e(stream.lag_error)
        parts.append(f'<p class="error" id="lag-unavailable">unavailable: {reason}</p>')
    elif stream.lag is not None:
        source = stream.consumed_from or "no adapter yet"
        if stream.other_stream is not None:
            parts.append(
                f'<p class="muted" id="lag-other-stream">{_e(source)} was trained on another '
                f"stream ({_e(stream.other_stream)}): no record of this one is in a version "
                "yet</p>"
            )
        else:
            parts.append(f'<p class="muted">learner offsets from {_e(source)}</p>')
        parts.append(
            _table(
                ("topic", "partition", "end offset", "learner offset", "lag"),
                (
                    (
                        _e(r["topic"]),
                        _e(r["partition"]),
                        _e(r["end"]),
                        _e("—" if r["consumed"] is None else r["consumed"]),
                        _e(r["lag"]),
                    )
                    for r in stream.lag
                ),
                cls="lag",
            )
        )
    return "".join(parts)


def _audit_link(event: str | None, page: int, size: int) -> str:
    query = {"page": page, "size": size, **({"event": event} if event else {})}
    return "/admin/ui?" + urlencode(query) + "#audit"


def _audit(data: PageData) -> str:
    parts = ['<h2 id="audit">Audit log</h2>']
    if data.csrf is not None:
        parts.append(
            '<form method="post" action="/admin/ui/verify" class="inline" id="verify-form">'
            f'<input type="hidden" name="csrf" value="{_e(data.csrf)}">'
            '<button type="submit">Verify chain</button></form> '
        )
    if data.verify_error is not None:
        reason = _e(data.verify_error)
        parts.append(f'<p class="error" id="verify-result">verify failed: {reason}</p>')
    elif data.verify is not None:
        v = data.verify
        if v.empty:
            # As `olp audit verify` (exit 2): an empty chain proves nothing, and the page's
            # own sign-in was audited, so a log found empty here was emptied.
            parts.append(
                '<p class="fail" id="verify-result" data-ok="false" data-empty="true">'
                f"Nothing to verify: {_e(v.reason)}</p>"
            )
        elif v.ok:
            parts.append(
                f'<p class="ok" id="verify-result" data-ok="true">Chain OK: {v.records} records '
                f"verified. {_e(v.reason)}</p>"
            )
        else:
            parts.append(
                f'<p class="fail" id="verify-result" data-ok="false" '
                f'data-first-bad-seq="{_e(v.first_bad_seq)}">Chain BROKEN at seq '
                f"{_e(v.first_bad_seq)}: {_e(v.reason)}</p>"
            )
    if data.audit_error is not None:
        parts.append(f'<p class="error">audit log unreadable: {_e(data.audit_error)}</p>')
        return "".join(parts)
    page = data.audit
    assert page is not None
    options = "".join(
        f'<option value="{_e(ev)}"{" selected" if ev == data.audit_event else ""}>{_e(ev)}</option>'
        for ev in page.events
    )
    parts.append(
        '<form method="get" action="/admin/ui" class="inline" id="audit-filter">'
        f'<label>Event <select name="event"><option value="">(all)</option>{options}'
        f'</select></label> <input type="hidden" name="size" value="{data.audit_size}">'
        '<button type="submit">Filter</button></form>'
        f'<p class="muted">{page.total} records in the log; page {data.audit_page + 1}</p>'
    )
    rows = (
        (_e(r.get("seq")), _e(r.get("event")), f'<span class="mono">{_e(format_record(r))}</span>')
        for r in page.records
    )
    parts.append(_table(("seq", "event", "record"), rows, cls="audit-records"))
    nav = []
    if data.audit_page > 0:
        prev = _audit_link(data.audit_event, data.audit_page - 1, data.audit_size)
        nav.append(f'<a href="{_e(prev)}">newer</a>')
    if page.has_more:
        nxt = _audit_link(data.audit_event, data.audit_page + 1, data.audit_size)
        nav.append(f'<a href="{_e(nxt)}" id="audit-older">older</a>')
    parts.append("<p>" + " · ".join(nav) + "</p>")
    return "".join(parts)


def operator_page(data: PageData, nonce: str) -> str:
    signed = f"signed in as <strong>{_e(data.actor)}</strong>"
    logout = (
        '<form method="post" action="/admin/ui/logout" class="inline">'
        f'<input type="hidden" name="csrf" value="{_e(data.csrf)}">'
        '<button type="submit">Sign out</button></form>'
        if data.csrf is not None
        else ""
    )
    body = (
        f'<h1>olp operator</h1><div class="muted">{signed} · '
        f"rendered {_when(datetime.now(UTC).timestamp())} {logout}</div>"
        + _errors(data.errors)
        + _section("serving", _serving, data.status)
        + _section("tenants", _tenants, data.status)
        + _section("gates", _gates, data.gates)
        + _section("rewards", _chart, data)
        + _section("stream", _stream, data.stream)
        + _section("audit", _audit, data)
    )
    return document("olp operator", body, nonce)


def _section(anchor: str, render: Callable[[Any], str], source: Any) -> str:
    """One section of the page, or, when something it shows has a shape it does not expect
    (the learner's files may hold anything), its error in its place: never a 500 for the
    whole page."""
    try:
        return render(source)
    except Exception as exc:
        log.exception("operator_section_failed", section=anchor)
        return (
            f'<h2 id="{_e(anchor)}">{_e(anchor.capitalize())}</h2>'
            f'<p class="error">this section could not be shown: {_e(type(exc).__name__)}: '
            f"{_e(exc)}</p>"
        )
