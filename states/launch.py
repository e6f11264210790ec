"""The launch machine: one llama-server, from a plan to ready and back, with crash recovery.

    stopped -> planning -> starting -> loading -> ready -> stopping -> stopped
    crashed -> backoff -> starting (or planning when the crash asks for a new plan)
    failed (crash loop, a plan that cannot be made, or a fatal exit) until UpRequested

One machine per server instance (its store id is keyed by the instance's name); one runs.

Timers are effects (`WatchReadiness`, `StartBackoff`, `ArmStableTimer`) whose expiry comes
back as an event. A timer belongs to the state that armed it: the daemon cancels it when the
machine leaves that state, and a late expiry is an illegal event that changes nothing.

`stopping` remembers why it stops in `data.after_stop`: the user's down (-> stopped), a
restart or config change (-> planning), or a stall (-> counted as a crash).

An unasked exit (`ServerExited`) carries facts: the exit status and the classified reason.
The exit policy (states/launch_exits.py, `judge_exit`) turns them into a verdict: fatal,
re-plan or respawn; this table acts on it and counts crashes until `max_restarts` makes a
crash loop.
"""

from __future__ import annotations

import enum
import typing
from typing import Any

import attrs

from states.launch_exits import FATAL_EXITS, REPLAN_EXITS, ExitVerdict, judge_exit
from states.launch_records import (
    Adopted,
    AfterStop,
    ArmStableTimer,
    BackoffElapsed,
    BackoffStarted,
    ConfigChanged,
    DownRequested,
    Effect,
    ExitPhase,
    LaunchData,
    LaunchSettings,
    LaunchState,
    LoadStarted,
    MakePlan,
    Notify,
    PlanFailed,
    PlanFailure,
    PlanReady,
    Ready,
    Reattach,
    RestartRequested,
    ServerExited,
    Spawn,
    Spawned,
    SpawnFailed,
    Stable,
    StallTimeout,
    StartBackoff,
    StopCompleted,
    Terminate,
    UpRequested,
    WatchReadiness,
)
from states.machine import STAY, Guarded, MachineSpec, Rule, Step, guarded
from states.reasons import ReasonCode

S = LaunchState

# --- handlers ---------------------------------------------------------------------------


def _settings(data: LaunchData, new: LaunchSettings | None) -> LaunchSettings:
    return data.settings if new is None else new


def _fresh_count(data: LaunchData) -> LaunchData:
    """A start the user asked for: earlier crashes and restarts no longer count."""
    return attrs.evolve(data, crashes=0, restarts=0)


def _plan(data: LaunchData, settings: LaunchSettings | None = None, *, reset: bool) -> Step:
    """Enter planning afresh (a start, restart or config change: no failure to avoid). A
    user start resets the counts and clears the last reason."""
    settings = _settings(data, settings)
    if reset:
        data = attrs.evolve(_fresh_count(data), reason=None, evidence={})
    data = attrs.evolve(data, settings=settings, pid=None, create_time=None, after_stop=AfterStop.STOP, replan_for=None)
    return Step(S.PLANNING, data, (MakePlan(previous=data.plan),))


def _stop(
    data: LaunchData, after: AfterStop, reason: ReasonCode | None = None, evidence: dict[str, Any] | None = None
) -> Step:
    data = attrs.evolve(data, after_stop=after)
    if reason is not None:
        data = attrs.evolve(data, reason=reason, evidence=evidence or {})
    text = {AfterStop.STOP: "stopping", AfterStop.RESTART: "restarting", AfterStop.CRASH: "stalled"}[after]
    return Step(S.STOPPING, data, (Terminate(data.settings.stop_grace), Notify("status", text)), reason, evidence or {})


