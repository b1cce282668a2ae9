"""Refuse requests whose `Host` names a server this proxy is not: the defence against DNS
rebinding.

A proxy on loopback is out of the network's reach, but not out of a browser's: a web page
can have its own host name re-resolve to 127.0.0.1 and then call the proxy as same-origin,
with any header, including the development keys every `olp up` ships with. Such requests
carry the page's host name in `Host`, so a loopback proxy serves only `localhost` and
loopback addresses unless `proxy.allowed_hosts` names more. A proxy bound to another address
is reached through names the operator chooses; it checks `Host` only when the list is set.
Loopback names are always served (a browser sets `Host` from the URL, so a page cannot send
them to a rebound name): `olp`'s own CLI and learner call the proxy at 127.0.0.1, or at its
bind address when it is bound to one address, which is served too.

Written here, not taken from a library: aiohttp has no host allow-list, and the check is a
set lookup on the header's name part.
"""

from __future__ import annotations

import ipaddress

from aiohttp import web

from proxy.errors import ProxyError

ANY_HOST = "*"
_SEEN_MAX = 64  # allowed Host values remembered (clients use one or two)
LOCAL_NAMES = frozenset({"localhost"})
_WILDCARD_BINDS = frozenset({"0.0.0.0", "::"})


def valid_allowed_host(entry: str) -> str:
    """A `proxy.allowed_hosts` entry, normalised like a `Host` value; ValueError naming it."""
    if entry.strip() == ANY_HOST:
        return ANY_HOST
    name = host_name(entry)
    if not name or any(c.isspace() or c in "/@?#" for c in name):
        raise ValueError(f"{entry!r} is not a host name or address (no scheme, path or spaces)")
    if "*" in name:
        # Compared as text, `*.example.com` matched no host at all.
        raise ValueError(f"{entry!r}: no wildcards in a name; list each name, or `*` for any")
    return name


def host_name(header: str) -> str:
    """The name part of a `Host` value: lower case, no port, no brackets, no final dot; an
    IP address in its compressed form (`2001:DB8:0::5` matched no `[2001:db8::5]`)."""
    value = header.strip().lower()
    if value.startswith("["):
        value = value[1:].partition("]")[0]
    else:
        name, colon, port = value.rpartition(":")
        if colon and port.isdigit() and ":" not in name:
            value = name
    value = value.rstrip(".")
    if ":" in value:  # IPv6 (IPv4 addresses have one spelling as a Host)
        try:
            return ipaddress.ip_address(value).compressed
        except ValueError:
            return value
    return value


def is_loopback(name: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1, IPv4-mapped loopback)."""
    if name in LOCAL_NAMES or name.endswith(".localhost"):
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class HostCheck:
    """Which `Host` names are served; built once from the config."""

    def __init__(self, bind_host: str, allowed_hosts: list[str] | None) -> None:
        self.any_host = False
        self.names: frozenset[str] = frozenset()
        self._seen: set[str] = set()  # Host values already allowed, verbatim
        if allowed_hosts is None:
            # The default: only a loopback proxy restricts names, to its own loopback ones.
            self.any_host = not is_loopback(host_name(bind_host))
        elif ANY_HOST in allowed_hosts:
            self.any_host = True
        else:
            names = {host_name(entry) for entry in allowed_hosts}
            # The bind address itself is what olp's own CLI, learner and readiness probe
            # call a proxy on a specific address by: a rebound page never sends it (a
            # browser sets Host from the page's own name).
            own = host_name(bind_host)
            if own and own not in _WILDCARD_BINDS:
                names.add(own)
            self.names = frozenset(names)

    def allows(self, header: str | None) -> bool:
        if self.any_host or header is None:  # no Host (HTTP/1.0): nothing to rebind
            return True
        if header in self._seen:
            return True
        name = host_name(header)
        allowed = name in self.names or is_loopback(name)
        if allowed and len(self._seen) < _SEEN_MAX:
            self._seen.add(header)  # parsing an address takes ~5 µs: once per Host value
        return allowed

    def check(self, request: web.Request) -> None:
        """Raise a 400 ProxyError when the request's `Host` is not served here."""
        header = request.headers.get("Host")
        if self.allows(header):
            return
        shown = (header or "")[:100]
        raise ProxyError(
            400,
            f"Host {shown!r} is not served here; list it in proxy.allowed_hosts to allow it.",
            code="host_not_allowed",
        )
