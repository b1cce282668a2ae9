"""The operator commands talk to the running proxy's /admin API with the admin key."""

from __future__ import annotations

import contextlib
import getpass
import http.client
import json
import os
import urllib.error
import urllib.request
from typing import Any

from deploy.config import OlpConfig
from deploy.dev_keys import DEV_ADMIN_KEY
from deploy.direct_http import open_direct
from deploy.ports import local_http_url
from proxy.config import INTERNAL_ADMIN_TOKEN_ENV, sha256_hex
from proxy.operator_auth import ACTOR_PATTERN


class AdminError(RuntimeError):
    pass


def admin_key(cfg: OlpConfig, explicit: str | None) -> str:
    """--admin-key, else OLP_ADMIN_KEY, else the dev key when the config still uses it."""
    if explicit is not None and not explicit.strip():
        # It fell back to OLP_ADMIN_KEY or the dev key: another key than the one meant.
        raise AdminError("--admin-key is empty: give the key, or leave the option out")
    key = (explicit or os.environ.get("OLP_ADMIN_KEY") or "").strip()
    if key:
        # Stripped as the proxy strips a presented key (a key file saved with CRLF ends in
        # `\r`); one an HTTP header cannot carry is refused without echoing it: http.client
        # raised with the whole header, key included, in its traceback.
        if not key.isascii() or not key.isprintable():
            raise AdminError(
                "the admin key holds a character an HTTP header cannot carry (not printable "
                "ASCII); check --admin-key / OLP_ADMIN_KEY"
            )
        return key
    if cfg.proxy.admin_key_sha256 == sha256_hex(DEV_ADMIN_KEY):
        return DEV_ADMIN_KEY
    raise AdminError("no admin key: pass --admin-key or set OLP_ADMIN_KEY")


def learner_admin_key(cfg: OlpConfig) -> str:
    """Under `olp up` a per-run internal token; standalone, the operator's admin key."""
    token = os.environ.get(INTERNAL_ADMIN_TOKEN_ENV)
    if token:
        return token
    try:
        return admin_key(cfg, None)
    except AdminError:
        # `olp learner` takes no --admin-key: the one way to give it a key is the environment.
        raise AdminError(
            "no admin key: set OLP_ADMIN_KEY (the learner flips the proxy alias when it promotes)"
        ) from None


def operator_name(explicit: str | None) -> str:
    """Who the audit log names for a change: --actor, else OLP_ACTOR, else the login name of
    whoever runs the command (before, every CLI change was audited as `admin`)."""
    if explicit is not None and not explicit.strip():
        # It fell back to the login name: the change was audited under another name than
        # the one the operator meant to give.
        raise AdminError("--actor is empty: give a name (1-64 letters, digits and . _ @ : -)")
    name = explicit or os.environ.get("OLP_ACTOR")
    if name:
        if not ACTOR_PATTERN.fullmatch(name):
            raise AdminError(
                f"actor {name!r}: use 1-64 letters, digits and . _ @ : - (--actor or OLP_ACTOR)"
            )
        return name
    with contextlib.suppress(Exception):  # no login name (a container's bare uid): `admin`
        user = getpass.getuser()
        if ACTOR_PATTERN.fullmatch(user):
            return user
    return "admin"


class AdminClient:
    def __init__(
        self, base_url: str, key: str, timeout_s: float = 30.0, actor: str = "admin"
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.key = key
        self.timeout_s = timeout_s
        self.actor = actor

    @classmethod
    def from_config(
        cls, cfg: OlpConfig, explicit_key: str | None = None, actor: str | None = None
    ) -> AdminClient:
        return cls(
            local_http_url(cfg.proxy.host, cfg.proxy.port),
            admin_key(cfg, explicit_key),
            actor=operator_name(actor),
        )

    def call(
        self, method: str, path: str, body: dict[str, Any] | None = None
    ) -> dict[str, Any] | None:
        """The JSON object the admin API answers (None for an empty body); AdminError for
        anything else, so that the operator commands print one line, never a traceback."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"{self.base_url}{path}",
            data=data,
            method=method,
            headers={
                "Authorization": f"Bearer {self.key}",
                "Content-Type": "application/json",
                "X-OLP-Actor": self.actor,
            },
        )
        try:
            with open_direct(req, self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise AdminError(f"{method} {path} failed with {exc.code}: {_detail(exc)}") from None
        except urllib.error.URLError as exc:
            raise AdminError(
                f"cannot reach the proxy at {self.base_url} ({exc.reason}); is `olp up` running?"
            ) from None
        except (OSError, http.client.HTTPException) as exc:  # timeout, reset, bad status line
            raise AdminError(
                f"{method} {path}: the proxy at {self.base_url} did not answer properly "
                f"({type(exc).__name__}: {exc or 'no detail'})"
            ) from None
        return _json_object(raw, f"{method} {path}")


def _detail(exc: urllib.error.HTTPError) -> str:
    """The admin API's error message, else the raw body, else the HTTP reason."""
    try:
        detail = exc.read().decode(errors="replace")
    except (OSError, http.client.HTTPException):  # the body broke off: the status still says
        return str(exc.reason)
    with contextlib.suppress(ValueError, KeyError, TypeError):
        detail = json.loads(detail)["error"]["message"]
    # One line, as every refused call prints: a reverse proxy's HTML error page spanned many.
    detail = " ".join(str(detail).split())
    return (detail[:300] + " ..." if len(detail) > 300 else detail) or str(exc.reason)


def _json_object(raw: bytes, what: str) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        raise AdminError(f"{what}: the answer is not JSON: {raw[:80]!r}") from None
    if not isinstance(value, dict):
        raise AdminError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value
