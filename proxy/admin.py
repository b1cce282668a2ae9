"""Operator API under /admin (admin key only): aliases, canaries, rollback, freeze, tenants.

Every change is persisted atomically to `<state_dir>/control/serving.json` and written to the
audit log with its actor (the `X-OLP-Actor` header, else "admin"; 400 for a name the
audit log would not take whole).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import dataclasses
import functools
import hmac
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path, PurePath
from typing import Any

import aiohttp
import structlog
from aiohttp import web

from proxy.aliases import Canary
from proxy.completions import read_json_body
from proxy.config import is_utf8_text, sha256_hex
from proxy.context import CONTEXT, ProxyContext
from proxy.errors import AuthError, ProxyError, bad_request
from proxy.expect_continue import defer_continue
from proxy.feedback import finite_float
from proxy.operator_auth import ACTOR_RULE, header_actor
from proxy.operator_data import recent_gate_decisions
from proxy.routing import Replica
from proxy.serving_state import ServingState, alias_lineage, save_state
from safety.audit import AuditError, AuditRecordWritten

log = structlog.get_logger(__name__)

# Whole-string matches only (`fullmatch`): `$` also matches before a final newline.
_VERSION = re.compile(r"policy-v[0-9]+")
STATUS_GATES = 5  # gate decisions in `/admin/status`: the recent ones, not the whole record
# Changes run one at a time: a flip awaits every replica's /v1/models, and a freeze (or
# another change) that lands meanwhile must not be overtaken by it.
ADMIN_LOCK = web.AppKey("olp_admin_lock", asyncio.Lock)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _known_alias(ctx: ProxyContext, body: dict[str, Any]) -> str:
    """The body's `alias` (the policy alias when absent); 400 when the table has no such
    alias."""
    alias = body.get("alias", ctx.config.policy_alias)
    if not isinstance(alias, str) or ctx.aliases.resolve(alias) is None:
        known = ", ".join(ctx.aliases.public_names())
        raise bad_request(f"Unknown alias {alias!r}; the aliases are: {known}.", param="alias")
    if alias in ctx.config.base_model_aliases:
        # Clients pin a base alias to stay off the learned policy: a mistyped flip or an
        # automation bug must not move them onto an adapter.
        raise ProxyError(
            400,
            f"{alias!r} is a base model alias (proxy.base_model_aliases): it always serves "
            f"the base model; change {ctx.config.policy_alias!r} instead.",
            param="alias",
            code="base_alias",
        )
    return alias


def _served_target(ctx: ProxyContext, value: Any, param: str) -> str:
    """A flip, rollback or canary target: `policy-v<N>`, or the base model as `base` or as
    its served name (`policy.served_model_name`), which is what upstream is asked for."""
    base = ctx.config.base_served_name
    if value in ("base", base):
        return base
    if not isinstance(value, str) or not _VERSION.fullmatch(value):
        raise bad_request(f"'{param}' must be 'base' or 'policy-v<N>'.", param=param)
    return value


def _check_expected(ctx: ProxyContext, alias: str, body: dict[str, Any]) -> None:
    """With `expected` (the target the caller decided against), 409 when the alias now
    serves another or runs a canary. The learner gates a candidate against the serving
    version for minutes; an operator's rollback meanwhile must not be undone by its flip,
    nor its canary ended by one."""
    if "expected" not in body:
        return
    expected = _served_target(ctx, body["expected"], "expected")
    current = ctx.aliases.resolve(alias)
    if current != expected:
        raise ProxyError(
            409,
            f"'{alias}' serves {current}, not {expected} as expected: it changed meanwhile.",
            type_="conflict",
            code="alias_changed",
        )
    canary = ctx.aliases.canaries().get(alias)
    if canary is not None:
        raise ProxyError(
            409,
            f"A canary of {canary.target} is running on '{alias}'; end it first.",
            type_="conflict",
            code="canary_running",
        )


def _authorize(request: web.Request) -> str:
    """The acting operator's name; 401 without a key, 403 with a wrong one or none configured."""
    ctx = request.app[CONTEXT]
    header = request.headers.get("Authorization") or ""
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise AuthError(
            401,
            "The admin API needs 'Authorization: Bearer <admin key>'.",
            code="missing_api_key",
            route_kind="admin",
        )
    if not ctx.admin_key_hashes:
        raise ProxyError(
            403,
            "The admin API is disabled: no proxy.admin_key_sha256 configured.",
            type_="permission_error",
            code="admin_disabled",
        )
    digest = sha256_hex(key.strip())
    if not any(hmac.compare_digest(known, digest) for known in ctx.admin_key_hashes):
        raise AuthError(
            403,
            "This key may not use the admin API.",
            type_="permission_error",
            code="forbidden",
            route_kind="admin",
        )
    actor = header_actor(request.headers.get("X-OLP-Actor"))
    if actor is None:
        raise bad_request(
            f"X-OLP-Actor must be {ACTOR_RULE}; nothing was changed.",
            param="X-OLP-Actor",
            code="invalid_actor",
        )
    return actor


