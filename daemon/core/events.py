"""The event bus: the daemon publishes, subscribers read, and a slow reader never slows the daemon.

`publish` is synchronous and never blocks: each subscriber has a bounded trio memory channel,
and one that is full is dropped on the spot; its stream ends with a final `dropped` notice
(one slot is kept for it) followed by end-of-channel. Call both sides from trio tasks on the
daemon's thread (memory channels are not thread-safe).

Events are plain dicts; by convention `topic` names what happened (`machine.launch.ready`).
The bus adds `seq`, strictly increasing from 1, and `time` (Unix seconds).
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import attrs
import trio

DEFAULT_BUFFER = 256
DROPPED_TOPIC = "dropped"


@attrs.frozen
class BusStatistics:
    seq: int
    subscribers: int
    dropped: int


@attrs.define(eq=False)
class _Subscriber:
    send: trio.MemorySendChannel[dict[str, Any]]
    limit: int


@attrs.define(eq=False)
class EventBus:
    """Fan-out of events to subscribers, each with its own bounded buffer."""

    buffer: int = DEFAULT_BUFFER
    _seq: int = attrs.field(default=0, init=False)
    _dropped: int = attrs.field(default=0, init=False)
    _closed: bool = attrs.field(default=False, init=False)
    _subscribers: list[_Subscriber] = attrs.field(factory=list, init=False)

    @property
    def seq(self) -> int:
        """The seq of the last event published (0 before the first)."""
        return self._seq

    def subscribe(self, buffer: int | None = None) -> trio.MemoryReceiveChannel[dict[str, Any]]:
        """A receive channel of every event published from now on.

        Close it (or use it as a context manager) to unsubscribe. It ends (EndOfChannel) when
        the bus closes, or after a final `{"topic": "dropped", ...}` notice if it fell behind.
        """
        limit = self.buffer if buffer is None else buffer
        if limit < 1:
            raise ValueError("a subscriber needs a buffer of at least 1")
        send, receive = trio.open_memory_channel[dict[str, Any]](limit + 1)  # +1: the notice
        if self._closed:
            send.close()
        else:
            self._subscribers.append(_Subscriber(send, limit))
        return receive

    def publish(self, event: Mapping[str, Any]) -> dict[str, Any]:
        """Stamp `event` with seq and time and hand it to every subscriber; never blocks."""
        self._seq += 1
        stamped = {**event, "seq": self._seq, "time": time.time()}
        if self._closed:
            return stamped
        keep: list[_Subscriber] = []
        for sub in self._subscribers:
            if sub.send.statistics().current_buffer_used >= sub.limit:
                self._drop(sub, stamped["seq"])
                continue
            try:
                sub.send.send_nowait(stamped)
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
                sub.send.close()  # the reader went away
                continue
            keep.append(sub)
        self._subscribers = keep
        return stamped

    def _drop(self, sub: _Subscriber, missed_seq: int) -> None:
        self._dropped += 1
        notice = {
            "topic": DROPPED_TOPIC,
            "reason": "subscriber_too_slow",
            "message": f"This subscriber fell {sub.limit} events behind and was dropped; "
            f"events from seq {missed_seq} on were not delivered. Subscribe again.",
            "missed_from_seq": missed_seq,
            "time": time.time(),
        }
        try:
            sub.send.send_nowait(notice)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass
        sub.send.close()

    def close(self) -> None:
        """End every subscriber's stream (after what is buffered); later publishes go nowhere."""
        self._closed = True
        for sub in self._subscribers:
            sub.send.close()
        self._subscribers = []

    def statistics(self) -> BusStatistics:
        """A snapshot: last seq, live subscribers, subscribers dropped so far."""
        live = [sub for sub in self._subscribers if sub.send.statistics().open_receive_channels]
        return BusStatistics(self._seq, len(live), self._dropped)
