"""Everything one proxy instance holds, in one object on the aiohttp app (no module globals)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.aliases import AliasTable
from proxy.auth_throttle import AuthThrottle
from proxy.capture import CaptureService
from proxy.client_address import ClientAddresses
from proxy.config import ProxyConfig
from proxy.feedback import RecentTrajectories
from proxy.host_check import HostCheck
from proxy.metrics import ProxyMetrics
from proxy.routing import UpstreamPool
from proxy.serving_state import ServingState
from proxy.stalled_clients import StalledClientWatch
from proxy.tenants import TenantRegistry


@dataclass
class ProxyContext:
    config: ProxyConfig
    tenants: TenantRegistry
    aliases: AliasTable
    pool: UpstreamPool
    metrics: ProxyMetrics
    capture: CaptureService
    recent: RecentTrajectories
    # Request ids of a training tenant's requests that were not captured (`X-OLP-Train: 0`,
    # a skipped capture), apart from `recent`: a tenant's opted-out traffic (an IDE's
    # completions at 100/s) turned that one over in minutes, and feedback for the captured
    # trajectories then found them unknown.
    not_captured: RecentTrajectories
    state: ServingState
    state_path: Path
    sink: Any
    redactor: Any
    audit: Any
    client_addresses: ClientAddresses
    host_check: HostCheck
    auth_throttle: AuthThrottle
    stalled_clients: StalledClientWatch
    admin_key_hashes: tuple[str, ...] = ()
    started_at: float = field(default_factory=time.time)
    pseudonym_key: bytes | None = None  # of client labels and users (`safety.pseudonym`)
    # When the drain of a stopping proxy ends (monotonic; set by app.on_shutdown, as the
    # drain begins): the requests it cuts then are counted `shutdown`, not
    # `client_disconnect` (no client left, and the dashboard could not tell them apart).
    drain_ends_at: float | None = None
    # The stream the sink writes, when named (`OLP_STREAM_ID`, from `olp up`): the operator
    # page measures no lag against offsets a version saved in another stream.
    stream_id: str | None = None


CONTEXT = web.AppKey("olp_proxy_context", ProxyContext)
REQUEST_ID = web.RequestKey("olp_request_id", str)
# Set while the handler's response is under way (its status and headers sent, its end not):
# a failure then can no longer be answered with an error response of its own.
RESPONSE_STARTED = web.RequestKey("olp_response_started", bool)
