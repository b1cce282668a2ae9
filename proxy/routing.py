"""Upstream vLLM replicas: session-sticky choice, pooled connections, retry before the first byte.

A request is retried on another replica only while nothing has reached the client: `open()`
returns once upstream response headers arrived, and the caller streams from there on without
any retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import structlog

log = structlog.get_logger(__name__)

# Upstream answers that mean "this replica cannot serve now": another one may.
RETRYABLE_STATUSES = frozenset({502, 503, 504})


class UpstreamUnavailable(Exception):
    """Every replica failed before answering; `timed_out` tells 504 from 502."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


# A pooled connection the replica closed (its keep-alive timer) fails as the request goes
# out, in milliseconds; one lost later had the request for a while (see `_post`).
_RESEND_WITHIN_S = 1.0


class ConnectionLostAfterSending(aiohttp.ClientError):
    """The replica closed the connection a while after the request reached it."""

    def __init__(self, waited_s: float, cause: BaseException) -> None:
        super().__init__(
            f"the connection was lost {waited_s:.1f} s after the request was sent "
            f"({type(cause).__name__}); not sent again, it may have run"
        )


def _closed_under_us(exc: aiohttp.ClientError) -> bool:
    """The replica closed (or reset) a connection it had accepted: a pooled one its
    keep-alive timer just ended, typically. A refused connect (ClientConnectorError, a
    ClientOSError too) means the replica is down instead."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)


# The longest a failing replica is sent to the back of the order (`_mark_down`).
MAX_DOWN_S = 60.0


@dataclass
class Replica:
    url: str
    down_until: float = 0.0
    failures: int = 0  # in a row: one answer resets it
    # What sessions are hashed with (`UpstreamPool.order`): the URL, and its position among
    # equal URLs (a URL listed twice is two replicas).
    rendezvous_key: bytes = b""


def _rendezvous_weight(session: bytes, replica: Replica) -> bytes:
    return hashlib.blake2b(replica.rendezvous_key + b"\0" + session, digest_size=8).digest()


class UpstreamPool:
    """The replicas of one model server, reached through one pooled aiohttp ClientSession."""

    def __init__(
        self,
        urls: list[str],
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
        max_connections: int = 256,
        down_for_s: float = 5.0,
        api_key: str | None = None,
        keepalive_s: float = 4.0,
    ) -> None:
        if not urls:
            raise ValueError("the proxy needs at least one upstream URL (proxy.upstreams)")
        self.replicas = [Replica(url.rstrip("/")) for url in urls]
        self._positions = {id(replica): i for i, replica in enumerate(self.replicas)}
        seen: dict[str, int] = {}
        for replica in self.replicas:
            copy = seen[replica.url] = seen.get(replica.url, -1) + 1
            replica.rendezvous_key = f"{replica.url}#{copy}".encode()
        # `connect` would also bound the wait for a free pooled connection: with every one of
        # `max_connections` busy (long streams), a request timed out there and marked healthy
        # replicas down, one after another, and its client got a 504. Waiting for a slot is
        # back-pressure, not a replica failing; only the TCP connect itself is bounded.
        self._timeout = aiohttp.ClientTimeout(
            total=None,
            connect=None,
            sock_connect=connect_timeout_s,
            sock_read=read_timeout_s,
        )
        self._max_connections = max_connections
        self._keepalive_s = keepalive_s
        self._down_for_s = down_for_s
        # The context length the replicas serve (vLLM's `max_model_len` in /v1/models, the
        # same for the base model and its adapters): the proxy's model list carries it as
        # vLLM's does, for clients that size their context by it. None until one said.
        self.max_model_len: int | None = None
        self._length_asked_at = -math.inf  # when `learn_max_model_len` last asked (monotonic)
        self._round_robin = itertools.count()
        # One session (and connection pool) per replica, by position: see `start`.
        self._sessions: list[aiohttp.ClientSession] = []
        # Model listings (readiness, an alias flip's check, the context length) go through
        # a small pool of their own: through the requests' pool, their `total` timeout
        # counted the wait for a free connection, so with every one busy on healthy streams
        # /readyz said "not ready" and every flip failed with 502, at peak load.
        self._control: aiohttp.ClientSession | None = None
        # The probe of every replica that /readyz callers share while it runs: each call
        # sent its own, so a few overlapping unauthenticated /readyz filled the small pool
        # above, and its 2 s timeouts (which count the wait for a connection) said healthy
        # replicas were down and failed a flip or a rollback with 502.
        self._readiness: asyncio.Task[dict[str, tuple[str | None, set[str]]]] | None = None
        # Every upstream call carries the model server's key (never the client's own key), and
        # asks for the answer uncompressed: the bytes are relayed and parsed as they come (a
        # compressing hop in between gave 502 "invalid JSON").
        self._headers = {"Accept-Encoding": "identity"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"

    def session(self, replica: Replica) -> aiohttp.ClientSession:
        if not self._sessions:
            raise RuntimeError("UpstreamPool.start() was not called")
        return self._sessions[self._positions[id(replica)]]

    async def start(self) -> None:
        # Idle connections are reused only while younger than `keepalive_s`, which must stay
        # below the replica's own keep-alive (vLLM closes idle ones after 5 s): at 30 s here,
        # a request sent ~5 s after the last one on its connection met a closing socket (25
        # of 960 requests in bursts 4.9-5.1 s apart got 502s).
        # Each replica has its own pool and limit: with one for all, a replica that took
        # requests and never answered held every connection until its read timeout, and the
        # healthy replicas' requests waited for one (measured: a 0.5 s answer took 15 s with
        # 8 connections, a 15 s read timeout). Not aiohttp's `limit_per_host`: replicas
        # behind one gateway (`http://gw/a`, `http://gw/b`) or a URL listed twice share a
        # host and port.
        self._sessions = [
            aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections,
                    keepalive_timeout=self._keepalive_s,
                    enable_cleanup_closed=True,
                ),
                timeout=self._timeout,
                auto_decompress=False,
                headers=self._headers,
            )
            for _ in self.replicas
        ]
        # Room for the shared readiness probe and a change's check (one connection per
        # replica each) and the context length's question (one).
        self._control = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=2 * len(self.replicas) + 1, keepalive_timeout=self._keepalive_s
            ),
            headers=self._headers,
        )

    async def close(self) -> None:
        sessions, self._sessions = self._sessions, []
        for session in sessions:
            await session.close()
        if self._readiness is not None and not self._readiness.done():
            self._readiness.cancel()
            await asyncio.wait([self._readiness])  # raises nothing: a cancel of close() stays
        if self._control is not None:
            await self._control.close()
            self._control = None

    def order(self, session_id: str | None) -> list[Replica]:
        """Replicas to try, best first: the session's sticky one, healthy before cooling-down.

        A session ranks the replicas by a hash of itself and each replica (rendezvous
        hashing): its first choice moves only when that replica is down (or one is added:
        about 1/N of the sessions move), and a down replica's sessions spread over all the
        others. Requests without a session take the healthy replicas in turn. Before, both
        rotated the list from a start point, and the replica after a down one took its whole
        share on top of its own (3 replicas, one down: 200 and 100 of 300 requests)."""
        replicas = self.replicas
        if len(replicas) == 1:
            return replicas
        now = time.monotonic()
        if session_id:
            key = session_id.encode("utf-8", "surrogatepass")
            ranked = sorted(replicas, key=lambda r: _rendezvous_weight(key, r), reverse=True)
            return [r for r in ranked if r.down_until <= now] + [
                r for r in ranked if r.down_until > now
            ]
        healthy = [r for r in replicas if r.down_until <= now]
        down = [r for r in replicas if r.down_until > now]
        if not healthy:
            healthy, down = down, []
        start = next(self._round_robin) % len(healthy)
        return healthy[start:] + healthy[:start] + down

    def _mark_down(self, replica: Replica, reason: str) -> None:
        """Send the replica to the back of the order for `down_for_s`, doubled with each
        failure in a row up to MAX_DOWN_S: with the same 5 s each time, a dead replica took
        traffic again every 5 s, each request there waiting its connect or read timeout
        (a hung one gave a quarter of all requests a 504). One answer resets it."""
        replica.failures += 1
        down_for = min(self._down_for_s * 2 ** min(replica.failures - 1, 16), MAX_DOWN_S)
        replica.down_until = time.monotonic() + max(down_for, self._down_for_s)
        log.warning("upstream_replica_failed", replica=replica.url, reason=reason)

    async def open(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        session_id: str | None,
    ) -> tuple[Replica, aiohttp.ClientResponse]:
        """POST to the first replica that answers; the caller must release the response."""
        timed_out = False
        last_error = "no replica tried"
        # A replica's 404 means it does not serve the model (e.g. vLLM restarted without the
        # current adapter): another replica may, and the request has not begun. The 404 is
        # kept for the client in case none does.
        not_found: tuple[Replica, aiohttp.ClientResponse] | None = None
        try:
            for replica in self.order(session_id):
                try:
                    response = await self._post(replica, path, body, headers)
                except aiohttp.SocketTimeoutError as exc:
                    # Sent, and no answer within read_timeout_s: for an unstreamed request
                    # vLLM sends nothing before the whole answer, so this is as likely a long
                    # generation as a hung replica. Retried, it ran again on every replica in
                    # turn (each marked down), and the client waited for all of them.
                    # Not retried, but marked down: a hung replica kept its share of the
                    # round robin and its sticky sessions, each waiting the whole timeout.
                    self._mark_down(replica, f"no answer within the read timeout ({exc!r})")
                    raise UpstreamUnavailable(
                        f"no answer within the read timeout ({type(exc).__name__})",
                        timed_out=True,
                    ) from exc
                except ConnectionLostAfterSending as exc:
                    self._mark_down(replica, str(exc))
                    raise UpstreamUnavailable(str(exc), timed_out=False) from exc
                except TimeoutError as exc:
                    timed_out = True
                    last_error = f"timeout ({type(exc).__name__})"
                    self._mark_down(replica, last_error)
                    continue
                except aiohttp.ClientError as exc:
                    last_error = f"{type(exc).__name__}: {exc}"
                    self._mark_down(replica, last_error)
                    continue
                if response.status in RETRYABLE_STATUSES:
                    last_error = f"HTTP {response.status}"
                    timed_out = timed_out or response.status == 504
                    response.release()
                    self._mark_down(replica, last_error)
                    continue
                replica.down_until, replica.failures = 0.0, 0
                if response.status == 404:
                    if not_found is None:
                        not_found = (replica, response)
                        log.warning("upstream_model_not_served", replica=replica.url, path=path)
                    else:
                        response.release()
                    continue
                if not_found is not None:
                    not_found[1].release()
                return replica, response
        except BaseException:
            if not_found is not None:
                not_found[1].release()
            raise
        if not_found is not None:
            return not_found
        raise UpstreamUnavailable(
            f"no upstream replica could serve the request ({last_error})", timed_out=timed_out
        )

    async def _post(
        self, replica: Replica, path: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """POST to one replica; a pooled connection the replica closed as the request went
        out is not the replica failing: the request is sent once more before it counts.

        Only a connection lost at once is one: lost after the replica had the request for
        a while (a balancer's idle timeout on a long generation, a worker that died), the
        request ran there, and sent again (then to every other replica, twice each) one
        request was 2 x N generations. That loss is `ConnectionLostAfterSending`, which
        `open` does not retry elsewhere, as it does not a read timeout."""
        try:
            return await self._post_once(replica, path, body, headers)
        except aiohttp.ClientError as exc:
            if isinstance(exc, ConnectionLostAfterSending) or not _closed_under_us(exc):
                raise
            log.info("upstream_connection_closed_retrying", replica=replica.url, error=repr(exc))
        request_id = headers.get("X-Request-Id")
        if request_id is not None:  # vLLM adopts it: a second request must not repeat it
            headers = {**headers, "X-Request-Id": f"{request_id}-resent"}
        # The resend is held to the same rule: lost late, it was retried on the next
        # replica as a connection error, and the generation ran there a second time.
        return await self._post_once(replica, path, body, headers)

    async def _post_once(
        self, replica: Replica, path: str, body: bytes, headers: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        """One POST; a connection closed under it more than `_RESEND_WITHIN_S` after it was
        sent is `ConnectionLostAfterSending`."""
        sent_at = time.monotonic()
        try:
            return await self.session(replica).post(
                replica.url + path, data=body, headers=dict(headers)
            )
        except aiohttp.ClientError as exc:
            waited = time.monotonic() - sent_at
            if _closed_under_us(exc) and waited > _RESEND_WITHIN_S:
                raise ConnectionLostAfterSending(waited, exc) from exc
            raise

    async def served_models(self, replica: Replica, timeout_s: float = 2.0) -> set[str]:
        """Model names a replica serves now (its /v1/models), for readiness and alias checks;
        ValueError when the answer is not JSON of vLLM's shape `{"data": [{"id": ...}]}`."""
        if self._control is None:
            raise RuntimeError("UpstreamPool.start() was not called")
        async with self._control.get(
            replica.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as response:
            response.raise_for_status()
            payload = await response.json()
        # No `data` ({}, {"detail": ...}) is not an empty list: it said ready, and a flip
        # got 409 not_loaded instead of 502.
        entries = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise ValueError("/v1/models is not a model list")
        for entry in entries:
            length = entry.get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool) and length > 0:
                self.max_model_len = length
        # Names only: an id of another type (a list) raised TypeError here, a 500 for a flip.
        return {entry["id"] for entry in entries if isinstance(entry.get("id"), str)}

    async def learn_max_model_len(self) -> int | None:
        """`max_model_len`, asking the replicas' /v1/models (in turn, 2 s each) when no
        answer has said it yet, at most every 30 s (unreachable replicas must not slow every
        model list down); None while none has."""
        now = time.monotonic()
        if self.max_model_len is not None or now - self._length_asked_at < 30.0:
            return self.max_model_len
        self._length_asked_at = now
        for replica in self.replicas:
            if self.max_model_len is not None:
                break
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                await self.served_models(replica)
        return self.max_model_len

    async def readiness(self) -> dict[str, tuple[str | None, set[str]]]:
        """Per replica: (None, served names) when reachable, else (why not, empty set).

        Callers while a probe runs share it (one connection per replica at most, whatever
        the number of callers); its result is the callers' to read, not to change."""
        if self._readiness is None or self._readiness.done():
            self._readiness = asyncio.ensure_future(self._probe_readiness())
        # Shielded: a caller that leaves (its client hung up) does not end the others' probe.
        return await asyncio.shield(self._readiness)

    async def _probe_readiness(self) -> dict[str, tuple[str | None, set[str]]]:
        result: dict[str, tuple[str | None, set[str]]] = {}

        async def probe(replica: Replica) -> None:
            try:
                result[replica.url] = (None, await self.served_models(replica))
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                result[replica.url] = (f"{type(exc).__name__}: {exc}", set())

        await asyncio.gather(*(probe(r) for r in self.replicas))
        return result
