"""A model's requests in flight, which a planned stop of its server drains, and its idle time
(daemon/fleet/usage.py)."""

from __future__ import annotations

import trio

from stoker.daemon.fleet.usage import Usage


async def test_wait_drained_returns_once_every_answer_in_flight_is_over(autojump_clock):
    usage = Usage()
    await usage.wait_drained()  # nothing in flight: at once
    first, second = usage.sent(), usage.sent()
    drained_at: list[float] = []

    # The front door's hook: its idle connections to the engine go once drained, before the stop.
    usage.on_drained = lambda: drained_at.append(-trio.current_time())

    async def drain() -> None:
        await usage.wait_drained()
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


async def test_a_stops_drain_is_bounded_and_says_what_it_waited_for_or_cut(autojump_clock, caplog):
    caplog.set_level("INFO", logger="stoker.daemon.fleet.usage")
    usage = Usage()
    over = usage.sent()

    async def end_later() -> None:
        await trio.sleep(2)
        over()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(end_later)
        await usage.drain_within(30.0, "chat")  # the answer ends after 2 s: the stop waited for it
    assert trio.current_time() == 2.0
    assert "chat: the stop waited 2.00 s for 1 request(s) in flight to finish" in caplog.text

    stuck = usage.sent()
    await usage.drain_within(5.0, "chat")  # it never ends: cut by the bound, and the log says so
    assert trio.current_time() == 7.0 and usage.in_flight == 1
    assert "chat: 1 request(s) still in flight after drain_timeout_s (5.0 s) are cut by the stop" in caplog.text
    stuck()

    caplog.clear()
    drained: list[bool] = []
    usage.on_drained = lambda: drained.append(True)
    await usage.drain_within(0.0, "chat")  # a stop that does not drain: nothing said, idle connections closed
    assert trio.current_time() == 7.0 and drained == [True] and not caplog.text
