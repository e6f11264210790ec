"""A model's requests in flight, which a planned stop of its server drains, and its idle time
(daemon/fleet/usage.py)."""

from __future__ import annotations

import trio

from daemon.fleet.usage import Usage


async def test_wait_drained_returns_once_every_answer_in_flight_is_over(autojump_clock):
    usage = Usage()
    assert await usage.wait_drained() == 0  # nothing in flight: at once
    first, second = usage.sent(), usage.sent()
    drained_at: list[float] = []

    # The front door's hook: its idle connections to the engine go once drained, before the stop.
    usage.on_drained = lambda: drained_at.append(-trio.current_time())

    async def drain() -> None:
        assert await usage.wait_drained() == 2  # how many it waited for, for the daemon's log
        drained_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        await trio.sleep(1)
        first()
        first()  # an answer is over once, however often its end is reported
        assert usage.in_flight == 1
        await trio.sleep(1)
        assert not drained_at
        second()
    assert usage.in_flight == 0 and drained_at == [-2.0, 2.0]


def test_idle_time_counts_from_the_last_request_or_from_ready():
    changes: list[int] = []
    usage = Usage(on_change=lambda: changes.append(1))
    assert usage.idle_s(now=100.0, ready_at=40.0) == 60.0  # never used: idle since ready
    over = usage.sent()
    assert usage.idle_s(now=1e12, ready_at=40.0) == 0.0  # a request in flight: not idle
    over()
    assert usage.last_used is not None and changes == [1]  # the fleet hears that a request ended
    assert usage.idle_s(now=usage.last_used + 5, ready_at=40.0) == 5.0
    with usage.held():
        assert usage.waiting == 1 and usage.held_total == 1
    assert usage.waiting == 0 and changes == [1, 1]
