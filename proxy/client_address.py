"""Which client sent a request: the TCP peer, or behind trusted reverse proxies the client
they name in `X-Forwarded-For`.

The failed-key throttle counts per client address, and the audit log records who signed in
to the operator page. Behind an ingress or a load balancer every request's TCP peer is that
hop, so without this one client's wrong keys would lock out all of them. `X-Forwarded-For`
is read only from a peer listed in `proxy.trusted_proxies` (any client can write the
header), and only as far as trusted hops go: walking the list from its right end (the entry
the nearest hop added), the first address that is not itself a trusted proxy is the client.
Entries to its left were written by the client and are never believed.

Written here rather than taken from a library: aiohttp has no trusted-proxy resolution of its
own, and aiohttp-remotes' strict mode answers 400 to every request whose peer is not a listed
proxy, which would refuse the loopback callers (`olp` CLI, the learner) that reach the proxy
directly.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from aiohttp import web

UNKNOWN_ADDRESS = "unknown"  # a transport without a peer address (a unix socket)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_network(text: str) -> IPNetwork:
    """An address (`10.0.0.7`, `::1`) or a network (`10.0.0.0/8`); ValueError naming it."""
    try:
        return ipaddress.ip_network(text.strip(), strict=False)
    except ValueError as exc:
        raise ValueError(f"{text!r} is not an IP address or network (CIDR)") from exc


def parse_forwarded_address(entry: str) -> IPAddress | None:
    """One `X-Forwarded-For` entry as an address; None when it is not one (`unknown`, a
    hostname, an obfuscated identifier). A port (`1.2.3.4:5`, `[::1]:5`) is dropped."""
    entry = entry.strip()
    if entry.startswith("["):
        entry, bracket, _ = entry[1:].partition("]")
        if not bracket:
            return None
    elif entry.count(":") == 1:
        entry = entry.partition(":")[0]  # IPv4 with a port; bare IPv6 has several colons
    try:
        address = ipaddress.ip_address(entry)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class ClientAddresses:
    """Resolves a request's client address; with no trusted proxy it is the TCP peer."""

    def __init__(self, trusted_proxies: Iterable[str] = ()) -> None:
        self.trusted = tuple(parse_network(text) for text in trusted_proxies)

    def is_trusted(self, address: IPAddress) -> bool:
        return any(address in network for network in self.trusted)

    def of(self, request: web.Request) -> str:
        """The address failures are counted and sign-ins audited under."""
        peer = request.remote
        if not peer:
            return UNKNOWN_ADDRESS
        if not self.trusted:
            return peer
        hop = parse_forwarded_address(peer)
        if hop is None or not self.is_trusted(hop):
            return peer
        # Several X-Forwarded-For headers are one list, in order (RFC 9110 field lines).
        entries = ",".join(request.headers.getall("X-Forwarded-For", ())).split(",")
        for entry in reversed(entries):
            if not entry.strip():
                continue
            address = parse_forwarded_address(entry)
            if address is None:
                # Not an address: the trusted hop that passed it on is the nearest sender
                # known, and anything further left is the client's own writing.
                break
            hop = address
            if not self.is_trusted(hop):
                break
        return str(hop)
