"""The steps the launch machine's handlers share (pure).

Planning afresh, entering `stopping`, counting a crash, judging an unasked exit, leaving
`stopping` once the process is gone, and what a ready server gets. The handlers that use them
are in states/launch/table.py (requests and process events) and states/launch/adoption.py (what the
identity file proved at daemon start); the table that binds them is in states/launch/table.py.
"""

from __future__ import annotations

from typing import Any

import attrs

from stoker.states.launch.exits import ExitVerdict, judge_exit, judge_stall
from stoker.states.launch.liveness import liveness_cadence
from stoker.states.launch.records import (
    AfterStop,
    ArmStableTimer,
    DownCause,
    Effect,
    ExitPhase,
    LaunchData,
    LaunchSettings,
    LaunchState,
    MakePlan,
    Notify,
    PlanFailure,
    ServerExited,
    SpawnFailed,
    StartBackoff,
    StopCompleted,
    Terminate,
    WatchLiveness,
)
from stoker.states.machine import Step, step_with_reason
from stoker.states.reasons import ReasonCode
from stoker.states.server_process import crash_loop

S = LaunchState
# The states in which a server of this machine runs (or is being spawned).
RUNNING = frozenset({S.STARTING, S.LOADING, S.READY})

_STOP_TEXT = {
    AfterStop.STOP: "stopping",
    AfterStop.RESTART: "restarting",
    AfterStop.CRASH: "stalled",
    AfterStop.HUNG: "hung",
    AfterStop.FAIL: "stopping",
}
# What a stop is for, as the snapshot hook before it records it (each snapshot's `cause`).
_STOP_CAUSE = {
    AfterStop.STOP: "stop",
    AfterStop.RESTART: "restart",
    AfterStop.CRASH: "stall",
    AfterStop.HUNG: "hung",
    AfterStop.FAIL: "stop",
}
# A stop for good that the daemon asked for itself says why: to make room, or idle past its TTL.
_DAEMON_STOPS = frozenset({DownCause.EVICTED, DownCause.IDLE})


def stop_cause(data: LaunchData, shutting_down: bool) -> str:
    """The cause a stop's snapshots carry: "shutdown" (the daemon stops), "evicted" or "idle"
    (the daemon unloads the model), else where the stop leads: stop, restart, stall, hung."""
    if shutting_down:
        return "shutdown"
    if data.after_stop is AfterStop.STOP and data.down_cause in _DAEMON_STOPS:
        return str(data.down_cause)
    return _STOP_CAUSE[data.after_stop]


def settings_of(data: LaunchData, new: LaunchSettings | None) -> LaunchSettings:
    """The knobs an event brings, or the machine's own."""
    return data.settings if new is None else new


def fresh_count(data: LaunchData) -> LaunchData:
    """A start the user asked for: earlier crashes and restarts no longer count."""
    return attrs.evolve(data, crashes=0, restarts=0)


def ask_plan(data: LaunchData, failure: PlanFailure | None = None) -> tuple[LaunchData, MakePlan]:
    """A new MakePlan, numbered: an answer to any earlier one (a restart or a config change
    came while it was planned) is refused, so the plan that runs is the newest asked for."""
    data = attrs.evolve(data, plan_requests=data.plan_requests + 1)
    return data, MakePlan(previous=data.plan, failure=failure, request=data.plan_requests, ctx_size=data.ctx_size)


def without_server(data: LaunchData, **changes: Any) -> LaunchData:
    """`data` with no server process in it (none started, or the last one gone): no pid, no
    spawn under way, no stop's follow-up, no watchdog verdict, no replan pending."""
    return attrs.evolve(
        data,
        pid=None,
        create_time=None,
        after_stop=AfterStop.STOP,
        replan_for=None,
        spawning=False,
        silent=False,
        **changes,
    )


def plan_step(data: LaunchData, settings: LaunchSettings | None = None, *, reset: bool) -> Step:
    """Enter planning afresh (a start, restart or config change: no failure to avoid). A
    user start resets the counts and clears the last reason."""
    settings = settings_of(data, settings)
    if reset:
        data = attrs.evolve(fresh_count(data), reason=None, evidence={})
    data, ask = ask_plan(without_server(data, settings=settings, down_cause=None))
    return Step(S.PLANNING, data, (ask,))


