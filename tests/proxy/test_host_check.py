"""DNS rebinding: a loopback proxy serves only requests addressed to a loopback name."""

from __future__ import annotations

import httpx
import openai
import pytest
from pydantic import ValidationError

from deploy.config import ConfigError, load_config
from deploy.ports import free_port
from proxy.config import ProxyConfig
from proxy.host_check import HostCheck, host_name, is_loopback
from tests.proxy.conftest import ADMIN_KEY, KEYS


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("LocalHost:8000", "localhost"),
        ("127.0.0.1", "127.0.0.1"),
        ("[::1]:8000", "::1"),
        ("::1", "::1"),  # unbracketed IPv6: no port taken off
        ("olp.example.com.", "olp.example.com"),
        ("olp.example.com:443", "olp.example.com"),
        ("[2001:DB8:0::5]:8000", "2001:db8::5"),  # an address in one spelling
        ("2001:db8:0:0:0:0:0:5", "2001:db8::5"),
    ],
)
def test_the_name_part_of_a_host_value(header, name):
    assert host_name(header) == name


def test_allowed_hosts_match_addresses_in_any_spelling_and_refuse_wildcards():
    """Compared as text, `2001:DB8:0::5` never matched the `[2001:db8::5]` a browser sends,
    and `*.example.com` matched no host at all: real hosts got a 400."""
    config = ProxyConfig(host="0.0.0.0", allowed_hosts=["2001:DB8:0::5"])
    check = HostCheck(config.host, config.allowed_hosts)
    assert check.allows("[2001:db8::5]:8000") and not check.allows("[2001:db8::6]")
    with pytest.raises(ValidationError, match="no wildcards in a name"):
        ProxyConfig(allowed_hosts=["*.example.com"])


@pytest.mark.parametrize(
    ("name", "loopback"),
    [
        ("localhost", True),
        ("app.localhost", True),
        ("127.0.0.1", True),
        ("127.9.9.9", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("localhost.evil.example", False),
        ("127.0.0.1.nip.io", False),
        ("192.168.1.5", False),
        ("0.0.0.0", False),
        ("", False),
    ],
)
def test_loopback_names(name, loopback):
    assert is_loopback(name) is loopback


def test_a_loopback_proxy_serves_only_loopback_names_by_default():
    check = HostCheck("127.0.0.1", None)
    for header in ("localhost:8000", "127.0.0.1:8000", "[::1]:8000", None):
        assert check.allows(header), header
    for header in ("evil.example:8000", "192.168.1.5:8000", "localhost.evil.example", ""):
        assert not check.allows(header), header
    assert not HostCheck("localhost", None).allows("evil.example")
    assert not HostCheck("::1", None).allows("evil.example")


def test_remembered_host_values_answer_as_a_fresh_check_does():
    check = HostCheck("127.0.0.1", None)
    values = [f"127.0.0.{n}:{8000 + n}" for n in range(1, 100)] + ["localhost:8000"]
    for _ in range(2):  # the second round from memory, where it has them
        assert all(check.allows(value) for value in values)
        assert not check.allows("evil.example:8000") and not check.allows("192.168.1.5")


def test_another_bind_address_checks_only_a_configured_list():
    assert HostCheck("0.0.0.0", None).allows("anything.example")
    listed = HostCheck("0.0.0.0", ["olp.example.com"])
    assert listed.allows("OLP.example.com:443") and listed.allows("127.0.0.1:8000")
    assert not listed.allows("evil.example")
    assert HostCheck("127.0.0.1", ["*"]).allows("evil.example")


def test_a_proxy_bound_to_one_address_serves_that_address_with_a_list_set():
    """olp's CLI, learner and readiness probe call such a proxy by its bind address: with
    `allowed_hosts` set, `olp up` waited out its readiness timeout and `olp status` got 400."""
    check = HostCheck("192.0.2.2", ["api.example.com"])
    assert check.allows("192.0.2.2:8000") and check.allows("api.example.com")
    assert not check.allows("192.0.2.3:8000") and not check.allows("evil.example")
    assert HostCheck("[2001:db8::5]", ["api.example.com"]).allows("[2001:db8::5]:8000")
    assert not HostCheck("0.0.0.0", ["api.example.com"]).allows("0.0.0.0:8000")


def test_the_setting_is_normalised_and_a_bad_entry_is_named():
    config = ProxyConfig(allowed_hosts=["OLP.Example.com:443", " * "])
    assert config.allowed_hosts == ["olp.example.com", "*"]
    assert ProxyConfig().allowed_hosts is None
    for bad in ("https://olp.example.com", "", "olp example"):
        with pytest.raises(ValidationError, match="is not a host name or address"):
            ProxyConfig(allowed_hosts=[bad])
    env = {"OLP_PROXY__ALLOWED_HOSTS": "[olp.example.com]"}
    assert load_config(environ=env).proxy.allowed_hosts == ["olp.example.com"]
    with pytest.raises(ConfigError, match=r"proxy\.allowed_hosts"):
        load_config(environ={"OLP_PROXY__ALLOWED_HOSTS": "[a/b]"})


# ----------------------------------------------------------------- through the app


def _refused(response: httpx.Response) -> bool:
    if response.status_code != 400 or not response.headers.get("x-request-id"):
        return False
    return response.json()["error"]["code"] == "host_not_allowed"


def test_a_rebound_page_gets_nothing_from_a_loopback_proxy(make_proxy):
    """With the development keys every `olp up` ships with, a page that rebinds its name to
    127.0.0.1 could have run the admin API and fed the learner."""
    harness, sink = make_proxy([f"http://127.0.0.1:{free_port()}"])
    evil = {"Host": f"evil.example:{harness.port}"}
    alice = {"Authorization": f"Bearer {KEYS['alice']}"}
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    url = harness.base_url
    assert _refused(httpx.get(url + "/v1/models", headers={**evil, **alice}))
    assert _refused(httpx.get(url + "/admin/status", headers={**evil, **admin}))
    assert _refused(httpx.post(url + "/admin/ui/login", data={"key": ADMIN_KEY}, headers=evil))
    feedback = {"trajectory_id": "t", "kind": "thumbs_up"}
    assert _refused(httpx.post(url + "/v1/feedback", json=feedback, headers={**evil, **alice}))
    assert _refused(httpx.get(url + "/metrics", headers=evil))
    assert sink.feedback == []
    assert [r for r in harness.ctx.audit.iter_records() if r["event"] == "operator_login"] == []
    # Addressed as itself, everything answers as before.
    assert httpx.get(url + "/v1/models", headers=alice).status_code == 200
    local = {"Host": f"localhost:{harness.port}"}
    assert httpx.get(url + "/admin/status", headers={**local, **admin}).status_code == 200
    api = openai.OpenAI(base_url=url + "/v1", api_key=KEYS["alice"], max_retries=0)
    assert [m.id for m in api.models.list().data]
    rebound = openai.OpenAI(
        base_url=url + "/v1",
        api_key=KEYS["alice"],
        max_retries=0,
        default_headers={"Host": "evil.example"},
    )
    with pytest.raises(openai.BadRequestError) as refused:
        rebound.models.list()
    assert refused.value.code == "host_not_allowed"


def test_listed_names_are_served(make_proxy):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"], allowed_hosts=["olp.example.com"])
    alice = {"Authorization": f"Bearer {KEYS['alice']}"}
    named = {**alice, "Host": "olp.example.com"}
    assert httpx.get(harness.base_url + "/v1/models", headers=named).status_code == 200
    assert _refused(
        httpx.get(harness.base_url + "/v1/models", headers={**alice, "Host": "evil.example"})
    )
