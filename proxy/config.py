"""Typed configuration of the proxy (`proxy` section) and its tenants (`tenants` section).

Keys are only ever held as sha256 hex digests: a plaintext `api_key` / `admin_key` given in the
config is hashed while the model is validated and then dropped, so it never lives on the object.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import PurePath
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from proxy.client_address import parse_network
from proxy.host_check import valid_allowed_host
from safety.config import non_empty_secret, refuse_userinfo

# Set by `olp up` for its children: a per-run token the learner uses to flip aliases.
INTERNAL_ADMIN_TOKEN_ENV = "OLP_INTERNAL_ADMIN_TOKEN"

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def sha256_hex(text: str) -> str:
    """Hex sha256 of a UTF-8 string: how keys, tenant names and users are stored.

    `surrogatepass`: a header with bytes that are not UTF-8 (aiohttp decodes those to lone
    surrogates) or a JSON `\\ud800` still hashes, to a digest no valid key has."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def is_utf8_text(text: str) -> bool:
    """Whether UTF-8 can carry `text` (no lone surrogates): what a record must hold to
    reach the sink and the logs."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _hash_plaintext_key(data: Any, plain_field: str, hashed_field: str) -> Any:
    """Replace a plaintext key field by its sha256 so the plaintext is never kept.

    Surrounding whitespace is removed first, as from a presented key (`Bearer <key>`) and
    by `olp key hash`: a YAML block scalar's newline or a pasted blank would otherwise make
    a key that validates and never matches."""
    if isinstance(data, dict) and plain_field in data:
        data = dict(data)
        plain = data.pop(plain_field)
        if plain is None:
            return data
        if isinstance(plain, str):
            plain = plain.strip()
        if not isinstance(plain, str) or not plain:
            raise ValueError(f"{plain_field} must be a non-empty string")
        if data.get(hashed_field) not in (None, sha256_hex(plain)):
            raise ValueError(f"give either {plain_field} or {hashed_field}, not two different keys")
        data[hashed_field] = sha256_hex(plain)
    return data


def _check_sha256(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    value = value.strip().lower()
    if not _SHA256_HEX.match(value):
        raise ValueError(f"{name} must be 64 lowercase hex characters (a sha256 digest)")
    return value


class TenantConfig(BaseModel):
    """One client organisation: its key (hashed), its limits and its training opt-in."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str = Field(default="default", min_length=1, max_length=128)
    api_key_sha256: str | None = None
    training_enabled: bool = False
    requests_per_minute: int = Field(default=600, ge=0, description="0 = unlimited")
    max_concurrent: int = Field(default=16, ge=0, description="0 = unlimited")

    @model_validator(mode="before")
    @classmethod
    def _hash_api_key(cls, data: Any) -> Any:
        return _hash_plaintext_key(data, "api_key", "api_key_sha256")

    @field_validator("api_key_sha256")
    @classmethod
    def _valid_digest(cls, value: str | None) -> str | None:
        return _check_sha256(value, "api_key_sha256")

    @field_validator("name")
    @classmethod
    def _addressable_name(cls, name: str) -> str:
        # Clients and servers resolve a `.` or `..` path segment away: such a tenant's
        # training switch (/admin/tenants/{name}/training) could never be reached.
        if name in (".", ".."):
            raise ValueError(f"a tenant cannot be named {name!r}: it names no URL path segment")
        return name


