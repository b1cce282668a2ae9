"""Tenants: who is calling (API key → tenant), how much they may call, and whether we learn.

Keys are compared as sha256 digests only. Rate limits are a token bucket of
`requests_per_minute` plus a cap on concurrent requests; both answer 429 with the headers
OpenAI clients understand (`x-ratelimit-*`, `retry-after`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from proxy.config import TenantConfig, sha256_hex
from proxy.errors import AuthError, ProxyError, bad_request
from proxy.serving_state import switch_applies

TRAIN_HEADER_OFF = frozenset({"0", "false", "no", "off"})
TRAIN_HEADER_ON = frozenset({"1", "true", "yes", "on"})


def opts_out_of_training(lines: Sequence[str]) -> bool:
    """Whether a request's `X-OLP-Train` header lines opt it out; 400 for a value that is
    neither off nor on: a client that meant to opt out with a spelling of its own ("never",
    "disabled") would otherwise have its request recorded for training.

    Every line counts, and a line is a comma-separated list (HTTP makes `1` and `0` on two
    lines the same as `1, 0`): any off value opts the request out."""
    words = [word.strip() for line in lines for word in line.split(",")]
    opted_out = False
    for word in filter(None, words):
        if word.lower() in TRAIN_HEADER_OFF:
            opted_out = True
        elif word.lower() not in TRAIN_HEADER_ON:
            raise bad_request(
                f"The X-OLP-Train header must be 0 (do not learn from this request) or 1, "
                f"got {word[:32]!r}.",
                param="X-OLP-Train",
                code="invalid_header",
            )
    return opted_out


ANONYMOUS = "anonymous"


@dataclass
class TokenBucket:
    """`capacity` requests per minute, refilled continuously."""

    capacity: int
    tokens: float = field(init=False)
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = float(self.capacity)

    def refill(self, now: float | None = None) -> None:
        """Add what accrued since the last update (up to the capacity)."""
        now = time.monotonic() if now is None else now
        rate = self.capacity / 60.0
        self.tokens = min(float(self.capacity), self.tokens + (now - self.updated) * rate)
        self.updated = now

    def take(self, now: float | None = None) -> float:
        """Take one token; returns 0 on success, else seconds until one is available."""
        now = time.monotonic() if now is None else now
        self.refill(now)
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / (self.capacity / 60.0)

    def seconds_to_next(self) -> float:
        """Seconds until a token is there (0 when one is); no refill, no token taken."""
        return max(0.0, (1.0 - self.tokens) / (self.capacity / 60.0))

    def seconds_to_full(self) -> float:
        return (self.capacity - self.tokens) / (self.capacity / 60.0)


@dataclass
class Tenant:
    """Run-time state of one tenant: config, limits, training override and in-flight count."""

    config: TenantConfig
    name_hash: str
    bucket: TokenBucket | None
    in_flight: int = 0
    training_override: bool | None = None
    # Feedback posts get a bucket of the same size of their own: limited (a key cannot flood
    # the stream), without spending the tenant's completion requests.
    feedback_bucket: TokenBucket | None = None

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def training_enabled(self) -> bool:
        if self.training_override is not None:
            return self.training_override
        return self.config.training_enabled


class Admission:
    """A granted request slot; release it exactly once when the request ends."""

    def __init__(self, tenant: Tenant, headers: dict[str, str]) -> None:
        self.tenant = tenant
        self.headers = headers
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.tenant.in_flight -= 1


class TenantRegistry:
    """Looks tenants up by key digest and applies their limits."""

    def __init__(self, tenants: list[TenantConfig], *, require_auth: bool = True) -> None:
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise ValueError("tenant names must be unique")
        self.require_auth = require_auth
        self.tenants: dict[str, Tenant] = {t.name: self._make(t) for t in tenants}
        self._by_key: dict[str, Tenant] = {}
        for tenant in self.tenants.values():
            digest = tenant.config.api_key_sha256
            if digest is None:
                continue
            if digest in self._by_key:
                raise ValueError(
                    f"tenants {self._by_key[digest].name!r} and {tenant.name!r} share a key"
                )
            self._by_key[digest] = tenant
        if not require_auth and ANONYMOUS not in self.tenants:
            self.tenants[ANONYMOUS] = self._make(TenantConfig(name=ANONYMOUS))

    @staticmethod
    def _make(config: TenantConfig) -> Tenant:
        rate = config.requests_per_minute
        return Tenant(
            config=config,
            name_hash=sha256_hex(config.name),
            bucket=TokenBucket(rate) if rate else None,
            feedback_bucket=TokenBucket(rate) if rate else None,
        )

    def holds_key(self, key: str) -> bool:
        """Whether `key` (stripped) is a configured tenant's, whatever `require_auth` says."""
        return sha256_hex(key.strip()) in self._by_key

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant of an `Authorization: Bearer <key>` header, or a 401 ProxyError."""
        key = None
        if authorization:
            scheme, _, value = authorization.partition(" ")
            if scheme.lower() == "bearer" and value.strip():
                key = value.strip()
        if key is None:
            if not self.require_auth:
                return self.tenants[ANONYMOUS]
            raise AuthError(
                401,
                "You didn't provide an API key. Provide it as 'Authorization: Bearer <key>'.",
                code="missing_api_key",
                route_kind="api",
            )
        # A dict lookup by digest, not a constant-time scan over every tenant (O(tenants)
        # per request): what a lookup's timing can reveal is about the digest, and a caller
        # cannot choose a key whose sha256 shares a prefix with a stored one.
        tenant = self._by_key.get(sha256_hex(key))
        if tenant is None and not self.require_auth:
            # The OpenAI SDK cannot send no key (`api_key="EMPTY"` is vLLM's convention):
            # refused, an SDK client could never reach a proxy that requires none.
            return self.tenants[ANONYMOUS]
        if tenant is None:
            raise AuthError(
                401, "Incorrect API key provided.", code="invalid_api_key", route_kind="api"
            )
        return tenant

    @staticmethod
    def _limit_headers(tenant: Tenant, feedback: bool = False) -> dict[str, str]:
        """`x-ratelimit-*` as the bucket stands now (none without a per-minute limit)."""
        bucket = tenant.feedback_bucket if feedback else tenant.bucket
        if bucket is None:
            return {}
        return {
            "x-ratelimit-limit-requests": str(tenant.config.requests_per_minute),
            "x-ratelimit-remaining-requests": str(int(bucket.tokens)),
            "x-ratelimit-reset-requests": f"{bucket.seconds_to_full():.3f}s",
        }

    def admit(self, tenant: Tenant) -> Admission:
        """Reserve a request slot under the tenant's limits or raise a 429 ProxyError."""
        headers: dict[str, str] = {}
        config = tenant.config
        if config.max_concurrent and tenant.in_flight >= config.max_concurrent:
            retry_after = 1
            if tenant.bucket is not None:
                tenant.bucket.refill()  # the 429 spends no request, but reports the bucket
                # A client that waited 1 s with the bucket spent met a second 429.
                retry_after = max(1, math.ceil(tenant.bucket.seconds_to_next()))
            raise ProxyError(
                429,
                f"Too many concurrent requests for this tenant (limit {config.max_concurrent}).",
                type_="rate_limit_error",
                code="concurrency_limit_exceeded",
                headers={"retry-after": str(retry_after), **self._limit_headers(tenant)},
            )
        if tenant.bucket is not None:
            wait_s = tenant.bucket.take()
            if wait_s > 0:
                raise ProxyError(
                    429,
                    f"Rate limit reached: {config.requests_per_minute} requests per minute.",
                    type_="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={
                        # retry-after: until the next request; reset: until the bucket is
                        # full again, as on every other answer (OpenAI's meaning).
                        "retry-after": str(max(1, math.ceil(wait_s))),
                        **self._limit_headers(tenant),
                    },
                )
            headers = self._limit_headers(tenant)
        tenant.in_flight += 1
        return Admission(tenant, headers)

    def admit_feedback(self, tenant: Tenant) -> dict[str, str]:
        """Take one feedback post from the tenant's feedback bucket; its `x-ratelimit-*`
        headers, or a 429 ProxyError."""
        bucket = tenant.feedback_bucket
        if bucket is None:
            return {}
        wait_s = bucket.take()
        if wait_s > 0:
            raise ProxyError(
                429,
                f"Feedback rate limit reached: {tenant.config.requests_per_minute} events per "
                "minute.",
                type_="rate_limit_error",
                code="rate_limit_exceeded",
                headers={
                    "retry-after": str(max(1, math.ceil(wait_s))),
                    **self._limit_headers(tenant, feedback=True),
                },
            )
        return self._limit_headers(tenant, feedback=True)

    def wants_training(self, tenant: Tenant, opted_out: bool) -> bool:
        """Tenant opt-in, narrowed by `X-OLP-Train: 0`; the header can never opt in."""
        return tenant.training_enabled and not opted_out

    def apply_overrides(self, overrides: Mapping[str, Mapping[str, bool | None]]) -> list[str]:
        """Apply the run-time training switches; return the tenants whose switch is stale.

        A switch is stale when the tenant's `training_enabled` in the config changed since it
        was set: the config's newer word wins (an operator who turns a tenant off in the
        config, say because it withdrew consent, is obeyed), and the caller drops it. So is
        the switch of a tenant the config no longer names: kept, it applied again to a new
        tenant given the same name (its traffic trained on, with `training_enabled: false`)."""
        stale = []
        for name, switch in overrides.items():
            tenant = self.tenants.get(name)
            if tenant is None:
                stale.append(name)
                continue
            if not switch_applies(switch, tenant.config.training_enabled):
                stale.append(name)
                continue
            tenant.training_override = switch["enabled"]
        return stale
