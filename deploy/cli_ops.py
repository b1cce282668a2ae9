"""Operator commands of the `olp` CLI: status, freeze, rollback, tenants, ui, audit."""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import sys
import tempfile
import urllib.parse
import webbrowser
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from deploy.admin_client import AdminClient, AdminError
from deploy.config import OlpConfig
from deploy.ports import local_http_url

AddConfig = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def positive_int(text: str) -> int:
    """argparse type for counts that must be at least 1 (0 would run nothing, or divide by 0)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def _admin_call(
    args: argparse.Namespace,
    cfg: OlpConfig,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    client = AdminClient.from_config(cfg, args.admin_key, getattr(args, "actor", None))
    return client.call(method, path, body) or {}


def _run_admin(fn: Callable[[argparse.Namespace, OlpConfig], int]) -> Callable[..., int]:
    def wrapped(args: argparse.Namespace, cfg: OlpConfig) -> int:
        try:
            return fn(args, cfg)
        except AdminError as exc:
            print(f"olp: {exc}", file=sys.stderr)
            return 1

    return wrapped


@_run_admin
def cmd_status(args: argparse.Namespace, cfg: OlpConfig) -> int:
    status = _admin_call(args, cfg, "GET", "/admin/status")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(format_status(status))
    return 0


def format_status(status: dict[str, Any]) -> str:
    """`/admin/status` for a terminal (`--json` prints it whole)."""
    lines = [
        f"serving: {status.get('serving_version')}   frozen: {status.get('frozen')}   "
        f"learning frozen: {status.get('learning_frozen')}"
    ]
    aliases = status.get("aliases", {})
    if aliases:
        lines.append("aliases: " + ", ".join(f"{k} -> {v}" for k, v in aliases.items()))
    for alias, canary in (status.get("canaries") or {}).items():
        lines.append(
            f"canary: {alias} -> {canary.get('target')} "
            f"for {canary.get('share')} of training traffic"
        )
    for tenant in status.get("tenants", []):
        lines.append(
            f"tenant {tenant.get('name')}: training "
            f"{'on' if tenant.get('training_enabled') else 'off'}"
            + (" (set at run time)" if tenant.get("training_switch") is not None else "")
        )
    if status.get("upstreams"):
        lines.append("upstreams: " + ", ".join(status["upstreams"]))
    history = status.get("history", [])
    if history:
        lines.append("history (newest last):")
        lines += [f"  {format_history_entry(entry)}" for entry in history[-5:]]
    gates = [g for g in status.get("gates") or [] if isinstance(g, dict)]
    if gates:
        lines.append("gates (newest last):")
        lines += [f"  {format_gate_decision(gate)}" for gate in gates]
    return "\n".join(lines)


def _when(at: Any) -> str:
    """Unix seconds as ISO UTC; anything no clock can show (a string, NaN, 1e300) as is."""
    if isinstance(at, int | float) and math.isfinite(at):
        try:
            iso = datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")
            return iso.replace("+00:00", "Z")
        except (OverflowError, ValueError, OSError):
            pass
    return str(at)


def _number_pair(metric: float, threshold: float) -> tuple[str, str]:
    """Both numbers with as few digits as tell them apart: `0.667 > 0.5`, yet never
    `0.5 > 0.5` for a metric of 0.5001."""
    for digits in range(3, 7):
        shown = f"{metric:.{digits}g}", f"{threshold:.{digits}g}"
        if shown[0] != shown[1]:
            break
    return shown


def _failed_gate(gate: dict[str, Any]) -> str:
    """`name (metric > threshold)` for a gate that measured and missed, `name (no metric:
    reason)` for one that could not measure (it fails closed)."""
    name, metric, threshold = gate.get("name", "?"), gate.get("metric"), gate.get("threshold")
    if isinstance(metric, int | float) and isinstance(threshold, int | float):
        # The report records the pass condition; a failed gate broke it, so show its negation.
        broke = {"<=": ">", ">=": "<"}.get(gate.get("comparison"), "vs")
        shown_metric, shown_threshold = _number_pair(metric, threshold)
        return f"{name} ({shown_metric} {broke} {shown_threshold})"
    reason = gate.get("reason")
    return f"{name} (no metric: {reason})" if reason else f"{name} (no metric)"


def format_gate_decision(gate: dict[str, Any]) -> str:
    """One entry of the status's `gates` as `version verdict time duration failed-gates`."""
    version = gate.get("version", "?")
    if gate.get("error"):
        return f"{version} unreadable: {gate['error']}"
    verdict = "passed" if gate.get("passed") is True else "rejected"
    duration = gate.get("duration_s")
    took = f"{duration:.1f} s" if isinstance(duration, int | float) else "? s"
    when = _when(gate["started_at"]) if gate.get("started_at") is not None else "?"
    failed = ", ".join(_failed_gate(g) for g in gate.get("failed") or [] if isinstance(g, dict))
    return f"{version} {verdict:<8}  {when}  {took:>7}  {failed}".rstrip()


