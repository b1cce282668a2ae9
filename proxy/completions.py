"""`POST /v1/chat/completions` and `POST /v1/completions`: authenticate, admit, relay, capture.

Two relay modes: a request that is not captured is passed through byte for byte; a captured
one asks upstream for token ids / logprobs / usage, feeds every chunk to the capture and
strips the additions before the client sees them.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
import uuid
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import structlog
from aiohttp import HttpVersion11, StreamReader, web

from proxy.capture import CaptureContext, Redact, TrajectoryCapture, private_label
from proxy.config import is_utf8_text
from proxy.context import CONTEXT, REQUEST_ID, RESPONSE_STARTED, ProxyContext
from proxy.errors import ProxyError, bad_request, error_body
from proxy.expect_continue import send_continue
from proxy.fingerprint import FingerprintCarry
from proxy.metrics import UNROUTED_VERSION
from proxy.relay import (
    ENDPOINT_PATHS,
    Endpoint,
    RelayPlan,
    SSEParser,
    capture_refusal,
    dumps,
    ends_with_done,
    ends_with_error_event,
    last_reads,
    parse_json,
    plan_request,
    sse_event,
    strip_bytes,
    strip_chunk,
    strip_response,
    strip_sse,
    usage_of,
    with_usage,
)
from proxy.routing import UpstreamUnavailable
from proxy.tenants import Tenant, opts_out_of_training
from proxy.validation import choice_count, validate_completion_request
from safety.pseudonym import pseudonym

log = structlog.get_logger(__name__)

# An upstream error answer's headers that the client acts on; the rest (hop-by-hop, length,
# the server's own) are not passed on.
_FORWARDED_ERROR_HEADERS = ("retry-after",)
# The model server refusing the proxy's own credentials (its `--api-key`, or a gateway in
# front of it): the operator's configuration, not the client's key.
_UPSTREAM_AUTH_STATUSES = frozenset({401, 403, 407})
_DISCONNECT_ERRORS = (ConnectionResetError, ConnectionAbortedError, BrokenPipeError)
_DONE_EVENT = b"data: [DONE]\n\n"


# Client labels (X-Session-Id, X-OLP-Group-Id, X-OLP-Task) keep their first this many
# characters: they go into every record and log line of the request, and aiohttp alone
# would let each be 8 KB.
LABEL_MAX_CHARS = 256


def text_header(request: web.Request, name: str) -> str | None:
    """A header that reaches records and logs; 400 when its bytes are not UTF-8 (aiohttp
    decodes them to lone surrogates, which no sink can write)."""
    value = request.headers.get(name)
    if not value:
        return None
    if not is_utf8_text(value):
        raise bad_request(
            f"The {name} header must be UTF-8 text.", param=name, code="invalid_header"
        )
    return value


def cut_label(value: str, redact: Redact, key: bytes | None) -> str:
    """A client's label cut to `LABEL_MAX_CHARS`, its pseudonym (`capture.private_label`)
    taken of the whole value first when it holds PII: a cut through an e-mail address or a
    card number left a fragment the Redactor no longer matched (`...:bob.smith@example.c`),
    and that fragment reached records, Kafka and logs."""
    if len(value) <= LABEL_MAX_CHARS:
        return value
    return (private_label(value, redact, key) or value)[:LABEL_MAX_CHARS]


def label_header(request: web.Request, name: str) -> str | None:
    """A client's label header (`text_header`), cut by `cut_label`."""
    value = text_header(request, name)
    if value is None or len(value) <= LABEL_MAX_CHARS:
        return value
    ctx = request.app[CONTEXT]
    return cut_label(value, ctx.redactor.redact_obj, ctx.pseudonym_key)


# The request codings the proxy decodes itself (the app runs aiohttp without
# `auto_decompress`: with it, a coding aiohttp lacks the library for, such as `br`, got
# aiohttp's plain-text 400 before any handler ran, and a body that was not what its header
# said raised a 500 out of `request.read()`).
_ZLIB_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": zlib.MAX_WBITS,
}


def request_codings(request: web.Request) -> list[str]:
    """The request body's Content-Encoding codings in the order they were applied,
    lower-cased, `identity` left out."""
    codings = (
        coding.strip().lower()
        for header in request.headers.getall("Content-Encoding", [])
        for coding in header.split(",")
    )
    return [coding for coding in codings if coding and coding != "identity"]


def content_codings(request: web.Request) -> list[str]:
    """`request_codings`; 415 when one is not gzip or deflate."""
    codings = request_codings(request)
    unsupported = [coding for coding in codings if coding not in _ZLIB_WBITS]
    if unsupported:
        raise unsupported_encoding(unsupported[0], "send the body uncompressed, gzip or deflate")
    return codings


def unsupported_encoding(coding: str, hint: str) -> ProxyError:
    return ProxyError(
        415,
        f"Content-Encoding '{coding[:40]}' is not supported here: {hint}.",
        code="unsupported_content_encoding",
    )


# How much of an upstream error that is not OpenAI-shaped goes to the log, and how much of
# it is redacted first (the excerpt is cut from the redacted text).
_ERROR_EXCERPT_BYTES = 300
_ERROR_REDACTED_BYTES = 16384
_LAST_WORD = re.compile(r"\S+\Z")


