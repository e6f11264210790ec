"""The launch machine at daemon start: what the identity file proved (pure handlers).

A server outlives a daemon killed with -9, and the store may not know it: the daemon may have
died between recording a request and acting on it, the store may have been moved aside
(`store_corrupt` tells the user to), or its -wal lost. So the first thing a daemon does,
whatever the store holds, is read the server identity file (`Reattach`); its answer resumes
the machine, before any plan, spawn, stop or user request:

- `Adopted` (every proof passed): kept when it is the server this machine runs (its pid, or
  the spawn that was under way when the daemon died); otherwise stopped, and the machine goes
  on where it was going: back to stopped or failed, a fresh plan from anywhere else, where a
  stop that was under way was going.
- `OrphanFound` (ours by pid, start time and executable, but no proof it serves): stopped.
- `NothingToAdopt`: the machine resumes where it was (a plan, a backoff, a spawn that never
  happened); a server the machine believed running is gone, which counts as its exit.
"""

from __future__ import annotations

from typing import Any

import attrs

from stoker.states.launch.steps import RUNNING, ask_plan, exit_step, serving_effects, stop_done_step, stop_step
from stoker.states.launch.records import (
    Adopted,
    AfterStop,
    Effect,
    LaunchData,
    LaunchState,
    NothingToAdopt,
    OrphanFound,
    ServerExited,
    Spawn,
    StartBackoff,
    StopCompleted,
    WatchReadiness,
)
from stoker.states.machine import STAY, Step, guarded
from stoker.states.reasons import ReasonCode

S = LaunchState


def _stop_found(state: S, data: LaunchData, pid: int, create_time: float | None, evidence: dict[str, Any]) -> Step:
    """Stop a server found at start-up that this machine does not run (or cannot keep)."""
    data = attrs.evolve(data, pid=pid, create_time=create_time, spawning=False)
    if state is S.STOPPING:
        after = data.after_stop
    elif state is S.STOPPED:
        after = AfterStop.STOP
    elif state is S.FAILED:
        after = AfterStop.FAIL  # failed stays failed until the user starts it
    else:
        after = AfterStop.RESTART
    result = stop_step(data, after)
    return attrs.evolve(result, evidence={**evidence, "after_stop": after.value})


@guarded(STAY, S.STOPPING)
def adopted(state: S, data: LaunchData, event: Adopted) -> Step:
    """A proven server: kept when it is the one this machine runs, stopped otherwise."""
    evidence = {"pid": event.pid, **event.evidence}
    mine = data.pid == event.pid or (data.pid is None and state is S.STARTING)
    if state not in RUNNING or not mine:
        return _stop_found(state, data, event.pid, event.create_time, {**evidence, "kept": False})
    data = attrs.evolve(data, pid=event.pid, create_time=event.create_time, spawning=False, silent=False)
    effects: tuple[Effect, ...]
    if state is S.READY:
        effects = serving_effects(data, "adopted")
    else:
        effects = (WatchReadiness(data.settings.stall_timeout),)
    return Step(state, data, effects, evidence={**evidence, "kept": True})


@guarded(S.STOPPING)
def orphan_found(state: S, data: LaunchData, event: OrphanFound) -> Step:
    """A process of ours that does not prove it serves (no health, not our key): stopped."""
    return _stop_found(state, data, event.pid, event.create_time, {"pid": event.pid, **event.evidence})


@guarded(STAY, S.STARTING, S.STOPPED, S.PLANNING, S.CRASHED, S.FAILED)
def nothing_adopted(state: S, data: LaunchData, event: NothingToAdopt) -> Step:
    """No server of ours outlived the last daemon: resume where the machine was."""
    if state is S.STARTING and data.spawning and data.plan is not None:
        # The daemon died while spawning, before anything ran: spawn the plan again.
        return Step(S.STARTING, data, (Spawn(data.plan),), evidence=event.evidence)
    if state in RUNNING:
        return exit_step(state, data, ServerExited(None, ReasonCode.SERVER_CRASHED, event.evidence))
    if state is S.STOPPING:
        return stop_done_step(data, StopCompleted(None, event.evidence))
    if state is S.PLANNING:
        # the plan under way when the daemon died is gone with it: ask again
        data, ask = ask_plan(data, data.replan_for)
        return Step(S.PLANNING, data, (ask,), evidence=event.evidence)
    # crashed, backoff: come back after a backoff, as the crash asked.
    return Step(state, data, (StartBackoff(max(data.crashes, 1)),), evidence=event.evidence)
