"""The idle unload: one task in the fleet that unloads each model whose `[models.NAME]
idle_ttl_s` has passed since it was last used, and keeps its conversations.

states/fleet/idle_unload.py decides from the facts of the moment (each model's state, TTL, pinned,
requests in flight and held, last use); this task acts: a planned stop with cause idle
(`DownRequested(DownCause.IDLE)`), which the launch table drains like any planned stop, and
before whose TERM the snapshot hook saves the slots (cause "idle"). The next request that names
the model loads it on demand and is held meanwhile; the ready hook restores the slots before
the first request is served (docs/models.md, "Idle unload keeps the conversation").

No polling: the task sleeps until the next model is due as things stand, or until the fleet's
change_signal says something changed (any model's transition, a request that ended or stopped waiting),
and asks again. A request that starts makes its model not due; the one that ends re-arms it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Callable, Iterable

import trio

from stoker.daemon.fleet.member import Member
from stoker.daemon.fleet.usage import ChangeSignal
from stoker.states.launch import records as LR
from stoker.states.fleet.idle_unload import review

log = logging.getLogger(__name__)


async def serve_idle_unloads(
    serving: Callable[[], Iterable[Member]],
    change_signal: ChangeSignal,
    *,
    now: Callable[[], float] = time.time,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Unload the idle models among `serving()` as they fall due, until cancelled; `change_signal`: the
    fleet's, fired at every change."""
    task_status.started()
    while True:
        # The facts are read and acted on with no checkpoint between: nothing changes meanwhile.
        members = {m.name: m for m in serving()}
        verdict = review([m.idle_facts() for m in members.values()], now())
        for unload in verdict.due:
            idle_s, ttl = unload.evidence["idle_s"], unload.evidence["idle_ttl_s"]
            log.info("unloading %s: idle for %.1f s, its idle_ttl_s is %g s", unload.name, idle_s, ttl)
            members[unload.name].supervisor.offer(LR.DownRequested(LR.DownCause.IDLE, unload.evidence))
        with trio.move_on_after(math.inf if verdict.next_in is None else verdict.next_in):
            await change_signal.wait()
