"""The operator page under /admin/ui: server-rendered HTML, admin key or session cookie only.

Routes:
- `GET /admin/ui` the page (query: `event`, `page`, `size` page the audit log);
- `POST /admin/ui/link` (Bearer admin key) → `{url, path, expires_in_s}`, a one-time login link;
- `GET /admin/ui/login?token=` (no HEAD) trades that link for an HttpOnly SameSite=Strict cookie
  when a browser navigates to it; anything else (a link preview) gets a confirmation page,
  whose button is `POST /admin/ui/login/link` (form: `token`);
- `POST /admin/ui/login` (form: `key`, `actor`) the same with the key typed into the page;
- `POST /admin/ui/verify` (session + CSRF token, or Bearer) verifies the audit chain;
- `POST /admin/ui/logout`.
Without a session or key every page answers 401 with a sign-in form and no data.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
import urllib.parse
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from proxy.admin import _authorize, _status_payload, state_dir_of
from proxy.context import CONTEXT, ProxyContext
from proxy.expect_continue import defer_continue, send_continue
from proxy.operator_auth import (
    ACTOR_RULE,
    COOKIE_NAME,
    COOKIE_PATH,
    SessionStore,
    clean_actor,
    header_actor,
    key_matches,
)
from proxy.operator_chart import Point
from proxy.operator_data import (
    Loaded,
    consumer_lag,
    read_adapter_metas,
    read_audit_page,
    read_gate_reports,
    sink_metrics,
    topic_end_offsets,
)
from proxy.operator_html import (
    PageData,
    StreamView,
    confirm_link_page,
    login_page,
    operator_page,
)
from safety.audit import AuditError, AuditRecordWritten, VerifyResult

log = structlog.get_logger(__name__)

FEEDBACK_SERIES_MAX = 2000
KAFKA_TIMEOUT_S = 2.0
AUDIT_PAGE_SIZE = 50
AUDIT_PAGE_SIZE_MAX = 500
# Beyond any log (10^12 pages of one record): every page of a real one can be asked for.
MAX_AUDIT_PAGE = 10**12
# The page's forms hold a key, an actor and a CSRF token. The sign-in form is read before
# any key is checked, so it must not be buffered up to `max_body_bytes` for anyone.
MAX_FORM_BYTES = 16 * 1024


@dataclass
class OperatorState:
    """In-memory state of the page on one proxy: sessions and the feedback value series."""

    sessions: SessionStore = field(default_factory=SessionStore)
    feedback: deque[Point] = field(default_factory=lambda: deque(maxlen=FEEDBACK_SERIES_MAX))


OPERATOR = web.AppKey("olp_operator_page", OperatorState)


def record_feedback(app: web.Application, kind: str, value: float | None) -> None:
    """Called by POST /v1/feedback for each recorded event: keep `score` values for the
    chart. Only a score's value is a reward: a `value` sent with another kind is ignored by
    the learner (a `thumbs_down` with `value: 1` was plotted as +1, where it counts -0.5)."""
    state = app.get(OPERATOR)
    if state is not None and value is not None and kind == "score":
        state.feedback.append(Point(time.time(), float(value), kind))


# ---------------------------------------------------------------------------- responses

_NONCE_BYTES = 16


def _html(
    body_for_nonce: Any, status: int = 200, referrer_policy: str = "no-referrer"
) -> web.Response:
    """An HTML response with a strict CSP: no script at all, one nonce'd style block."""
    nonce = secrets.token_urlsafe(_NONCE_BYTES)
    response = web.Response(text=body_for_nonce(nonce), status=status, content_type="text/html")
    response.headers.update(
        {
            "Content-Security-Policy": (
                f"default-src 'none'; style-src 'nonce-{nonce}'; img-src 'self' data:; "
                "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
            ),
            "Cache-Control": "no-store",
            "Referrer-Policy": referrer_policy,
            "X-Content-Type-Options": "nosniff",
            "X-Frame-Options": "DENY",
        }
    )
    return response


def _refused(message: str, status: int = 401) -> web.Response:
    # The sign-in form's page: `same-origin`, so that the browser posts the form with its
    # real `Origin`. Under `no-referrer` it sent `Origin: null`, which `_cross_site` must
    # read as another site (sandboxed frames send it), and over plain HTTP to another host
    # (no Fetch Metadata) every sign-in was refused as cross-site. Other sites still get no
    # referrer.
    response = _html(lambda nonce: login_page(message, nonce), status, "same-origin")
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="olp-admin"'
    return response


