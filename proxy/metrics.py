"""Prometheus metrics of one proxy instance, on a registry the app owns (no global state).

Tenants are labelled by their configured name, never by key.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

# The policy version of a request refused before a model was chosen (401, 429, 400, 413):
# its series are no version's, and no change of what serves removes them.
UNROUTED_VERSION = "unknown"

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)


class ProxyMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._also: list[CollectorRegistry] = []
        labels = ("endpoint", "tenant", "policy_version")
        self.requests = Counter(
            "olp_proxy_requests",
            "Proxied requests by final HTTP status",
            (*labels, "stream", "status"),
            registry=self.registry,
        )
        self.errors = Counter(
            "olp_proxy_errors",
            "Requests that ended in an error, by kind",
            ("kind", "tenant"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "olp_proxy_request_seconds",
            "Time from request arrival to the last byte sent",
            (*labels, "stream"),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "olp_proxy_ttft_seconds",
            "Time to the first streamed token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "olp_proxy_tokens",
            "Tokens in (prompt) and out (completion)",
            ("direction", "tenant", "policy_version"),
            registry=self.registry,
        )
        # Read from the tenants' own counts when scraped (`count_in_flight`): a Gauge
        # took a lock twice per request for what the tenant registry counts anyway.
        self._in_flight: Callable[[], Iterable[tuple[str, int]]] = tuple
        self.registry.register(_InFlight(lambda: self._in_flight()))
        self.trajectories = Counter(
            "olp_proxy_trajectories",
            "Trajectory records handed to the sink",
            ("status", "trainable"),
            registry=self.registry,
        )
        self.captures_skipped = Counter(
            "olp_proxy_captures_skipped",
            "Requests of training tenants served without capture, by reason (echo: the "
            "additions would break it; backlog: proxy.capture_backlog_limit reached)",
            ("tenant", "reason"),
            registry=self.registry,
        )
        self.capture_failures = Counter(
            "olp_proxy_capture_failures",
            "Trajectory records lost to an internal error",
            registry=self.registry,
        )
        self.feedback = Counter(
            "olp_proxy_feedback",
            "Feedback events accepted",
            ("kind",),
            registry=self.registry,
        )
        # Failed authentications by route kind (`api`: /v1, `admin`: /admin), never by key.
        self.auth_failures = Counter(
            "olp_proxy_auth_failures",
            "Requests refused for a wrong or missing key, by route kind (api, admin)",
            ("kind",),
            registry=self.registry,
        )
        self.auth_lockouts = Counter(
            "olp_proxy_auth_lockouts",
            "Addresses locked out after proxy.auth_failures.max_failures failed authentications",
            ("kind",),
            registry=self.registry,
        )
        self.auth_throttled = Counter(
            "olp_proxy_auth_throttled",
            "Requests refused with 429 because their address is locked out",
            ("kind",),
            registry=self.registry,
        )
        self.gc_frozen = Gauge(
            "olp_proxy_gc_frozen_objects",
            "Objects frozen out of the garbage collector's scans at start-up (0: not tuned)",
            registry=self.registry,
        )
        GCCollector(registry=self.registry)  # python_gc_*: collections per generation
        # Labelled series of the per-request metrics: tenants × policy versions × endpoints
        # × statuses; a version's are removed once nothing routes to it (`forget_versions`).
        self._series: dict[tuple[Any, tuple[str, ...]], Any] = {}
        self._requests: dict[tuple[str, str, str, bool, int], RequestSeries] = {}

    def series(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus_client checks the label values
        and takes a lock on every call (~2.4 µs), several times per request."""
        key = (metric, labels)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = metric.labels(*labels)
        return found

    def count_in_flight(self, counts: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """`olp_proxy_in_flight{tenant}` is `counts()` (tenant name, requests admitted and
        not yet finished) at each scrape."""
        self._in_flight = counts

    def request_series(
        self, endpoint: str, tenant: str, policy_version: str, stream: bool, status: int
    ) -> RequestSeries:
        """The series a finished request of this kind is counted in, remembered: one lookup
        a request where each metric's own took one (and `str(status)` another)."""
        key = (endpoint, tenant, policy_version, stream, status)
        found = self._requests.get(key)
        if found is None:
            found = self._requests[key] = RequestSeries(self, *key)
        return found

    def forget_versions(self, keep: set[str]) -> int:
        """Remove the series of every policy version not in `keep` (what still routes or
        is a rollback target); returns how many series went. Kept, every version promoted
        once stayed on /metrics for the proxy's life (60 promotions: 982 KB a scrape). A
        request of a forgotten version that still finishes makes its series anew, from 0,
        which Prometheus reads as a counter reset."""
        # The refused requests' series stayed only until the next admin change (a training
        # switch, a freeze, every promotion), and the 401 and 429 counts alerts watch read
        # as counter resets from zero.
        keep = keep | {UNROUTED_VERSION}
        gone = 0
        version_metrics = (self.requests, self.latency, self.ttft, self.tokens)
        for key in [k for k in self._series if k[0] in version_metrics]:
            metric, labels = key
            version = labels[2]  # (endpoint|direction, tenant, policy_version, ...)
            if version in keep:
                continue
            with contextlib.suppress(KeyError):  # prometheus_client: not there any more
                metric.remove(*labels)
            del self._series[key]
            gone += 1
        for request_key in [k for k in self._requests if k[2] not in keep]:
            del self._requests[request_key]
        return gone

    def also_serve(self, registry: CollectorRegistry) -> None:
        """Serve another component's series on /metrics too (the sink's `olp_stream_*`)."""
        self._also.append(registry)

    def render(self) -> tuple[bytes, str]:
        body = b"".join(generate_latest(r) for r in (self.registry, *self._also))
        return body, CONTENT_TYPE_LATEST


class RequestSeries:
    """The series one kind of finished request (endpoint, tenant, policy version, stream,
    status) is counted in. The time-to-first-token and token series are made on first use,
    so a kind of request that never has them adds none to /metrics."""

    __slots__ = ("_labels", "_metrics", "_tokens_in", "_tokens_out", "_ttft", "latency", "requests")

    def __init__(
        self,
        metrics: ProxyMetrics,
        endpoint: str,
        tenant: str,
        policy_version: str,
        stream: bool,
        status: int,
    ) -> None:
        self._metrics = metrics
        self._labels = (endpoint, tenant, policy_version)
        stream_label = "true" if stream else "false"
        self.requests = metrics.series(metrics.requests, *self._labels, stream_label, str(status))
        self.latency = metrics.series(metrics.latency, *self._labels, stream_label)
        self._ttft: Any = None
        self._tokens_in: Any = None
        self._tokens_out: Any = None

    def count(self, seconds: float, ttft_s: float | None, usage: Any) -> None:
        """One request that took `seconds`, its first token after `ttft_s` (a stream's), and
        the `usage` object upstream reported (prompt and completion tokens), if any."""
        self.requests.inc()
        self.latency.observe(seconds)
        if ttft_s is not None:
            if self._ttft is None:
                self._ttft = self._metrics.series(self._metrics.ttft, *self._labels)
            self._ttft.observe(ttft_s)
        if not isinstance(usage, dict):
            return
        prompt = usage.get("prompt_tokens")
        completion = usage.get("completion_tokens")
        if isinstance(prompt, int) and prompt > 0:
            if self._tokens_in is None:
                self._tokens_in = self._tokens("in")
            self._tokens_in.inc(prompt)
        if isinstance(completion, int) and completion > 0:
            if self._tokens_out is None:
                self._tokens_out = self._tokens("out")
            self._tokens_out.inc(completion)

    def _tokens(self, direction: str) -> Any:
        _, tenant, policy_version = self._labels
        return self._metrics.series(self._metrics.tokens, direction, tenant, policy_version)


class _InFlight(Collector):
    """`olp_proxy_in_flight`: requests being served now, per tenant."""

    def __init__(self, counts: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "olp_proxy_in_flight", "Requests being served now", labels=("tenant",)
        )
        for tenant, count in self._counts():
            family.add_metric((tenant,), count)
        yield family
