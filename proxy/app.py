"""The proxy's aiohttp application: routes, the request-id/error middleware and the lifecycle.

`build_app(...)` returns a ready `web.Application`; all state sits in one `ProxyContext` on
the app (`app[CONTEXT]`), so several proxies can live in one process (tests do).
"""

from __future__ import annotations

import functools
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from proxy.admin import add_admin_routes
from proxy.aliases import AliasTable, Canary
from proxy.auth_throttle import AuthThrottle
from proxy.capture import CaptureService, passes_generated_ids, private_label
from proxy.client_address import ClientAddresses
from proxy.completions import (
    chat_completions,
    completions,
    cut_label,
    label_header,
    read_json_body,
    request_codings,
    unsupported_encoding,
)
from proxy.config import ProxyConfig, TenantConfig
from proxy.context import CONTEXT, REQUEST_ID, RESPONSE_STARTED, ProxyContext
from proxy.errors import AuthError, ProxyError, bad_request, error_response
from proxy.expect_continue import defer_continue, refused_before_continue
from proxy.feedback import (
    RecentTrajectories,
    build_event,
    check_owner,
    event_trajectory_id,
    feedback_body_limit,
    not_recorded_reason,
    parse_feedback,
)
from proxy.host_check import HostCheck
from proxy.log_context import bind_request, unbind_request
from proxy.metrics import ProxyMetrics
from proxy.operator_auth import key_matches
from proxy.operator_page import record_feedback
from proxy.relay import SSE_STRIP
from proxy.routing import UpstreamPool
from proxy.serving_state import ServingState, load_state, save_state
from proxy.stalled_clients import StalledClientWatch
from proxy.tenants import TenantRegistry
from safety.audit import AuditError, AuditLog, AuditRecordWritten
from safety.config import AuditConfig
from safety.pseudonym import deployment_key
from safety.redaction import Redactor