def format_history_entry(entry: dict[str, Any]) -> str:
    """One admin change as `time actor kind key=value ...`, the shape `olp audit show` uses
    (the raw entry has a unix-seconds float an operator cannot read at a glance)."""
    rest = {k: v for k, v in entry.items() if k not in ("at", "actor", "kind")}
    fields = " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(rest.items()))
    when, actor, kind = _when(entry.get("at")), entry.get("actor", "?"), entry.get("kind", "?")
    return f"{when} {actor} {kind} {fields}".rstrip()


@_run_admin
def cmd_freeze(args: argparse.Namespace, cfg: OlpConfig) -> int:
    result = _admin_call(args, cfg, "POST", "/admin/freeze", {"learning": args.learning})
    # What the proxy says: learning paused by an earlier freeze stays paused.
    paused = bool((result or {}).get("learning_frozen", args.learning))
    # JSON alone with --json, as `olp status --json`: the line before it broke `| jq`.
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"frozen: promotions stopped{' and learning paused' if paused else ''}")
    return 0


@_run_admin
def cmd_unfreeze(args: argparse.Namespace, cfg: OlpConfig) -> int:
    _admin_call(args, cfg, "POST", "/admin/unfreeze", {})
    print("unfrozen: promotions and learning resume")
    return 0


@_run_admin
def cmd_rollback(args: argparse.Namespace, cfg: OlpConfig) -> int:
    # What is rolled back, said to the proxy: the learner may flip to a newer version (or
    # start its canary) between the operator's look and this call, and the rollback then
    # undid that one instead; the proxy refuses (409) when it changed.
    meant = args.from_
    if meant is None:
        status = _admin_call(args, cfg, "GET", "/admin/status")
        canary = (status.get("canaries") or {}).get(status.get("policy_alias"))
        meant = canary.get("target") if isinstance(canary, dict) else status.get("serving_version")
    body: dict[str, Any] = {"from": meant} if meant is not None else {}
    if args.to is not None:
        body["to"] = args.to
    result = _admin_call(args, cfg, "POST", "/admin/rollback", body)
    if result.get("decision") == "rollback":
        print(
            f"canary of {result.get('target')} ended: "
            f"all traffic on {result.get('serving_version')}"
        )
    else:
        print(f"rolled back: now serving {result.get('serving_version', result)}")
    if unconfirmed := result.get("unconfirmed_replicas"):
        print(
            f"not confirmed on {', '.join(unconfirmed)} (did not answer): requests go to the "
            "other replicas until it serves the version again"
        )
    return 0


@_run_admin
def cmd_tenant(args: argparse.Namespace, cfg: OlpConfig) -> int:
    enabled = {"on": True, "off": False, "config": None}[args.training]
    result = _admin_call(args, cfg, "POST", _tenant_training_path(args.name), {"enabled": enabled})
    if enabled is None:
        state = "enabled" if result.get("training_enabled") else "disabled"
        print(f"tenant {args.name}: online training {state}, as the config says")
    else:
        print(f"tenant {args.name}: online training {'enabled' if enabled else 'disabled'}")
    return 0


