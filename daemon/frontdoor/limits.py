"""What one client may send the front door, and for how long: `[frontdoor]`'s limits.

Two places enforce them, both reading the config in force (a reload applies to the next
connection or request, no restart):

- The HTTP server (daemon/frontdoor/http11.py): a connection with no request under way, kept
  alive or still sending its request line and headers, is closed after `idle_timeout_s`; h11
  buffers at most `max_header_bytes` of an incomplete head (past it: a bare 431 and the
  connection closed).
- The app (`check_head`, `read_body`): the head exactly against `max_header_bytes` (h11 lets a
  whole head that arrived in one read through), and the body: a `Content-Length` over
  `max_body_bytes` is refused before any of it is read, a chunked body is counted as it is read
  and refused at the first byte past the limit; a body that has not arrived in full
  `slow_client_timeout_s` after the headers is refused as too slow, one whose chunked coding is
  malformed as such (400). The refusals are
  `LimitExceeded`, answered in the API's error shape with `Connection: close`.

No timeout bounds a read once a request is whole: it would also cut a client waiting silently
for a long non-streamed answer.
"""

from __future__ import annotations

import trio

from stoker.daemon.config.frontdoor import FrontdoorConfig
from stoker.daemon.frontdoor.http11 import MalformedBody, Request
from stoker.states.reasons import ReasonCode, message_for

# HTTP/1.1's framing around each header (": " and CRLF) and the request line's ("  HTTP/1.1\r\n").
HEADER_FRAMING = 4
REQUEST_LINE_FRAMING = 12


class LimitExceeded(Exception):
    """The request broke a limit: answer `status` with `reason`, then close the connection."""

    def __init__(self, status: int, reason: ReasonCode, detail: str) -> None:
        super().__init__(f"{message_for(reason)} ({detail})")
        self.status = status
        self.reason = reason


def head_bytes(request: Request) -> int:
    """The request line and headers as the client sent them, give or take the version's spelling."""
    line = len(request.method) + len(request.target) + REQUEST_LINE_FRAMING
    return line + sum(len(name) + len(value) + HEADER_FRAMING for name, value in request.headers)


def check_head(request: Request, limits: FrontdoorConfig) -> None:
    """Raise `LimitExceeded` (431) for a request line and headers over `max_header_bytes`."""
    size = head_bytes(request)
    if size > limits.max_header_bytes:
        raise LimitExceeded(
            431, ReasonCode.FRONTDOOR_HEADERS_TOO_LARGE, f"{size} bytes; the limit is {limits.max_header_bytes}"
        )


async def read_body(request: Request, limits: FrontdoorConfig) -> bytes:
    """The whole body, never reading past `max_body_bytes`; raises `LimitExceeded` (413, or 408
    for a body still arriving `slow_client_timeout_s` after the headers, or 400 for a body whose
    chunked coding is malformed)."""
    try:
        return await _read_body(request, limits)
    except MalformedBody as exc:
        raise LimitExceeded(400, ReasonCode.FRONTDOOR_MALFORMED_BODY, str(exc)) from None


async def _read_body(request: Request, limits: FrontdoorConfig) -> bytes:
    limit = limits.max_body_bytes
    declared = (request.header(b"content-length") or b"").decode("latin-1") or None
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise LimitExceeded(
            413, ReasonCode.FRONTDOOR_BODY_TOO_LARGE, f"Content-Length {declared} bytes; the limit is {limit}"
        )
    chunks: list[bytes] = []
    received = 0

    def add(chunk: bytes) -> None:
        nonlocal received
        received += len(chunk)
        if received > limit:
            raise LimitExceeded(
                413, ReasonCode.FRONTDOOR_BODY_TOO_LARGE, f"more than {limit} bytes sent; the limit is {limit}"
            )
        chunks.append(chunk)

    while chunk := request.receive_now():  # what came with the head: no wait, no timeout
        add(chunk)
    if chunk is not None:
        return b"".join(chunks)
    with trio.move_on_after(limits.slow_client_timeout_s):
        while chunk := await request.receive():
            add(chunk)
        return b"".join(chunks)
    raise LimitExceeded(
        408,
        ReasonCode.FRONTDOOR_SLOW_CLIENT,
        f"{received} bytes in {limits.slow_client_timeout_s:g} s, the body unfinished",
    )
