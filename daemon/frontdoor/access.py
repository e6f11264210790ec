"""The front door's access log: one line per request, in the daemon's log (logger `stoker.access`).

Written once a request's answer is over (after its last byte left, so it costs the client
nothing), by the HTTP server (daemon/frontdoor/http11.py) beside the request figures of /metrics,
and read back with `stoker logs --access`. A line says who asked what and how it went, never
what was said: no prompt, no answer, no key (the key's name only):

    POST /v1/chat/completions 200 model=default instance=default duration_ms=182.4 ttfb_ms=3.1
    added_ms=0.31 tokens_in=12 tokens_out=64 key=webui client=127.0.0.1:53422

`-` for what is not known: no model (a request refused before its body was read), no
instance (no configured model answers to it), no first byte, no token counts (the engine
reports them in a completion's last bytes: `timings`, else `usage`; an embedding or an error
has none), no key (a loopback client that sent none). The status is `none` when no answer was
started (the client left while its request was held). An answer that did not end whole adds
`cut=REASON` (`client_gone`, `engine_cut`, `error`: as stoker_responses_cut_total counts them).
A scrape of /metrics is not logged, as it is not counted.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # nothing heavy at run time: `stoker logs --access` imports ACCESS_LOGGER
    from stoker.daemon.frontdoor.metrics import EngineFigures, Exchange
    from stoker.daemon.frontdoor.daemon_view import Caller

ACCESS_LOGGER = "stoker.access"
log = logging.getLogger(ACCESS_LOGGER)

# A model name as the client sent it is shown at most this long (the rest is the client's).
MODEL_CHARS = 120
# A word written as it is: not empty, no space, quote, `=` or backslash (and printable).
_PLAIN = re.compile(r'[^ "=\\]+')


class Request(Protocol):
    """What a line tells of the request (daemon/frontdoor/http11.py's `Request`)."""

    method: str
    path: str
    client: tuple[str, int] | None
    caller: Caller | None
    model: object
    instance: str | None


def token(value: object) -> str:
    """A value as one space-free word of the line: as it is when plain, JSON-quoted when it holds
    a space, a quote, a control character or is empty (a client's model name can hold anything,
    and must not forge a line)."""
    if value is None:
        return "-"
    text = value if isinstance(value, str) else json.dumps(value)
    text = text[:MODEL_CHARS]
    if _PLAIN.fullmatch(text) and text.isprintable():
        return text
    return json.dumps(text)


def _ms(seconds: float | None, digits: int = 1) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.{digits}f}"


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


def access_line(request: Request, exchange: Exchange, figures: EngineFigures | None) -> str:
    """The line for one request, recorded once its answer ended (`RequestFigures.finish`)."""
    status = "none" if exchange.status is None else str(exchange.status)
    first = None if exchange.first_byte is None else exchange.first_byte - exchange.started
    client = "-" if request.client is None else f"{request.client[0]}:{request.client[1]}"
    caller = request.caller
    line = (
        f"{token(request.method)} {token(request.path)} {status} model={token(request.model)} "
        f"instance={token(request.instance)} duration_ms={_ms(exchange.ended - exchange.started)} ttfb_ms={_ms(first)} "
        f"added_ms={_ms(exchange.added(), 2)} "
        f"tokens_in={_count(figures.prompt if figures else None)} "
        f"tokens_out={_count(figures.generated if figures else None)} "
        f"key={token(caller.key_name if caller is not None else None)} client={client}"
    )
    if exchange.cut is not None:
        line += f" cut={exchange.cut}"
    return line


def log_access(request: Request, exchange: Exchange, figures: EngineFigures | None) -> None:
    """Write the request's line (nothing when the daemon's log level hides INFO)."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s", access_line(request, exchange, figures))
