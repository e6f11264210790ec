"""`[frontdoor]`: the front door's address, its holding bounds and whether keys are required.

Documented in docs/config.md and docs/frontdoor.md; the front door itself is daemon/frontdoor/.
"""

from __future__ import annotations

from typing import Any

import attrs

from daemon.config.checks import Invalid, boolean, integer, loopback_ip, seconds, setting

# The front door's fixed default address (docs/frontdoor.md): beside Ollama's 11434 and clear of
# LM Studio (1234), Jan (1337) and llama-server's own 8080.
FRONTDOOR_PORT = 11436


def _frontdoor_host(value: Any) -> str:
    # Loopback only until user API keys guard the front door (issue 13 item 2).
    try:
        return loopback_ip(value)
    except Invalid as err:
        raise Invalid(f"{err}; the front door binds loopback only until user API keys are required") from None


@attrs.frozen
class FrontdoorConfig:
    # The stable OpenAI-compatible address clients use; requests are held while the server
    # (re)starts, at most `max_queue` of them for at most `hold_timeout_s` each.
    enabled: bool = setting(True, boolean)
    host: str = setting("127.0.0.1", _frontdoor_host)
    port: int = setting(FRONTDOOR_PORT, integer(1, 65535))
    hold_timeout_s: float = setting(120.0, seconds(high=3600))
    max_queue: int = setting(256, integer(0, 100_000))
    # With keys required, every request needs a valid user key (`stoker key create`); without,
    # loopback clients may call with none (a valid key always passes).
    require_keys: bool = setting(False, boolean)