def _https(request: web.Request) -> bool:
    """Whether the browser talks HTTPS: directly, or to a reverse proxy that ends TLS and
    says so in `X-Forwarded-Proto`. Trusting the header is safe here: it only adds
    `Secure`, and a client that spoofs it restricts nothing but its own cookie."""
    forwarded = request.headers.get("X-Forwarded-Proto", "")
    return request.secure or forwarded.split(",")[0].strip().lower() == "https"


# A sign-in is recorded in the audit log before its session opens; one the log cannot
# record is refused, on a page that says why (it was the middleware's JSON 500).
_AUDIT_BROKEN = (
    "Sign-in is refused: the audit log cannot record it ({error}). Run `olp audit verify` "
    "on the proxy's machine and repair the log; the admin API still takes the admin key "
    "as a Bearer token."
)


async def _recorded_session(
    ctx: ProxyContext, sessions: Any, actor: str, method: str, remote: str
) -> str | None:
    """Record the sign-in, then open its session; None when the audit log refused it. The
    append runs in a worker thread: it waits on the log's file lock and fsyncs, and all
    traffic waited with it on the event loop."""
    try:
        await asyncio.to_thread(
            ctx.audit.append, actor, "operator_login", {"method": method, "remote": remote}
        )
    except AuditRecordWritten:
        pass  # its line is in the chain: the sign-in it records stands
    except (AuditError, OSError) as exc:
        log.error(
            "operator_login_not_audited",
            actor=ctx.audit.actor_label(actor),  # as the audit log names actors: no e-mail
            method=method,
            error=str(exc),
        )
        raise _Refusal(_AUDIT_BROKEN.format(error=exc), 503) from exc
    session_id, _ = sessions.open_session(actor)
    return session_id


async def _redirect_with_session(request: web.Request, actor: str, method: str) -> web.Response:
    ctx = request.app[CONTEXT]
    remote = ctx.client_addresses.of(request)
    # Run to its end when the browser leaves (aiohttp cancels its handler): cancelled between
    # the record and the session, the log said `operator_login` with no session, and a
    # sign-in link was spent on nothing.
    signing_in = asyncio.ensure_future(
        _recorded_session(ctx, request.app[OPERATOR].sessions, actor, method, remote)
    )
    try:
        session_id = await asyncio.shield(signing_in)
    except asyncio.CancelledError:
        signing_in.add_done_callback(_retrieve)
        raise
    except _Refusal as refusal:
        return _refused(str(refusal), refusal.status)
    response = web.Response(status=303, headers={"Location": COOKIE_PATH})
    response.set_cookie(
        COOKIE_NAME,
        session_id,
        path=COOKIE_PATH,
        httponly=True,
        samesite="Strict",
        secure=_https(request),
        max_age=int(request.app[OPERATOR].sessions.session_ttl_s),
    )
    response.headers["Cache-Control"] = "no-store"
    response.headers["Referrer-Policy"] = "no-referrer"
    return response


def _retrieve(signing_in: asyncio.Future[str]) -> None:
    """Its outcome, once nobody waits for it (else asyncio logs it as never retrieved)."""
    if not signing_in.cancelled() and (error := signing_in.exception()) is not None:
        log.warning("operator_login_after_the_browser_left", error=str(error))


# ------------------------------------------------------------------------------- viewer


@dataclass
class Viewer:
    actor: str
    csrf: str | None  # None for Bearer callers (a browser cannot forge their header)


