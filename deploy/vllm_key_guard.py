"""ASGI middleware olp adds to the vLLM it launches with a key: every route but the health
checks needs it.

vLLM's own `--api-key` (VLLM_API_KEY) guards only paths under /v1, /v2, /inference and
/cohere (`GUARDED_PREFIX`, vLLM 0.32). The SageMaker routes it always mounts lie outside:
`POST /invocations` answers chat completions, `POST /adapters` and `DELETE /adapters/{name}`
load and unload LoRA adapters (the serving one included), and /tokenize, /metrics and /docs
need nothing either. Whatever reaches the port could use them, a web page that rebinds its
own name to 127.0.0.1 included.

vLLM imports this by `--middleware` in its own process, so it uses the standard library
only: `olp up` puts this tree on vLLM's PYTHONPATH (deploy/policy.py); the compose and
Kubernetes manifests mount this one file into the vLLM image."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

# Liveness and readiness probes (compose, Kubernetes) carry no key; they tell nothing else.
OPEN_PATHS = frozenset({"/health", "/ping"})
_REFUSED = json.dumps({"error": "Unauthorized"}).encode()  # vLLM's own 401 body
_POLICY_VIOLATION = 1008  # WebSocket close code


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).digest()


class RequireKeyEverywhere:
    """Refuses, with vLLM's own 401, any request without `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            # Added without a key it would lock out every caller, olp included.
            raise RuntimeError("RequireKeyEverywhere needs VLLM_API_KEY in vLLM's environment")
        self.app = app
        self._key = _digest(key)

    def _has_key(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(_digest(token), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)  # lifespan
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self._has_key(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": _POLICY_VIOLATION})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_REFUSED)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _REFUSED})
