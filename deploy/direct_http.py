"""HTTP from olp's commands to olp's own services, never through `$http_proxy`.

urllib's default opener follows `http_proxy` / `HTTP_PROXY` even for 127.0.0.1, and
`no_proxy` is often unset: an operator's shell that exports a corporate proxy sent `olp
status`'s `Authorization: Bearer <admin key>` to that proxy in clear text, and the operator
saw only its 502. These calls go to the stack's own proxy and model servers, which no
forward proxy stands between.
"""

from __future__ import annotations

import urllib.request
from http.client import HTTPResponse


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A redirect is answered as the HTTPError it is, not followed: urllib follows it with
    every header of the request, so `olp status` sent `Authorization: Bearer <admin key>`
    wherever a 302 pointed. olp's own services never redirect."""

    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None


def open_direct(request: urllib.request.Request | str, timeout_s: float) -> HTTPResponse:
    """`urllib.request.urlopen` without the environment's proxies, and without following
    redirects."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())
    response: HTTPResponse = opener.open(request, timeout=timeout_s)
    return response
