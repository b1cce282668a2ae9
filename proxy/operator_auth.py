"""Browser sessions of the operator page: one-time login links and HttpOnly session cookies.

A browser cannot send a Bearer header from a plain link and an admin key must never sit in
a URL, so the admin key (or the run's internal token) mints a one-time token that a browser
trades for a session cookie. Everything lives in memory (a proxy restart signs operators
out), and tokens are kept only as sha256 digests so a memory dump shows no usable token.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from proxy.config import sha256_hex

LINK_TTL_S = 60.0
SESSION_TTL_S = 8 * 3600.0
MAX_ENTRIES = 256  # live links / sessions; the oldest go first beyond this
COOKIE_NAME = "olp_operator"
COOKIE_PATH = "/admin/ui"
# Who made a change, as the audit log names them (the admin API's X-OLP-Actor, the sign-in
# form's field, the CLI's --actor): checked with fullmatch.
ACTOR_PATTERN = re.compile(r"[A-Za-z0-9._@:\-]{1,64}")


ACTOR_RULE = "1-64 letters, digits and . _ @ : -"


def clean_actor(actor: str | None, default: str = "operator") -> str:
    """An actor name safe for the audit log (the same rule as `X-OLP-Actor`). `fullmatch`:
    `$` also matches before a final newline, which a form field can carry."""
    return actor if actor and ACTOR_PATTERN.fullmatch(actor) else default


def header_actor(value: str | None, default: str = "admin") -> str | None:
    """The `X-OLP-Actor` header's name (`default` without the header), or None when it
    breaks the rule: the caller refuses the request. Taken as `default` instead, a change
    by `alice smith` or `ops\n` went into the audit log as `admin`, under nobody's name."""
    if not value:
        return default
    return value if ACTOR_PATTERN.fullmatch(value) else None


def key_matches(admin_key_hashes: tuple[str, ...], key: str) -> bool:
    """Whether `key` is one of the admin keys (compared as digests, in constant time)."""
    digest = sha256_hex(key.strip())
    return any(hmac.compare_digest(known, digest) for known in admin_key_hashes)


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass
class Session:
    actor: str
    csrf: str
    expires: float


class SessionStore:
    """One-time login links (`link_ttl_s`) and browser sessions (`session_ttl_s`)."""

    def __init__(
        self,
        link_ttl_s: float = LINK_TTL_S,
        session_ttl_s: float = SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.link_ttl_s = link_ttl_s
        self.session_ttl_s = session_ttl_s
        self._clock = clock
        self._links: dict[str, tuple[str, float]] = {}
        self._sessions: dict[str, Session] = {}

    def issue_link(self, actor: str) -> str:
        """A fresh one-time token for `actor`; valid for `link_ttl_s` seconds."""
        self._prune()
        token = secrets.token_urlsafe(32)
        self._links[_digest(token)] = (actor, self._clock() + self.link_ttl_s)
        return token

    def link_actor(self, token: str) -> str | None:
        """The actor of a live link, without spending it (the confirmation page shows it)."""
        entry = self._links.get(_digest(token))
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]

    def redeem_link(self, token: str) -> str | None:
        """The actor the token was issued to, once; None when unknown, used or expired."""
        entry = self._links.pop(_digest(token), None)
        if entry is None or entry[1] < self._clock():
            return None
        return entry[0]

    def open_session(self, actor: str) -> tuple[str, Session]:
        self._prune()
        session_id = secrets.token_urlsafe(32)
        session = Session(actor, secrets.token_urlsafe(24), self._clock() + self.session_ttl_s)
        self._sessions[_digest(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        session = self._sessions.get(_digest(session_id))
        if session is None or session.expires < self._clock():
            return None
        return session

    def close(self, session_id: str) -> None:
        self._sessions.pop(_digest(session_id), None)

    def _prune(self) -> None:
        now = self._clock()
        self._links = {k: v for k, v in self._links.items() if v[1] >= now}
        self._sessions = {k: v for k, v in self._sessions.items() if v.expires >= now}
        for table in (self._links, self._sessions):
            while len(table) >= MAX_ENTRIES:
                table.pop(next(iter(table)))