class StatePaths(BaseModel):
    """Sub-paths below the state dir that the proxy writes."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    serving_state: str = Field(
        default="control/serving.json",
        description="alias table, canaries, history, freeze flags, run-time training switches "
        "(relative, below the state dir)",
    )
    records_dir: str = Field(
        default="records",
        description="JSONL sink directory (sink: jsonl; relative, below the state dir)",
    )

    @field_validator("serving_state", "records_dir")
    @classmethod
    def _below_state_dir(cls, value: str, info: ValidationInfo) -> str:
        """The proxy finds the state dir (the learner's `adapters/` and `gates/`) from the
        serving state's path below it: an absolute path, or one that climbs out with '..',
        left it unknowable."""
        path = PurePath(value)
        if not path.parts:
            raise ValueError(f"{info.field_name} is empty: give a path below the state dir")
        if path.is_absolute():
            raise ValueError(
                f"{info.field_name} {value!r} is absolute: give a path relative to the state dir"
            )
        if ".." in path.parts:
            raise ValueError(
                f"{info.field_name} {value!r} climbs out of the state dir with '..': give a "
                "path below it"
            )
        return value


class GcTuning(BaseModel):
    """Garbage-collector settings of the proxy process (applied once it listens).

    With the interpreter's defaults a full collection walks every object the process holds
    (~40 ms here) while every request on the loop waits: the proxy's worst p99 per
    benchmark round at 16 concurrent requests was 34-62 ms with them, 12-20 ms with these
    (docs/perf/proxy.md)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    freeze_after_start: bool = Field(
        default=True,
        description="move the objects built at start-up out of the collector's scans",
    )
    young_threshold: int = Field(
        default=20_000,
        ge=0,
        description="net allocations between young collections (0: the interpreter default)",
    )


class AuthFailureLimits(BaseModel):
    """The failed-authentication throttle (`proxy.auth_failures`): an address that keeps
    presenting wrong keys is refused for a while, so keys cannot be guessed at line rate."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_failures: int = Field(
        default=20,
        ge=0,
        description="wrong keys from one address within window_s before it is refused "
        "with 429 for window_s (missing keys are not counted); 0 = off",
    )
    window_s: float = Field(
        default=60.0,
        gt=0,
        allow_inf_nan=False,
        description="seconds (finite): the counting window, and how long a lockout lasts",
    )
    max_addresses: int = Field(
        default=10_000,
        ge=1,
        description="addresses tracked at once; beyond it the least recently failing go first",
    )


def bind_address(host: str) -> str:
    """A listening address as the socket layer resolves it: `[::1]` (a URL's spelling) without
    its brackets; none empty (vLLM listened on every interface) and none with spaces
    (`getaddrinfo` fails on them, and the process died at start-up)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not bare.strip():
        raise ValueError("an address is needed (127.0.0.1 keeps it on loopback)")
    if any(char.isspace() for char in bare):
        raise ValueError("an address holds no spaces")
    return bare


class ProxyConfig(BaseModel):
    """The `proxy` config section. Every field has a default so the embedded stack runs as is."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="bind address; every interface must be named (`0.0.0.0`): an empty "
        "host listened on every interface with the Host check off",
    )
    allowed_hosts: list[str] | None = Field(
        default=None,
        description="Host header names served besides localhost and loopback addresses "
        "(port ignored; `*` = any); null = any name, except on a loopback `host`: only "
        "localhost and loopback addresses (against DNS rebinding)",
    )
    port: int = Field(default=8000, ge=0, le=65535)
    upstreams: list[str] = Field(
        default_factory=list,
        description="vLLM base URLs without /v1; empty = filled in by the launcher",
    )
    drain_s: float = Field(
        default=15.0,
        ge=0,
        description="on stop, how long requests in flight may still run; then they are "
        "cancelled (a trajectory is recorded `aborted`) and the sink closes "
        "(`stream.close_timeout_s`); `olp up` waits for both",
    )
    upstream_api_key: SecretStr | None = Field(
        default=None,
        description="Bearer key sent to the upstreams (vLLM's --api-key); null: "
        "`policy.api_key` (`olp proxy` fills it in)",
    )
    pseudonym_key: SecretStr | None = Field(
        default=None,
        description="HMAC key of the pseudonyms of client labels and users in records and "
        "logs; null: a random one kept in <state_dir>/control/pseudonym.key. Proxies whose "
        "records and feedback must join need the same key",
    )
    base_served_name: str = Field(
        default="base",
        description="served model name of the base model on the upstreams; `olp proxy` and "
        "`olp up` set it from `policy.served_model_name` (a value here is not used there)",
    )
    policy_alias: str = Field(default="policy", description="public name of the learned policy")
    base_model_aliases: list[str] = Field(
        default_factory=lambda: ["base"],
        description="public names that always reach the base model",
    )
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    max_messages: int = Field(default=1024, ge=1)
    max_choices: int = Field(
        default=16,
        ge=1,
        description="choices one request may ask for (`n`, times the prompts of a batched "
        "completions request); more: 400",
    )
    connect_timeout_s: float = Field(default=5.0, gt=0)
    read_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="between two reads of an upstream answer, and for an unstreamed request "
        "the wait for the whole answer (504 then, not retried on another replica)",
    )
    idle_timeout_s: float = Field(
        default=75.0,
        gt=0,
        description="a client connection with no request being served (idle between "
        "requests, or not done sending its request's headers) is closed after this; keep it "
        "above the idle timeout of a load balancer in front of the proxy",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a request whose body stops arriving for this long (no bytes between "
        "two reads) gets a 408 and its tenant's concurrency slot back; a client gone without "
        "closing its connection held both until TCP keep-alive noticed, hours later",
    )
    send_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="a client that reads nothing of its streamed answer for this long (its "
        "connection open, its socket buffer full) is disconnected, and its upstream request "
        "cancelled; it held its concurrency slot and a generation on the model server until "
        "it closed the connection",
    )
    max_upstream_connections: int = Field(
        default=256,
        ge=1,
        description="connections open to each replica at once (a request waits for one); "
        "per replica, so that one that stopped answering holds only its own",
    )
    upstream_keepalive_s: float = Field(
        default=4.0,
        gt=0,
        description="an idle connection to a replica is reused only while younger than "
        "this; keep it below the replica's own keep-alive timeout (vLLM: 5 s, "
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE), or requests meet connections it is closing",
    )
    require_auth: bool = Field(
        default=True,
        description="false serves requests without a tenant's key (none, or one no tenant "
        "has, such as the SDK's placeholder `EMPTY`) as tenant 'anonymous'",
    )
    admin_key_sha256: str | None = None
    capture_enabled: bool = Field(default=True, description="global switch for trajectories")
    sink: Literal["kafka", "jsonl"] = Field(
        default="kafka", description="where trajectories and feedback go (run_proxy)"
    )
    capture_backlog_limit: int = Field(
        default=20_000,
        ge=1,
        description="records and captures the Kafka sink may hold in the proxy's memory, "
        "not yet durable; at this many, training tenants' requests are served without "
        "capture (olp_proxy_captures_skipped_total, reason backlog) until half of it is left",
    )
    capture_backlog_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1,
        description="bytes of captures the Kafka sink may hold in the proxy's memory, not yet "
        "durable (its worker holds a copy of those it was handed: up to twice this in all); "
        "at this many, capture pauses as at capture_backlog_limit, until half of both is left",
    )
    recent_trajectories: int = Field(
        default=100_000,
        ge=1,
        description="trajectory ids remembered for feedback ownership (about 350 bytes of "
        "the proxy's memory each: 35 MB when full at the default), and a tenth as many ids of "
        "a training tenant's requests that were not captured (feedback on them is not "
        "recorded)",
    )
    max_feedback_metadata_bytes: int = Field(default=16 * 1024, ge=0)
    state: StatePaths = Field(default_factory=StatePaths)
    gc: GcTuning = Field(default_factory=GcTuning)
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto",
        description="the proxy process's event loop: `auto` = uvloop where installed, else "
        "asyncio's own; `uvloop` refuses to start without it (proxy/event_loop.py)",
    )
    auth_failures: AuthFailureLimits = Field(default_factory=AuthFailureLimits)
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or CIDR networks of the reverse proxies in front of olp; "
        "from one of them the client is the right-most X-Forwarded-For entry that is not "
        "itself listed (failed-key throttle, audit); empty = the TCP peer, the header is "
        "never read",
    )

    @model_validator(mode="before")
    @classmethod
    def _hash_admin_key(cls, data: Any) -> Any:
        return _hash_plaintext_key(data, "admin_key", "admin_key_sha256")

    @field_validator("upstream_api_key")
    @classmethod
    def _non_empty_upstream_key(cls, key: SecretStr | None) -> SecretStr | None:
        # An empty key was sent as no key at all (and `policy.api_key` was not used), so a
        # vLLM started with one refused every request with 401.
        return non_empty_secret(key, "`policy.api_key`")

    @field_validator("pseudonym_key")
    @classmethod
    def _long_pseudonym_key(cls, key: SecretStr | None) -> SecretStr | None:
        if key is not None and len(key.get_secret_value().strip()) < 16:
            raise ValueError("must be 16 characters or more (a guessable key is no key)")
        return key

    @field_validator("admin_key_sha256")
    @classmethod
    def _valid_digest(cls, value: str | None) -> str | None:
        return _check_sha256(value, "admin_key_sha256")

    @model_validator(mode="after")
    def _policy_alias_is_not_a_base_alias(self) -> ProxyConfig:
        # A base alias always reaches the base model (flips refuse it): the policy alias
        # among them could never serve a learned version.
        if self.policy_alias in self.base_model_aliases:
            raise ValueError(
                f"policy_alias {self.policy_alias!r} is also in base_model_aliases: a base "
                "alias always serves the base model; give the policy another name"
            )
        return self

    @field_validator("host")
    @classmethod
    def _bind_address(cls, host: str) -> str:
        return bind_address(host)

    @field_validator("allowed_hosts")
    @classmethod
    def _valid_hosts(cls, entries: list[str] | None) -> list[str] | None:
        return None if entries is None else [valid_allowed_host(entry) for entry in entries]

    @field_validator("trusted_proxies")
    @classmethod
    def _valid_networks(cls, entries: list[str]) -> list[str]:
        return [str(parse_network(entry)) for entry in entries]

    @field_validator("upstreams")
    @classmethod
    def _valid_upstreams(cls, urls: list[str]) -> list[str]:
        cleaned = []
        for url in urls:
            refuse_userinfo(  # before any message that shows the URL
                url,
                "proxy.upstreams",
                "the proxy would log and show in /admin/status",
                "the upstream's key as proxy.upstream_api_key instead",
            )
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"upstream {url!r} must start with http:// or https://")
            url = url.rstrip("/")
            if url.endswith("/v1"):
                raise ValueError(f"upstream {url!r} must be the base URL without /v1")
            cleaned.append(url)
        return cleaned
