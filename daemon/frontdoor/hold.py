"""Hold, don't fail: a request that arrives while the server (re)starts waits until it is ready.

At most `[frontdoor] max_queue` requests wait at once, each at most `hold_timeout_s`; past
either bound, or when the server is stopped or failed (nothing will make it ready unasked),
`Refused` carries the reason code the front door answers 503 with, and a Retry-After.
It also counts the requests in flight to the engine: before a planned stop of a ready server
the supervisor waits (bounded) until their answers are over (`wait_drained`).
"""

from __future__ import annotations

from typing import Callable

import attrs
import trio

from daemon.frontdoor.served import FrontDoorDaemon
from states import launch_records as LR
from states.frontdoor_policy import DOWN, READY, EngineLoss, waits
from states.reasons import ReasonCode, message_for

# After the engine's connection failed, how long to wait for the supervisor to notice (the
# state leaves ready) before judging the loss (states/frontdoor_policy.py) without it.
NOTICE_S = 2.0
# Seconds a refused client is told to wait before trying again.
RETRY_AFTER_S = {
    ReasonCode.FRONTDOOR_HOLD_TIMEOUT: 5,
    ReasonCode.FRONTDOOR_QUEUE_FULL: 2,
    ReasonCode.FRONTDOOR_SERVER_DOWN: 30,
}


class Refused(Exception):
    """The request cannot be held any longer: 503 with `reason` and `retry_after_s`."""

    def __init__(self, reason: ReasonCode, detail: str) -> None:
        super().__init__(f"{message_for(reason)} ({detail})")
        self.reason = reason
        self.retry_after_s = RETRY_AFTER_S[reason]


@attrs.define(eq=False)
class Hold:
    """The bounded waiting room in front of the engine."""

    daemon: FrontDoorDaemon
    waiting: int = 0
    held_total: int = 0  # requests that had to wait at all (/metrics: stoker_requests_held_total)
    in_flight: int = 0  # requests sent to the engine whose answer is not over (a planned stop drains them)
    _drained: trio.Event = attrs.field(factory=trio.Event)

    def sent(self) -> Callable[[], None]:
        """Count a request sent to the engine; call what this returns once its answer is over."""
        self.in_flight += 1
        done = False

        def over() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
                if self.in_flight == 0:
                    self._drained.set()
                    self._drained = trio.Event()

        return over

    async def wait_drained(self) -> None:
        """Return once no request is in flight to the engine (the supervisor's drain before a
        planned stop; requests arriving meanwhile are held, so the count only falls)."""
        while self.in_flight:
            await self._drained.wait()
        await trio.lowlevel.checkpoint()

    async def until_ready(self) -> tuple[str, str | None]:
        """The engine's base URL and key once the server is ready; raises `Refused`."""
        state = self.daemon.supervisor.state
        if state is not READY:
            settings = self.daemon.config.frontdoor
            if not waits(state):
                raise Refused(ReasonCode.FRONTDOOR_SERVER_DOWN, f"server {state.value}")
            if self.waiting >= settings.max_queue:
                raise Refused(ReasonCode.FRONTDOOR_QUEUE_FULL, f"{self.waiting} waiting")
            self.waiting += 1
            self.held_total += 1
            try:
                with trio.move_on_after(settings.hold_timeout_s):
                    await self.daemon.wait_state({READY, *DOWN})
            finally:
                self.waiting -= 1
            state = self.daemon.supervisor.state
            if state in DOWN:
                raise Refused(ReasonCode.FRONTDOOR_SERVER_DOWN, f"server {state.value}")
            if state is not READY:
                raise Refused(
                    ReasonCode.FRONTDOOR_HOLD_TIMEOUT, f"server {state.value} after {settings.hold_timeout_s:g} s"
                )
        base_url, api_key = self.daemon.supervisor.endpoint()
        if base_url is None:  # ready always has a plan; kept honest rather than asserted
            raise Refused(ReasonCode.FRONTDOOR_SERVER_DOWN, "no endpoint")
        return base_url, api_key

    async def notice_loss(self, base_url: str, reached: bool) -> EngineLoss:
        """The facts of an engine lost under a request before any byte of its answer: wait (at
        most NOTICE_S) for the supervisor to notice the server it was sent to is gone, then
        read what the launch machine recorded (why it stops, the signal that ended it)."""
        supervisor = self.daemon.supervisor

        def gone() -> bool:
            return supervisor.state is not READY or supervisor.endpoint()[0] != base_url

        if not gone():
            with trio.move_on_after(NOTICE_S):
                await self.daemon.wait_state(set(LR.LaunchState) - {READY})
        data = supervisor.data
        signal = data.evidence.get("signal")
        return EngineLoss(
            reached, gone(), supervisor.state, data.after_stop, signal if isinstance(signal, str) else None
        )
