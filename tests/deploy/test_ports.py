"""URLs and listener addresses built from configured hosts."""

from __future__ import annotations

import pytest

from deploy.ports import http_url, listener_host, local_http_url


@pytest.mark.parametrize(
    ("host", "url", "local"),
    [
        ("127.0.0.1", "http://127.0.0.1:8000", "http://127.0.0.1:8000"),
        ("localhost", "http://localhost:8000", "http://localhost:8000"),
        # An IPv6 literal without brackets is no URL: urllib sent `Host: ::1:8000`, which
        # the proxy's host check refused, and `olp up` waited for a proxy that was up.
        ("::1", "http://[::1]:8000", "http://[::1]:8000"),
        ("[::1]", "http://[::1]:8000", "http://[::1]:8000"),
        # A wildcard bind address is reached through loopback: `0.0.0.0` is no Host the
        # proxy serves once allowed_hosts is set.
        ("0.0.0.0", "http://0.0.0.0:8000", "http://127.0.0.1:8000"),
        ("::", "http://[::]:8000", "http://[::1]:8000"),
    ],
)
def test_urls_of_a_configured_host(host: str, url: str, local: str) -> None:
    assert http_url(host, 8000) == url
    assert local_http_url(host, 8000) == local


def test_a_listener_binds_an_address_never_a_name() -> None:
    assert listener_host("localhost") == "127.0.0.1"
    assert listener_host("127.0.0.1") == "127.0.0.1"
    assert listener_host("::1") == "[::1]"
    assert listener_host("[::1]") == "[::1]"
    assert listener_host("0.0.0.0") == "0.0.0.0"
