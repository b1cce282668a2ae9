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


def open_direct(request: urllib.request.Request | str, timeout_s: float) -> HTTPResponse:
    """`urllib.request.urlopen` without the environment's proxies."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    response: HTTPResponse = opener.open(request, timeout=timeout_s)
    return response
