"""CORS: which web pages on other origins may call the front door, and the headers that say so.

`[frontdoor] cors_origins` (the role of Ollama's OLLAMA_ORIGINS) lists the origins a browser may
call from (`"https://app.example"`, `"http://localhost:3000"`), or `"*"` for any. By default it
is empty: only the front door's own origin (a page it serves itself) may call it from a browser.

What a request's `Origin` header gets (`judge_origin`):

- none (curl, SDKs, servers: not a browser's cross-origin call): nothing added, nothing refused;
- the front door's own origin (the `Origin` names the `Host` the request was sent to): nothing
  added; but a loopback front door without keys takes this only for an IP address or
  `localhost`, so a page whose own name was made to resolve to 127.0.0.1 (DNS rebinding) cannot
  use a keyless front door as if it were its own origin;
- a listed origin: `Access-Control-Allow-Origin: <that origin>`, credentials allowed, `Vary: Origin`;
- any origin under `"*"`: `Access-Control-Allow-Origin: *`, and never credentials (the
  Fetch standard forbids them with `*`, and a wildcard must not carry a user's credentials);
- any other origin: refused, 403 `frontdoor_origin_refused`, so that a page elsewhere cannot
  make the engine work for it with a request that needs no preflight (a form's text/plain POST).

A preflight (`OPTIONS` with `Access-Control-Request-Method`) is answered by the front door on
every path, before any key check (a browser sends no credentials with it), with the route's
methods, the headers the browser asked for, and `Access-Control-Max-Age`.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from urllib.parse import urlsplit

ANY = "*"
# How long a browser may keep a preflight's answer (seconds): 10 minutes, Chromium's own cap is 2 h.
MAX_AGE = 600
# Headers a page's script may read on an answer beyond the CORS-safelisted ones.
EXPOSED = b"Retry-After"
# A header list as a browser sends it in Access-Control-Request-Headers: names, commas, spaces.
HEADER_LIST = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z, ]*$")


class Origin(enum.Enum):
    """How a request's `Origin` stands (`judge_origin`)."""

    NONE = "none"  # no Origin header
    SAME = "same"  # the front door's own origin
    LISTED = "listed"  # named in cors_origins
    ANY = "any"  # allowed by "*"
    REFUSED = "refused"


def _plain_host(host: str) -> bool:
    """An IP address or localhost: a name no other site's DNS can make point here."""
    name = urlsplit("//" + host).hostname or ""
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def judge_origin(origins: tuple[str, ...], origin: bytes | None, host: bytes | None, *, keyless: bool) -> Origin:
    """How a request's `Origin` stands, given cors_origins, the `Host` it was sent to, and
    whether it may pass without a key (a loopback client, keys not required)."""
    if origin is None:
        return Origin.NONE
    text = origin.decode("latin-1").strip().lower()
    if text in origins:
        return Origin.LISTED
    sent_to = (host or b"").decode("latin-1").strip().lower()
    scheme, _, rest = text.partition("://")
    if scheme == "http" and sent_to and rest == sent_to and (not keyless or _plain_host(sent_to)):
        return Origin.SAME
    if ANY in origins:
        return Origin.ANY
    return Origin.REFUSED


def answer_headers(verdict: Origin, origin: bytes | None) -> list[tuple[bytes, bytes]]:
    """The Access-Control-* headers every answer to this request carries."""
    if verdict is Origin.LISTED and origin is not None:
        return [
            (b"access-control-allow-origin", origin.strip()),
            (b"access-control-allow-credentials", b"true"),
            (b"access-control-expose-headers", EXPOSED),
            (b"vary", b"Origin"),
        ]
    if verdict is Origin.ANY:
        return [(b"access-control-allow-origin", b"*"), (b"access-control-expose-headers", EXPOSED)]
    return []


def preflight_headers(
    methods: str, requested: bytes | None, private_network: bool = False
) -> list[tuple[bytes, bytes]]:
    """What a preflight's answer adds to `answer_headers`: the methods, the headers asked for
    (any: the key travels in Authorization or x-api-key, the SDKs add their own), how long to keep
    it; and, when Chromium asks whether a public page may reach this private address (Private
    Network Access), yes: the origin is one cors_origins allows."""
    headers = [
        (b"access-control-allow-methods", methods.encode("latin-1")),
        (b"access-control-max-age", b"%d" % MAX_AGE),
    ]
    if requested and HEADER_LIST.match(requested):
        headers.append((b"access-control-allow-headers", requested))
    if private_network:
        headers.append((b"access-control-allow-private-network", b"true"))
    return headers


def is_preflight(method: str, origin: bytes | None, request_method: bytes | None) -> bool:
    """An OPTIONS request a browser sends before a cross-origin call."""
    return method == "OPTIONS" and origin is not None and request_method is not None
