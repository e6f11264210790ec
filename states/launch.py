"""The launch machine: one llama-server, from a plan to ready and back, with crash recovery.

    stopped -> planning -> starting -> loading -> ready -> stopping -> stopped
    crashed -> backoff -> starting (or planning when the crash asks for a new plan)
    failed (crash loop, a plan that cannot be made, or a fatal exit) until UpRequested

Timers are effects (`WatchReadiness`, `StartBackoff`, `ArmStableTimer`) whose expiry comes
back as an event. A timer belongs to the state that armed it: the daemon cancels it when the
machine leaves that state, and a late expiry is an illegal event that changes nothing.

`stopping` remembers why it stops in `data.after_stop`: the user's down (-> stopped), a
restart or config change (-> planning), or a stall (-> counted as a crash).
"""

from __future__ import annotations

from typing import Any

import attrs

from states.machine import STAY, Guarded, MachineSpec, Step, guarded
from states.reasons import ReasonCode


from states.launch_records import (  # noqa: F401  (the machine's vocabulary, re-exported)
    Adopted,
    AfterStop,
    ArmStableTimer,
    BackoffElapsed,
    BackoffStarted,
    ConfigChanged,
    DownRequested,
    Effect,
    LaunchData,
    LaunchPlan,
    LaunchSettings,
    LaunchState,
    LoadStarted,
    MakePlan,
    Notify,
    PlanFailed,
    PlanReady,
    Ready,
    Reattach,
    RestartRequested,
    ServerExited,
    Spawn,
    Spawned,
    Stable,
    StallTimeout,
    StartBackoff,
    StopCompleted,
    Terminate,
    UpRequested,
    WatchReadiness,
)


S = LaunchState


# --- handlers ---------------------------------------------------------------------------


def _settings(data: LaunchData, new: LaunchSettings | None) -> LaunchSettings:
    return data.settings if new is None else new


def _plan(data: LaunchData, settings: LaunchSettings | None = None, *, reset: bool) -> Step:
    """Enter planning. A user start resets the crash count and clears the last reason."""
    settings = _settings(data, settings)
    if reset:
        data = attrs.evolve(data, crashes=0, reason=None, evidence={})
    data = attrs.evolve(
        data, settings=settings, pid=None, create_time=None, after_stop=AfterStop.STOP, replan=False
    )
    failure = data.reason if not reset else None
    evidence = data.evidence if failure is not None else {}
    return Step(S.PLANNING, data, (MakePlan(previous=data.plan, failure=failure, failure_evidence=evidence),))


def _stop(data: LaunchData, after: AfterStop, reason: ReasonCode | None = None,
          evidence: dict[str, Any] | None = None) -> Step:
    data = attrs.evolve(data, after_stop=after)
    if reason is not None:
        data = attrs.evolve(data, reason=reason, evidence=evidence or {})
    text = {AfterStop.STOP: "stopping", AfterStop.RESTART: "restarting", AfterStop.CRASH: "stalled"}[after]
    return Step(
        S.STOPPING,
        data,
        (Terminate(data.settings.stop_grace), Notify("status", text)),
        reason,
        evidence or {},
    )


def _crash(data: LaunchData, reason: ReasonCode, evidence: dict[str, Any], *,
           replan: bool = False, fatal: bool = False, returncode: int | None = None) -> Step:
    """Count a crash: back off and retry, or fail for good (fatal exit or crash loop)."""
    crashes = data.crashes + 1
    evidence = {**evidence, "crashes": crashes, "returncode": returncode}
    data = attrs.evolve(data, crashes=crashes, pid=None, create_time=None, replan=replan,
                        after_stop=AfterStop.STOP)
    if fatal:
        data = attrs.evolve(data, reason=reason, evidence=evidence)
        return Step(S.FAILED, data, (Notify("status", f"failed: {reason}"),), reason, evidence)
    if crashes > data.settings.max_restarts:
        loop = {**evidence, "last_reason": str(reason), "max_restarts": data.settings.max_restarts}
        data = attrs.evolve(data, reason=ReasonCode.CRASH_LOOP, evidence=loop)
        return Step(S.FAILED, data, (Notify("status", "failed: crash_loop"),), ReasonCode.CRASH_LOOP, loop)
    data = attrs.evolve(data, reason=reason, evidence=evidence)
    return Step(S.CRASHED, data, (StartBackoff(crashes), Notify("status", f"crashed: {reason}")),
                reason, evidence)


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
def stop_idle(state: S, data: LaunchData, event: Any) -> Step:
    """Nothing runs (planning, crashed, backoff): stopped at once."""
    data = attrs.evolve(data, pid=None, create_time=None, reason=None, evidence={},
                        after_stop=AfterStop.STOP, replan=False)
    return Step(S.STOPPED, data, (Notify("status", "stopped"),))


def _keep(state: S, data: LaunchData, event: Any) -> Step:
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
    data = attrs.evolve(data, plan=event.plan, pid=None, create_time=None)
    return Step(
        S.STARTING,
        data,
        (Spawn(event.plan), WatchReadiness(data.settings.stall_timeout)),
        evidence={"backend": event.plan.backend, "variant": event.plan.variant},
    )