@_run_admin
def cmd_ui(args: argparse.Namespace, cfg: OlpConfig) -> int:
    """A one-time sign-in link for the operator page: the admin key stays off the URL bar."""
    link = _admin_call(args, cfg, "POST", "/admin/ui/link")
    url = link.get("url")
    if not isinstance(url, str):
        print(f"olp: the proxy answered no link: {link}", file=sys.stderr)
        return 1
    print(url)
    print(f"(one use, valid {link.get('expires_in_s', '?')} s)", file=sys.stderr)
    if args.open and not webbrowser.open(url):
        print("olp: no browser to open here; open the link above", file=sys.stderr)
    return 0


def _non_empty(what: str) -> Callable[[str], str]:
    """An argparse type refusing an empty value: `olp rollback --to "$VERSION"` with an
    empty variable did a plain rollback, to another version than the script meant."""

    def parse(value: str) -> str:
        if not value.strip():
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        return value

    return parse


def _tenant_training_path(name: str) -> str:
    # Quoted: a name with a space or '/' would otherwise be an invalid or different URL.
    return f"/admin/tenants/{urllib.parse.quote(name, safe='')}/training"


class _NoAuditLog(Exception):
    pass


def _audit_path(args: argparse.Namespace, cfg: OlpConfig) -> Path:
    """The live audit file named by FILE (a file, a rotated file or a directory) or the
    config; _NoAuditLog when it has neither a chain file nor a head (a head without its
    files is a deleted log, which `verify` reports as tampering)."""
    from safety.audit import chain_files, head_path, resolve_live_path

    configured = cfg.state_dir / cfg.safety.audit.path
    given = Path(args.file) if args.file is not None else configured
    if given.is_dir():
        # A directory means `audit.jsonl` in it, else the log of the configured name in it
        # (`safety.audit.path` `audit/events.jsonl`: `verify <state_dir>/audit` said there
        # was none), else the configured path below it (a state dir: `verify <state_dir>`
        # said there was none).
        candidates = [given / "audit.jsonl", given / configured.name]
        if not Path(cfg.safety.audit.path).is_absolute():  # else `given /` would drop given
            candidates.append(given / cfg.safety.audit.path)
        found = [c for c in candidates if chain_files(c) or head_path(c).exists()]
        given = found[0] if found else candidates[1]
    live = resolve_live_path(given)
    if not chain_files(live) and not head_path(live).exists():
        raise _NoAuditLog(f"no audit log at {live}")
    return live


def _run_audit(fn: Callable[[argparse.Namespace, OlpConfig], int]) -> Callable[..., int]:
    def wrapped(args: argparse.Namespace, cfg: OlpConfig) -> int:
        from safety.audit import AuditError

        try:
            return fn(args, cfg)
        except _NoAuditLog as exc:
            print(f"olp: {exc}", file=sys.stderr)
            return 2
        except BrokenPipeError:
            raise  # `olp audit show | head`: the reader had what it wanted (see `main`)
        except (AuditError, OSError) as exc:  # a damaged or unreadable log
            print(f"olp: cannot read the audit log: {exc}", file=sys.stderr)
            return 2

    return wrapped


