"""The failed-authentication throttle: wrong keys from one address end in 429 for a while."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from aiohttp.test_utils import make_mocked_request
from pydantic import ValidationError
from structlog.testing import capture_logs

from deploy.config import ConfigError, load_config
from deploy.ports import free_port
from proxy.auth_throttle import AuthThrottle
from proxy.client_address import UNKNOWN_ADDRESS, ClientAddresses
from proxy.config import AuthFailureLimits, ProxyConfig
from proxy.errors import ProxyError
from proxy.metrics import ProxyMetrics
from tests.proxy.conftest import ADMIN_KEY, KEYS

MAX = 3
WINDOW_S = 30.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(max_failures=MAX, window_s=WINDOW_S, max_addresses=100, metrics=None):
    clock = FakeClock()
    limits = AuthFailureLimits(
        max_failures=max_failures, window_s=window_s, max_addresses=max_addresses
    )
    return AuthThrottle(limits, metrics, clock=clock), clock


def _sample(metrics: ProxyMetrics, name: str, kind: str) -> float:
    return metrics.registry.get_sample_value(name, {"kind": kind}) or 0.0


# ------------------------------------------------------------------------------- unit


def test_an_address_is_locked_after_max_failures_until_the_window_passes():
    throttle, clock = _throttle()
    for _ in range(MAX - 1):
        throttle.failed("10.0.0.1", "api")
        throttle.check("10.0.0.1", "api")  # not yet
    clock.now += 5
    throttle.failed("10.0.0.1", "api")
    with pytest.raises(ProxyError) as err:
        throttle.check("10.0.0.1", "api")
    assert (err.value.status, err.value.code, err.value.type) == (
        429,
        "auth_throttled",
        "rate_limit_error",
    )
    assert err.value.headers["retry-after"] == str(math.ceil(WINDOW_S))
    clock.now += WINDOW_S - 0.5
    with pytest.raises(ProxyError) as err:
        throttle.check("10.0.0.1", "admin")
    assert err.value.headers["retry-after"] == "1"
    clock.now += 0.5
    throttle.check("10.0.0.1", "api")  # the lockout is over
    throttle.failed("10.0.0.1", "api")  # and counting starts afresh
    throttle.check("10.0.0.1", "api")


def test_other_addresses_are_unaffected():
    throttle, _ = _throttle()
    for _ in range(MAX):
        throttle.failed("10.0.0.1", "api")
    throttle.failed("10.0.0.2", "api")
    with pytest.raises(ProxyError):
        throttle.check("10.0.0.1", "api")
    throttle.check("10.0.0.2", "api")
    throttle.check("::1", "admin")
    assert throttle.retry_after("10.0.0.2") == 0


def test_failures_further_apart_than_the_window_never_lock():
    throttle, clock = _throttle()
    for _ in range(4 * MAX):
        throttle.failed("10.0.0.1", "api")
        clock.now += WINDOW_S / (MAX - 1) + 0.01  # MAX of them span more than the window
        throttle.check("10.0.0.1", "api")  # raises (429) once locked
        assert throttle.retry_after("10.0.0.1") == 0


def test_zero_max_failures_turns_the_throttle_off_but_still_counts_failures():
    metrics = ProxyMetrics()
    throttle, _ = _throttle(max_failures=0, metrics=metrics)
    for _ in range(100):
        throttle.failed("10.0.0.1", "api")
    throttle.check("10.0.0.1", "api")
    assert len(throttle) == 0 and not throttle.enabled
    assert _sample(metrics, "olp_proxy_auth_failures_total", "api") == 100


def test_tracked_addresses_are_capped_and_expired_ones_dropped():
    throttle, clock = _throttle(max_failures=2, max_addresses=50)
    throttle.failed("victim", "api")
    throttle.failed("victim", "api")  # locked out
    for i in range(10_000):
        throttle.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", "api")
        assert len(throttle) <= 50
    # The least recently failing go first: the newest addresses are still counted.
    throttle.failed("10.0.39.15", "api")
    with pytest.raises(ProxyError):
        throttle.check("10.0.39.15", "api")
    assert throttle.retry_after("victim") == 0  # evicted: the cap is a hard bound
    clock.now += WINDOW_S + 1
    throttle.failed("late", "api")
    assert len(throttle) == 1  # every entry of the old window expired


def test_a_lockout_is_logged_once_and_counted_without_the_key():
    metrics = ProxyMetrics()
    throttle, _ = _throttle(metrics=metrics)
    with capture_logs() as logs:
        for _ in range(MAX + 2):  # two late failures of requests that were already running
            throttle.failed("10.0.0.9", "admin")
    lockouts = [e for e in logs if e["event"] == "auth_lockout"]
    assert lockouts == [
        {
            "event": "auth_lockout",
            "log_level": "warning",
            "remote": "10.0.0.9",
            "route": "admin",
            "failures": MAX,
            "window_s": WINDOW_S,
        }
    ]
    assert _sample(metrics, "olp_proxy_auth_failures_total", "admin") == MAX + 2
    assert _sample(metrics, "olp_proxy_auth_lockouts_total", "admin") == 1
    with pytest.raises(ProxyError):
        throttle.check("10.0.0.9", "api")
    assert _sample(metrics, "olp_proxy_auth_throttled_total", "api") == 1


def _request(method: str, path: str, remote: str = "10.0.0.1"):
    return make_mocked_request(method, path).clone(remote=remote)


def test_guard_refuses_only_keyed_routes_and_forgets_once_failures_stop():
    throttle, clock = _throttle(max_failures=1)
    throttle.failed("10.0.0.1", "api")
    with pytest.raises(ProxyError):
        throttle.guard(_request("GET", "/v1/models"))
    with pytest.raises(ProxyError):
        throttle.guard(_request("POST", "/admin/ui/login"))
    throttle.guard(_request("GET", "/healthz"))
    throttle.guard(_request("GET", "/metrics"))
    throttle.guard(_request("GET", "/v1/models", remote="10.0.0.2"))
    clock.now += WINDOW_S
    throttle.guard(_request("GET", "/v1/models"))
    assert len(throttle) == 0  # back to the fast path: no address is tracked


def test_a_peer_without_an_address_is_counted_under_one_name():
    assert ClientAddresses().of(make_mocked_request("GET", "/v1/models")) == UNKNOWN_ADDRESS


@pytest.mark.parametrize(
    "fields",
    [
        {"max_failures": -1},
        {"window_s": 0},
        {"window_s": "inf"},
        {"max_addresses": 0},
        {"lockout": 5},
    ],
)
def test_bad_settings_fail_validation_naming_the_key(fields):
    with pytest.raises(ValidationError) as err:
        ProxyConfig(auth_failures=fields)
    [error] = err.value.errors()
    assert error["loc"] == ("auth_failures", next(iter(fields)))


def test_the_default_lets_a_few_wrong_keys_through():
    limits = ProxyConfig().auth_failures
    assert (limits.max_failures, limits.window_s) == (20, 60.0)


def test_environment_overrides_reach_the_throttle_and_bad_ones_name_the_key():
    env = {"OLP_PROXY__AUTH_FAILURES__MAX_FAILURES": "0"}
    assert load_config(environ=env).proxy.auth_failures.max_failures == 0
    with pytest.raises(ConfigError, match=r"proxy\.auth_failures\.window_s"):
        load_config(environ={"OLP_PROXY__AUTH_FAILURES__WINDOW_S": "-1"})


# ----------------------------------------------------------------- through the app


@pytest.fixture
def throttled(make_proxy):
    """A proxy (no live upstream) whose throttle locks after MAX failures, on a fake clock."""
    harness, _ = make_proxy(
        [f"http://127.0.0.1:{free_port()}"],
        auth_failures={"max_failures": MAX, "window_s": WINDOW_S},
    )
    clock = FakeClock()
    ctx = harness.ctx
    ctx.auth_throttle = AuthThrottle(
        ctx.config.auth_failures, ctx.metrics, clock=clock, addresses=ctx.client_addresses
    )
    return harness, clock


def _get(harness, path, key, client=httpx):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return client.get(harness.base_url + path, headers=headers, timeout=30)


def _assert_throttled(response: httpx.Response) -> None:
    assert response.status_code == 429
    assert response.headers["content-type"].startswith("application/json")
    assert 1 <= int(response.headers["retry-after"]) <= WINDOW_S
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "auth_throttled"
    assert error["message"] and error["param"] is None


def _metric(harness, name: str, kind: str) -> float:
    return _sample(harness.ctx.metrics, name, kind)


def test_wrong_api_keys_lock_the_address_even_for_the_right_key(throttled):
    harness, clock = throttled
    for _ in range(MAX + 1):  # no key at all: in the metrics, not towards the lockout
        assert _get(harness, "/v1/models", None).status_code == 401
    for _ in range(MAX):
        assert _get(harness, "/v1/models", "guess").status_code == 401
    _assert_throttled(_get(harness, "/v1/models", "guess"))
    _assert_throttled(_get(harness, "/v1/models", KEYS["alice"]))  # guessed right: no help
    chat = httpx.post(
        harness.base_url + "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEYS['alice']}"},
        json={"model": "policy", "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    _assert_throttled(chat)
    api = openai.OpenAI(base_url=harness.base_url + "/v1", api_key=KEYS["bob"], max_retries=0)
    with pytest.raises(openai.RateLimitError):
        api.models.list()
    _assert_throttled(_get(harness, "/admin/status", ADMIN_KEY))  # the address, every route
    assert _get(harness, "/healthz", None).status_code == 200  # no key needed: not throttled
    assert _metric(harness, "olp_proxy_auth_failures_total", "api") == 2 * MAX + 1
    assert _metric(harness, "olp_proxy_auth_lockouts_total", "api") == 1
    assert _metric(harness, "olp_proxy_auth_throttled_total", "api") == 4
    assert 'olp_proxy_auth_failures_total{kind="api"} 7.0' in _get(harness, "/metrics", None).text

    clock.now += WINDOW_S
    assert _get(harness, "/v1/models", KEYS["alice"]).status_code == 200
    assert _get(harness, "/admin/status", ADMIN_KEY).status_code == 200


def test_a_web_page_cannot_lock_local_clients_out(throttled):
    """What any page can make the operator's browser send to a proxy on 127.0.0.1: key-less
    requests (`<img src=.../v1/models>`) and forms posted to the sign-in route. Twenty of
    them locked out every local client, the CLI with the right admin key included."""
    harness, _ = throttled
    cross_site = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
    for _ in range(2 * MAX):
        key_less = httpx.get(harness.base_url + "/v1/models", headers=cross_site, timeout=30)
        assert key_less.status_code == 401
        form = httpx.post(
            harness.base_url + "/admin/ui/login",
            data={"key": "guess"},
            headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate"},
            timeout=30,
        )
        assert form.status_code == 403 and "set-cookie" not in form.headers
        # Over plain HTTP to another machine browsers send no Fetch Metadata: the form's
        # Origin names the page's site (or `null`, from a sandboxed frame).
        for origin in ("http://pages.example", "null"):
            posted = httpx.post(
                harness.base_url + "/admin/ui/login",
                data={"key": "guess"},
                headers={"Origin": origin},
                timeout=30,
            )
            assert posted.status_code == 403 and "set-cookie" not in posted.headers
    same_site = httpx.post(
        harness.base_url + "/admin/ui/login",
        data={"key": ADMIN_KEY},
        headers={"Sec-Fetch-Site": "same-site"},
        timeout=30,
    )
    assert same_site.status_code == 403 and "set-cookie" not in same_site.headers
    assert _get(harness, "/admin/status", ADMIN_KEY).status_code == 200
    assert _get(harness, "/v1/models", KEYS["alice"]).status_code == 200
    assert _metric(harness, "olp_proxy_auth_lockouts_total", "api") == 0
    assert _metric(harness, "olp_proxy_auth_lockouts_total", "admin") == 0
    own_page = httpx.post(
        harness.base_url + "/admin/ui/login",
        data={"key": ADMIN_KEY},
        headers={"Sec-Fetch-Site": "same-origin", "Origin": harness.base_url},
        timeout=30,
    )
    assert own_page.status_code == 303 and "set-cookie" in own_page.headers
    behind_a_reverse_proxy = httpx.post(  # it rewrote Host, and kept the original
        harness.base_url + "/admin/ui/login",
        data={"key": ADMIN_KEY},
        headers={"Origin": "https://olp.example", "X-Forwarded-Host": "olp.example"},
        timeout=30,
    )
    assert behind_a_reverse_proxy.status_code == 303, behind_a_reverse_proxy.text
    # nginx's default rewrites Host and sends no X-Forwarded-Host: the browser's own
    # same-origin verdict decides, not the Origin against the rewritten Host.
    host_rewritten = httpx.post(
        harness.base_url + "/admin/ui/login",
        data={"key": ADMIN_KEY},
        headers={"Sec-Fetch-Site": "same-origin", "Origin": "https://olp.example"},
        timeout=30,
    )
    assert host_rewritten.status_code == 303, host_rewritten.text


def test_another_address_is_not_locked_out(throttled):
    harness, _ = throttled
    for _ in range(MAX):
        _get(harness, "/v1/models", "guess")
    _assert_throttled(_get(harness, "/v1/models", KEYS["alice"]))
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(transport=transport) as other:
        assert _get(harness, "/v1/models", KEYS["alice"], other).status_code == 200
        assert _get(harness, "/v1/models", "typo", other).status_code == 401  # counted apart
    _assert_throttled(_get(harness, "/v1/models", KEYS["alice"]))  # success resets nothing


def test_wrong_admin_keys_lock_the_admin_api_and_the_sign_in_form(throttled):
    harness, clock = throttled
    assert _get(harness, "/admin/status", "guess").status_code == 403
    assert _get(harness, "/admin/ui", "guess").status_code == 403  # the page's Bearer check
    login = httpx.post(harness.base_url + "/admin/ui/login", data={"key": "guess"}, timeout=30)
    assert login.status_code == 401 and "set-cookie" not in login.headers
    assert _metric(harness, "olp_proxy_auth_failures_total", "admin") == MAX
    assert _metric(harness, "olp_proxy_auth_lockouts_total", "admin") == 1
    right = httpx.post(harness.base_url + "/admin/ui/login", data={"key": ADMIN_KEY}, timeout=30)
    _assert_throttled(right)
    assert "set-cookie" not in right.headers
    _assert_throttled(_get(harness, "/admin/status", ADMIN_KEY))
    _assert_throttled(_get(harness, "/v1/models", KEYS["alice"]))
    assert _metric(harness, "olp_proxy_auth_throttled_total", "admin") == 2

    clock.now += WINDOW_S
    signed_in = httpx.post(
        harness.base_url + "/admin/ui/login", data={"key": ADMIN_KEY}, timeout=30
    )
    assert signed_in.status_code == 303 and "set-cookie" in signed_in.headers


def test_the_sign_in_page_without_a_session_is_not_a_failure(throttled):
    harness, _ = throttled
    for _ in range(2 * MAX):
        assert httpx.get(harness.base_url + "/admin/ui", timeout=30).status_code == 401
    assert _metric(harness, "olp_proxy_auth_failures_total", "admin") == 0
    assert _get(harness, "/admin/status", ADMIN_KEY).status_code == 200


def test_the_runs_internal_admin_token_is_not_locked_out(tmp_path):
    """Under `olp up` the learner flips aliases from 127.0.0.1 with the run's internal token;
    a local client retrying a wrong key locked the learner out with it for a minute."""
    from proxy.app import build_app
    from proxy.config import sha256_hex
    from tests.proxy.conftest import CollectingSink, ProxyHarness, default_tenants

    internal = "internal-token-of-this-run"
    config = ProxyConfig(
        upstreams=[f"http://127.0.0.1:{free_port()}"],
        port=0,
        admin_key=ADMIN_KEY,
        auth_failures={"max_failures": MAX, "window_s": WINDOW_S},
    )
    app = build_app(
        config,
        default_tenants(),
        CollectingSink(),
        tmp_path / "state",
        internal_admin_key_sha256=sha256_hex(internal),
    )
    harness = ProxyHarness(app).start()
    try:
        for _ in range(MAX):
            assert _get(harness, "/v1/models", "guess").status_code == 401
        _assert_throttled(_get(harness, "/admin/status", ADMIN_KEY))  # the operator's key too
        _assert_throttled(_get(harness, "/admin/status", internal + "x"))
        assert _get(harness, "/admin/status", internal).status_code == 200
        _assert_throttled(_get(harness, "/v1/models", KEYS["alice"]))
    finally:
        harness.stop()
