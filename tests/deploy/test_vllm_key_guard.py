"""The key guard olp adds to the vLLM it launches (deploy/vllm_key_guard.py), as an ASGI app
around a stand-in; the real vLLM behind it is checked in tests/e2e/test_online_loop.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from deploy.vllm_key_guard import RequireKeyEverywhere

KEY = "guard-test-key"


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """A stand-in vLLM: 200 "served" to every request that reaches it."""
    if scope["type"] == "lifespan":
        scope["reached"] = True
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"served"})


def _call(scope_type: str, path: str, authorization: str | None = None) -> list[dict[str, Any]]:
    guard = RequireKeyEverywhere(_app)
    headers = [(b"authorization", authorization.encode())] if authorization else []
    scope = {"type": scope_type, "path": path, "method": "POST", "headers": headers}
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": f"{scope_type}.connect" if scope_type == "websocket" else "http.request"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    return sent


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", KEY)


@pytest.mark.parametrize(
    "path",
    ["/invocations", "/adapters", "/adapters/policy-v1", "/tokenize", "/metrics", "/v1/models"],
)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", KEY, "Bearer"])
def test_every_route_without_the_key_gets_vllms_401(path: str, authorization: str | None) -> None:
    start, body = _call("http", path, authorization)
    assert start["status"] == 401 and body["body"] == b'{"error": "Unauthorized"}'
    assert (b"content-type", b"application/json") in start["headers"]


@pytest.mark.parametrize("path", ["/invocations", "/adapters", "/v1/chat/completions"])
@pytest.mark.parametrize("scheme", ["Bearer", "bearer"])
def test_the_key_passes(path: str, scheme: str) -> None:
    start, body = _call("http", path, f"{scheme} {KEY}")
    assert start["status"] == 200 and body["body"] == b"served"


@pytest.mark.parametrize("path", ["/health", "/ping"])
def test_health_checks_need_no_key(path: str) -> None:
    """Compose and Kubernetes probe /health without credentials."""
    start, _ = _call("http", path)
    assert start["status"] == 200


def test_a_websocket_without_the_key_is_closed() -> None:
    assert _call("websocket", "/v1/realtime") == [{"type": "websocket.close", "code": 1008}]


def test_lifespan_events_pass_through() -> None:
    guard = RequireKeyEverywhere(_app)
    scope: dict[str, Any] = {"type": "lifespan"}
    asyncio.run(guard(scope, None, None))  # type: ignore[arg-type]
    assert scope["reached"]


def test_without_a_key_in_the_environment_it_refuses_to_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Added without a key it would lock out every caller, olp's own included."""
    monkeypatch.delenv("VLLM_API_KEY")
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        RequireKeyEverywhere(_app)