class _Refusal(Exception):
    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _viewer(request: web.Request) -> Viewer:
    """Who is looking: a Bearer admin key, else a valid session cookie; else _Refusal."""
    ctx = request.app[CONTEXT]
    if not ctx.admin_key_hashes:
        raise _Refusal("The admin API is disabled: no proxy.admin_key_sha256 configured.", 403)
    scheme, _, key = (request.headers.get("Authorization") or "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        if not key_matches(ctx.admin_key_hashes, key):
            # An HTML refusal, not an AuthError: counted here for the throttle.
            ctx.auth_throttle.failed_request(request, "admin")
            raise _Refusal("This key may not use the admin API.", 403)
        actor = header_actor(request.headers.get("X-OLP-Actor"))
        if actor is None:
            raise _Refusal(f"X-OLP-Actor must be {ACTOR_RULE}.", 400)
        return Viewer(actor, None)
    session = request.app[OPERATOR].sessions.get(request.cookies.get(COOKIE_NAME))
    if session is None:
        raise _Refusal("Sign-in required: no valid operator session.", 401)
    return Viewer(session.actor, session.csrf)


# --------------------------------------------------------------------------------- data


def _read_files(ctx: ProxyContext, event: str | None, page: int, size: int) -> dict[str, Any]:
    """Runs in a worker thread: everything the page reads from disk."""
    state_dir = state_dir_of(ctx)
    out: dict[str, Any] = {
        "gates": read_gate_reports(state_dir),
        "adapters": read_adapter_metas(state_dir),
        "audit": None,
        "audit_error": None,
    }
    try:
        out["audit"] = read_audit_page(Path(ctx.audit.path), event, page, size)
    except Exception as exc:  # shown on the page: a damaged log must not hide the rest
        log.exception("operator_audit_unreadable")
        out["audit_error"] = f"{type(exc).__name__}: {exc}"
    return out


async def _stream_view(ctx: ProxyContext, adapters: Loaded) -> StreamView:
    sink = ctx.sink
    view = StreamView(type(sink).__name__, sink_metrics(sink))
    config, topics = getattr(sink, "config", None), getattr(sink, "topics", None)
    if view.metrics is None or config is None or topics is None:
        view.lag_error = f"the proxy's sink ({view.sink_kind}) does not write to Kafka"
        return view
    newest = adapters.items[-1] if adapters.items else None
    view.consumed_from = newest["name"] if newest else None
    names = [topics.trajectories, topics.feedback]
    try:
        ends = await asyncio.wait_for(
            asyncio.to_thread(topic_end_offsets, config.bootstrap_servers, names, KAFKA_TIMEOUT_S),
            KAFKA_TIMEOUT_S + 1.0,
        )
    except Exception as exc:  # the broker may be down: say so on the page
        log.warning("operator_kafka_unavailable", error=repr(exc))
        view.lag_error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return view
    consumed = (newest or {}).get("consumed_offsets")
    if (
        newest is not None
        and ctx.stream_id is not None
        and newest.get("stream_id") != ctx.stream_id
    ):
        # Offsets of an earlier stream (`olp up` starts a new one with its embedded broker):
        # against this one's ends they read as a lag of 0 until the next version.
        view.other_stream = str(newest.get("stream_id") or "unnamed")
        consumed = None
    try:
        view.lag = consumer_lag(ends, consumed)
    except ValueError as exc:  # the learner's file: name it, as the other sections do
        view.lag_error = f"{view.consumed_from}/olp_meta.json: {exc}"
    return view


def _int_query(request: web.Request, name: str, default: int, high: int) -> int:
    try:
        return min(max(int(request.query.get(name, default)), 0), high)
    except ValueError:
        return default


async def _page_data(request: web.Request, viewer: Viewer) -> PageData:
    ctx = request.app[CONTEXT]
    event = request.query.get("event") or None
    size = _int_query(request, "size", AUDIT_PAGE_SIZE, AUDIT_PAGE_SIZE_MAX) or AUDIT_PAGE_SIZE
    page = _int_query(request, "page", 0, MAX_AUDIT_PAGE)
    files = await asyncio.to_thread(_read_files, ctx, event, page, size)
    stream = await _stream_view(ctx, files["adapters"])
    return PageData(
        status=_status_payload(ctx),
        gates=files["gates"],
        adapters=files["adapters"],
        feedback=list(request.app[OPERATOR].feedback),
        stream=stream,
        audit=files["audit"],
        audit_error=files["audit_error"],
        audit_event=event,
        audit_page=page,
        audit_size=size,
        actor=viewer.actor,
        csrf=viewer.csrf,
    )


# ----------------------------------------------------------------------------- handlers


async def page(request: web.Request) -> web.Response:
    try:
        viewer = _viewer(request)
    except _Refusal as refusal:
        return _refused(str(refusal), refusal.status)
    data = await _page_data(request, viewer)
    return _html(lambda nonce: operator_page(data, nonce))


async def issue_link(request: web.Request) -> web.Response:
    """One-time login link for a browser (JSON; the admin API's Bearer rules apply)."""
    actor = _authorize(request)
    sessions = request.app[OPERATOR].sessions
    token = sessions.issue_link(actor)
    path = f"{COOKIE_PATH}/login?token={token}"
    origin = request.url.origin()
    if _https(request) and origin.scheme == "http":
        # Behind a reverse proxy that ends TLS the proxy itself sees http: the link said
        # http://, and the one-time token crossed the network in clear (or did not open).
        origin = origin.with_scheme("https")
    return web.json_response(
        {
            "url": f"{origin}{path}",
            "path": path,
            "expires_in_s": sessions.link_ttl_s,
        },
        headers={"Cache-Control": "no-store"},
    )


_LINK_REFUSED = "This login link is invalid, expired or already used."


def _browser_navigation(request: web.Request) -> bool:
    """Whether a browser itself opened the page (a typed or clicked link, not a fetch).

    Browsers send Fetch Metadata to trustworthy origins (HTTPS, loopback); link previewers
    and mail scanners fetch with plain HTTP clients that send none, and must not spend the
    one-time link. Where a browser sends none either (plain HTTP to another host), the
    confirmation page costs the operator one click. So does a link clicked on another site
    (a chat, a ticket): the redirect after it counts as that site's, which is sent no
    `SameSite=Strict` cookie, so the spent link led to "Sign-in required"; the
    confirmation page's button posts from this origin."""
    headers = request.headers
    return (
        headers.get("Sec-Fetch-Mode") == "navigate"
        and headers.get("Sec-Fetch-Dest") == "document"
        and headers.get("Sec-Fetch-Site") not in ("cross-site", "same-site")
    )


async def login_with_link(request: web.Request) -> web.Response:
    sessions = request.app[OPERATOR].sessions
    token = request.query.get("token", "")
    if not _browser_navigation(request):
        actor = sessions.link_actor(token)
        if actor is None:
            return _refused(_LINK_REFUSED)
        return _html(lambda nonce: confirm_link_page(actor, token, nonce))
    actor = sessions.redeem_link(token)
    if actor is None:
        return _refused(_LINK_REFUSED)
    return await _redirect_with_session(request, actor, "link")


async def login_with_confirmed_link(request: web.Request) -> web.Response:
    """The confirmation page's button: spends the link it carries."""
    try:
        form = await _form(request)
    except _Refusal as refusal:
        return _refused(str(refusal), refusal.status)
    token = form.get("token")
    actor = request.app[OPERATOR].sessions.redeem_link(token) if isinstance(token, str) else None
    if actor is None:
        return _refused(_LINK_REFUSED)
    return await _redirect_with_session(request, actor, "link")


async def _form(request: web.Request) -> Any:
    """The posted form; a 400 refusal when aiohttp cannot decode it: bytes that are not
    UTF-8 (ValueError), a charset Python does not know (LookupError), a multipart part in
    an unknown transfer encoding (RuntimeError). A body over MAX_FORM_BYTES (413) or of no
    declared length (411, chunked: its size is known only once buffered) is not read."""
    if request.body_exists:
        if request.content_length is None:
            raise _Refusal("The form needs a Content-Length.", 411)
        if request.content_length > MAX_FORM_BYTES:
            raise _Refusal(f"The form is larger than {MAX_FORM_BYTES} bytes.", 413)
    # The whole form, not each read, is timed: it is at most MAX_FORM_BYTES, so the body
    # timeout is ample for it at any speed a browser sends, and a stalled one gets its 408
    # instead of waiting on TCP.
    timeout_s = request.app[CONTEXT].config.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            await send_continue(request)
            return await request.post()
    except TimeoutError:
        raise _Refusal(
            f"The form stopped arriving: not whole after {timeout_s:g} s.", 408
        ) from None
    except (ValueError, LookupError, RuntimeError) as exc:
        raise _Refusal("The form could not be decoded (UTF-8 text expected).", 400) from exc


def _cross_site(request: web.Request) -> bool:
    """Whether a browser sent this from another site's page: its Fetch Metadata (which
    browsers send to loopback and HTTPS origins only), else an `Origin` naming another host
    than the request's `Host` or `X-Forwarded-Host` (a reverse proxy that rewrites `Host`
    passes the original there). A page anywhere could otherwise post the sign-in form to
    the proxy, each wrong key counting towards locking its clients out: browsers let pages
    post forms across sites, and over plain HTTP to another machine (`http://olp.lan:8000`)
    they send no Fetch Metadata. A request without `Origin` (curl, a script) is not a
    browser's form post, and is counted as before."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site in ("cross-site", "same-site"):
        return True
    if fetch_site == "same-origin":
        # A page cannot forge this header, and the browser compared the origins itself:
        # behind a reverse proxy that rewrites `Host` without `X-Forwarded-Host` (nginx's
        # default), the comparison below refused the operator's own sign-in.
        return False
    origin = request.headers.get("Origin")
    if origin is None:
        return False
    sent_from = urllib.parse.urlsplit(origin).netloc.lower()  # "" for `null`
    own = {request.headers.get(name, "").lower() for name in ("Host", "X-Forwarded-Host")}
    return sent_from not in own - {""}


async def login_with_key(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    if _cross_site(request):
        log.warning("operator_login_cross_site", remote=ctx.client_addresses.of(request))
        return _refused("Sign in from the operator page itself, not from another site.", 403)
    try:
        form = await _form(request)
    except _Refusal as refusal:
        return _refused(str(refusal), refusal.status)
    key = form.get("key")
    if not ctx.admin_key_hashes:
        return _refused("The admin API is disabled: no proxy.admin_key_sha256 configured.", 403)
    if not isinstance(key, str) or not key.strip() or not key_matches(ctx.admin_key_hashes, key):
        log.warning("operator_login_refused", remote=ctx.client_addresses.of(request))
        ctx.auth_throttle.failed_request(request, "admin")
        return _refused("Wrong admin key.")
    actor = form.get("actor")
    actor = clean_actor(actor if isinstance(actor, str) else None)
    return await _redirect_with_session(request, actor, "form")


async def _checked_form_viewer(request: web.Request) -> Viewer:
    """The viewer of a state-changing POST: Bearer, or a session with its CSRF token."""
    viewer = _viewer(request)
    if viewer.csrf is not None:
        form = await _form(request)
        given = form.get("csrf")
        # Compared as bytes: compare_digest raises TypeError on non-ASCII str (a 500).
        if not isinstance(given, str) or not hmac.compare_digest(
            given.encode("utf-8", "surrogatepass"), viewer.csrf.encode()
        ):
            raise _Refusal("The form's CSRF token is missing or stale; reload the page.", 403)
    return viewer


async def verify(request: web.Request) -> web.Response:
    try:
        viewer = await _checked_form_viewer(request)
    except _Refusal as refusal:
        return _refused(str(refusal), refusal.status)
    ctx = request.app[CONTEXT]
    result: VerifyResult | None = None
    error: str | None = None
    try:
        result = await asyncio.to_thread(ctx.audit.verify)
    except Exception as exc:  # an unreadable file: show it rather than a bare 500
        log.exception("operator_verify_failed")
        error = f"{type(exc).__name__}: {exc}"
    else:
        actor = ctx.audit.actor_label(viewer.actor)  # as the audit log names it: no e-mail
        log.info("operator_audit_verified", actor=actor, **result.to_dict())
    data = await _page_data(request, viewer)
    data.verify, data.verify_error = result, error
    return _html(lambda nonce: operator_page(data, nonce))


async def logout(request: web.Request) -> web.Response:
    try:
        await _checked_form_viewer(request)
    except _Refusal as refusal:
        return _refused(str(refusal), refusal.status)
    session_id = request.cookies.get(COOKIE_NAME)
    if session_id:
        request.app[OPERATOR].sessions.close(session_id)
    response = _refused("Signed out.", 200)
    response.del_cookie(COOKIE_NAME, path=COOKIE_PATH)
    return response


def add_operator_routes(app: web.Application) -> None:
    app[OPERATOR] = OperatorState()
    app.router.add_get("/admin/ui", page)
    app.router.add_post("/admin/ui/link", issue_link, expect_handler=defer_continue)
    # No HEAD: link checkers and mail scanners probe with it, and a HEAD would spend the
    # one-time link (and take the session cookie).
    app.router.add_get("/admin/ui/login", login_with_link, allow_head=False)
    app.router.add_post(
        "/admin/ui/login/link", login_with_confirmed_link, expect_handler=defer_continue
    )
    app.router.add_post("/admin/ui/login", login_with_key, expect_handler=defer_continue)
    app.router.add_post("/admin/ui/verify", verify, expect_handler=defer_continue)
    app.router.add_post("/admin/ui/logout", logout, expect_handler=defer_continue)
