"""The event bus: ordered fan-out, bounded buffers, slow subscribers dropped, never blocking."""

from __future__ import annotations

import trio

from stoker.daemon.core.events import DROPPED_TOPIC, EventBus


async def drain(receive) -> list[dict]:
    out = []
    while True:
        try:
            out.append(receive.receive_nowait())
        except trio.WouldBlock:
            return out
        except trio.EndOfChannel:
            out.append("END")
            return out


async def test_every_subscriber_gets_events_in_order_with_increasing_seq():
    bus = EventBus(buffer=10)
    a, b = bus.subscribe(), bus.subscribe()
    for i in range(5):
        bus.publish({"topic": "t", "i": i})
    for receive in (a, b):
        got = await drain(receive)
        assert [e["i"] for e in got] == list(range(5))
        assert [e["seq"] for e in got] == [1, 2, 3, 4, 5]
    assert bus.seq == 5


async def test_events_before_subscribing_are_not_delivered():
    bus = EventBus()
    bus.publish({"topic": "early"})
    receive = bus.subscribe()
    bus.publish({"topic": "late"})
    assert [e["topic"] for e in await drain(receive)] == ["late"]


async def test_publish_does_not_mutate_the_callers_dict():
    bus = EventBus()
    event = {"topic": "t"}
    stamped = bus.publish(event)
    assert event == {"topic": "t"} and stamped["seq"] == 1 and "time" in stamped


async def test_a_slow_subscriber_is_dropped_with_a_notice_and_others_keep_going():
    bus = EventBus(buffer=3)
    slow, fast = bus.subscribe(), bus.subscribe()
    fast_got = []
    for i in range(10):
        bus.publish({"topic": "t", "i": i})  # sync: returns at once however full slow is
        fast_got.extend(await drain(fast))
    assert [e["i"] for e in fast_got] == list(range(10))
    got = await drain(slow)
    assert [e["i"] for e in got[:3]] == [0, 1, 2]
    notice = got[3]
    assert notice["topic"] == DROPPED_TOPIC and notice["missed_from_seq"] == 4
    assert got[4] == "END"
    stats = bus.statistics()
    assert stats.dropped == 1 and stats.subscribers == 1 and stats.seq == 10


async def test_closed_subscriber_is_forgotten():
    bus = EventBus()
    receive = bus.subscribe()
    receive.close()
    bus.publish({"topic": "t"})
    assert bus.statistics().subscribers == 0


async def test_close_ends_streams_after_buffered_events():
    bus = EventBus()
    receive = bus.subscribe()
    bus.publish({"topic": "last"})
    bus.close()
    assert [e if e == "END" else e["topic"] for e in await drain(receive)] == ["last", "END"]
    late = bus.subscribe()
    assert await drain(late) == ["END"]


async def test_a_subscriber_reading_in_a_task_sees_everything():
    bus = EventBus(buffer=4)
    receive = bus.subscribe()
    got = []

    async def reader():
        async for event in receive:
            got.append(event["seq"])

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            for _ in range(50):
                bus.publish({"topic": "t"})
                await trio.sleep(0)
            bus.close()
    assert got == list(range(1, 51))