def stop_step(
    data: LaunchData,
    after: AfterStop,
    reason: ReasonCode | None = None,
    evidence: dict[str, Any] | None = None,
    *,
    drain: bool = False,
) -> Step:
    """Enter stopping. While a spawn is under way there is nothing to signal yet: the stop
    waits for its answer (Spawned: then Terminate; SpawnFailed: nothing ran). `drain`: a
    planned stop of a ready server, whose requests in flight may finish first (bounded)."""
    data = attrs.evolve(data, after_stop=after, silent=False)
    if reason is not None:
        data = attrs.evolve(data, reason=reason, evidence=evidence or {})
    evidence = dict(evidence or {})
    effects: tuple[Effect, ...] = (Notify("status", _STOP_TEXT[after]),)
    if data.spawning:
        evidence["waiting_for"] = "spawn"
    else:
        wait = data.settings.drain_timeout if drain else 0.0
        effects = (Terminate(data.settings.stop_grace, wait), *effects)
    return Step(S.STOPPING, data, effects, reason, evidence)


def crash_step(
    data: LaunchData,
    reason: ReasonCode,
    evidence: dict[str, Any],
    verdict: ExitVerdict,
    phase: ExitPhase,
    returncode: int | None,
) -> Step:
    """Count a crash: fail for good (fatal, or a crash loop), or back off and come back with
    the same plan or, for REPLAN, a new one that knows what failed."""
    crashes = data.crashes + 1
    evidence = {**evidence, "crashes": crashes, "returncode": returncode}
    data = without_server(data, crashes=crashes)
    if verdict is ExitVerdict.FATAL:
        data = attrs.evolve(data, ctx_size=None)  # a context a request asked ends with its server
        return step_with_reason(S.FAILED, data, (Notify("status", f"failed: {reason}"),), reason, evidence)
    if crash_loop(crashes, data.settings.max_restarts):
        loop = {**evidence, "last_reason": str(reason), "max_restarts": data.settings.max_restarts}
        data = attrs.evolve(data, ctx_size=None)
        return step_with_reason(S.FAILED, data, (Notify("status", "failed: crash_loop"),), ReasonCode.CRASH_LOOP, loop)
    failure = PlanFailure(reason, phase, evidence) if verdict is ExitVerdict.REPLAN else None
    effects = (StartBackoff(crashes), Notify("status", f"crashed: {reason}"))
    return step_with_reason(S.CRASHED, data, effects, reason, evidence, restarts=data.restarts + 1, replan_for=failure)


def exit_step(state: LaunchState, data: LaunchData, event: ServerExited) -> Step:
    """An unasked exit while running: judged from its reason, the phase (the state it died
    in) and the plan."""
    phase = ExitPhase.AFTER_READY if state is S.READY else ExitPhase.NEVER_READY
    verdict = judge_exit(event.reason, phase, data.plan)
    evidence = {**event.evidence, "phase": phase.value, "verdict": verdict.value}
    return crash_step(data, event.reason, evidence, verdict, phase, event.returncode)


def stop_done_step(data: LaunchData, event: StopCompleted | ServerExited | SpawnFailed) -> Step:
    """The process is gone while stopping: go where `after_stop` says."""
    data = attrs.evolve(data, spawning=False)
    returncode = None if isinstance(event, SpawnFailed) else event.returncode
    evidence = {"returncode": returncode, **event.evidence}
    if data.after_stop in (AfterStop.CRASH, AfterStop.HUNG):
        # A stall (only ever before ready) or a hang (only after): respawned like any crash,
        # re-planned only where RPC workers may be what holds it (states/launch/exits.py).
        hung = data.after_stop is AfterStop.HUNG
        phase = ExitPhase.AFTER_READY if hung else ExitPhase.NEVER_READY
        verdict = judge_stall(hung, data.plan)
        evidence = {**data.evidence, **evidence, "phase": phase.value, "verdict": verdict.value}
        reason = data.reason or (ReasonCode.SERVER_HUNG if hung else ReasonCode.SERVER_STALLED)
        return crash_step(data, reason, evidence, verdict, phase, returncode)
    if data.after_stop is AfterStop.RESTART:
        return attrs.evolve(plan_step(data, reset=False), evidence=evidence)
    # Stopped for good: a context a request asked ends with its server (Ollama's too, as it unloads).
    if data.after_stop is AfterStop.FAIL:
        data = attrs.evolve(data, pid=None, create_time=None, after_stop=AfterStop.STOP, ctx_size=None)
        return Step(S.FAILED, data, (Notify("status", f"failed: {data.reason}"),), evidence=evidence)
    data = attrs.evolve(data, pid=None, create_time=None, reason=None, evidence={}, ctx_size=None)
    return Step(S.STOPPED, data, (Notify("status", "stopped"),), evidence=evidence)


def serving_effects(data: LaunchData, text: str) -> tuple[Effect, ...]:
    """What a ready server gets: the Stable timer, the liveness watchdog, READY=1."""
    effects: tuple[Effect, ...] = (ArmStableTimer(data.settings.stable_after),)
    if data.settings.hung_after > 0:
        effects += (WatchLiveness(*liveness_cadence(data.settings.hung_after)),)
    return (*effects, Notify("ready", text))