def openai_shaped_error(payload: bytes) -> bool:
    """Whether an upstream's error body is one an OpenAI SDK reads: `{"error": {...}}`, or
    the flat `{"object": "error", "message": ...}` of older vLLM releases."""
    try:
        body, _ = parse_json(payload, allow_nonfinite=True)
    except ValueError:
        return False
    if not isinstance(body, dict):
        return False
    return isinstance(body.get("error"), dict) or body.get("object") == "error"


def _too_large(max_bytes: int) -> ProxyError:
    # Built when raised: made up front, it cost every request an exception and a message.
    return ProxyError(
        413, f"Request body exceeds the limit of {max_bytes} bytes.", code="request_too_large"
    )


async def _arriving_body(
    content: StreamReader, max_bytes: int, timeout_s: float, whole_within_s: bool = False
) -> bytes:
    """The body as it arrives, each wait for more bytes bounded by `timeout_s` (nginx's
    `client_body_timeout`). A client that stops sending without closing its connection (gone
    behind a NAT that dropped it, a laptop put to sleep) held its request, and one of its
    tenant's concurrency slots, until TCP keep-alive gave up on it: over two hours.

    `whole_within_s`: the whole body within `timeout_s`, for a request that holds no
    concurrency slot (feedback): a client sending a byte now and then kept any number of
    them open, one per post its rate allowed."""
    if whole_within_s:
        try:
            async with asyncio.timeout(timeout_s):
                return await _arriving_body(content, max_bytes, timeout_s)
        except TimeoutError:
            raise ProxyError(
                408,
                f"The request body was not whole after {timeout_s:g} s.",
                code="request_timeout",
            ) from None
    chunks, size = [], 0
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                chunk = await content.readany()
        except TimeoutError:
            raise ProxyError(
                408,
                f"The request body stopped arriving: no bytes for {timeout_s:g} s.",
                code="request_timeout",
            ) from None
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)


def _inflate(raw: bytes, coding: str, max_bytes: int) -> bytes:
    """`raw` decoded from `coding` (gzip, possibly of several members, or deflate with or
    without its zlib header); 400 when it is not that, 413 past `max_bytes` decoded (a
    small body can decode to gigabytes: no more than `max_bytes + 1` is ever produced)."""
    wbits = _ZLIB_WBITS[coding]
    if coding == "deflate" and raw and raw[0] & 0x0F != 8:
        wbits = -zlib.MAX_WBITS  # raw deflate, as some clients send it
    invalid = bad_request(
        f"The request body is not valid {coding} data (its Content-Encoding).",
        code="invalid_content_encoding",
    )
    parts: list[bytes] = []
    size = 0
    rest = raw
    while True:
        decoder = zlib.decompressobj(wbits)
        try:
            part = decoder.decompress(rest, max_bytes + 1 - size)
        except zlib.error as exc:
            raise invalid from exc
        size += len(part)
        if size > max_bytes:
            raise _too_large(max_bytes)
        if not decoder.eof:
            raise invalid  # cut short
        parts.append(part)
        rest = decoder.unused_data
        if not rest:
            return b"".join(parts)
        if wbits != _ZLIB_WBITS["gzip"]:
            raise invalid  # data after the end of the deflate stream


async def read_json_body(
    request: web.Request, max_bytes: int, timeout_s: float, whole_within_s: bool = False
) -> Any:
    """The request body as JSON; 413 over the limit, 400 when it does not parse, 408 when
    it stops arriving (`read_json`)."""
    body, _, _ = await read_json(request, max_bytes, timeout_s, whole_within_s)
    return body


