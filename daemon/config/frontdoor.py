"""`[frontdoor]`: the front door's address, its holding bounds, its limits on what a client may
send, and whether keys are required.

Documented in docs/config.md and docs/frontdoor.md; the front door itself is daemon/frontdoor/.
A non-loopback `host` (a LAN address, 0.0.0.0, ::) is refused unless `require_keys = true`
(`lan_bind_problems`, checked across keys when the config is read or reloaded).
"""

from __future__ import annotations

import ipaddress
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

import attrs

from stoker.daemon.config.checks import Invalid, boolean, byte_size, describe, integer, ip_address, seconds, setting

# The front door's fixed default address (docs/frontdoor.md): beside Ollama's 11434 and clear of
# LM Studio (1234), Jan (1337) and llama-server's own 8080.
FRONTDOOR_PORT = 11436

KIB, MIB, GIB = 2**10, 2**20, 2**30


# An IP address: loopback, or (with keys required, see `lan_bind_problems`) any other.
_host = ip_address(
    "an IP address such as 127.0.0.1 (this machine only), a LAN address, or 0.0.0.0 / :: (every interface)"
)


def _bytes_between(low: int, high: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        size = byte_size(value)
        if not low <= size <= high:
            raise Invalid(f"must be between {low} and {high} bytes, got {size}")
        return size

    return check


def origin_problem(value: str) -> str | None:
    """Why `value` cannot be an entry of cors_origins (None: it can)."""
    if value == "*":
        return None
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return (
            f"{value!r} is not an origin: give scheme://host[:port], such as https://app.example or "
            f'http://localhost:3000, or "*"'
        )
    if parts.path or parts.query or parts.fragment or parts.username or value.endswith("/"):
        return f"{value!r} has more than an origin: give scheme://host[:port] alone, no path or trailing slash"
    try:
        parts.port
    except ValueError:
        return f"{value!r} has a port that is not a number from 0 to 65535"
    return None


def _origins(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise Invalid(f"must be a list of origins (strings), got {describe(value)}")
    problems = [problem for item in value if (problem := origin_problem(item)) is not None]
    if problems:
        raise Invalid("; ".join(problems))
    return tuple(item.lower() for item in value)  # as a browser writes an origin


@attrs.frozen
class FrontdoorConfig:
    # The stable OpenAI-compatible address clients use; requests are held while the server
    # (re)starts, at most `max_queue` of them for at most `hold_timeout_s` each.
    enabled: bool = setting(True, boolean)
    host: str = setting("127.0.0.1", _host)
    port: int = setting(FRONTDOOR_PORT, integer(1, 65535))
    hold_timeout_s: float = setting(120.0, seconds(high=3600))
    max_queue: int = setting(256, integer(0, 100_000))
    # With keys required, every request needs a valid user key (`stoker key create`); without,
    # loopback clients may call with none (a valid key always passes).
    require_keys: bool = setting(False, boolean)
    # What one client may send. The body allows base64 images in a multimodal chat (a 10 MB
    # photo is ~13.4 MB of base64); headers are a request line and a few short fields.
    max_body_bytes: int = setting(32 * MIB, _bytes_between(KIB, GIB))
    max_header_bytes: int = setting(16 * KIB, _bytes_between(KIB, MIB))
    # A connection with no request under way (kept alive between requests, or whose request line
    # and headers have not all arrived) is closed after idle_timeout_s: longer than the 5 s
    # httpx keeps an idle connection, so a client never reuses one the server is closing.
    idle_timeout_s: float = setting(30.0, seconds(high=3600))
    # A request's body must have arrived in full this long after its headers did (32 MiB at
    # about 0.5 MB/s); a slower client gets 408 and its connection is closed.
    slow_client_timeout_s: float = setting(60.0, seconds(high=3600))
    # A planned stop of a ready server (stoker restart/down, a relaunching config change, an
    # idle unload, an eviction, the daemon's shutdown) lets the requests in flight through the
    # front door finish first, for at most this long; 0 stops at once (the streams are cut).
    drain_timeout_s: float = setting(30.0, seconds(allow_zero=True, high=3600))
    # The origins of web pages that may call the front door from a browser (CORS; the role of
    # OLLAMA_ORIGINS), or "*" for any: none by default but the front door's own
    # (daemon/frontdoor/cors.py).
    cors_origins: tuple[str, ...] = setting((), _origins)

    @property
    def loopback_only(self) -> bool:
        return ipaddress.ip_address(self.host).is_loopback


def lan_bind_problems(frontdoor: FrontdoorConfig) -> list[str]:
    """A front door other machines can reach must require keys: the problem, naming both fixes."""
    if frontdoor.loopback_only or frontdoor.require_keys:
        return []
    return [
        f"frontdoor.host: {frontdoor.host} is reachable from other machines, so it needs "
        f"require_keys = true in [frontdoor] (every client then sends a key made with `stoker key create`); "
        f'or bind host = "127.0.0.1" to serve this machine only'
    ]


def address_from_env(environ: Mapping[str, str]) -> tuple[dict[str, Any], list[str]]:
    """`[frontdoor]` host and port from STOKER_HOST (`host`, `host:port`, `[::1]:port`, or a URL, as
    OLLAMA_HOST takes them) and STOKER_PORT, which win over the config file; and their problems."""
    found: dict[str, Any] = {}
    problems: list[str] = []
    if value := environ.get("STOKER_HOST", "").strip():
        try:
            parts = urlsplit(value if "//" in value else f"//{value}")
            if parts.hostname:
                found["host"] = parts.hostname
            if parts.port is not None:
                found["port"] = parts.port
            if not found or parts.path not in ("", "/"):
                raise ValueError("no host")
        except ValueError:
            problems.append(f"STOKER_HOST: must be host, host:port or http://host:port, got {value!r}")
    if value := environ.get("STOKER_PORT", "").strip():
        if value.isdigit():
            found["port"] = int(value)
        else:
            problems.append(f"STOKER_PORT: must be a port number, got {value!r}")
    return found, problems
