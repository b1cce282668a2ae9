"""Failed-authentication throttle: an address that keeps presenting wrong keys is refused.

Without it a client could try API keys and the admin key as fast as the proxy answers 401.
Failures are counted per client address (`proxy/client_address.py`: the TCP peer, or,
from a peer listed in `proxy.trusted_proxies`, the client that `X-Forwarded-For` names). After
`max_failures` within `window_s` of the first of them, every request of that address to
`/v1/...` or `/admin/...` gets 429 for `window_s`, *before* its key is looked at, so a
right key guessed during the lockout gains nothing. State is bounded: at most
`max_addresses` addresses are tracked, the least recently failing dropped first.
"""

from __future__ import annotations

import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from aiohttp import web

from proxy.client_address import ClientAddresses
from proxy.config import AuthFailureLimits, sha256_hex
from proxy.errors import ProxyError
from proxy.metrics import ProxyMetrics

log = structlog.get_logger(__name__)

# Routes whose callers must present a key: the throttle refuses these while locked.
GUARDED_PREFIXES = ("/v1/", "/admin/")


def route_kind(path: str) -> str:
    """`admin` for /admin/..., else `api`: the metrics' label."""
    return "admin" if path.startswith("/admin/") else "api"


@dataclass(slots=True)
class _Failures:
    first: float  # the first failure of the current window
    count: int = 0
    locked_until: float = 0.0


class AuthThrottle:
    """Counts failed authentications per address and refuses locked-out addresses."""

    def __init__(
        self,
        limits: AuthFailureLimits,
        metrics: ProxyMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        addresses: ClientAddresses | None = None,
        exempt_key_sha256: str | None = None,
    ) -> None:
        self.limits = limits
        self.addresses = addresses or ClientAddresses()
        # The per-run internal admin token of `olp up` (256 random bits, not guessable):
        # the learner's alias flips come from 127.0.0.1 too, and a local client retrying a
        # wrong key must not lock them out.
        self._exempt_key_sha256 = exempt_key_sha256
        self._metrics = metrics
        self._clock = clock
        # Least recently failing first (an entry is re-inserted on each failure): expiry
        # and eviction both take from the front.
        self._entries: dict[str, _Failures] = {}

    @property
    def enabled(self) -> bool:
        return self.limits.max_failures > 0

    def __len__(self) -> int:
        """Addresses tracked now."""
        return len(self._entries)

    def retry_after(self, address: str) -> float:
        """Seconds until `address` may try again; 0 when it is not locked out."""
        entry = self._entries.get(address)
        if entry is None:
            return 0.0
        return max(0.0, entry.locked_until - self._clock())

    def guard(self, request: web.Request) -> None:
        """`check` for a request to a route that takes a key; free while no address is
        tracked (the common case: the table empties once failures stop for `window_s`), so
        the request path is not even decoded then."""
        if not self._entries:
            return
        self._trim(self._clock())
        path = request.path
        if self._entries and path.startswith(GUARDED_PREFIXES) and not self._exempt(request):
            self.check(self.addresses.of(request), route_kind(path))

    def _exempt(self, request: web.Request) -> bool:
        if self._exempt_key_sha256 is None:
            return False
        scheme, _, key = (request.headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        return hmac.compare_digest(sha256_hex(key.strip()), self._exempt_key_sha256)

    def check(self, address: str, kind: str) -> None:
        """Raise a 429 ProxyError while `address` is locked out; called before any key is
        checked."""
        wait_s = self.retry_after(address)
        if wait_s <= 0:
            return
        if self._metrics is not None:
            self._metrics.series(self._metrics.auth_throttled, kind).inc()
        seconds = max(1, math.ceil(wait_s))
        raise ProxyError(
            429,
            f"Too many failed authentication attempts from this address; retry after {seconds} s.",
            type_="rate_limit_error",
            code="auth_throttled",
            headers={"retry-after": str(seconds)},
        )

    def failed_request(self, request: web.Request, kind: str, guessed: bool = True) -> None:
        """`failed` for the client that sent `request`."""
        self.failed(self.addresses.of(request), kind, guessed)

    def failed(self, address: str, kind: str, guessed: bool = True) -> None:
        """Count one wrong or missing key from `address` (`kind`: `api` or `admin`); lock
        the address out when its guesses reach `max_failures` within the window.

        A request that presented no key (`guessed` False) is in the metrics but guesses
        nothing, so it does not count towards a lockout: any web page can make the browser
        send such requests to a proxy on the operator's machine (an `<img>` pointing at
        `/v1/models`), and 20 of them locked every local client out, the CLI included."""
        if self._metrics is not None:
            self._metrics.series(self._metrics.auth_failures, kind).inc()
        if not self.enabled or not guessed:
            return
        now = self._clock()
        window = self.limits.window_s
        entry = self._entries.pop(address, None)
        if entry is None or (now >= entry.locked_until and now - entry.first >= window):
            entry = _Failures(first=now)
        entry.count += 1
        # A request that passed the check just before the lockout may still fail: it is
        # counted, but neither extends the lockout nor logs it again.
        if entry.count >= self.limits.max_failures and not entry.locked_until:
            entry.locked_until = now + window
            self._locked_out(address, kind, entry)
        self._entries[address] = entry
        self._trim(now)

    def _locked_out(self, address: str, kind: str, entry: _Failures) -> None:
        # The address and counts only: never the key that was presented.
        log.warning(
            "auth_lockout",
            remote=address,
            route=kind,
            failures=entry.count,
            window_s=self.limits.window_s,
        )
        if self._metrics is not None:
            self._metrics.series(self._metrics.auth_lockouts, kind).inc()

    def _trim(self, now: float) -> None:
        """Drop expired entries from the front, then the oldest beyond `max_addresses`."""
        entries, window = self._entries, self.limits.window_s
        while entries:
            entry = next(iter(entries.values()))
            if now < entry.locked_until or now - entry.first < window:
                break
            entries.pop(next(iter(entries)))
        while len(entries) > self.limits.max_addresses:
            entries.pop(next(iter(entries)))