async def _json_object(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object ({} without one), read as the completion endpoints read
    theirs: 408 when it stops arriving (a stalled admin request waited on TCP before), 413
    over `max_body_bytes`, 400 when it is not JSON."""
    if not request.body_exists:
        return {}
    config = request.app[CONTEXT].config
    body = await read_json_body(request, config.max_body_bytes, config.body_timeout_s)
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _status_payload(ctx: ProxyContext) -> dict[str, Any]:
    state = ctx.state
    policy = ctx.config.policy_alias
    return {
        "aliases": dict(ctx.aliases.snapshot()),
        "canaries": {k: v.to_json() for k, v in ctx.aliases.canaries().items()},
        "serving_version": ctx.aliases.resolve(policy),
        "policy_alias": policy,
        # What a rollback of each alias would serve: the learner keeps these loaded.
        "rollback_targets": {
            alias: target
            for alias in ctx.aliases.public_names()
            if (target := rollback_target(ctx, alias)) is not None
        },
        "history": state.history,
        "frozen": state.frozen,
        "learning_frozen": state.learning_frozen,
        "tenants": [
            {
                "name": t.name,
                "training_enabled": t.training_enabled,
                # The run-time switch (None: the config decides), so that an operator sees
                # why a tenant trains when its config says it does not.
                "training_switch": t.training_override,
                "in_flight": t.in_flight,
            }
            for t in ctx.tenants.tenants.values()
        ],
        "upstreams": [r.url for r in ctx.pool.replicas],
    }


@dataclasses.dataclass(frozen=True)
class _Serving:
    """What an admin change alters: the routing tables, the serving state and the tenants'
    training switches, as one snapshot to serve again."""

    tables: object
    state: ServingState
    overrides: dict[str, bool | None]

    @classmethod
    def of(cls, ctx: ProxyContext) -> _Serving:
        overrides = {name: t.training_override for name, t in ctx.tenants.tenants.items()}
        return cls(ctx.aliases.saved(), copy.deepcopy(ctx.state), overrides)

    def serve(self, ctx: ProxyContext) -> None:
        ctx.aliases.restore(self.tables)
        vars(ctx.state).update(vars(copy.deepcopy(self.state)))
        for name, override in self.overrides.items():
            ctx.tenants.tenants[name].training_override = override


class _Change:
    """One admin change: made on the live tables by its handler, served only once persisted
    and audited (`commit`)."""

    def __init__(self, ctx: ProxyContext) -> None:
        self.ctx = ctx
        self.before = _Serving.of(ctx)
        self.committed = False  # recorded and serving: nothing undoes it

    async def commit(self, actor: str, event: str, payload: dict[str, Any]) -> None:
        """Persist the state, then audit the change (the audit log is the record of truth),
        in a worker thread: the append waits on the log's file lock and fsyncs, and on the
        event loop all traffic waited with it (behind `olp audit verify`, a backup). The
        proxy serves as before the change until both are done, then serves the change:
        nothing is served under a change the log does not hold."""
        ctx = self.ctx
        ctx.state.aliases = dict(ctx.aliases.snapshot())
        ctx.state.canaries = {k: v.to_json() for k, v in ctx.aliases.canaries().items()}
        if ctx.state.compact_history(ctx.config.base_served_name):
            log.info("serving_history_compacted", kept=len(ctx.state.history) - 1)
        after = _Serving.of(ctx)
        self.before.serve(ctx)
        # An executor's future, not a task: at shutdown asyncio cancels every task, and a
        # cancelled task wrapping the thread says nothing of how the thread ended.
        recording = asyncio.get_running_loop().run_in_executor(
            None,
            functools.partial(
                contextvars.copy_context().run, _record, ctx, after.state, actor, event, payload
            ),
        )
        # Cancelled meanwhile (the proxy stopping: `_to_the_end` covers a client that left),
        # the change ends as its record does: the thread cannot be stopped, and undone while
        # it wrote, the change was in the log and not in the state file.
        cancelled = await _outwait(recording)
        if (error := recording.exception()) is not None:
            raise error
        after.serve(ctx)
        self.committed = True
        ctx.metrics.forget_versions(_versions_in_use(ctx))
        if cancelled:
            raise asyncio.CancelledError


async def _outwait(future: asyncio.Future[Any]) -> bool:
    """Wait for `future` whatever cancels the waiter; whether anything did."""
    cancelled = False
    while True:
        try:
            await asyncio.shield(future)
            return cancelled
        except asyncio.CancelledError:
            if future.done():
                return True
            cancelled = True


@contextlib.asynccontextmanager
async def _all_or_nothing(ctx: ProxyContext) -> AsyncIterator[_Change]:
    """A change serves only once it is persisted and audited. The handlers change the live
    tables, then `commit`; when saving the state or appending to the audit log fails, the
    routing, the serving state and the tenant switches stay what they were (and the state
    file too), so the caller's error is the whole truth: before, a failed save answered 500
    with the flip already serving, unaudited, until a restart undid it."""
    change = _Change(ctx)
    try:
        yield change
    except BaseException:
        if change.committed:
            raise
        change.before.serve(ctx)
        try:
            await asyncio.to_thread(save_state, ctx.state_path, ctx.state)
        except OSError:
            log.exception("serving_state_restore_failed")
        raise


def _record(
    ctx: ProxyContext, state: ServingState, actor: str, event: str, payload: dict[str, Any]
) -> None:
    """Runs in a worker thread (`_Change.commit`).

    An append that fails after its record's line is in the log (the head file could not
    follow) does not undo the change: the log says it happened, the state file holds it,
    so it stands. Undoing it left a record of a change that never served, and `verify`
    passed."""
    try:
        save_state(ctx.state_path, state)
    except OSError as exc:
        log.error("admin_change_not_saved", audit_event=event, error=str(exc))
        raise _not_applied(
            f"the serving state could not be saved ({exc})", "state_not_saved"
        ) from exc
    try:
        ctx.audit.append(actor, event, payload)
    except AuditRecordWritten as exc:
        log.error(
            "audit_head_not_written",
            seq=exc.record["seq"],
            audit_event=event,
            error=str(exc),
        )
    except (AuditError, OSError) as exc:
        log.error("admin_change_not_audited", audit_event=event, error=str(exc))
        hint = "" if "olp audit verify" in str(exc) else "; run `olp audit verify` on its machine"
        raise _not_applied(
            f"the audit log cannot record it ({exc}){hint}", "audit_unavailable"
        ) from exc


def _to_the_end(handler: Handler) -> Handler:
    """An admin change runs to its end when its client leaves (aiohttp cancels a handler
    whose client went away): cancelled while its record was being written, the change was
    undone on the live tables while the record could still land in the log. The response
    of a change whose client left is dropped."""

    @functools.wraps(handler)
    async def run(request: web.Request) -> web.StreamResponse:
        change = asyncio.ensure_future(handler(request))
        try:
            return await asyncio.shield(change)
        except asyncio.CancelledError:
            change.add_done_callback(_log_unanswered)
            raise

    return run


def _log_unanswered(change: asyncio.Future[web.StreamResponse]) -> None:
    if change.cancelled():
        return
    if (error := change.exception()) is not None:
        log.warning("admin_change_failed_after_client_left", error=str(error))


def _not_applied(why: str, code: str) -> ProxyError:
    """A 503 that says the change did not happen and why: a bare 500 left an operator in an
    incident (`olp freeze` refused) guessing whether it had, and where to look."""
    return ProxyError(503, f"The change was not applied: {why}.", type_="api_error", code=code)


def _versions_in_use(ctx: ProxyContext) -> set[str]:
    """The policy versions whose metric series stay: what an alias or a canary routes to,
    what a rollback would serve, and the base model."""
    aliases = ctx.aliases.snapshot()
    return {
        "base",
        ctx.config.base_served_name,
        *aliases.values(),
        *(canary.target for canary in ctx.aliases.canaries().values()),
        *(target for alias in aliases if (target := rollback_target(ctx, alias)) is not None),
    }


def state_dir_of(ctx: ProxyContext) -> Path:
    """The state dir the proxy was started with: the serving-state file sits at the
    configured path below it (the learner's `adapters/` and `gates/` are beside it)."""
    depth = len(PurePath(ctx.config.state.serving_state).parts)
    return ctx.state_path.parents[depth - 1]


def _gate_decisions(ctx: ProxyContext) -> list[dict[str, Any]]:
    """Runs in a worker thread (file reads). A rejection is no alias change, so `history`
    never shows it; an unreadable gates dir leaves the list empty instead of failing the
    status the learner and `olp status` depend on."""
    try:
        return recent_gate_decisions(state_dir_of(ctx), STATUS_GATES)
    except Exception:
        log.exception("status_gate_reports_unreadable")
        return []


async def status(request: web.Request) -> web.Response:
    _authorize(request)
    ctx = request.app[CONTEXT]
    payload = _status_payload(ctx)
    payload["gates"] = await asyncio.to_thread(_gate_decisions, ctx)
    return web.json_response(payload)


async def _check_served(ctx: ProxyContext, target: str, rollback: bool = False) -> list[str]:
    """Refuse to point an alias at a name some replica does not serve (409); the replicas
    that could not be asked are returned when `rollback` allows them.

    A rollback is the incident's tool, and the incident may be a bad version that took a
    replica down: refused until every replica answered, it could not undo that version. So
    a rollback goes ahead once every replica that answers lists the target (at least one
    must): the proxy routes around a down replica, and one that comes back without the
    target answers 404, which hands the request to another, until the learner's reloader
    has loaded it there. A flip or canary still needs every replica's word."""

    async def listed(replica: Replica) -> bool | None:
        try:
            return target in await ctx.pool.served_models(replica)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # ValueError: no list
            if rollback and not isinstance(exc, ValueError):
                log.warning("rollback_replica_unconfirmed", replica=replica.url, error=repr(exc))
                return None
            raise ProxyError(
                502,
                f"Replica {replica.url} did not list its models: {type(exc).__name__}.",
                type_="api_error",
                code="upstream_error",
            ) from exc

    replicas = ctx.pool.replicas
    found = await asyncio.gather(*(listed(r) for r in replicas))
    unreachable = [r.url for r, ok in zip(replicas, found, strict=True) if ok is None]
    if len(unreachable) == len(replicas):
        raise ProxyError(
            502,
            f"No replica listed its models ({', '.join(unreachable)}): nothing confirms "
            f"that '{target}' is served, so nothing was rolled back.",
            type_="api_error",
            code="upstream_error",
        )
    missing = [r.url for r, ok in zip(replicas, found, strict=True) if ok is False]
    if missing:
        raise ProxyError(
            409,
            f"'{target}' is not loaded on replica(s) {', '.join(missing)}; load it on "
            "every replica before flipping the alias.",
            type_="conflict",
            code="not_loaded",
        )
    return unreachable


def _ended_canary(ctx: ProxyContext, alias: str) -> dict[str, Any] | None:
    canary = ctx.aliases.canaries().get(alias)
    return canary.to_json() if canary is not None else None


async def set_alias(request: web.Request) -> web.Response:
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    body = await _json_object(request)
    if not isinstance(body.get("alias"), str) or not body["alias"]:
        raise bad_request("'alias' must be a non-empty string.", param="alias")
    # Only an alias the table has: a name it lacks (a typo, a learner configured with
    # another alias) would have become a new public model, answering 200 while the
    # intended alias stayed where it was.
    alias = _known_alias(ctx, body)
    target = _served_target(ctx, body.get("target"), "target")
    async with request.app[ADMIN_LOCK]:
        if ctx.state.frozen:
            raise ProxyError(
                409,
                "Serving is frozen; unfreeze before changing aliases (rollback still works).",
                type_="conflict",
                code="frozen",
            )
        _check_expected(ctx, alias, body)
        if ctx.aliases.resolve(alias) == target and alias not in ctx.aliases.canaries():
            # Nothing would change: it answered 200 and wrote a flip to the state's history
            # and an `alias_set` audit record whose `previous` was its `target`, as if a
            # decision had been made (a rollback or canary of the current version is 409).
            raise ProxyError(
                409, f"'{alias}' already serves {target}.", type_="conflict", code="already_serving"
            )
        return await _point_alias(ctx, actor, alias, target, "flip", "alias_set")


async def _point_alias(
    ctx: ProxyContext, actor: str, alias: str, target: str, kind: str, event: str
) -> web.Response:
    """A flip or rollback (under the admin lock): the target must be served (a rollback:
    by every replica that answers, which the response and the audit record name as
    `unconfirmed_replicas`); a canary on the alias ends; the change is recorded and
    audited."""
    unconfirmed = await _check_served(ctx, target, rollback=kind == "rollback")
    ended = _ended_canary(ctx, alias)
    async with _all_or_nothing(ctx) as change:
        previous = ctx.aliases.set(alias, target)
        ctx.state.record(kind, actor, alias=alias, target=target, previous=previous)
        payload: dict[str, Any] = {"alias": alias, "target": target, "previous": previous}
        if unconfirmed:
            payload["unconfirmed_replicas"] = unconfirmed
        await change.commit(actor, event, payload | ({"ended_canary": ended} if ended else {}))
    return web.json_response(
        payload | {"serving_version": ctx.aliases.resolve(ctx.config.policy_alias)}
    )


def _lineage(ctx: ProxyContext, alias: str) -> list[str]:
    """The versions the alias served, oldest first, without those rolled back past."""
    return alias_lineage(ctx.state.history, alias, ctx.config.base_served_name)


def _earlier_versions(ctx: ProxyContext, alias: str) -> list[str]:
    """The versions a rollback of the alias may serve, oldest first: its lineage before the
    current version."""
    current = ctx.aliases.resolve(alias)
    lineage = _lineage(ctx, alias)
    if current in lineage:
        lineage = lineage[: len(lineage) - 1 - lineage[::-1].index(current)]
    return lineage


def rollback_target(ctx: ProxyContext, alias: str) -> str | None:
    """What `olp rollback` would serve: the version before the current one in the alias's
    lineage, or None when there is none."""
    earlier = _earlier_versions(ctx, alias)
    return earlier[-1] if earlier else None


def _rollback_to(ctx: ProxyContext, alias: str, value: Any) -> str:
    """A rollback's `to`: a version earlier in the alias's lineage, else 409. A rollback
    works while frozen; a `to` that went anywhere loaded made it a promotion past the
    freeze (and past the gate: a version the alias never served)."""
    target = _served_target(ctx, value, "to")
    current = ctx.aliases.resolve(alias)
    if target == current:
        raise ProxyError(
            409, f"'{alias}' already serves {target}.", type_="conflict", code="already_serving"
        )
    earlier = _earlier_versions(ctx, alias)
    if target not in earlier:
        raise ProxyError(
            409,
            f"'{alias}' did not serve {target} before {current}, so a rollback cannot go to "
            f"it (it may go back to: {', '.join(reversed(earlier)) or 'nothing'}); to serve "
            "another version, flip the alias (POST /admin/aliases), which a freeze refuses.",
            type_="conflict",
            code="not_in_lineage",
        )
    return target


def _rollback_target(ctx: ProxyContext, alias: str) -> str:
    """`rollback_target`, or 409 when the alias has no earlier version."""
    target = rollback_target(ctx, alias)
    if target is not None:
        return target
    raise ProxyError(
        409,
        f"There is no earlier version of '{alias}' to roll back to.",
        type_="conflict",
        code="no_previous_version",
    )


def _check_rolled_back_from(ctx: ProxyContext, alias: str, body: dict[str, Any]) -> None:
    """With `from` (the version the operator decided to roll back: a running canary's
    target, else what the alias serves), 409 when that is no longer what a rollback would
    undo. Between `olp status` and `olp rollback` the learner may flip to a newer version
    or start its canary: the rollback then undid the newer one, or ended its canary, and the
    version the operator meant kept serving."""
    if "from" not in body:
        return
    meant = _served_target(ctx, body["from"], "from")
    canary = ctx.aliases.canaries().get(alias)
    current = canary.target if canary is not None else ctx.aliases.resolve(alias)
    if current != meant:
        running = f"runs a canary of {current}" if canary is not None else f"serves {current}"
        raise ProxyError(
            409,
            f"'{alias}' {running}, not {meant} as the rollback expected: it changed "
            "meanwhile, and nothing was rolled back. Look at `olp status` and run it again.",
            type_="conflict",
            code="alias_changed",
        )


async def rollback(request: web.Request) -> web.Response:
    """Undo the newest change: a running canary first, else the alias's last version."""
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    body = await _json_object(request)
    async with request.app[ADMIN_LOCK]:
        alias = _known_alias(ctx, body)
        _check_rolled_back_from(ctx, alias, body)
        target = body.get("to")
        if alias in ctx.aliases.canaries() and (
            target is None or _served_target(ctx, target, "to") == ctx.aliases.resolve(alias)
        ):
            # Back to the stable version while a canary runs is ending the canary: a 409
            # "already serves" left the canary's share on the version being rolled back.
            return await _end_canary(ctx, actor, alias, "rollback", "operator rollback")
        if target is None:
            target = _rollback_target(ctx, alias)
        else:
            target = _rollback_to(ctx, alias, target)
        return await _point_alias(ctx, actor, alias, target, "rollback", "rollback")


def _share(value: Any) -> float:
    share = finite_float(value)
    if share is None:
        raise bad_request("'share' must be a number between 0 and 1.", param="share")
    if not 0.0 < share < 1.0:
        raise bad_request("'share' must lie strictly between 0 and 1.", param="share")
    return share


async def start_canary(request: web.Request) -> web.Response:
    """Send `share` of an alias's training-enabled traffic to `target` (loaded everywhere)."""
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    body = await _json_object(request)
    async with request.app[ADMIN_LOCK]:
        alias = _known_alias(ctx, body)
        target = _served_target(ctx, body.get("target"), "target")
        share = _share(body.get("share"))
        if ctx.state.frozen:
            raise ProxyError(
                409,
                "Serving is frozen; unfreeze before starting a canary.",
                type_="conflict",
                code="frozen",
            )
        _check_expected(ctx, alias, body)
        stable = ctx.aliases.resolve(alias)
        if target == stable:
            raise ProxyError(
                409, f"'{alias}' already serves {target}.", type_="conflict", code="already_serving"
            )
        if alias in ctx.aliases.canaries():
            raise ProxyError(
                409,
                f"A canary is already running on '{alias}'; end it first.",
                type_="conflict",
                code="canary_running",
            )
        await _check_served(ctx, target)
        async with _all_or_nothing(ctx) as change:
            ctx.aliases.start_canary(alias, Canary(target, share, time.time()))
            ctx.state.record(
                "canary_start", actor, alias=alias, target=target, share=share, stable=stable
            )
            await change.commit(
                actor,
                "canary_started",
                {"alias": alias, "target": target, "share": share, "stable": stable},
            )
        return web.json_response(
            {"alias": alias, "target": target, "share": share, "stable": stable}
        )


async def _end_canary(
    ctx: ProxyContext, actor: str, alias: str, decision: str, reason: str
) -> web.Response:
    canary = ctx.aliases.canaries()[alias]
    stable = ctx.aliases.resolve(alias)
    payload = {"alias": alias, "target": canary.target, "stable": stable, "reason": reason}
    async with _all_or_nothing(ctx) as change:
        if decision == "promote":
            ctx.aliases.set(alias, canary.target)
            ctx.state.record("flip", actor, alias=alias, target=canary.target, previous=stable)
            await change.commit(actor, "canary_promoted", payload)
        else:
            ctx.aliases.end_canary(alias)
            ctx.state.record("canary_rollback", actor, alias=alias, target=canary.target)
            await change.commit(actor, "canary_rolled_back", payload)
    return web.json_response(
        {
            "alias": alias,
            "decision": decision,
            "target": canary.target,
            "serving_version": ctx.aliases.resolve(alias),
        }
    )


async def end_canary(request: web.Request) -> web.Response:
    """Promote the canary's target to all traffic, or send all traffic back to the stable."""
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    body = await _json_object(request)
    async with request.app[ADMIN_LOCK]:
        alias = body.get("alias", ctx.config.policy_alias)
        decision = body.get("decision")
        reason = body.get("reason", "")
        if decision not in ("promote", "rollback"):
            raise bad_request("'decision' must be 'promote' or 'rollback'.", param="decision")
        # A lone surrogate (`"\ud800"` reads as one) cannot be written to the audit log.
        if not isinstance(reason, str) or len(reason) > 500 or not is_utf8_text(reason):
            raise bad_request(
                "'reason' must be UTF-8 text of at most 500 characters.", param="reason"
            )
        if not isinstance(alias, str) or alias not in ctx.aliases.canaries():
            raise ProxyError(404, f"No canary is running on {alias!r}.", code="no_canary")
        running = ctx.aliases.canaries()[alias].target
        if "target" in body and _served_target(ctx, body["target"], "target") != running:
            # The learner names its candidate: an operator's canary started since is not its.
            raise ProxyError(
                409,
                f"The canary on {alias!r} is of {running}, not {body['target']}.",
                type_="conflict",
                code="canary_changed",
            )
        if decision == "promote":
            if ctx.state.frozen:
                raise ProxyError(
                    409,
                    "Serving is frozen; a canary can only be rolled back.",
                    type_="conflict",
                    code="frozen",
                )
            await _check_served(ctx, ctx.aliases.canaries()[alias].target)
        return await _end_canary(ctx, actor, alias, decision, reason)


async def freeze(request: web.Request) -> web.Response:
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    body = await _json_object(request)
    async with request.app[ADMIN_LOCK]:
        learning = body.get("learning")
        if learning is None:  # absent or null: the default, learning stops too
            learning = True
        if not isinstance(learning, bool):
            raise bad_request("'learning' must be a boolean.", param="learning")
        # A freeze never loosens one in force: a second operator's plain freeze ("make sure
        # promotions are stopped") resumed the learning a first one had paused, on the very
        # traffic under investigation. Learning resumes with an unfreeze.
        learning = learning or (ctx.state.frozen and ctx.state.learning_frozen)
        # Freezing stops every change to what serves, so running canaries go back to stable.
        ended = {alias: c.to_json() for alias, c in ctx.aliases.canaries().items()}
        async with _all_or_nothing(ctx) as change:
            for alias in ended:
                ctx.aliases.end_canary(alias)
            ctx.state.frozen = True
            ctx.state.learning_frozen = learning
            ctx.state.record("freeze", actor, learning=learning)
            await change.commit(
                actor,
                "freeze",
                {"learning": learning} | ({"ended_canaries": ended} if ended else {}),
            )
        return web.json_response({"frozen": True, "learning_frozen": learning})


async def unfreeze(request: web.Request) -> web.Response:
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    # Its body was never read: `{"learning": false}` (meant as "keep learning paused") lifted
    # the whole freeze, and a body that was no JSON answered 200.
    if body := await _json_object(request):
        raise bad_request(
            f"An unfreeze takes no parameters (got {', '.join(map(repr, body))}): it lifts "
            "the whole freeze. To keep learning paused, freeze with learning instead.",
            param=next(iter(body)),
        )
    async with request.app[ADMIN_LOCK]:
        async with _all_or_nothing(ctx) as change:
            ctx.state.frozen = False
            ctx.state.learning_frozen = False
            ctx.state.record("unfreeze", actor)
            await change.commit(actor, "unfreeze", {})
        return web.json_response({"frozen": False, "learning_frozen": False})


async def set_tenant_training(request: web.Request) -> web.Response:
    actor = _authorize(request)
    ctx = request.app[CONTEXT]
    name = request.match_info["name"]
    tenant = ctx.tenants.tenants.get(name)
    if tenant is None:
        raise ProxyError(404, f"Unknown tenant {name!r}.", code="tenant_not_found")
    body = await _json_object(request)
    if "enabled" not in body:
        raise bad_request("'enabled' is required: true, false or null.", param="enabled")
    enabled = body["enabled"]
    if enabled is not None and not isinstance(enabled, bool):
        raise bad_request(
            "'enabled' must be true, false or null (null: follow the config again).",
            param="enabled",
        )
    async with request.app[ADMIN_LOCK], _all_or_nothing(ctx) as change:
        tenant.training_override = enabled
        if enabled is None:
            ctx.state.tenant_training.pop(name, None)
        else:
            ctx.state.tenant_training[name] = {
                "enabled": enabled,
                "config_enabled": tenant.config.training_enabled,
            }
        ctx.state.record("tenant_training", actor, tenant=name, enabled=enabled)
        await change.commit(actor, "tenant_training", {"tenant": name, "enabled": enabled})
    return web.json_response(
        {"tenant": name, "training_enabled": tenant.training_enabled, "switch": enabled}
    )


def add_admin_routes(app: web.Application) -> None:
    # Imported here: the operator page builds on this module's auth and status payload.
    from proxy.operator_page import add_operator_routes

    add_operator_routes(app)
    app[ADMIN_LOCK] = asyncio.Lock()
    app.router.add_get("/admin/status", status)
    app.router.add_post("/admin/aliases", _to_the_end(set_alias), expect_handler=defer_continue)
    app.router.add_post("/admin/rollback", _to_the_end(rollback), expect_handler=defer_continue)
    app.router.add_post("/admin/canary", _to_the_end(start_canary), expect_handler=defer_continue)
    app.router.add_post("/admin/canary/end", _to_the_end(end_canary), expect_handler=defer_continue)
    app.router.add_post("/admin/freeze", _to_the_end(freeze), expect_handler=defer_continue)
    app.router.add_post("/admin/unfreeze", _to_the_end(unfreeze), expect_handler=defer_continue)
    app.router.add_post(
        "/admin/tenants/{name}/training",
        _to_the_end(set_tenant_training),
        expect_handler=defer_continue,
    )
