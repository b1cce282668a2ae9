"""A 405 keeps aiohttp's `Allow` header (HTTP requires it) when the error middleware turns
it into OpenAI-style JSON."""

from __future__ import annotations

import httpx

from deploy.ports import free_port
from tests.proxy.conftest import ADMIN_KEY


def test_a_405_names_the_allowed_methods(make_proxy):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"])
    response = httpx.get(harness.base_url + "/v1/chat/completions", timeout=30)
    assert response.status_code == 405
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == "method_not_allowed"
    assert response.headers["x-request-id"]
    assert response.headers["allow"] == "POST"
    response = httpx.post(harness.base_url + "/v1/models", timeout=30)
    assert response.status_code == 405
    assert set(response.headers["allow"].split(",")) == {"GET", "HEAD"}
    response = httpx.delete(
        harness.base_url + "/admin/status",
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        timeout=30,
    )
    assert response.status_code == 405 and "GET" in response.headers["allow"]


def test_other_http_errors_carry_no_allow_header(make_proxy):
    harness, _ = make_proxy([f"http://127.0.0.1:{free_port()}"])
    response = httpx.get(harness.base_url + "/v1/nothing-here", timeout=30)
    assert response.status_code == 404 and "allow" not in response.headers
