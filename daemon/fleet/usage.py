"""A model's use at the front door: requests in flight and held, and when it was last used.

What placement reads to choose the model to unload (states/fleet/placement.py: nothing in flight,
nobody held, the least recently used), what a planned stop of that model drains (its own
requests only: another model's streams are not its business), and the hooks the idle unload
reads (`last_used`, `in_flight`). A `ChangeSignal` wakes whoever waits for the fleet to change: a
transition of any model, or a request that ended.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Iterator

import attrs
import trio

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class ChangeSignal:
    """An event fired on every change; `wait` returns at the next one."""

    _event: trio.Event = attrs.field(factory=trio.Event)

    def fire(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait(self) -> None:
        await self._event.wait()

    def armed(self) -> trio.Event:
        """The event the next change sets: taken before a lock is released, waited on after, so
        that a change in between is not missed."""
        return self._event


def _nothing() -> None:
    return None


@attrs.define(eq=False)
class Usage:
    """One model's requests: in flight to its engine, held for it, and its last use (Unix time)."""

    on_change: Callable[[], None] = _nothing  # the fleet's change_signal: a place may have freed
    in_flight: int = 0  # sent to the engine, answer not over (a planned stop drains them)
    waiting: int = 0  # held until the model is ready (it is not unloaded meanwhile)
    held_total: int = 0  # requests that had to wait at all
    last_used: float | None = None  # when a request for it was last sent or ended; None: never
    # The last request's `keep_alive` in seconds (inf: for good), over [models.NAME] idle_ttl_s.
    keep_alive_s: float | None = None
    # Once a planned stop's drain is over, before the server stops: the front door closes its
    # idle connections to the engine (daemon/engine/wire.py `forget`), which would hold its exit.
    on_drained: Callable[[], None] = _nothing
    _drained: trio.Event = attrs.field(factory=trio.Event)

    def sent(self) -> Callable[[], None]:
        """Count a request sent to the engine; call what this returns once its answer is over."""
        self.in_flight += 1
        self.last_used = time.time()
        done = False

        def over() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
                self.last_used = time.time()
                if self.in_flight == 0:
                    self._drained.set()
                    self._drained = trio.Event()
                self.on_change()

        return over

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """A request waits for this model while inside."""
        self.waiting += 1
        self.held_total += 1
        try:
            yield
        finally:
            self.waiting -= 1
            self.on_change()

    async def wait_drained(self) -> None:
        """Return once no request is in flight to the engine (the supervisor's drain before a
        planned stop; requests arriving meanwhile are held, so the count only falls)."""
        while self.in_flight:
            await self._drained.wait()
        self.on_drained()
        await trio.lowlevel.checkpoint()

    async def drain_within(self, bound: float, name: str) -> None:
        """A planned stop's drain: return once no request is in flight, or after `bound`
        seconds ([frontdoor] drain_timeout_s; 0: a stop that does not drain). The daemon's log
        says how long the stop waited for how many, or that the rest are cut by the stop."""
        waited_for, began = self.in_flight, trio.current_time()
        if bound <= 0:
            if not waited_for:
                self.on_drained()
            return
        with trio.move_on_after(bound):
            await self.wait_drained()
        if self.in_flight:
            log.warning(
                "%s: %d request(s) still in flight after drain_timeout_s (%.1f s) are cut by the stop",
                name,
                self.in_flight,
                bound,
            )
        elif waited_for:
            log.info(
                "%s: the stop waited %.2f s for %d request(s) in flight to finish",
                name,
                trio.current_time() - began,
                waited_for,
            )

    def idle_s(self, now: float, ready_at: float | None) -> float:
        """Seconds since the model was last used, or since it became ready if that is later."""
        since = max((t for t in (self.last_used, ready_at) if t is not None), default=now)
        return max(0.0, now - since) if not self.in_flight else 0.0
