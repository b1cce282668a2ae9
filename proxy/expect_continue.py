"""`Expect: 100-continue`, answered when a handler is about to read the body.

aiohttp's default expect handler sends `100 Continue` as soon as the headers arrive, before
the middleware and the handler run: a client (curl sends the header for large bodies)
uploaded the whole body for a request the proxy then refused for its key, its rate limit or
its `Content-Length`. The routes that take a body use `defer_continue` instead, and the
body readers call `send_continue` once their checks have passed; a refusal is then a final
status the client gets in place of the `100`, its body never sent (RFC 9110 10.1.1), and
`Connection: close` with it: the body it held back may still follow, and would be read as
the next request.
"""

from __future__ import annotations

from aiohttp import HttpVersion11, hdrs, web

# False while the client waits for its `100 Continue`, True once it went out (a second
# would be read by the client as the start of the response). Absent: no client waits.
_CONTINUE_SENT = web.RequestKey("continue_sent", bool)


async def defer_continue(request: web.Request) -> None:
    """The body-taking routes' expect handler: refuses an expectation other than
    `100-continue` (417, as aiohttp's own does) and leaves the `100` to `send_continue`."""
    if request.version != HttpVersion11:
        return  # HTTP/1.0 has no 100 status; aiohttp ignores the header there too
    expect = request.headers.get(hdrs.EXPECT, "")
    if expect.lower() != "100-continue":
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {expect}")
    request[_CONTINUE_SENT] = False


async def send_continue(request: web.Request) -> None:
    """Tell a client that waits for it to send its body; nothing for any other request (one
    header lookup on the hot path)."""
    if hdrs.EXPECT not in request.headers or request.get(_CONTINUE_SENT) is not False:
        return
    request[_CONTINUE_SENT] = True
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    # As aiohttp's own handler does: the response's size counts from its status line.
    request.writer.output_size = 0


def refused_before_continue(request: web.Request) -> bool:
    """Whether the client waits for a `100 Continue` it will not get: the answer is final."""
    return hdrs.EXPECT in request.headers and request.get(_CONTINUE_SENT) is False