def _crash(
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
    data = attrs.evolve(data, crashes=crashes, pid=None, create_time=None, replan_for=None, after_stop=AfterStop.STOP)
    if verdict is ExitVerdict.FATAL:
        data = attrs.evolve(data, reason=reason, evidence=evidence)
        return Step(S.FAILED, data, (Notify("status", f"failed: {reason}"),), reason, evidence)
    if crashes > data.settings.max_restarts:
        loop = {**evidence, "last_reason": str(reason), "max_restarts": data.settings.max_restarts}
        data = attrs.evolve(data, reason=ReasonCode.CRASH_LOOP, evidence=loop)
        return Step(S.FAILED, data, (Notify("status", "failed: crash_loop"),), ReasonCode.CRASH_LOOP, loop)
    failure = PlanFailure(reason, phase, evidence) if verdict is ExitVerdict.REPLAN else None
    data = attrs.evolve(data, reason=reason, evidence=evidence, restarts=data.restarts + 1, replan_for=failure)
    return Step(S.CRASHED, data, (StartBackoff(crashes), Notify("status", f"crashed: {reason}")), reason, evidence)


@guarded(S.PLANNING)
def start(state: S, data: LaunchData, event: UpRequested) -> Step:
    return _plan(data, event.settings, reset=True)


@guarded(S.PLANNING)
def restart_now(state: S, data: LaunchData, event: RestartRequested) -> Step:
    return _plan(data, reset=True)


@guarded(S.PLANNING)
def replan_on_config(state: S, data: LaunchData, event: ConfigChanged) -> Step:
    return _plan(data, event.settings, reset=False)


@guarded(S.STOPPED)
def stop_idle(state: S, data: LaunchData, event: DownRequested) -> Step:
    """Nothing runs (planning, crashed, backoff): stopped at once."""
    data = attrs.evolve(
        data, pid=None, create_time=None, reason=None, evidence={}, after_stop=AfterStop.STOP, replan_for=None
    )
    return Step(S.STOPPED, data, (Notify("status", "stopped"),))


def _keep(state: S, data: LaunchData, event: object) -> Step:
    return Step(state, data)


# Idempotent requests (up while already going up, down while stopped): accepted and
# recorded, nothing else happens.
keep = Guarded(_keep, {STAY})


@guarded(STAY)
def new_settings_only(state: S, data: LaunchData, event: ConfigChanged) -> Step:
    """Not running: remember new knobs, launch nothing."""
    return Step(state, attrs.evolve(data, settings=_settings(data, event.settings)))


@guarded(S.STARTING)
def plan_ready(state: S, data: LaunchData, event: PlanReady) -> Step:
    data = attrs.evolve(data, plan=event.plan, pid=None, create_time=None, replan_for=None)
    return Step(
        S.STARTING, data, (Spawn(event.plan),), evidence={"backend": event.plan.backend, "variant": event.plan.variant}
    )


@guarded(S.FAILED)
def plan_failed(state: S, data: LaunchData, event: PlanFailed) -> Step:
    data = attrs.evolve(data, reason=event.reason, evidence=event.evidence, replan_for=None)
    return Step(S.FAILED, data, (Notify("status", f"failed: {event.reason}"),), event.reason, event.evidence)


@guarded(S.STARTING)
def spawned(state: S, data: LaunchData, event: Spawned) -> Step:
    """The process exists: watch it until it is ready."""
    data = attrs.evolve(data, pid=event.pid, create_time=event.create_time)
    evidence: dict[str, Any] = {"pid": event.pid}
    if event.log_path:
        evidence["log_path"] = event.log_path
    return Step(S.STARTING, data, (WatchReadiness(data.settings.stall_timeout),), evidence=evidence)


@guarded(S.FAILED)
def spawn_failed(state: S, data: LaunchData, event: SpawnFailed) -> Step:
    """No process at all: retrying the same binary cannot help."""
    return _crash(data, event.reason, event.evidence, ExitVerdict.FATAL, ExitPhase.NEVER_READY, None)


@guarded(STAY)
def adopted(state: S, data: LaunchData, event: Adopted) -> Step:
    data = attrs.evolve(data, pid=event.pid, create_time=event.create_time)
    if state is S.READY:
        effects: tuple[Effect, ...] = (ArmStableTimer(data.settings.stable_after), Notify("ready", "adopted"))
    else:
        effects = (WatchReadiness(data.settings.stall_timeout),)
    return Step(state, data, effects, evidence={"pid": event.pid, **event.evidence})


@guarded(S.LOADING)
def load_started(state: S, data: LaunchData, event: LoadStarted) -> Step:
    return Step(S.LOADING, data, evidence=event.evidence)


@guarded(S.READY)
def ready(state: S, data: LaunchData, event: Ready) -> Step:
    data = attrs.evolve(data, reason=None, evidence={})
    text = f"ready on {data.plan.backend}" if data.plan else "ready"
    return Step(
        S.READY, data, (ArmStableTimer(data.settings.stable_after), Notify("ready", text)), evidence=event.evidence
    )


@guarded(S.READY)
def stable(state: S, data: LaunchData, event: Stable) -> Step:
    return Step(S.READY, attrs.evolve(data, crashes=0), evidence={"crashes_forgotten": data.crashes})


@guarded(S.CRASHED, S.FAILED)
def exited(state: S, data: LaunchData, event: ServerExited) -> Step:
    """An unasked exit: judged from its reason, the phase (this state) and the plan."""
    phase = ExitPhase.AFTER_READY if state is S.READY else ExitPhase.NEVER_READY
    verdict = judge_exit(event.reason, phase, data.plan)
    evidence = {**event.evidence, "phase": phase.value, "verdict": verdict.value}
    return _crash(data, event.reason, evidence, verdict, phase, event.returncode)


@guarded(S.STOPPING)
def stall(state: S, data: LaunchData, event: StallTimeout) -> Step:
    evidence = {"stall_timeout": data.settings.stall_timeout, "state": state.value}
    return _stop(data, AfterStop.CRASH, ReasonCode.SERVER_STALLED, evidence)


@guarded(S.STOPPING)
def down(state: S, data: LaunchData, event: DownRequested) -> Step:
    return _stop(data, AfterStop.STOP)


@guarded(S.STOPPING)
def relaunch(state: S, data: LaunchData, event: RestartRequested | ConfigChanged) -> Step:
    if isinstance(event, ConfigChanged):
        data = attrs.evolve(data, settings=_settings(data, event.settings))
    else:
        data = _fresh_count(data)
    return _stop(data, AfterStop.RESTART)


@guarded(S.STOPPING)
def retarget_stop(
    state: S, data: LaunchData, event: DownRequested | RestartRequested | UpRequested | ConfigChanged
) -> Step:
    """Already stopping: the newest request decides where it leads.

    Down: stopped. Restart: a fresh start with a clean count. Up: come back up if this was
    a plain stop (a stall already comes back through backoff, counted). Config change:
    re-plan with the new config unless this was a plain stop.
    """
    after = data.after_stop
    if isinstance(event, DownRequested):
        after = AfterStop.STOP
    elif isinstance(event, RestartRequested):
        after = AfterStop.RESTART
        data = _fresh_count(data)
    elif isinstance(event, UpRequested):
        if after is AfterStop.STOP:
            after = AfterStop.RESTART
            data = _fresh_count(data)
        data = attrs.evolve(data, settings=_settings(data, event.settings))
    else:  # ConfigChanged
        if after is not AfterStop.STOP:
            after = AfterStop.RESTART
        data = attrs.evolve(data, settings=_settings(data, event.settings))
    return Step(S.STOPPING, attrs.evolve(data, after_stop=after), evidence={"after_stop": after.value})


@guarded(S.STOPPED, S.PLANNING, S.CRASHED, S.FAILED)
def stopped(state: S, data: LaunchData, event: StopCompleted | ServerExited | SpawnFailed) -> Step:
    """The process is gone while stopping: go where `after_stop` says."""
    returncode = None if isinstance(event, SpawnFailed) else event.returncode
    evidence = {"returncode": returncode, **event.evidence}
    if data.after_stop is AfterStop.CRASH:
        # A stall (only ever before ready): respawned like any crash, never re-planned.
        return _crash(
            data,
            data.reason or ReasonCode.SERVER_STALLED,
            {**data.evidence, **evidence},
            ExitVerdict.RESPAWN,
            ExitPhase.NEVER_READY,
            returncode,
        )
    if data.after_stop is AfterStop.RESTART:
        step_ = _plan(data, reset=False)
        return attrs.evolve(step_, evidence=evidence)
    data = attrs.evolve(data, pid=None, create_time=None, reason=None, evidence={})
    return Step(S.STOPPED, data, (Notify("status", "stopped"),), evidence=evidence)


@guarded(S.BACKOFF)
def backoff_started(state: S, data: LaunchData, event: BackoffStarted) -> Step:
    return Step(S.BACKOFF, data, evidence={"delay": event.delay, "attempt": data.crashes})


@guarded(S.STARTING, S.PLANNING)
def backoff_elapsed(state: S, data: LaunchData, event: BackoffElapsed) -> Step:
    """Come back: a new plan if the crash asked for one (or there is none), else respawn."""
    if data.replan_for is not None or data.plan is None:
        return Step(S.PLANNING, data, (MakePlan(previous=data.plan, failure=data.replan_for),))
    return Step(
        S.STARTING,
        attrs.evolve(data, pid=None, create_time=None),
        (Spawn(data.plan),),
        evidence={"attempt": data.crashes},
    )


@guarded(S.PLANNING)
def retry_now(state: S, data: LaunchData, event: RestartRequested | ConfigChanged) -> Step:
    """Crashed or backing off: a user restart retries at once with a clean count; a config
    change retries at once but keeps the count, so a bad config still ends in crash_loop."""
    if isinstance(event, ConfigChanged):
        return _plan(data, event.settings, reset=False)
    return _plan(data, reset=True)


# --- the table --------------------------------------------------------------------------

_RUNNING: dict[type, Rule] = {
    DownRequested: down,
    RestartRequested: relaunch,
    ConfigChanged: relaunch,
    ServerExited: exited,
    StallTimeout: stall,
}

TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.STOPPED: {
        UpRequested: start,
        RestartRequested: restart_now,
        DownRequested: keep,
        ConfigChanged: new_settings_only,
    },
    S.PLANNING: {
        PlanReady: plan_ready,
        PlanFailed: plan_failed,
        UpRequested: keep,
        DownRequested: stop_idle,
        RestartRequested: restart_now,
        ConfigChanged: replan_on_config,
    },
    S.STARTING: {
        **_RUNNING,
        UpRequested: keep,
        Spawned: spawned,
        SpawnFailed: spawn_failed,
        Adopted: adopted,
        LoadStarted: load_started,
        Ready: ready,
    },
    S.LOADING: {**_RUNNING, UpRequested: keep, Adopted: adopted, Ready: ready},
    S.READY: {
        **{k: v for k, v in _RUNNING.items() if k is not StallTimeout},
        UpRequested: keep,
        Adopted: adopted,
        Stable: stable,
    },
    S.STOPPING: {
        StopCompleted: stopped,
        ServerExited: stopped,
        SpawnFailed: stopped,
        DownRequested: retarget_stop,
        UpRequested: retarget_stop,
        RestartRequested: retarget_stop,
        ConfigChanged: retarget_stop,
    },
    S.CRASHED: {
        BackoffStarted: backoff_started,
        UpRequested: keep,
        DownRequested: stop_idle,
        RestartRequested: retry_now,
        ConfigChanged: retry_now,
    },
    S.BACKOFF: {
        BackoffElapsed: backoff_elapsed,
        BackoffStarted: backoff_started,  # re-armed after a daemon restart
        UpRequested: keep,
        DownRequested: stop_idle,
        RestartRequested: retry_now,
        ConfigChanged: retry_now,
    },
    S.FAILED: {
        UpRequested: start,
        RestartRequested: restart_now,
        DownRequested: keep,
        ConfigChanged: new_settings_only,
    },
}