async def read_json(
    request: web.Request, max_bytes: int, timeout_s: float, whole_within_s: bool = False
) -> tuple[Any, Callable[[Any], bytes], bytes]:
    """`read_json_body`, plus the encoder that writes the body back as it came (msgspec, or
    Python's `json` for what only `json` reads, such as NaN): several times faster than
    `json` on the large bodies coding agents send; and the raw bytes."""
    length = request.content_length  # parses the header at each read
    if length is not None and length > max_bytes:
        raise ProxyError(
            413,
            f"Request body of {length} bytes exceeds the limit of {max_bytes} bytes.",
            code="request_too_large",
        )
    codings = content_codings(request)
    await send_continue(request)  # the checks before the body passed: a waiting client sends it
    try:
        if length is not None and request.content.is_eof():
            raw = await request.read()  # the usual body, whole with its headers: no timer
        else:
            # Still arriving, or chunked (where `read()` would buffer up to the app's limit,
            # max_body_bytes, before a smaller limit, the feedback endpoint's, is checked).
            raw = await _arriving_body(request.content, max_bytes, timeout_s, whole_within_s)
    except web.HTTPRequestEntityTooLarge as exc:
        raise _too_large(max_bytes) from exc
    if len(raw) > max_bytes:
        raise _too_large(max_bytes)
    for coding in reversed(codings):
        raw = _inflate(raw, coding, max_bytes)
    try:
        body, encode = parse_json(raw)
    except ValueError as exc:  # not JSON, not UTF-8, or nested too deeply
        raise bad_request(
            f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from exc
    return body, encode, raw


class CompletionRelay:
    """One request's journey; attributes keep what metrics and capture need."""

    def __init__(self, ctx: ProxyContext, request: web.Request, endpoint: Endpoint) -> None:
        self.ctx = ctx
        self.request = request
        self.endpoint = endpoint
        self.request_id: str = request[REQUEST_ID]
        self.client_request_id = request.headers.get("x-request-id") == self.request_id
        self.arrived = time.monotonic()
        self.policy_version = UNROUTED_VERSION
        self.tenant_label = "unauthenticated"
        self.stream = False
        self.status = 500
        self.ttft_s: float | None = None
        # A stream's last usage object (the usage chunk; with `continuous_usage_stats` every
        # chunk carries the running total): counted once, when the stream ends.
        self.usage: dict[str, Any] | None = None
        self.encode_body: Callable[[Any], bytes] = dumps
        self.raw_body = b""
        self.session_id: str | None = None  # X-Session-Id
        self.group_id: str | None = None  # X-OLP-Group-Id
        self.task: str | None = None  # X-OLP-Task
        self.opted_out = False  # X-OLP-Train: 0
        self.counted = False  # the request's metrics and log line were written

    async def handle(self) -> web.StreamResponse:
        ctx = self.ctx
        try:
            tenant = ctx.tenants.authenticate(self.request.headers.get("Authorization"))
            self.tenant_label = tenant.name
            self._read_headers()
            # Admitted before the body is read: a tenant over its limits gets its 429 without
            # the proxy buffering and parsing up to max_body_bytes, and a body still arriving
            # holds one of its concurrency slots.
            admission = ctx.tenants.admit(tenant)
        except ProxyError as err:
            self._count_error(err.status, err.kind)
            raise
        except Exception:
            self._count_error(500, "internal_error")  # the middleware answers it
            raise
        try:
            body, self.encode_body, self.raw_body = await read_json(
                self.request, ctx.config.max_body_bytes, ctx.config.body_timeout_s
            )
            # Before validation: a stream refused for its body is counted as a stream.
            self.stream = isinstance(body, dict) and body.get("stream") is True
            validate_completion_request(
                self.endpoint, body, ctx.config.max_messages, ctx.config.max_choices
            )
            self.stream = bool(body.get("stream", False))
            training = self._training(tenant, body)
            # A canary only ever takes traffic that is recorded for training: its live
            # reward decides whether it stays.
            served = ctx.aliases.route(
                body["model"],
                self.session_id or self.request_id,
                canary_eligible=training,
            )
            if served is None:
                raise ProxyError(
                    404,
                    f"The model '{body['model']}' does not exist or you do not have access to it.",
                    code="model_not_found",
                    param="model",
                )
            self.policy_version = served
            ctx.stalled_clients.watch(self.request)
            try:
                response = await self._relay(tenant, body, served, admission.headers, training)
            finally:
                ctx.stalled_clients.forget(self.request)
        except ProxyError as err:
            # The request was admitted (and spent a request): its error reports the limits.
            err.headers = {**admission.headers, **err.headers}
            self._count_error(err.status, err.kind)
            raise
        except Exception:
            if not self.counted:  # a failure after the answer was counted is not a 500
                self._count_error(500, "internal_error")
            raise
        except asyncio.CancelledError:
            if not self.counted:  # left before its answer began (a stream counts itself)
                if self._departure() == "shutdown":  # the client got no answer
                    self._count_error(503, "shutdown")
                else:
                    self._count_error(499, "client_disconnect")  # nginx's "client closed"
            raise
        finally:
            admission.release()  # also what `olp_proxy_in_flight` reads
        return response

    def _departure(self) -> str:
        """Why a request ended without its client: `shutdown` when the proxy's own stop cut
        it, else `client_disconnect` (a client that left during the drain, or was
        disconnected for not reading, too). The drain cuts nothing before `drain_s` has
        passed; aiohttp closes the connections it cuts as it cancels their handlers, so the
        time is what tells the two apart."""
        ends = self.ctx.drain_ends_at
        if ends is not None and time.monotonic() >= ends:
            return "shutdown"
        return "client_disconnect"

    def _count_error(self, status: int, kind: str) -> None:
        self.status = status
        self.ctx.metrics.errors.labels(kind, self.tenant_label).inc()
        self._count_request()

    def _count_request(self, usage: dict[str, Any] | None = None) -> None:
        """The request's metrics (with the tokens of `usage`) and its log line."""
        self.counted = True
        seconds = time.monotonic() - self.arrived
        self.ctx.metrics.request_series(
            self.endpoint, self.tenant_label, self.policy_version, self.stream, self.status
        ).count(seconds, self.ttft_s, usage)
        log.info(
            "request",
            endpoint=self.endpoint,
            tenant=self.tenant_label,
            policy_version=self.policy_version,
            stream=self.stream,
            status=self.status,
            seconds=round(seconds, 4),
        )

    def _capture_for(self, tenant: Tenant, body: dict[str, Any], served: str) -> TrajectoryCapture:
        user = body.get("user")
        # Without the client's x-request-id the request id is the proxy's own (`req-` and
        # 32 random hex, unique): the trajectory takes it as its id. Without X-Session-Id
        # it is also the trajectory's session id, its Kafka key, so feedback for it that
        # comes to a proxy that no longer remembers it is still keyed alike (app.feedback).
        # A client's own request id may repeat: then 128 random bits (token_hex: a quarter
        # of uuid4's cost).
        trajectory_id = secrets.token_hex(16) if self.client_request_id else self.request_id
        session_id = self.session_id or self.request_id
        # Positional, in the fields' order (one per line, named in its comment): a class
        # called with twelve keywords has them packed into a dict and unpacked again, ~5k
        # instructions of the ~80k that capture adds to a request (callgrind).
        context = CaptureContext(
            trajectory_id,  # trajectory_id
            self.request_id,  # request_id
            session_id,  # session_id
            tenant.name_hash,  # tenant_hash
            pseudonym(self.ctx.pseudonym_key, user) if isinstance(user, str) else None,  # user_hash
            self.endpoint,  # endpoint
            body["model"],  # model_alias
            # The record's contract names the base model `base` whatever vLLM serves it as
            # (`policy.served_model_name`): the schema and every reader expect that.
            "base" if served == self.ctx.config.base_served_name else served,  # policy_version
            self.group_id,  # group_id
            self.task,  # task
            body,  # request_body
            None,  # sampling: read from the body in the sink's worker
            time.time(),  # created_at
            time.monotonic(),  # started
            self.raw_body,  # request_raw
        )
        self.ctx.recent.add(
            trajectory_id, tenant.name_hash, session_id, choice_count(self.endpoint, body)
        )
        capture = TrajectoryCapture(context)
        self.ctx.capture.open(capture)
        return capture

    def _read_headers(self) -> None:
        self.session_id = label_header(self.request, "X-Session-Id")
        self.group_id = label_header(self.request, "X-OLP-Group-Id")
        self.task = label_header(self.request, "X-OLP-Task")
        self.opted_out = opts_out_of_training(self.request.headers.getall("X-OLP-Train", []))

    def _training(self, tenant: Tenant, body: dict[str, Any]) -> bool:
        """Whether this request is captured for training."""
        ctx = self.ctx
        if not ctx.config.capture_enabled or not ctx.tenants.wants_training(tenant, self.opted_out):
            self._not_captured(tenant)
            return False
        refusal = capture_refusal(self.endpoint, body)
        limit = ctx.capture.max_body_bytes
        if refusal is None and limit is not None and len(self.raw_body) > limit:
            refusal = "too_large"
        if refusal is None and not ctx.capture.has_room():
            refusal = "backlog"  # logged once when capture pauses and once when it resumes
        elif refusal is not None:
            log.info("capture_skipped", tenant=tenant.name, reason=refusal)
        if refusal is not None:
            ctx.metrics.captures_skipped.labels(self.tenant_label, refusal).inc()
            self._not_captured(tenant)
            return False
        return True

    def _not_captured(self, tenant: Tenant) -> None:
        """A training tenant's request that is not captured: remembered (in `not_captured`,
        apart from the captured ones), so that feedback on its request id is not recorded
        (`not_recorded_reason`)."""
        if tenant.training_enabled:
            self.ctx.not_captured.add(self.request_id, tenant.name_hash, "", 0)

    def _response_headers(
        self, extra: dict[str, str], capture: TrajectoryCapture | None
    ) -> dict[str, str]:
        headers = {
            "x-request-id": self.request_id,
            "x-olp-policy-version": self.policy_version,
            **extra,
        }
        if capture is not None:
            headers["x-olp-trajectory-id"] = capture.context.trajectory_id
        return headers

    async def _relay(
        self,
        tenant: Tenant,
        body: dict[str, Any],
        served: str,
        limit_headers: dict[str, str],
        training: bool,
    ) -> web.StreamResponse:
        ctx = self.ctx
        plan = plan_request(self.endpoint, body, served, capture=training)
        if plan.stream and not plan.added_usage and not plan.client_wants_usage:
            _ask_for_usage(plan)
        capture = self._capture_for(tenant, body, served) if training else None
        # vLLM adopts X-Request-Id as its own request id; a client's id may repeat, so
        # upstream gets it with a unique suffix (logs still correlate by prefix).
        upstream_id = self.request_id
        if self.client_request_id:
            upstream_id = f"{self.request_id}-{uuid.uuid4().hex[:8]}"
        upstream_headers = {"Content-Type": "application/json", "X-Request-Id": upstream_id}
        try:
            _, upstream = await ctx.pool.open(
                ENDPOINT_PATHS[self.endpoint],
                self.encode_body(plan.upstream_body),
                upstream_headers,
                self.session_id,
            )
        except UpstreamUnavailable as exc:
            if capture is not None:
                ctx.capture.submit(capture, "error")
            status = 504 if exc.timed_out else 502
            # The detail (a replica's host:port, the connect error) is for the operator's
            # log: the model server's address is not exposed beyond the proxy.
            log.warning("upstream_unavailable", error=str(exc))
            reason = "did not answer in time" if exc.timed_out else "is unavailable"
            raise ProxyError(
                status,
                f"The model server {reason} (request id {self.request_id}).",
                type_="api_error",
                code="upstream_timeout" if exc.timed_out else "upstream_error",
            ) from exc
        except asyncio.CancelledError:
            # aiohttp cancels the handlers still running after its shutdown grace period:
            # the record says so, and `drain()` does not wait for it in vain.
            if capture is not None:
                ctx.capture.submit(capture, "aborted")
            raise
        except Exception:
            if capture is not None:
                ctx.capture.submit(capture, "error")
            raise
        headers = self._response_headers(limit_headers, capture)
        try:
            if upstream.status != 200:
                return await self._relay_upstream_error(upstream, headers, capture)
            self._refuse_compressed(upstream, capture)
            if plan.stream:
                return await self._relay_stream(upstream, plan, headers, capture)
            return await self._relay_whole(upstream, plan, headers, capture)
        except asyncio.CancelledError:
            # The client left while the answer was on its way (a stream records this itself).
            if capture is not None and capture.finished_at is None:  # not submitted yet
                ctx.capture.submit(capture, "aborted")
            raise
        finally:
            upstream.release()  # an unfinished body closes the connection: vLLM aborts
            if capture is not None and capture.finished_at is None:
                # An unexpected failure: the record still says what happened.
                ctx.capture.submit(capture, "error")

    def _refuse_compressed(
        self, upstream: aiohttp.ClientResponse, capture: TrajectoryCapture | None
    ) -> None:
        """A 502 for an answer compressed against the proxy's `Accept-Encoding: identity` (a
        hop in between that compresses regardless): relayed, a stream reached the client as
        gzip bytes under `text/event-stream`, then an error event."""
        coding = upstream.headers.get("Content-Encoding", "identity").strip().lower()
        if coding in ("identity", ""):
            return
        log.error("upstream_answer_compressed", content_encoding=coding[:64])
        if capture is not None:
            self.ctx.capture.submit(capture, "error")
        raise ProxyError(
            502,
            f"The model server sent a compressed answer the proxy did not ask for "
            f"(request id {self.request_id}).",
            type_="api_error",
            code="upstream_error",
        )

    def _failed_mid_response(
        self, exc: BaseException, capture: TrajectoryCapture | None
    ) -> ProxyError:
        """The 502 (504 on a timeout) for a body upstream began but did not finish."""
        if capture is not None:
            self.ctx.capture.submit(capture, "error")
        timed_out = isinstance(exc, TimeoutError)
        return ProxyError(
            504 if timed_out else 502,
            f"The model server failed mid-response: {type(exc).__name__} "
            f"(request id {self.request_id}).",
            type_="api_error",
            code="upstream_timeout" if timed_out else "upstream_error",
        )

    async def _relay_upstream_error(
        self,
        upstream: aiohttp.ClientResponse,
        headers: dict[str, str],
        capture: TrajectoryCapture | None,
    ) -> web.Response:
        """vLLM's own 4xx/5xx answer goes to the client unchanged (it is OpenAI-shaped).
        Any other (a plain-text 404 from a server that is not vLLM, a load balancer's HTML
        502 page) gets an OpenAI-shaped error with the same status, so that the client's SDK
        reads a message and not a decoding failure; the upstream's words stay in the log,
        where they cannot show the client the upstream's address."""
        try:
            payload = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed_mid_response(exc, capture) from exc
        if capture is not None:
            self.ctx.capture.submit(capture, "error")
        status = upstream.status
        self.ctx.metrics.errors.labels(f"upstream_{status}", self.tenant_label).inc()
        for name in _FORWARDED_ERROR_HEADERS:
            if name in upstream.headers:
                headers[name] = upstream.headers[name]
        if status in _UPSTREAM_AUTH_STATUSES:
            # Relayed, the client's SDK raised AuthenticationError for a key the proxy had
            # accepted: clients took it for their own key being wrong.
            return self._upstream_refused_credentials(status, headers)
        self.status = status
        self._count_request()
        if openai_shaped_error(payload):
            return web.Response(
                status=status,
                body=payload,
                headers=headers,
                content_type=upstream.content_type or "application/json",
            )
        # Redacted before it is cut: cut first, a value across the cut (`alice@exa`) lost
        # what the patterns match and went to the log in part. The window redacted is cut
        # too, so its last word is dropped when the body goes on: a value split there could
        # still reach the excerpt when what came before it shrank (a 2 KB private key
        # redacted to a marker pulled a split `jane.doe@exa` into the first 300 characters).
        window = payload[:_ERROR_REDACTED_BYTES].decode("utf-8", "replace")
        if len(payload) > _ERROR_REDACTED_BYTES:
            window = _LAST_WORD.sub("", window)
        excerpt = self.ctx.redactor.redact_text(window)[0][:_ERROR_EXCERPT_BYTES]
        log.warning(
            "upstream_error_not_openai_shaped",
            status=status,
            content_type=upstream.content_type,
            size=len(payload),
            excerpt=excerpt,
        )
        message = (
            f"The model server answered {status} {upstream.reason or ''}".rstrip()
            + f" without an OpenAI error (request id {self.request_id})."
        )
        type_ = "invalid_request_error" if status < 500 else "api_error"
        return web.Response(
            status=status,
            body=dumps(error_body(message, type_, "upstream_error")),
            headers=headers,
            content_type="application/json",
        )

    def _upstream_refused_credentials(self, status: int, headers: dict[str, str]) -> web.Response:
        log.error(
            "upstream_refused_credentials",
            status=status,
            fix="check proxy.upstream_api_key (or policy.api_key) against the model server's key",
        )
        self.status = 502
        self._count_request()
        message = (
            f"The model server refused the proxy's credentials (HTTP {status}): a "
            f"configuration problem of this deployment, logged for its operator "
            f"(request id {self.request_id})."
        )
        return web.Response(
            status=502,
            body=dumps(error_body(message, "api_error", "upstream_error")),
            headers=headers,
            content_type="application/json",
        )

    async def _relay_whole(
        self,
        upstream: aiohttp.ClientResponse,
        plan: RelayPlan,
        headers: dict[str, str],
        capture: TrajectoryCapture | None,
    ) -> web.Response:
        try:
            raw = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise self._failed_mid_response(exc, capture) from exc
        try:
            if capture is not None:
                stripped = strip_bytes(plan, raw, whole=True)
                if stripped is None:  # a shape the byte path cannot prove: parse it
                    payload, encode = parse_json(raw, allow_nonfinite=True)
                    result = strip_response(plan, payload)
                    # Nothing of the proxy's there: the bytes as they came (re-encoded,
                    # floats changed spelling: `-1.2e-05` became `-0.000012`).
                    stripped = raw if result == payload else _as_vllm_writes(result, encode)
                # Read from the client's bytes: the usage is the same, and the logprobs and
                # token ids the proxy added are gone (skipping them was 17k instructions of
                # the bench's 16-token answer, 15 % of what capture adds to a request).
                usage = usage_of(stripped)
                capture.add_raw_response(raw)
                raw = stripped
            else:
                usage = usage_of(raw)
        except ValueError as exc:  # not JSON, not UTF-8, or nested too deeply
            if capture is not None:
                self.ctx.capture.submit(capture, "error")
            raise ProxyError(
                502,
                f"The model server sent invalid JSON (request id {self.request_id}).",
                type_="api_error",
                code="upstream_error",
            ) from exc
        response = web.Response(
            status=200, body=raw, headers=headers, content_type="application/json"
        )
        self.status = 200
        await self._send(response)
        self._count_request(usage)
        if capture is not None:
            self.ctx.capture.submit(capture, "ok")
        return response

    async def _send(self, response: web.Response) -> None:
        """Send a whole answer now rather than after the handler returns (aiohttp's way):
        the request's bookkeeping (metrics, log line, the capture's hand-off) then runs
        while the client reads its answer, not before the answer leaves. aiohttp finds
        the response sent and does not send it again."""
        try:
            await response.prepare(self.request)
            self.request[RESPONSE_STARTED] = True
            await response.write_eof()
            # Whole: a later failure's 500 is dropped by aiohttp as before, the connection
            # kept (re-raised, it closed a keep-alive connection after a complete answer).
            self.request[RESPONSE_STARTED] = False
        except _DISCONNECT_ERRORS:
            # The client left as its answer went out; aiohttp would have dropped it alike.
            log.info("client_left_before_answer")

    async def _relay_stream(
        self,
        upstream: aiohttp.ClientResponse,
        plan: RelayPlan,
        headers: dict[str, str],
        capture: TrajectoryCapture | None,
    ) -> web.StreamResponse:
        response = web.StreamResponse(status=200, headers=headers)
        # vLLM's own (`text/event-stream; charset=utf-8`): the charset was dropped.
        content_type = upstream.headers.get("Content-Type", "")
        if content_type.lower().startswith("text/event-stream"):
            response.headers["Content-Type"] = content_type
        else:
            response.content_type = "text/event-stream"
        response.headers["Cache-Control"] = "no-cache"
        if self.request.version >= HttpVersion11:
            response.enable_chunked_encoding()
        else:
            # HTTP/1.0 has no chunked encoding (aiohttp raises for it): the stream ends when
            # the connection closes. nginx talks HTTP/1.0 to its backends unless told
            # `proxy_http_version 1.1`.
            response.force_close()
        try:
            await response.prepare(self.request)
            self.request[RESPONSE_STARTED] = True
        except _DISCONNECT_ERRORS:
            # The client left as its answer began, before handler cancellation said so (a
            # soak of early disconnects hit this in 55 of 9000 requests): a departure, not a
            # proxy failure. aiohttp drops the response it cannot send.
            upstream.close()
            self.status = 499
            self._finish_stream("aborted", capture)
            return response
        self.status = 200
        parser = SSEParser()
        watch_usage = capture is None and plan.client_wants_usage
        watcher = SSEParser()  # reads the whole events `parser` passes on, for their usage
        drop_usage = capture is None and plan.added_usage
        carry = FingerprintCarry() if plan.added_usage else None
        outcome = "ok"
        done_sent = False  # the stream's `data: [DONE]` reached the client
        # vLLM reports a generation that failed mid-stream in the stream itself (an error
        # event, then [DONE]); relayed as sent, it made an 'ok' request and record. The
        # last two reads are kept (references, no copies) to look for it at the end.
        before_last = last = b""
        failure_kind = "upstream_mid_stream"  # what `olp_proxy_errors_total` counts it as
        try:
            async for data in _reads(upstream.content, carry, response):
                if self.ttft_s is None:
                    self.ttft_s = time.monotonic() - self.arrived
                    if capture is not None:
                        capture.mark_first_token()
                before_last, last = last_reads(before_last, last, data)
                if capture is not None or drop_usage:
                    block = parser.complete(data)
                    if not block:
                        continue
                    if capture is not None:
                        data = self._transform_events(plan, capture, block)
                    else:
                        data = self._drop_usage(block)
                    if carry is not None:
                        data = carry.pass_on(block, data)
                    if not data:
                        continue
                else:
                    # Whole events only: cut off mid-event (a crash, a balancer's cut), the
                    # half event went out and the error event below was glued onto it, one
                    # event of bad JSON (the SDK raised JSONDecodeError, not the error).
                    data = parser.complete(data)
                    if not data:
                        continue
                    if watch_usage:
                        self._watch_usage(watcher, data)
                await response.write(data)
                done_sent = data.endswith(_DONE_EVENT)
            if carry is not None and (held := carry.flush()):
                await response.write(held)
            if capture is None and parser.rest() and ends_with_done(before_last, last):
                # Bytes after the last event border of a stream that ended with its [DONE]
                # (`data: [DONE]\n`) go out as they came.
                await response.write(parser.rest())
            elif capture is not None and parser.rest():
                # A last event without its blank line (`data: [DONE]\n`, or no line end at
                # all): a stream's end ends it. Left in the parser, it never reached the
                # client, [DONE] included, nor the capture.
                end = b"\n" if parser.rest().endswith(b"\n") else b"\n\n"
                block = parser.complete(end)
                data = self._transform_events(plan, capture, block) if block else b""
                if data:
                    await response.write(data)
                    done_sent = data.endswith(_DONE_EVENT)
            if not ends_with_done(before_last, last):
                # The model server closed the stream cleanly but without its end: relayed as
                # is, the client saw an answer that just stopped, counted and recorded `ok`.
                raise aiohttp.ClientPayloadError("the stream ended without data: [DONE]")
        except _DISCONNECT_ERRORS:
            outcome = "aborted"
        except asyncio.CancelledError:
            # The client left. Once [DONE] reached it the answer was whole: the OpenAI SDK
            # closes the connection right then, before the stream's last bytes arrive.
            if not done_sent:
                outcome = "aborted"
            else:
                outcome = "error" if ends_with_error_event(before_last, last) else "ok"
            upstream.close()
            self._finish_stream(outcome, capture)
            raise
        except Exception as exc:
            outcome = "error"
            if isinstance(exc, aiohttp.ClientError | TimeoutError | ValueError):
                # ValueError: a chunk that is not JSON.
                log.warning("upstream_failed_mid_stream", error=type(exc).__name__)
                failed, code = "The model server failed", "upstream_error"
            else:
                # A chunk of a shape the relay could not handle (`"choices": 5`) or a bug
                # here: raised past the 200, the middleware's 500 went into the chunked
                # body as raw bytes, and the client's framing broke (SDK: connection error).
                log.exception("stream_relay_failed")
                failed, code = "The proxy failed", "internal_error"
                failure_kind = "internal_error"
            message = f"{failed} mid-stream (request id {self.request_id})."
            error_event = sse_event(dumps(error_body(message, "api_error", code)))
            held = carry.flush() if carry is not None else b""
            try:
                await response.write(held + error_event)
            except _DISCONNECT_ERRORS:
                outcome = "aborted"
            except asyncio.CancelledError:
                # The client left while its error event went out: the upstream failure is
                # still this stream's outcome (it was counted a 499 client disconnect,
                # though its 200 had gone out, and the failure was lost).
                upstream.close()
                self._finish_stream(outcome, capture, failure_kind)
                raise
        if outcome == "ok" and ends_with_error_event(before_last, last):
            outcome = "error"
            log.warning("upstream_error_event")
        if outcome == "aborted":
            # Closing the connection makes vLLM abort the request and free its slot.
            upstream.close()
        try:
            if outcome != "aborted":
                await response.write_eof()
                self.request[RESPONSE_STARTED] = False  # whole, as in `_send`
        except _DISCONNECT_ERRORS:
            log.info("client_left_before_eof")
        finally:
            # After the stream's end went out: the bookkeeping runs while the client reads
            # it, not before.
            self._finish_stream(outcome, capture, failure_kind)
        return response

    def _finish_stream(
        self,
        outcome: str,
        capture: TrajectoryCapture | None,
        failure_kind: str = "upstream_mid_stream",
    ) -> None:
        if outcome != "ok":
            if outcome == "aborted":
                failure_kind = self._departure()
            self.ctx.metrics.errors.labels(failure_kind, self.tenant_label).inc()
        if capture is not None:
            self.ctx.capture.submit(capture, outcome)
        self._count_request(self.usage)

    def _transform_events(self, plan: RelayPlan, capture: TrajectoryCapture, block: bytes) -> bytes:
        """The client's bytes for one upstream read's whole events; the capture keeps them.

        The block is stripped at once (`strip_sse`); a block the byte path cannot prove goes
        event by event (`_strip_events`)."""
        capture.add_sse(block)
        fast = strip_sse(plan, block)
        if fast is None:
            return self._strip_events(plan, block)
        stripped, usage = fast
        if usage is not None:
            self.usage = usage
        return stripped

    def _strip_events(self, plan: RelayPlan, block: bytes) -> bytes:
        """Event by event: on the bytes where `strip_bytes` can prove the cut, else parsed
        (raising ValueError when an event is not JSON). `block` is whole events."""
        out = []
        raws = block.split(b"\n\n")
        rest = raws.pop()  # after the last border: nothing (`complete` hands whole events)
        for raw in raws:
            if b"data:" not in raw:
                # A comment (`: keep-alive`, vLLM's --sse-keep-alive-interval) or an event
                # without data: as it came, in its place (it was dropped for captured
                # clients only).
                out.append(raw + b"\n\n")
                continue
            out.extend(self._strip_event(plan, event) for event in SSEParser().feed(raw + b"\n\n"))
        out.append(rest)
        return b"".join(out)

    def _strip_event(self, plan: RelayPlan, event: bytes) -> bytes:
        """One event's `data:` payload as the client gets it (b"" when it is dropped)."""
        if event == b"[DONE]":
            return sse_event(event)
        stripped = strip_bytes(plan, event)
        if stripped is not None:
            return sse_event(stripped)
        chunk, encode = parse_json(event, allow_nonfinite=True)
        if not isinstance(chunk, dict):
            raise ValueError("an upstream chunk is not a JSON object")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        if not plan.augmented:
            return sse_event(event)
        stripped_chunk = strip_chunk(plan, chunk)
        if stripped_chunk is None:
            return b""
        if stripped_chunk == chunk:  # nothing of the proxy's there (vLLM's error event)
            return sse_event(event)  # as it came, not re-encoded
        return sse_event(encode(stripped_chunk))

    def _drop_usage(self, block: bytes) -> bytes:
        """An uncaptured stream's bytes without the usage the proxy asked for on its own
        (`_ask_for_usage`), whose last usage is kept for the token counts. The events go
        out as they came, but for the usage chunk (dropped) and, should a chunk with choices
        carry usage too (the proxy turns the client's `continuous_usage_stats` off,
        `relay.with_usage`, but an upstream may send it), that usage. `block` is a read's
        whole events."""
        at = block.find(_USAGE_KEY)
        if at < 0:  # every read but the last: one search
            return block
        # Only the events holding the key are cut out and looked at; the bytes between them
        # go out as slices (splitting a whole answer into its events cost ~4x as much).
        out = []
        start = 0  # the first byte not yet placed in `out`, always an event's start
        while at >= 0:
            border = block.rfind(b"\n\n", start, at)
            event_start = border + 2 if border >= 0 else start
            event_end = block.index(b"\n\n", at)  # `complete` returns whole events
            out.append(block[start:event_start])
            event, usage = _without_usage(block[event_start:event_end])
            out.append(event)
            if usage is not None:
                self.usage = usage
            start = event_end + 2
            at = block.find(_USAGE_KEY, start)
        out.append(block[start:])
        return b"".join(out)

    def _watch_usage(self, parser: SSEParser, data: bytes) -> None:
        """Keep the last usage an uncaptured stream carried (the client asked for usage)."""
        for event in parser.feed(data):
            if b'"usage"' in event and event != b"[DONE]":
                usage = usage_of(event)
                if usage is not None:
                    self.usage = usage


_USAGE_KEY = b'"usage"'  # in JSON text a key: a `"` inside a string is escaped

# How long a finish chunk waits for the usage chunk's fingerprint (`FingerprintCarry`)
# before it goes out without it: vLLM sends the usage chunk right after, so only an
# upstream that stalls there waits this long (it held the answer's last text up to the
# read timeout).
FINISH_HOLD_S = 1.0


async def _reads(
    content: StreamReader, carry: FingerprintCarry | None, response: web.StreamResponse
) -> AsyncIterator[bytes]:
    """`content.iter_any()`, but while `carry` holds a finish chunk the next read is waited
    for `FINISH_HOLD_S` at most; then the held chunk is written as it is."""
    while True:
        if carry is not None and carry.holding:
            try:
                data = await asyncio.wait_for(content.readany(), FINISH_HOLD_S)
            except TimeoutError:
                await response.write(carry.flush())
                continue
        else:
            data = await content.readany()
        if not data:
            return
        yield data


def _without_usage(event: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """One event whose text holds `"usage"` (`\n\n` not included), as it goes to the client
    (`\n\n` included; empty for the usage chunk itself), and the usage it carried."""
    payload = b"\n".join(
        line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
    )
    try:
        chunk, encode = parse_json(payload, allow_nonfinite=True)
    except ValueError:
        chunk = None  # not JSON: relayed as it came, as it always was
    if not isinstance(chunk, dict) or "usage" not in chunk:
        return event + b"\n\n", None
    usage = chunk.pop("usage")
    kept = usage if isinstance(usage, dict) else None
    if not chunk.get("choices"):
        return b"", kept  # the usage chunk
    return sse_event(encode(chunk)), kept


def _as_vllm_writes(payload: Any, encode: Callable[[Any], bytes]) -> bytes:
    """A whole answer written back as vLLM's JSON response writes it (Python's `json`,
    compact, UTF-8: msgspec spells floats otherwise); `encode` where `json` cannot (a
    non-finite number, a lone surrogate read as it came)."""
    try:
        return json.dumps(
            payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode()
    except (ValueError, UnicodeEncodeError):
        return encode(payload)


def _ask_for_usage(plan: RelayPlan) -> None:
    """Ask upstream for a stream's usage chunk on the proxy's own behalf, so that every
    stream's tokens are counted (`olp_proxy_tokens_total`); `_drop_usage` keeps it from the
    client, which did not ask for it. A captured stream already asks (`plan_request`)."""
    options = plan.upstream_body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return  # not an object: vLLM's 400 tells the client, as it would without the proxy
    plan.upstream_body["stream_options"] = with_usage(options)
    plan.added_usage = True


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await CompletionRelay(request.app[CONTEXT], request, "chat.completions").handle()


async def completions(request: web.Request) -> web.StreamResponse:
    return await CompletionRelay(request.app[CONTEXT], request, "completions").handle()
