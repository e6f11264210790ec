"""What the front door may see of the daemon: the narrow interface it types against.

Like daemon/control/controlled.py for the socket handlers: `daemon.runtime` sits above this
package, so the root nursery's `Daemon` satisfies these protocols structurally and nothing here
imports it. The front door needs the fleet (daemon/fleet/: each model found by the names a
request may use, its state, its engine's base URL and per-launch key, a way to wait for a state
and to load it on demand; for /metrics each model's state, live server target and use), and the
history's new rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, Sequence

import attrs

from stoker.states.launch import records as LR

if TYPE_CHECKING:
    from stoker.daemon.config.model import Config
    from stoker.daemon.core.events import EventBus
    from stoker.daemon.models.pull import PullService
    from stoker.daemon.fleet.fleet import Fleet
    from stoker.store.records import TransitionRecord


class FrontDoorDaemon(Protocol):
    """Everything the front door reads of the daemon, and nothing else."""

    @property
    def config(self) -> Config: ...

    @property
    def fleet(self) -> Fleet:
        """Every configured model: routing, state, on-demand loads (daemon/fleet/fleet.py)."""

    @property
    def pulls(self) -> PullService:
        """The catalog and its pulls (Ollama's /api/pull, /api/delete, /api/tags' details)."""

    @property
    def bus(self) -> EventBus:
        """The daemon's events (a pull's progress, for /api/pull)."""

    # Where Ollama's listener serves, or the OS's words for why it could not bind (set by
    # daemon/frontdoor/server.py; `stoker status` shows them).
    ollama_url: str | None
    ollama_error: str | None

    async def wait_state(self, states: Iterable[LR.LaunchState]) -> None:
        """Return once the default model's launch machine is in one of `states`."""

    def transitions_after(self, after_id: int, kinds: Sequence[str], limit: int) -> Sequence[TransitionRecord]:
        """Up to `limit` written history rows of these machine kinds past `after_id`, in write
        order (for /metrics' counters that survive a daemon restart)."""

    def install_statistics(self) -> Sequence[Mapping[str, Any]]:
        """Every install machine as status shows it (a build's `progress` among its fields)."""


@attrs.frozen
class Caller:
    """Who a request passed the key check as: the name of the user key it presented (its name
    in `stoker key list`, or `#ID` for a key made without one), never the key; None: no valid key
    (a loopback client that may call without one)."""

    key_name: str | None = None


# The hook user API keys (`stoker key`) plug into: called with the key a client presented
# (`Authorization: Bearer K` or `x-api-key: K`; None when it sent none) and whether the client
# is on loopback; None answers 401 in the API's error shape.
Authorize = Callable[[str | None, bool], Caller | None]


def allow_loopback(presented_key: str | None, loopback: bool) -> Caller | None:
    """No user keys configured: every loopback client may call (the config binds loopback only)."""
    return Caller() if loopback else None