@_run_audit
def cmd_audit_verify(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from safety.audit import verify

    path = _audit_path(args, cfg)
    # The configured log is the live one: never read as a copy, even without head and lock.
    result = verify(path, require_head=args.file is None)
    # A rotated segment archived alone resolves to a live name that is not there.
    where = path if path.exists() or len(result.files) != 1 else result.files[0]
    if result.ignored:  # beside the log, named like a segment, not part of the chain
        print(f"not part of the chain, not read: {', '.join(map(str, result.ignored))}")
    if result.empty:  # an emptied log and its head deleted look the same: no proof
        print(f"olp: the audit log at {where} holds {result.reason}", file=sys.stderr)
        return 2
    if result.ok and result.copy:
        last = (result.first_seq or 1) + result.records - 1
        print(
            f"audit log OK as a copy: {result.records} records (seq {result.first_seq} to "
            f"{last}), their chain intact ({where})"
        )
        print(f"note: {result.reason}")
        return 0
    if result.ok:
        print(f"audit log OK: {result.records} records, chain intact ({where})")
        if result.reason:  # what it accepted and why (an interrupted append)
            print(f"note: {result.reason}")
        return 0
    print(f"audit log TAMPERED at seq {result.first_bad_seq}: {result.reason} ({where})")
    return 1


@_run_audit
def cmd_audit_show(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from safety.audit import (
        AuditError,
        format_record,
        ignored_files,
        iter_records,
        no_records_reason,
    )

    path = _audit_path(args, cfg)

    def show(record: dict[str, Any]) -> None:
        print(json.dumps(record) if args.json else format_record(record))

    # With --last, only that many are kept: a 228 MB log held 881 MB to show one record.
    # Without it, each is printed as it is read (all of them kept took 4x the log's size
    # and printed nothing until the whole log was read, `olp audit show | less` too).
    records: collections.deque[dict[str, Any]] = collections.deque(maxlen=args.last)
    read = 0
    damaged: AuditError | None = None
    try:
        for record in iter_records(path):
            read += 1
            if not args.event or record.get("event") == args.event:
                if args.last:
                    records.append(record)
                else:
                    show(record)
    except AuditError as exc:
        # The records before a damaged line are what an operator needs then: shown, and
        # the damage after them (it exits 2 all the same).
        damaged = exc
    for record in records:
        show(record)
    # Segments after a gap in the numbers (a deleted `.1`) are not part of the chain and not
    # read: the listing stopped short of them with nothing said, and exited 0.
    ignored = ignored_files(path)
    if ignored:
        names = ", ".join(p.name for p in ignored[:5])
        more = f" and {len(ignored) - 5} more" if len(ignored) > 5 else ""
        print(
            f"olp: not part of the chain, not read: {names}{more} (run `olp audit verify`)",
            file=sys.stderr,
        )
    if not read and damaged is None:  # as `verify`: not an empty listing of a quiet log
        print(f"olp: the audit log at {path} holds {no_records_reason(path)}", file=sys.stderr)
        return 2
    if damaged is not None:
        print(
            f"olp: cannot read the audit log past the records above: {damaged}",
            file=sys.stderr,
        )
        return 2
    return 0


_DATE_ONLY = re.compile(r"\d{4}-?\d{2}-?\d{2}(?:[+-].*)?")


def parse_bound(value: str | None) -> tuple[Any, float | None]:
    """`--from/--to`: a JSON object of offsets ({"trajectories": {"0": 10}}) or a time
    (unix seconds, or ISO 8601 with its zone). Returns (offsets, time)."""
    if value is None:
        return None, None
    text = value.strip()
    if text.startswith("{"):
        try:
            return json.loads(text), None
        except ValueError as exc:
            raise ValueError(f"--from/--to offsets are not valid JSON: {exc}") from None
    try:
        return None, float(text)
    except ValueError:
        pass
    if text[-1:] in ("Z", "z"):
        text = text[:-1] + "+00:00"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--from/--to {value!r} is neither offsets (JSON), unix seconds nor ISO 8601"
        ) from None
    if _DATE_ONLY.fullmatch(text):
        # Python 3.11 reads `2026-11-29+00:00` as that date with no zone (the offset dropped).
        raise ValueError(
            f"--from/--to {value!r} is a date: give a time and a zone, such as "
            f"{moment.date().isoformat()}T00:00:00Z"
        )
    if moment.tzinfo is None:
        # Read as this machine's local time it silently moved the window by the zone's
        # offset on a UTC server (the records and the audit log keep UTC).
        raise ValueError(
            f"--from/--to {value!r} has no time zone: add Z for UTC or an offset such as +01:00"
        )
    return None, moment.timestamp()


def cmd_replay_export(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from kafka.errors import KafkaError

    from replay.consumer import ResumeOffsetError
    from replay.export import STALLED_TIMEOUT_S, export_records

    try:
        from_offsets, from_time = parse_bound(args.from_)
        to_offsets, to_time = parse_bound(args.to)
    except ValueError as exc:  # the same exit as every other failed export
        print(f"olp: replay export: {exc}", file=sys.stderr)
        return 2
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    try:
        result = export_records(
            cfg.stream,
            Path(args.out),
            kinds=kinds,
            from_offsets=from_offsets,
            to_offsets=to_offsets,
            from_time=from_time,
            to_time=to_time,
        )
    except KafkaError as exc:
        # str() of a KafkaError starts with its class name (KafkaTimeoutError: ...).
        print(f"olp: replay export from {cfg.stream.bootstrap_servers}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # unwritable --out, bad --kinds or offsets
        print(f"olp: replay export: {exc}", file=sys.stderr)
        return 2
    except ResumeOffsetError as exc:  # --from past a partition's end: nothing was written
        print(f"olp: replay export: {exc}", file=sys.stderr)
        return 2
    print(
        f"exported {result.counts} to {result.path} ({result.format}); "
        f"invalid {result.invalid}, duplicates removed {result.duplicates}"
        + (f", tombstones skipped {result.tombstones}" if result.tombstones else "")
    )
    for kind, partitions in sorted(result.skipped_by_retention.items()):
        for partition, count in sorted(partitions.items()):
            print(
                f"olp: replay export: {count} {kind} records of partition {partition} before "
                "the first one the broker keeps were deleted by retention: not exported",
                file=sys.stderr,
            )
    # Where each partition's export stopped, in --from's own form: the next export of the
    # same topics starts there (without it, a CLI user could not chain exports).
    ends = {
        kind: {str(partition): offset for partition, offset in sorted(partitions.items())}
        for kind, partitions in result.end_offsets.items()
    }
    print(f"next --from: {json.dumps(ends, separators=(',', ':'))}")
    unread = sum(count for partitions in result.unread.values() for count in partitions.values())
    if unread:
        print(
            f"olp: replay export: stopped with at least {unread} records unread: the broker sent "
            f"nothing for {STALLED_TIMEOUT_S:g} s; the file holds the records before them, "
            "and an export from the `next --from` above gets the rest",
            file=sys.stderr,
        )
        return 1
    return 0


def _proxy_refuses_replay(base_url: str, key: str, model: str) -> str | None:
    """Why the proxy would refuse every replayed request, asked once, or None. Each request
    sent with a wrong key counted towards the failed-key lockout: past 20 the proxy locked
    this machine's address out, every local client with it; and a model that is not one of
    its aliases (a served name, `policy-v7`) was N 404s."""
    import urllib.error
    import urllib.request

    from deploy.direct_http import open_direct

    request = urllib.request.Request(
        f"{base_url}/v1/models", headers={"Authorization": f"Bearer {key}"}
    )
    try:
        with open_direct(request, 5.0) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return "the proxy refuses --api-key (401): give a tenant's key"
        if exc.code == 429:  # locked out after failed keys: each request would be a 429
            retry = exc.headers.get("retry-after") if exc.headers else None
            return f"the proxy answers 429 to this address; retry after {retry or 'a while'} s"
        return None  # another answer: the requests will say, each in its line
    except (urllib.error.URLError, OSError, ValueError):
        return None  # not answering: the requests will say so
    data = body.get("data") if isinstance(body, dict) else None
    listed = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
    if listed and model not in listed:
        return (
            f"the proxy serves no model '{model}' (its aliases: "
            f"{', '.join(map(str, listed))}); to replay against one version or a served name, "
            "use --direct"
        )
    return None


def cmd_replay_run(args: argparse.Namespace, cfg: OlpConfig) -> int:
    import asyncio

    from replay.replayer import replay_file

    if args.direct:
        base_url, key = cfg.policy.base_urls()[0], cfg.policy.api_key_value()
        from deploy.policy import NotAModelList, PolicyKeyRefused, models_listed

        try:  # not one 401 per recorded request: say which setting is missing
            served = models_listed(base_url, api_key=key)
        except PolicyKeyRefused as exc:
            if key is None:
                # The default: `olp up` made a key for this run and shows it nowhere.
                hint = (
                    "the vLLM `olp up` starts takes a new random key each run unless "
                    "policy.api_key names one: set the same policy.api_key (or "
                    "OLP_POLICY__API_KEY) for `olp up`, which takes it at its next start, "
                    "and for this command"
                )
            else:
                hint = (
                    "give this command the policy.api_key (or OLP_POLICY__API_KEY) that "
                    "`olp up` started with"
                )
            print(
                f"olp: replay run --direct: {exc}; {hint}; or replay through the proxy "
                "instead: --api-key with a tenant key, without --direct",
                file=sys.stderr,
            )
            return 2
        except NotAModelList as exc:  # something else listens there: no record would replay
            print(
                f"olp: replay run --direct: {exc}; that is not a vLLM server: check "
                "policy.host and policy.port (or policy.external_urls) point at the policy's "
                "vLLM",
                file=sys.stderr,
            )
            return 2
        if served and args.model not in served:
            # Not one 404 per recorded request, as through the proxy (a typo, an adapter
            # not loaded); vLLM lists its loaded adapters too.
            print(
                f"olp: replay run --direct: vLLM at {base_url} serves no model "
                f"'{args.model}' (it serves: {', '.join(map(str, served))})",
                file=sys.stderr,
            )
            return 2
    else:
        base_url, key = local_http_url(cfg.proxy.host, cfg.proxy.port), args.api_key
        if not key:
            print(
                "olp: replay through the proxy needs --api-key (or use --direct)", file=sys.stderr
            )
            return 2
        refused = _proxy_refuses_replay(base_url, key, args.model)
        if refused is not None:
            print(f"olp: replay run: {refused}", file=sys.stderr)
            return 2
    try:
        result = asyncio.run(
            replay_file(
                Path(args.file),
                Path(args.out),
                base_url=base_url,
                model=args.model,
                api_key=key,
                concurrency=args.concurrency,
            )
        )
    except (OSError, ValueError) as exc:  # missing or unreadable file, not an export
        print(f"olp: replay run: {exc}", file=sys.stderr)
        return 2
    print(
        f"replayed {result.sent} requests as {args.model}: {result.ok} ok, "
        f"{result.errors} errors → {result.path}"
    )
    return 0 if result.errors == 0 else 1


def cmd_demo(args: argparse.Namespace, cfg: OlpConfig) -> int:
    from deploy.demo import DemoSettings, run_demo
    from deploy.dev_keys import DEV_API_KEY

    out_dir = Path(args.out) if args.out else cfg.state_dir / "demo"
    try:  # before the run, not after: its results are written there at the end
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        print(
            f"olp: demo cannot write its results to {out_dir}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 2
    if args.enable_training:
        try:
            _admin_call(args, cfg, "POST", _tenant_training_path(args.tenant), {"enabled": True})
        except AdminError as exc:
            print(f"olp: {exc}", file=sys.stderr)
            return 1
        print(f"olp demo: online training enabled for tenant {args.tenant}", file=sys.stderr)
    settings = DemoSettings(
        proxy_url=local_http_url(cfg.proxy.host, cfg.proxy.port),
        api_key=args.api_key or DEV_API_KEY,
        sessions=args.sessions,
        samples_per_request=args.n,
        max_tokens=args.max_tokens,
        duration_s=args.minutes * 60,
        max_requests=args.requests,
        out_dir=out_dir,
    )
    summary = run_demo(settings, audit_path=cfg.state_dir / cfg.safety.audit.path)
    return 0 if summary["requests"] > 0 else 1


def register(sub: Any, with_config: AddConfig, admin: AddConfig) -> None:
    replay = sub.add_parser("replay", help="export recorded traffic, replay it")
    replay_sub = replay.add_subparsers(dest="replay_command", required=True)
    export = with_config(replay_sub.add_parser("export", help="stream records to a file"))
    export.add_argument("--out", required=True, help="FILE.jsonl (or .parquet with pyarrow)")
    export.add_argument("--from", dest="from_", help="offsets as JSON, or a time")
    export.add_argument("--to", help="offsets as JSON, or a time")
    export.add_argument("--kinds", default="trajectories,feedback")
    export.set_defaults(handler=cmd_replay_export)
    run = with_config(replay_sub.add_parser("run", help="re-send recorded requests"))
    run.add_argument("file", help="an export (JSONL) holding trajectories")
    run.add_argument("--model", required=True, help="alias or served name to replay against")
    run.add_argument("--out", required=True, help="JSONL with recorded and new side by side")
    run.add_argument("--direct", action="store_true", help="straight to vLLM, not the proxy")
    run.add_argument("--api-key", help="tenant key when replaying through the proxy")
    run.add_argument("--concurrency", type=int, default=4)
    run.set_defaults(handler=cmd_replay_run)

    demo = admin(sub.add_parser("demo", help="simulated users that show the loop learning"))
    demo.add_argument("--api-key", help="tenant API key (default: the dev key)")
    demo.add_argument("--tenant", default="demo", help="tenant to enable training for")
    demo.add_argument(
        "--no-enable-training",
        dest="enable_training",
        action="store_false",
        help="do not switch training on for the tenant first",
    )
    demo.add_argument("--sessions", type=positive_int, default=4, help="parallel simulated users")
    demo.add_argument(
        "--n", type=positive_int, default=8, help="samples per request (a GRPO group)"
    )
    demo.add_argument("--max-tokens", type=positive_int, default=16)
    demo.add_argument("--minutes", type=positive_float, default=30.0, help="how long to run")
    demo.add_argument("--requests", type=positive_int, help="stop after this many requests")
    demo.add_argument("--out", help="where the summary and plot go (default: <state>/demo)")
    demo.set_defaults(handler=cmd_demo)

    status = admin(sub.add_parser("status", help="serving version, candidates, learner state"))
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=cmd_status)

    freeze = admin(sub.add_parser("freeze", help="stop promotions (and optionally learning)"))
    freeze.add_argument("--learning", action="store_true", help="also pause learning")
    freeze.add_argument("--json", action="store_true")
    freeze.set_defaults(handler=cmd_freeze)
    admin(sub.add_parser("unfreeze", help="resume promotions and learning")).set_defaults(
        handler=cmd_unfreeze
    )
    rollback = admin(sub.add_parser("rollback", help="serve the previous (or a given) version"))
    rollback.add_argument(
        "--to",
        type=_non_empty("--to"),
        help="an earlier version of the alias to serve, e.g. policy-v3 or base",
    )
    rollback.add_argument(
        "--from",
        dest="from_",
        type=_non_empty("--from"),
        help="the version you mean to roll back (default: what `olp status` shows now); "
        "refused if the alias serves another by then",
    )
    rollback.set_defaults(handler=cmd_rollback)

    tenant = admin(sub.add_parser("tenant", help="per-tenant online-training switch"))
    tenant.add_argument("name", type=_non_empty("the tenant name"))
    tenant.add_argument(
        "--training",
        choices=["on", "off", "config"],
        required=True,
        help="on/off: a switch that survives restarts until the config's training_enabled "
        "for the tenant changes; config: drop the switch, follow the config",
    )
    tenant.set_defaults(handler=cmd_tenant)

    ui = admin(sub.add_parser("ui", help="print a one-time sign-in link to the operator page"))
    ui.add_argument("--open", action="store_true", help="also open it in the browser")
    ui.set_defaults(handler=cmd_ui)

    audit = sub.add_parser("audit", help="the tamper-evident audit log")
    audit_sub = audit.add_subparsers(dest="audit_command", required=True)
    verify = with_config(audit_sub.add_parser("verify", help="check the hash chain"))
    verify.add_argument("file", nargs="?", help="audit.jsonl (default: the state dir's)")
    verify.set_defaults(handler=cmd_audit_verify)
    show = with_config(audit_sub.add_parser("show", help="print the records readably"))
    show.add_argument("file", nargs="?", help="audit.jsonl (default: the state dir's)")
    show.add_argument(
        "--last",
        type=non_negative_int,
        default=0,
        help="only the last N records (0, the default: all of them)",
    )
    show.add_argument("--event", help="only records of this event type")
    show.add_argument("--json", action="store_true")
    show.set_defaults(handler=cmd_audit_show)