log = structlog.get_logger(__name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
# A client's session id as it may leave the process (logs, feedback events): the records'
# `private_label` with the app's Redactor, cached: a session sends many requests, and a
# label costs the Redactor 7-35 µs.
SESSION_LABEL = web.AppKey("session_label", Callable[[str], str])
_SESSION_LABELS_CACHED = 4096
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


_HTTP_ERROR_TYPES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


def request_middleware(ctx: ProxyContext, session_label: Callable[[str], str]) -> Middleware:
    """The app's one middleware: every response gets an x-request-id and every failure
    OpenAI-style JSON. Made per app with its context at hand: looked up on the request
    (`request.app[CONTEXT]`: three calls), it was four lookups a request."""
    redact = ctx.redactor.redact_obj
    # The proxy's own ids hold nothing this redactor finds: logged as they are.
    own_ids_as_is = passes_generated_ids(redact)

    @web.middleware
    async def request_id_and_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.headers.get("x-request-id")
        if given and _REQUEST_ID.match(given):
            request_id = given
            # The client's x-request-id is its label too (a card number fits its
            # characters): logged as the record carries it (`capture.redact_record`). Not
            # through the cached `session_label`: request ids rarely repeat and would only
            # push sessions out of it.
            logged_id = private_label(given, redact, ctx.pseudonym_key)
        else:
            # 32 random hex digits, as a uuid4's hex has (122 random bits there, 128 here),
            # at a third of uuid4's cost.
            request_id = "req-" + secrets.token_hex(16)
            logged_id = (
                request_id
                if own_ids_as_is
                else private_label(request_id, redact, ctx.pseudonym_key)
            )
        request[REQUEST_ID] = request_id
        session_id = request.headers.get("X-Session-Id")
        if session_id:
            # Bytes that are not UTF-8 arrive as lone surrogates: escaped, a log line can
            # carry them (the handlers refuse such a header with 400). Logged as the records
            # carry it: the pseudonym when it holds PII (an e-mail).
            escaped = session_id.encode("utf-8", "backslashreplace").decode("utf-8")
            session_id = session_label(cut_label(escaped, redact, ctx.pseudonym_key))
        bound = bind_request(logged_id or request_id, session_id)
        try:
            # A page that rebound its host name to this proxy's address is refused before
            # anything else (keys included) is looked at.
            ctx.host_check.check(request)
            # Before the handler looks at any key: a locked-out address gains nothing from
            # guessing right.
            ctx.auth_throttle.guard(request)
            _refuse_ambiguous_credentials(request)
            _refuse_encoded_body(request)
            response = await handler(request)
        except ProxyError as err:
            if isinstance(err, AuthError):
                guessed = "Authorization" in request.headers
                ctx.auth_throttle.failed_request(request, err.route_kind, guessed)
            response = error_response(err, request_id)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            code = _HTTP_ERROR_TYPES.get(exc.status, "http_error")
            # A 405 must say which methods the resource takes (RFC 9110 15.5.6).
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            response = error_response(
                ProxyError(exc.status, exc.reason or "error", code=code, headers=allow),
                request_id,
            )
        except Exception:
            # The line carries the request id as the request's other lines do (bound above).
            log.exception("unhandled_error", path=request.path)
            if request.get(RESPONSE_STARTED):
                # Its status and headers went out: a second response would be written into
                # the first one's body as raw bytes. aiohttp closes the connection instead.
                raise
            response = error_response(
                ProxyError(
                    500,
                    f"Internal proxy error (request id {request_id}).",
                    type_="api_error",
                    code="internal_error",
                ),
                request_id,
            )
        finally:
            unbind_request(bound)
        if not response.prepared:
            response.headers["x-request-id"] = request_id
            if refused_before_continue(request):
                response.force_close()
        return response

    return request_id_and_errors


def _refuse_ambiguous_credentials(request: web.Request) -> None:
    """400 for a request with Authorization headers that differ. HTTP allows one; with two
    keys the proxy took the first, while something in front of it (a gateway that adds its
    own, a log) may go by the other: which key a request is charged to must not depend on
    who reads it."""
    keys = request.headers.getall("Authorization", ())
    if len(keys) > 1 and len(set(keys)) > 1:
        raise bad_request(
            "Send one Authorization header: this request carries several different ones.",
            param="Authorization",
            code="invalid_header",
        )


def _refuse_encoded_body(request: web.Request) -> None:
    """415 for a compressed body sent to a route that does not decode one itself. The app
    runs without aiohttp's `auto_decompress` (see `build_app`): the JSON endpoints decode
    gzip and deflate in `read_json`; the admin API and the operator page read bodies as
    they come, and would misread a compressed one."""
    if not request.body_exists or request.match_info.http_exception is not None:
        return
    if request.match_info.handler in _DECODING_HANDLERS:
        return
    encoded = request_codings(request)
    if encoded:
        raise unsupported_encoding(encoded[0], "this endpoint takes its body uncompressed")


def _model_entry(ctx: ProxyContext, name: str, max_model_len: int | None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": int(ctx.started_at),
        "owned_by": "olp",
    }
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return entry


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    ctx.tenants.authenticate(request.headers.get("Authorization"))
    length = await ctx.pool.learn_max_model_len()
    data = [_model_entry(ctx, name, length) for name in ctx.aliases.public_names()]
    return web.json_response({"object": "list", "data": data})


async def retrieve_model(request: web.Request) -> web.Response:
    """OpenAI's `GET /v1/models/{model}` (the SDK's `models.retrieve`, which some clients
    call to check a model before using it); vLLM has only the list."""
    ctx = request.app[CONTEXT]
    ctx.tenants.authenticate(request.headers.get("Authorization"))
    name = request.match_info["model"]
    if name not in ctx.aliases.public_names():
        raise ProxyError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            code="model_not_found",
            param="model",
        )
    return web.json_response(_model_entry(ctx, name, await ctx.pool.learn_max_model_len()))


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _shows_replica_urls(request: web.Request) -> bool:
    """Whether /readyz may name the replicas' URLs: only for `Authorization: Bearer <admin
    key>`. Anything else is the anonymous view, never a 401 (a load balancer's probe sends
    no key). A key that is neither the admin key nor a tenant's counts for the failed-key
    throttle like one at the admin API (else /readyz would let the admin key be guessed at
    line rate); a tenant's key does not (a client probing with its own key must not lock
    itself out of /v1). While the address is locked out no key is looked at."""
    ctx = request.app[CONTEXT]
    scheme, _, key = (request.headers.get("Authorization") or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip() or not ctx.admin_key_hashes:
        return False
    throttle = ctx.auth_throttle
    if throttle.retry_after(throttle.addresses.of(request)) > 0:
        return False
    if key_matches(ctx.admin_key_hashes, key):
        return True
    # Looked up by digest, not authenticated: with `require_auth: false` every unknown key is
    # served as `anonymous`, so none counted, and the admin key could be guessed at line rate.
    if not ctx.tenants.holds_key(key):
        throttle.failed_request(request, "admin")
    return False


async def readyz(request: web.Request) -> web.Response:
    """Ready when at least one replica answers. Also lists aliases whose target no reachable
    replica serves (e.g. vLLM restarted without the current adapter): requests for those
    get vLLM's 404 until the adapter is loaded again.

    Replicas are listed in the configured order. Without the admin key they are named
    `replica-<N>` and a problem by its kind only (the exception's text names the host): the
    model servers' addresses are never shown to clients."""
    ctx = request.app[CONTEXT]
    show_urls = _shows_replica_urls(request)
    readiness = await ctx.pool.readiness()
    # In the configured order, by URL or by position (a URL listed twice: two positions).
    replicas = {
        replica.url if show_urls else f"replica-{i}": readiness[replica.url]
        for i, replica in enumerate(ctx.pool.replicas)
    }
    reachable = [served for problem, served in replicas.values() if problem is None]
    served_anywhere = set().union(*reachable) if reachable else set()
    unserved = {
        alias: target
        for alias, target in ctx.aliases.snapshot().items()
        if reachable and target not in served_anywhere
    }
    # A canary's share of its alias's traffic goes to its own target: unserved, it gets 404s.
    unserved_canaries = {
        alias: canary.target
        for alias, canary in ctx.aliases.canaries().items()
        if reachable and canary.target not in served_anywhere
    }
    # A replica that lacks a target others serve: its share of those requests is retried on
    # another replica (one extra round trip each) until the adapter is loaded there again.
    targets = set(ctx.aliases.snapshot().values()) | {
        canary.target for canary in ctx.aliases.canaries().values()
    }
    missing = {
        name: sorted(targets & served_anywhere - served)
        for name, (problem, served) in replicas.items()
        if problem is None and targets & served_anywhere - served
    }
    # `UpstreamPool.readiness` writes "<exception type>: <text>", and the text of a
    # connection or HTTP error names the host: without the key, the type alone.
    states = {
        name: "ok" if problem is None else problem if show_urls else problem.partition(":")[0]
        for name, (problem, _) in replicas.items()
    }
    return web.json_response(
        {
            "ready": bool(reachable),
            "replicas": states,
            "unserved_aliases": unserved,
            "unserved_canaries": unserved_canaries,
            "replicas_missing_targets": missing,
        },
        status=200 if reachable else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[CONTEXT].metrics.render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = content_type
    return response


async def feedback(request: web.Request) -> web.Response:
    """Accept a feedback event for one of the tenant's trajectories (202)."""
    ctx = request.app[CONTEXT]
    tenant = ctx.tenants.authenticate(request.headers.get("Authorization"))
    limit_headers = ctx.tenants.admit_feedback(tenant)
    session_header = label_header(request, "X-Session-Id")
    limit = feedback_body_limit(ctx.config.max_feedback_metadata_bytes, ctx.config.max_body_bytes)
    # Whole within body_timeout_s: a feedback post holds no concurrency slot to bound it.
    body = await read_json_body(request, limit, ctx.config.body_timeout_s, whole_within_s=True)
    parsed = parse_feedback(body, ctx.config.max_feedback_metadata_bytes)
    # Ownership and the choice first: another tenant's trajectory is a 403 whatever this
    # tenant's training switch says.
    known_session = check_owner(ctx.recent, parsed, tenant.name_hash)
    if (reason := not_recorded_reason(ctx.not_captured, parsed, tenant)) is not None:
        log.info("feedback_not_recorded", tenant=tenant.name, kind=parsed.kind)
        return web.json_response(
            {"status": "not_recorded", "reason": reason}, status=202, headers=limit_headers
        )
    # Unknown to the proxy (a restart, or evicted from `recent`) and without X-Session-Id:
    # keyed by the trajectory id, which is the trajectory's own key when its request came
    # without X-Session-Id and x-request-id (the proxy's request id is then both).
    session_id = known_session or session_header or parsed.trajectory_id
    metadata, _ = ctx.redactor.redact_obj(parsed.metadata)
    # The same pseudonym as the trajectory's record carries (capture.redact_record).
    session_id = request.app[SESSION_LABEL](session_id)
    trajectory_id = event_trajectory_id(
        parsed.trajectory_id, known_session is not None, ctx.redactor.redact_obj, ctx.pseudonym_key
    )
    event = build_event(parsed, tenant.name_hash, session_id, metadata, trajectory_id)
    ctx.sink.put_feedback(event)
    ctx.metrics.feedback.labels(parsed.kind).inc()
    record_feedback(request.app, parsed.kind, parsed.value)
    return web.json_response(
        {"status": "accepted", "event_id": event["event_id"], "known": known_session is not None},
        status=202,
        headers=limit_headers,
    )


# The handlers whose bodies go through `read_json`, which decodes gzip and deflate.
_DECODING_HANDLERS = frozenset({chat_completions, completions, feedback})


# The actor of the audit records the proxy writes for itself (start-up reconciliation).
PROXY_ACTOR = "olp-proxy"


def _reconcile_state(
    state: ServingState, config: ProxyConfig, registry: TenantRegistry
) -> list[tuple[str, dict[str, Any]]]:
    """Bring the persisted serving state in line with the config at start-up; the changes
    made, as (audit event, payload), each also logged as a warning (the caller saves the
    state, then audits them: a dropped switch kept on disk would apply again once the
    config went back, and what serves changed without an operator's command).

    The public names are the config's: an alias the config no longer names (a renamed
    `policy_alias`, a base alias taken out) is dropped with its canary, not served on from
    the file, where nothing would promote it and a dropped base alias could be flipped to
    an adapter. Base aliases serve the base model whatever the file says (a flip of one,
    refused now, may predate that), and a training switch set when the config said
    otherwise than it says now gives way to the config's newer word."""
    changes: list[tuple[str, dict[str, Any]]] = []

    def change(event: str, **payload: Any) -> None:
        log.warning(event, **payload)
        changes.append((event, payload))

    configured = {config.policy_alias, *config.base_model_aliases}
    for alias in [name for name in state.aliases if name not in configured]:
        change(
            "alias_dropped",
            alias=alias,
            was=state.aliases.pop(alias),
            canary=state.canaries.pop(alias, None) is not None,
            reason="the config no longer names it",
        )
    for alias in [name for name in state.canaries if name not in configured]:
        # A canary of an alias the file itself did not hold.
        change("canary_dropped", alias=alias, was=state.canaries.pop(alias))
    for alias in config.base_model_aliases:
        if state.aliases.get(alias) != config.base_served_name or alias in state.canaries:
            change(
                "base_alias_reset",
                alias=alias,
                was=state.aliases.get(alias),
                canary=alias in state.canaries,
            )
            state.aliases[alias] = config.base_served_name
            state.canaries.pop(alias, None)
    # The admin API targets `policy-v<N>` or the base model by its served name: any other
    # target in the file is the base model under the served name it had when the file was
    # written (`policy.served_model_name` changed since). Left so, the alias asked vLLM for
    # a model it no longer serves, and every request to it was a 404.
    policy = config.policy_alias
    target = state.aliases.get(policy)
    if target is not None and not _serves_by_current_name(target, config):
        change("policy_alias_reset", alias=policy, was=target, now=config.base_served_name)
        state.aliases[policy] = config.base_served_name
    canary = state.canaries.get(policy)
    if isinstance(canary, dict) and not _serves_by_current_name(canary.get("target"), config):
        change("canary_dropped", alias=policy, was=state.canaries.pop(policy))
    for name in registry.apply_overrides(state.tenant_training):
        switch = state.tenant_training.pop(name)
        known = name in registry.tenants
        change(
            "tenant_training_switch_dropped",
            tenant=name,
            switch=switch["enabled"],
            config_enabled=not switch["config_enabled"] if known else None,
            reason="the config's training_enabled changed since the switch was set"
            if known
            else "the config no longer names the tenant",
        )
    return changes


_VERSION_TARGET = re.compile(r"policy-v[0-9]+")


def _serves_by_current_name(target: Any, config: ProxyConfig) -> bool:
    """Whether an alias or canary target is one the admin API would set now."""
    return isinstance(target, str) and (
        target == config.base_served_name or _VERSION_TARGET.fullmatch(target) is not None
    )


def build_app(
    config: ProxyConfig,
    tenants: list[TenantConfig],
    sink: Any,
    state_dir: Path | str,
    *,
    redactor: Redactor | None = None,
    audit: AuditLog | None = None,
    internal_admin_key_sha256: str | None = None,
) -> web.Application:
    """The proxy application. `sink` is a replay RecordSink; `state_dir` holds serving state
    and (unless `audit` is given) the audit log. `internal_admin_key_sha256` admits a second
    admin key (the per-run token `olp up` gives the learner for alias flips)."""
    state_dir = Path(state_dir)
    metrics_ = ProxyMetrics()
    redactor = redactor if redactor is not None else Redactor()
    state_path = state_dir / config.state.serving_state
    key = config.pseudonym_key.get_secret_value() if config.pseudonym_key else None
    label_key = deployment_key(state_path.parent, key)
    if audit is None:
        audit = AuditLog(state_dir / AuditConfig().path, redactor=redactor)
    if audit.pseudonym_key is None:  # its e-mail actors get the same pseudonyms as the logs
        audit.pseudonym_key = label_key
    registry = TenantRegistry(tenants, require_auth=config.require_auth)
    metrics_.count_in_flight(lambda: ((t.name, t.in_flight) for t in registry.tenants.values()))
    default_aliases = {config.policy_alias: config.base_served_name}
    default_aliases.update({name: config.base_served_name for name in config.base_model_aliases})
    state = load_state(state_path, default_aliases)
    reconciled = _reconcile_state(state, config, registry)
    if reconciled:
        save_state(state_path, state)
        for event, payload in reconciled:  # the state file holds them: as `_commit` does
            try:
                audit.append(PROXY_ACTOR, event, payload)
            except AuditRecordWritten as exc:
                log.error("audit_head_not_written", audit_event=event, error=str(exc))
            except (AuditError, OSError) as exc:
                # Nobody to answer at start-up: the proxy serves what the config says, and
                # the error names what the log lacks (`olp audit verify` finds the cause).
                log.error(
                    "startup_change_not_audited", audit_event=event, error=str(exc), **payload
                )

    def on_outcome(status: str, trainable: bool, count: int) -> None:
        metrics_.trajectories.labels(status, str(trainable).lower()).inc(count)

    client_addresses = ClientAddresses(config.trusted_proxies)
    ctx = ProxyContext(
        config=config,
        tenants=registry,
        aliases=AliasTable(
            state.aliases, {k: Canary.from_json(v) for k, v in state.canaries.items()}
        ),
        pool=UpstreamPool(
            config.upstreams,
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.read_timeout_s,
            max_connections=config.max_upstream_connections,
            keepalive_s=config.upstream_keepalive_s,
            api_key=(
                config.upstream_api_key.get_secret_value() if config.upstream_api_key else None
            ),
        ),
        metrics=metrics_,
        stalled_clients=StalledClientWatch(config.send_timeout_s),
        capture=CaptureService(
            sink,
            redactor.redact_obj,
            on_outcome=on_outcome,
            on_failures=metrics_.capture_failures.inc,
            backlog_limit=config.capture_backlog_limit,
            label_key=label_key,
            backlog_bytes_limit=config.capture_backlog_bytes,
        ),
        recent=RecentTrajectories(config.recent_trajectories),
        not_captured=RecentTrajectories(max(1, config.recent_trajectories // 10)),
        state=state,
        state_path=state_path,
        sink=sink,
        redactor=redactor,
        audit=audit,
        client_addresses=client_addresses,
        host_check=HostCheck(config.host, config.allowed_hosts),
        auth_throttle=AuthThrottle(
            config.auth_failures,
            metrics_,
            addresses=client_addresses,
            exempt_key_sha256=internal_admin_key_sha256,
        ),
        admin_key_hashes=tuple(
            h for h in (config.admin_key_sha256, internal_admin_key_sha256) if h is not None
        ),
        started_at=time.time(),
        pseudonym_key=label_key,
    )

    @functools.lru_cache(maxsize=_SESSION_LABELS_CACHED)
    def session_label(session_id: str) -> str:
        return private_label(session_id, redactor.redact_obj, label_key) or session_id

    app = web.Application(
        middlewares=[request_middleware(ctx, session_label)],
        client_max_size=config.max_body_bytes,
        # Request bodies are decoded by the handlers (`read_json`), which answer a body that
        # is not what its Content-Encoding says, or a coding they cannot decode (`br`,
        # `zstd`), in the OpenAI format with the request id. aiohttp's own decoding raised
        # a 500 out of `request.read()` for the first, and refused the second with a
        # plain-text 400 before the middleware ran.
        handler_args={"auto_decompress": False},
    )
    app[CONTEXT] = ctx
    app[SESSION_LABEL] = session_label
    app.router.add_post("/v1/chat/completions", chat_completions, expect_handler=defer_continue)
    app.router.add_post("/v1/completions", completions, expect_handler=defer_continue)
    app.router.add_get("/v1/models", list_models)
    # `{model:.+}`: a base model's alias may hold a `/` (an organisation/name id).
    app.router.add_get("/v1/models/{model:.+}", retrieve_model)
    app.router.add_post("/v1/feedback", feedback, expect_handler=defer_continue)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app)
    app.on_startup.append(_start)
    app.on_shutdown.append(_stopping)
    app.on_cleanup.append(_stop)
    return app


async def _start(app: web.Application) -> None:
    ctx = app[CONTEXT]
    await ctx.pool.start()
    ctx.stalled_clients.start()
    log.info(
        "proxy_started",
        upstreams=[r.url for r in ctx.pool.replicas],
        aliases=dict(ctx.aliases.snapshot()),
        canaries={k: v.to_json() for k, v in ctx.aliases.canaries().items()},
        sse_strip=SSE_STRIP,
    )


async def _stopping(app: web.Application) -> None:
    """The runner stopped listening and is about to drain: it cuts what still runs after
    `drain_s` (`app_runner`'s two waits of half of it, each from a later start)."""
    ctx = app[CONTEXT]
    ctx.drain_ends_at = time.monotonic() + ctx.config.drain_s


async def _stop(app: web.Application) -> None:
    """Finish queued records before the pool and the sink go away."""
    ctx = app[CONTEXT]
    await ctx.stalled_clients.stop()
    await ctx.capture.drain()
    await ctx.pool.close()
