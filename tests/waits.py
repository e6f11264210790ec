"""Waiting for what a test needs under a deadline, and saying what it waited for when it does not come.

A test waits for the event, the log line or the state it needs, never for a fixed time: a fixed
sleep reads a state one step early on a loaded machine and wastes time on a quiet one. Where
nothing announces the change (another process's state, a file a thread writes), these poll it;
the tick is the poll's, the deadline the test's. Inside trio, `until` ticks on the run's clock,
so on a MockClock it takes no real time.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

import trio

T = TypeVar("T")


def _timed_out(what: str, timeout: float, last: object, detail: Callable[[], str] | None) -> AssertionError:
    message = f"timed out after {timeout:g} s waiting for {what}; last seen: {last!r}"
    if detail is not None:
        message += "\n" + detail()
    return AssertionError(message)


def wait_until(
    check: Callable[[], T], *, timeout: float, what: str, tick: float = 0.05, detail: Callable[[], str] | None = None
) -> T:
    """Call `check` until it returns something true and return that; after `timeout` seconds fail
    naming `what`, the last value seen and `detail()` (a log's tail, say)."""
    deadline = time.monotonic() + timeout
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, detail)
        time.sleep(tick)


async def until(
    check: Callable[[], T], *, timeout: float, what: str, tick: float = 0.01, detail: Callable[[], str] | None = None
) -> T:
    """`wait_until` inside trio: the ticks are `trio.sleep`s on the run's clock."""
    deadline = trio.current_time() + timeout
    while True:
        last = check()
        if last:
            return last
        if trio.current_time() >= deadline:
            raise _timed_out(what, timeout, last, detail)
        await trio.sleep(tick)
