"""Hold, don't fail: a request that arrives while its model's server (re)starts, or is not
loaded yet, waits until it is ready.

Per model: a request waits for the model it names (daemon/fleet/: its member), and only for
that one. A model that is configured but not loaded (never loaded, unloaded to make room, or
stopped with the daemon) is loaded on demand (`Fleet.load`, which may first unload the least
recently used idle model, states/fleet/placement.py) while the request is held, within the same
bounds as a restart. At most `[frontdoor] max_queue` requests wait at once (all models
together), each at most `hold_timeout_s`; past either bound, when the model is stopped by the
user or failed (nothing will make it ready unasked), or when no place could be made for it in
time, `Refused` carries the reason code the front door answers 503 with, and a Retry-After.
Whether to hold, what to do next while held, which 503 and which Retry-After are all
states/frontdoor/policy.py's decisions; this module gathers the facts and waits.
Each model counts its own requests in flight (`Usage`): a planned stop of its server drains
those, and only those (`wait_drained`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import attrs
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.frontdoor.daemon_view import FrontDoorDaemon
from stoker.states.launch import records as LR
from stoker.states.frontdoor.policy import (
    DOWN,
    READY,
    RETRY_AFTER_S,
    EngineLoss,
    HoldMove,
    admit,
    gives_up_after,
    hold_move,
    refusal,
)
from stoker.states.reasons import ReasonCode, message_for

if TYPE_CHECKING:
    from stoker.daemon.fleet.member import Member

# After the engine's connection failed, how long to wait for the supervisor to notice (the
# state leaves ready) before judging the loss (states/frontdoor/policy.py) without it.
NOTICE_S = 2.0


class Refused(Exception):
    """The request cannot be held any longer: 503 with `reason` and `retry_after_s`."""

    def __init__(self, reason: ReasonCode, detail: str) -> None:
        super().__init__(f"{message_for(reason)} ({detail})")
        self.reason = reason
        self.retry_after_s = RETRY_AFTER_S[reason]


@attrs.define(eq=False)
class Hold:
    """The bounded waiting room in front of the engines."""

    daemon: FrontDoorDaemon
    waiting: int = 0  # requests held now, every model together ([frontdoor] max_queue bounds it)
    held_total: int = 0  # requests that had to wait at all (/metrics: stoker_requests_held_total)

    def sent(self, member: Member) -> Callable[[], None]:
        """Count a request sent to `member`'s engine; call what this returns once its answer is over."""
        return member.usage.sent()

    async def until_ready(self, member: Member) -> tuple[str, str | None]:
        """`member`'s engine base URL and key once it is ready (loaded first if it is not);
        raises `Refused`."""
        if member.state is not READY:
            await self._hold(member)
        base_url, api_key = member.endpoint()
        if base_url is None:  # ready always has a plan; kept honest rather than asserted
            raise Refused(ReasonCode.FRONTDOOR_SERVER_DOWN, f"{member.name}: no endpoint")
        return base_url, api_key

    async def _hold(self, member: Member) -> None:
        """Hold the request while states/frontdoor/policy.py says so; raise its refusal."""
        settings = self.daemon.config.frontdoor
        refused = admit(member.state, member.loads_on_demand, self.waiting, settings.max_queue)
        if refused is not None:
            raise Refused(refused, self._detail(member, refused, placing=False))
        self.waiting += 1
        self.held_total += 1
        placing = False
        try:
            with member.usage.held(), trio.move_on_after(settings.hold_timeout_s):
                while (move := hold_move(member.state, member.loads_on_demand)) is not HoldMove.SERVE:
                    if move is HoldMove.GIVE_UP:
                        break
                    if move is HoldMove.LOAD:  # not loaded: load it, making room first
                        placing = True
                        await self.daemon.fleet.load(member, wait=True)
                        placing = False
                        if gives_up_after(move, member.state):
                            break
                    await member.wait_state({READY, *DOWN})
                    if gives_up_after(HoldMove.WAIT, member.state):
                        break
        except StokerError as err:  # no valid config was ever read: nothing may start
            raise Refused(ReasonCode.FRONTDOOR_SERVER_DOWN, f"{member.name}: {err.reason}") from None
        finally:
            self.waiting -= 1
        state = member.state
        reason = refusal(state, placing, member.data.reason if state is LR.LaunchState.FAILED else None)
        if reason is not None:
            raise Refused(reason, self._detail(member, reason, placing))

    def _detail(self, member: Member, reason: ReasonCode, placing: bool) -> str:
        """The words after a refusal's sentence, from the facts that decided it (the policy chose `reason`)."""
        settings = self.daemon.config.frontdoor
        state = member.state.value
        if placing:
            loaded = self.daemon.fleet.max_loaded()
            return f"{member.name} not loaded after {settings.hold_timeout_s:g} s: {loaded} models loaded, none idle"
        match reason:
            case ReasonCode.FRONTDOOR_QUEUE_FULL:
                return f"{self.waiting} waiting"
            case ReasonCode.PLACEMENT_NO_ROOM:
                return str(member.data.evidence.get("message") or member.name)
            case ReasonCode.FRONTDOOR_HOLD_TIMEOUT:
                return f"{member.name} {state} after {settings.hold_timeout_s:g} s"
            case ReasonCode.FRONTDOOR_SERVER_DOWN:
                return f"{member.name} {state}: `stoker up {member.name}` starts it"
        return f"{member.name} {state}"

    async def notice_loss(self, member: Member, base_url: str, reached: bool) -> EngineLoss:
        """The facts of an engine lost under a request before any byte of its answer: wait (at
        most NOTICE_S) for `member`'s supervisor to notice the server it was sent to is gone,
        then read what its launch machine recorded (why it stops, the signal that ended it)."""

        def gone() -> bool:
            return member.state is not READY or member.endpoint()[0] != base_url

        if not gone():
            with trio.move_on_after(NOTICE_S):
                await member.wait_state(set(LR.LaunchState) - {READY})
        data = member.data
        signal = data.evidence.get("signal")
        return EngineLoss(reached, gone(), member.state, data.after_stop, signal if isinstance(signal, str) else None)
