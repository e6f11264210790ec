"""The front door's count of requests in flight, which a planned stop drains (daemon/frontdoor/hold.py)."""

from __future__ import annotations

import trio

from daemon.frontdoor.hold import Hold


async def test_wait_drained_returns_once_every_answer_in_flight_is_over(autojump_clock):
    hold = Hold(daemon=None)  # type: ignore[arg-type]  # counting needs no daemon
    await hold.wait_drained()  # nothing in flight: at once
    first, second = hold.sent(), hold.sent()
    drained_at: list[float] = []

    async def drain() -> None:
        await hold.wait_drained()
        drained_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(drain)
        await trio.sleep(1)
        first()
        first()  # an answer is over once, however often its end is reported
        assert hold.in_flight == 1
        await trio.sleep(1)
        assert not drained_at
        second()
    assert hold.in_flight == 0 and drained_at == [2.0]
