"""Small network helpers for launchers and health checks."""

from __future__ import annotations

import ipaddress
import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different free ports. Separate `free_port` calls may return the same port
    (each socket is closed before the next bind), and a configuration naming one port twice
    is refused: every socket stays bound until all the ports are chosen."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def port_open(host: str, port: int, timeout_s: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


def http_url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 literal in brackets (`http://::1:8000` is no URL: urllib
    sent `Host: ::1:8000`, which the proxy's host check refused)."""
    bare = host.strip("[]")
    return f"http://[{bare}]:{port}" if ":" in bare else f"http://{bare}:{port}"


def local_http_url(host: str, port: int) -> str:
    """The URL a process on this machine reaches a listener bound to `host` by: a wildcard
    bind address through loopback (`0.0.0.0` is no address the proxy's host check serves)."""
    bare = host.strip("[]")
    if bare in ("0.0.0.0", ""):
        bare = "127.0.0.1"
    elif bare == "::":
        bare = "::1"
    return http_url(bare, port)


def listener_host(host: str) -> str:
    """`host` as the IP literal a listener binds (an IPv6 one in brackets). The embedded
    broker took a name as it came and, given `localhost`, listened on every interface,
    where olp counts `localhost` as loopback; so a name is resolved here, `localhost` to
    127.0.0.1."""
    bare = host.strip("[]")
    if bare == "localhost":
        bare = "127.0.0.1"
    else:
        try:
            ipaddress.ip_address(bare)
        except ValueError:  # another name: what it resolves to, as a client would connect
            bare = str(socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)[0][4][0])
    return f"[{bare}]" if ":" in bare else bare


def is_loopback(host: str) -> bool:
    """`localhost` or a loopback address (127.0.0.0/8, ::1): reachable from this machine only."""
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything
