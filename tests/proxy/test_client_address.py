"""Client addresses behind trusted reverse proxies: X-Forwarded-For is believed only from a
listed peer and only as far as listed hops go."""

from __future__ import annotations

from unittest import mock

import httpx
import pytest
from aiohttp.test_utils import make_mocked_request
from pydantic import ValidationError

from deploy.config import ConfigError, load_config
from deploy.ports import free_port
from proxy.auth_throttle import AuthThrottle
from proxy.client_address import ClientAddresses, parse_forwarded_address
from proxy.config import ProxyConfig
from tests.proxy.conftest import ADMIN_KEY, KEYS
from tests.proxy.test_auth_throttle import MAX, WINDOW_S, FakeClock

INGRESS = ["10.0.0.0/24", "fd00::/64"]


def _request(peer: str | None, *forwarded_for: str) -> object:
    transport = mock.Mock()
    peername = (peer, 40000) if peer is not None else None
    transport.get_extra_info.side_effect = lambda key, default=None: (
        peername if key == "peername" else default
    )
    headers = [("X-Forwarded-For", value) for value in forwarded_for]
    return make_mocked_request("GET", "/v1/models", headers=headers, transport=transport)


@pytest.mark.parametrize(
    ("peer", "forwarded_for", "client"),
    [
        # From a listed proxy: the right-most entry that is not itself a listed proxy.
        ("10.0.0.5", ["203.0.113.9"], "203.0.113.9"),
        ("10.0.0.5", ["198.51.100.1, 203.0.113.9"], "203.0.113.9"),  # left: client-written
        ("10.0.0.5", ["203.0.113.9, 10.0.0.6"], "203.0.113.9"),  # two proxies in a row
        ("10.0.0.5", ["198.51.100.1", "203.0.113.9"], "203.0.113.9"),  # two header lines
        ("10.0.0.5", ["203.0.113.9:5123"], "203.0.113.9"),  # a port is dropped
        ("10.0.0.5", ["[2001:db8::7]:443"], "2001:db8::7"),
        ("10.0.0.5", ["2001:db8::7"], "2001:db8::7"),
        ("10.0.0.5", ["::ffff:203.0.113.9"], "203.0.113.9"),  # IPv4-mapped: one address
        ("fd00::1", ["203.0.113.9"], "203.0.113.9"),
        ("::ffff:10.0.0.5", ["203.0.113.9"], "203.0.113.9"),  # a dual-stack listener's peer
        # The nearest sender known when the chain holds no client address.
        ("10.0.0.5", [], "10.0.0.5"),  # the proxy's own request (a health check)
        ("10.0.0.5", ["10.0.0.7"], "10.0.0.7"),  # every hop listed: the left-most
        ("10.0.0.5", ["203.0.113.9, unknown"], "10.0.0.5"),  # not an address: stop there
        ("10.0.0.5", ["203.0.113.9, unknown, 10.0.0.6"], "10.0.0.6"),
        ("10.0.0.5", [" , "], "10.0.0.5"),
        # Not from a listed proxy: the header is anybody's and never read.
        ("203.0.113.50", ["10.0.0.5"], "203.0.113.50"),
        ("127.0.0.1", ["203.0.113.9"], "127.0.0.1"),
        (None, ["203.0.113.9"], "unknown"),
    ],
)
def test_the_client_is_the_first_untrusted_hop_from_the_right(peer, forwarded_for, client):
    assert ClientAddresses(INGRESS).of(_request(peer, *forwarded_for)) == client


def test_without_trusted_proxies_the_header_is_never_read():
    request = _request("10.0.0.5", "203.0.113.9")
    assert ClientAddresses().of(request) == "10.0.0.5"


@pytest.mark.parametrize("entry", ["unknown", "_hidden", "example.com", "1.2.3", "[::1", ""])
def test_entries_that_are_not_addresses_are_recognised(entry):
    assert parse_forwarded_address(entry) is None


def test_the_setting_is_normalised_and_a_bad_entry_is_named():
    config = ProxyConfig(trusted_proxies=["10.0.0.7", " 10.1.2.3/16", "::1"])
    assert config.trusted_proxies == ["10.0.0.7/32", "10.1.0.0/16", "::1/128"]
    assert ProxyConfig().trusted_proxies == []  # the default trusts no one
    with pytest.raises(ValidationError, match="'ingress' is not an IP address or network"):
        ProxyConfig(trusted_proxies=["10.0.0.0/8", "ingress"])
    env = {"OLP_PROXY__TRUSTED_PROXIES": "[10.0.0.0/8, fd00::/8]"}
    assert load_config(environ=env).proxy.trusted_proxies == ["10.0.0.0/8", "fd00::/8"]
    with pytest.raises(ConfigError, match=r"proxy\.trusted_proxies"):
        load_config(environ={"OLP_PROXY__TRUSTED_PROXIES": "[10.0.0.300]"})


# ----------------------------------------------------------------- through the app


@pytest.fixture
def behind_ingress(make_proxy):
    """A proxy (no live upstream) that trusts 127.0.0.1 as its reverse proxy; its throttle
    locks after MAX failures, on a fake clock."""
    harness, _ = make_proxy(
        [f"http://127.0.0.1:{free_port()}"],
        auth_failures={"max_failures": MAX, "window_s": WINDOW_S},
        trusted_proxies=["127.0.0.1"],
    )
    ctx = harness.ctx
    ctx.auth_throttle = AuthThrottle(
        ctx.config.auth_failures, ctx.metrics, clock=FakeClock(), addresses=ctx.client_addresses
    )
    return harness


def _models(harness, key: str, forwarded_for: str | None, client=httpx) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    if forwarded_for is not None:
        headers["X-Forwarded-For"] = forwarded_for
    return client.get(harness.base_url + "/v1/models", headers=headers, timeout=30).status_code


def test_one_client_behind_the_ingress_is_locked_out_not_all_of_them(behind_ingress):
    harness = behind_ingress
    for _ in range(MAX):
        assert _models(harness, "guess", "203.0.113.9") == 401
    assert _models(harness, KEYS["alice"], "203.0.113.9") == 429
    assert _models(harness, KEYS["alice"], "198.51.100.4") == 200  # another client
    # A locked-out client cannot pose as another one: its own entry is the right-most.
    assert _models(harness, KEYS["alice"], "198.51.100.4, 203.0.113.9") == 429
    assert _models(harness, KEYS["alice"], None) == 200  # the ingress's own requests
    assert len(harness.ctx.auth_throttle) == 1


def test_a_peer_that_is_not_trusted_cannot_shift_the_blame(behind_ingress):
    harness = behind_ingress
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport) as direct:
        for index in range(MAX):
            assert _models(harness, "guess", f"203.0.113.{index}", direct) == 401
        assert _models(harness, KEYS["alice"], "198.51.100.4", direct) == 429
    assert _models(harness, KEYS["alice"], "203.0.113.0") == 200  # nobody it named


def test_the_audit_names_the_forwarded_client_of_a_sign_in(behind_ingress):
    harness = behind_ingress
    signed_in = httpx.post(
        harness.base_url + "/admin/ui/login",
        data={"key": ADMIN_KEY, "actor": "ops"},
        headers={"X-Forwarded-For": "198.51.100.1, 203.0.113.9"},
        timeout=30,
    )
    assert signed_in.status_code == 303
    logins = [r for r in harness.ctx.audit.iter_records() if r["event"] == "operator_login"]
    assert [r["payload"]["remote"] for r in logins] == ["203.0.113.9"]
