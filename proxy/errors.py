"""OpenAI-format error responses, so clients' SDKs raise their usual exception types."""

from __future__ import annotations

import json

from aiohttp import web


class ProxyError(Exception):
    """An error that becomes an OpenAI-style JSON response; never carries a traceback."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    @property
    def kind(self) -> str:
        """Short label for the errors metric."""
        return self.code or self.type


class AuthError(ProxyError):
    """A wrong or missing key (401/403): the failed-authentication throttle counts these
    (`proxy.auth_throttle`) when the app's middleware turns them into a response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        route_kind: str,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(status, message, type_=type_, code=code)
        self.route_kind = route_kind  # "api" (/v1) or "admin" (/admin): the metric's label


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(err: ProxyError, request_id: str | None = None) -> web.Response:
    body = error_body(err.message, err.type, err.code, err.param)
    if request_id:
        body["error"]["request_id"] = request_id
    return web.Response(
        status=err.status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers=err.headers,
    )


def bad_request(
    message: str, param: str | None = None, code: str = "invalid_request"
) -> ProxyError:
    return ProxyError(400, message, param=param, code=code)