LAUNCH = MachineSpec(
    name="launch",
    states=LaunchState,
    initial=S.STOPPED,
    data_type=LaunchData,
    transitions=TRANSITIONS,
    terminal={S.STOPPED, S.FAILED},
    description=(
        "One llama-server instance: plan, spawn, load, serve, stop; crash recovery with backoff. "
        "An unasked exit is judged here: "
        + ", ".join(sorted(FATAL_EXITS))
        + " fail at once; "
        + ", ".join(sorted(REPLAN_EXITS))
        + ", or a non-CPU plan that dies before ready, asks for a "
        "new plan; any other exit respawns the same plan, until more than max_restarts crashes in a "
        "row (without Stable) make it crash_loop."
    ),
    effect_types=typing.get_args(Effect),
)


def resume_effects(state: LaunchState, data: LaunchData) -> tuple[Effect, ...]:
    """What the daemon must (re)do for a machine loaded from the store after a restart.

    In starting/loading/ready the server may still run (Reattach); stopping re-sends the
    stop, which must also only ever signal a proven process.
    """
    if state is S.PLANNING:
        return (MakePlan(previous=data.plan, failure=data.replan_for),)
    if state in (S.STARTING, S.LOADING, S.READY):
        return (Reattach(data.pid, data.create_time),)
    if state is S.STOPPING:
        return (Reattach(data.pid, data.create_time), Terminate(data.settings.stop_grace))
    if state in (S.CRASHED, S.BACKOFF):
        return (StartBackoff(max(data.crashes, 1)),)
    return ()
