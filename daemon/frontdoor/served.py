"""What the front door may see of the daemon: the narrow interface it types against.

Like daemon/control/controlled.py for the socket handlers: `daemon.service` sits above this
package, so the root nursery's `Daemon` satisfies these protocols structurally and nothing here
imports it. The front door needs the fleet (daemon/fleet/: each model found by the names a
request may use, its state, its engine's base URL and per-launch key, a way to wait for a state
and to load it on demand), and for /metrics the default instance's state, the live server's
backend and layers and the history's new rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable, Protocol, Sequence

from states import launch_records as LR

if TYPE_CHECKING:
    from daemon.config.model import Config
    from daemon.fleet.fleet import Fleet
    from daemon.telemetry.sampler import ServerTarget
    from store.records import TransitionRecord


class ServedInstance(Protocol):
    """The launch machine of the instance the front door forwards to."""

    @property
    def state(self) -> LR.LaunchState: ...

    @property
    def data(self) -> LR.LaunchData: ...

    def endpoint(self) -> tuple[str | None, str | None]:
        """The engine's base URL and per-launch API key (None, None without a plan)."""


class FrontDoorDaemon(Protocol):
    """Everything the front door reads of the daemon, and nothing else."""

    @property
    def config(self) -> Config: ...

    @property
    def supervisor(self) -> ServedInstance:
        """The default model's launch machine (/metrics describes it)."""

    @property
    def fleet(self) -> Fleet:
        """Every configured model: routing, state, on-demand loads (daemon/fleet/fleet.py)."""

    async def wait_state(self, states: Iterable[LR.LaunchState]) -> None:
        """Return once the default model's launch machine is in one of `states`."""

    def telemetry_target(self) -> ServerTarget | None:
        """The live server (for /metrics): the backend really in use, the planned one, the
        layers the engine offloaded; None when no server process runs."""

    def transitions_after(self, after_id: int, kinds: Sequence[str], limit: int) -> Sequence[TransitionRecord]:
        """Up to `limit` written history rows of these machine kinds past `after_id`, in write
        order (for /metrics' counters that survive a daemon restart)."""


# The hook user API keys plug into (issue 13 item 2): called with the key a client presented
# (`Authorization: Bearer K` or `x-api-key: K`; None when it sent none) and whether the client
# is on loopback; False answers 401 in the API's error shape.
Authorize = Callable[[str | None, bool], bool]


def allow_loopback(presented_key: str | None, loopback: bool) -> bool:
    """No user keys configured: every loopback client may call (the config binds loopback only)."""
    return loopback