@guarded(S.FAILED)
def plan_failed(state: S, data: LaunchData, event: PlanFailed) -> Step:
    data = attrs.evolve(data, reason=event.reason, evidence=event.evidence)
    return Step(S.FAILED, data, (Notify("status", f"failed: {event.reason}"),), event.reason, event.evidence)


@guarded(S.STARTING)
def spawned(state: S, data: LaunchData, event: Spawned) -> Step:
    data = attrs.evolve(data, pid=event.pid, create_time=event.create_time)
    evidence = {"pid": event.pid}
    if event.log_path:
        evidence["log_path"] = event.log_path
    return Step(S.STARTING, data, evidence=evidence)


@guarded(STAY)
def adopted(state: S, data: LaunchData, event: Adopted) -> Step:
    data = attrs.evolve(data, pid=event.pid, create_time=event.create_time)
    if state is S.READY:
        effects: tuple[Any, ...] = (ArmStableTimer(data.settings.stable_after), Notify("ready", "adopted"))
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
        S.READY,
        data,
        (ArmStableTimer(data.settings.stable_after), Notify("ready", text)),
        evidence=event.evidence,
    )


@guarded(S.READY)
def stable(state: S, data: LaunchData, event: Stable) -> Step:
    return Step(S.READY, attrs.evolve(data, crashes=0), evidence={"crashes_forgotten": data.crashes})


@guarded(S.CRASHED, S.FAILED)
def exited(state: S, data: LaunchData, event: ServerExited) -> Step:
    return _crash(data, event.reason, event.evidence, replan=event.replan, fatal=event.fatal,
                  returncode=event.returncode)


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
        data = attrs.evolve(data, crashes=0)
    return _stop(data, AfterStop.RESTART)


@guarded(S.STOPPING)
def retarget_stop(state: S, data: LaunchData, event: Any) -> Step:
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
        data = attrs.evolve(data, crashes=0)
    elif isinstance(event, UpRequested):
        if after is AfterStop.STOP:
            after = AfterStop.RESTART
            data = attrs.evolve(data, crashes=0)
        data = attrs.evolve(data, settings=_settings(data, event.settings))
    else:  # ConfigChanged
        if after is not AfterStop.STOP:
            after = AfterStop.RESTART
        data = attrs.evolve(data, settings=_settings(data, event.settings))
    return Step(S.STOPPING, attrs.evolve(data, after_stop=after), evidence={"after_stop": after.value})


@guarded(S.STOPPED, S.PLANNING, S.CRASHED, S.FAILED)
def stopped(state: S, data: LaunchData, event: StopCompleted | ServerExited) -> Step:
    """The process is gone while stopping: go where `after_stop` says."""
    evidence = {"returncode": event.returncode, **event.evidence}
    if data.after_stop is AfterStop.CRASH:
        return _crash(data, data.reason or ReasonCode.SERVER_STALLED, {**data.evidence, **evidence},
                      returncode=event.returncode)
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
    if data.replan or data.plan is None:
        data = attrs.evolve(data, replan=False)
        return Step(S.PLANNING, data, (MakePlan(previous=data.plan, failure=data.reason,
                                                failure_evidence=data.evidence if data.reason else {}),))
    return Step(
        S.STARTING,
        attrs.evolve(data, pid=None, create_time=None),
        (Spawn(data.plan), WatchReadiness(data.settings.stall_timeout)),
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

_RUNNING = {
    DownRequested: down,
    RestartRequested: relaunch,
    ConfigChanged: relaunch,
    ServerExited: exited,
    StallTimeout: stall,
}

TRANSITIONS: dict[LaunchState, dict[type, Any]] = {
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
        Adopted: adopted,
        LoadStarted: load_started,
        Ready: ready,
    },
    S.LOADING: {
        **_RUNNING,
        UpRequested: keep,
        Adopted: adopted,
        Ready: ready,
    },
    S.READY: {
        **{k: v for k, v in _RUNNING.items() if k is not StallTimeout},
        UpRequested: keep,
        Adopted: adopted,
        Stable: stable,
    },
    S.STOPPING: {
        StopCompleted: stopped,
        ServerExited: stopped,
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
    description="One llama-server: plan, spawn, load, serve, stop; crash recovery with backoff.",
    effect_types=(MakePlan, Spawn, WatchReadiness, Terminate, StartBackoff, Reattach, ArmStableTimer, Notify),
)


def resume_effects(state: LaunchState, data: LaunchData) -> tuple[Any, ...]:
    """What the daemon must (re)do for a machine loaded from the store after a restart.

    In starting/loading/ready the server may still run (Reattach); stopping re-sends the
    stop, which must also only ever signal a proven process.
    """
    if state is S.PLANNING:
        return (MakePlan(previous=data.plan, failure=data.reason,
                         failure_evidence=data.evidence if data.reason else {}),)
    if state in (S.STARTING, S.LOADING, S.READY):
        return (Reattach(data.pid, data.create_time),)
    if state is S.STOPPING:
        return (Reattach(data.pid, data.create_time), Terminate(data.settings.stop_grace))
    if state in (S.CRASHED, S.BACKOFF):
        return (StartBackoff(max(data.crashes, 1)),)
    return ()
