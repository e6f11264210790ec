"""The launch machine: one llama-server, from a plan to ready and back, with crash recovery.

    stopped -> planning -> starting -> loading -> ready -> stopping -> stopped
    crashed -> backoff -> starting (or planning when the crash asks for a new plan)
    failed (crash loop, a plan that cannot be made, or a fatal exit) until UpRequested

One machine per server instance (its store id is keyed by the instance's name): one per
configured model. `data.down_cause` remembers who stopped a stopped server (the user, an
eviction, the daemon's shutdown): states/fleet/placement.py reads it to decide whether a request may
load the model again.

Timers and watchers are effects (`WatchReadiness`, `StartBackoff`, `ArmStableTimer`,
`WatchLiveness`) whose findings come back as events. A timer belongs to the state that armed it: the daemon cancels it when the
machine leaves that state, and a late expiry is an illegal event that changes nothing.

`stopping` remembers why it stops in `data.after_stop`: the user's down (-> stopped), a
restart or config change (-> planning), a stall or a hang (-> counted as a crash).

One server at a time, whatever the order of requests: a stop asked while a spawn is under way
(`data.spawning`) waits for its answer and then stops what was spawned, never completing
against nothing; every way out of `stopping` is an answer about the process being gone.

At daemon start, before anything else is planned or accepted, the identity file is read
(`Reattach`, the only resume effect): a server it proves (`Adopted`) is kept when it is the
one this machine runs and stopped otherwise; a process of ours it cannot prove
(`OrphanFound`) is stopped; with none (`NothingToAdopt`) the machine resumes where it was.
The file is evidence on its own: a store moved aside or a lost -wal still finds the server.

After ready, a liveness watchdog (`WatchLiveness`) samples the server; states/launch/liveness.py
judges each sample by progress, not wall time, and the table stops a server that showed no
sign of life for `hung_after` seconds (`server_hung`, counted as a crash). While the engine
is silent, `Stable` forgives no crash.

An unasked exit (`ServerExited`) carries facts: the exit status and the classified reason.
The exit policy (states/launch/exits.py, `judge_exit`) turns them into a verdict: fatal,
re-plan or respawn; this table acts on it and counts crashes until `max_restarts` makes a
crash loop.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.launch.adoption import adopted, nothing_adopted, orphan_found
from stoker.states.launch.exits import FATAL_EXITS, REPLAN_EXITS, ExitVerdict
from stoker.states.launch.liveness import is_hung
from stoker.states.launch.steps import (
    ask_plan,
    crash_step,
    exit_step,
    fresh_count,
    plan_step,
    serving_effects,
    settings_of,
    stop_done_step,
    stop_step,
    without_server,
)
from stoker.states.launch.records import (
    Adopted,
    AfterStop,
    ArmStableTimer,
    BackoffElapsed,
    BackoffStarted,
    ConfigChanged,
    ContextRequested,
    DownCause,
    DownRequested,
    Effect,
    EngineAnswered,
    EngineSilent,
    ExitPhase,
    LaunchData,
    LaunchState,
    LoadStarted,
    NothingToAdopt,
    Notify,
    OrphanFound,
    PlanFailed,
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
    StopCompleted,
    Terminate,
    UpRequested,
    WatchReadiness,
)
from stoker.states.machine import STAY, Guarded, MachineSpec, Rule, Step, guarded, step_with_reason
from stoker.states.reasons import ReasonCode

S = LaunchState

# --- handlers ---------------------------------------------------------------------------


@guarded(S.PLANNING)
def start(state: S, data: LaunchData, event: UpRequested) -> Step:
    return plan_step(data, event.settings, reset=True)


@guarded(S.PLANNING)
def restart_now(state: S, data: LaunchData, event: RestartRequested) -> Step:
    return plan_step(data, reset=True)


@guarded(S.PLANNING)
def replan_on_config(state: S, data: LaunchData, event: ConfigChanged) -> Step:
    return plan_step(data, event.settings, reset=False)


@guarded(S.STOPPED)
def stop_idle(state: S, data: LaunchData, event: DownRequested) -> Step:
    """Nothing runs (planning, crashed, backoff): stopped at once."""
    data = without_server(data, reason=None, evidence={}, down_cause=down_cause(data, event), ctx_size=None)
    return Step(S.STOPPED, data, (Notify("status", "stopped"),), evidence=down_evidence(event))


def down_cause(data: LaunchData, event: DownRequested) -> DownCause:
    """Who keeps it stopped now: the user's down always; the daemon's own (an eviction, its
    shutdown) never overrides a stop the user asked for."""
    if event.cause is DownCause.USER or data.down_cause is None:
        return event.cause
    return data.down_cause


def down_evidence(event: DownRequested) -> dict[str, Any]:
    return {"cause": event.cause.value, **event.evidence}


@guarded(STAY)
def down_again(state: S, data: LaunchData, event: DownRequested) -> Step:
    """Already stopped (or failed): nothing runs; only who keeps it down may change."""
    return Step(state, attrs.evolve(data, down_cause=down_cause(data, event)), evidence=down_evidence(event))


def _keep(state: S, data: LaunchData, event: object) -> Step:
    return Step(state, data)


# Idempotent requests (up while already going up, down while stopped): accepted and
# recorded, nothing else happens.
keep = Guarded(_keep, {STAY})


@guarded(STAY)
def remember_context(state: S, data: LaunchData, event: ContextRequested) -> Step:
    """No server runs: the next start plans with the context asked."""
    return Step(state, attrs.evolve(data, ctx_size=event.ctx_size), evidence=event.evidence)


@guarded(S.PLANNING)
def replan_for_context(state: S, data: LaunchData, event: ContextRequested) -> Step:
    """Planning, crashed or backing off: plan again at once with the context asked (the crash
    count kept, as for a config change)."""
    step = plan_step(attrs.evolve(data, ctx_size=event.ctx_size), reset=False)
    return attrs.evolve(step, evidence=event.evidence)


@guarded(S.STOPPING)
def relaunch_for_context(state: S, data: LaunchData, event: ContextRequested) -> Step:
    """A running server with too small a context for a request: a planned restart (drained when
    ready) into a plan with the context asked."""
    data = attrs.evolve(data, ctx_size=event.ctx_size)
    return stop_step(data, AfterStop.RESTART, evidence=event.evidence, drain=state is S.READY)


@guarded(STAY)
def new_settings_only(state: S, data: LaunchData, event: ConfigChanged) -> Step:
    """Not running: remember new knobs, launch nothing."""
    return Step(state, attrs.evolve(data, settings=settings_of(data, event.settings)))


def _stale(data: LaunchData, event: PlanReady | PlanFailed) -> bool:
    """An answer to an older MakePlan than the newest (asked again while it was planned)."""
    return event.request is not None and event.request != data.plan_requests


@guarded(S.STARTING)
def plan_ready(state: S, data: LaunchData, event: PlanReady) -> Step | None:
    if _stale(data, event):
        return None
    data = attrs.evolve(data, plan=event.plan, pid=None, create_time=None, replan_for=None, spawning=True)
    return Step(
        S.STARTING, data, (Spawn(event.plan),), evidence={"backend": event.plan.backend, "variant": event.plan.variant}
    )


@guarded(S.FAILED)
def plan_failed(state: S, data: LaunchData, event: PlanFailed) -> Step | None:
    """No plan: failed with its reason. A context a request asked is dropped with it, so the next
    start (a request loads a model that failed for want of room) plans the config's."""
    if _stale(data, event):
        return None
    effects = (Notify("status", f"failed: {event.reason}"),)
    return step_with_reason(S.FAILED, data, effects, event.reason, event.evidence, replan_for=None, ctx_size=None)


@guarded(STAY)
def spawned(state: S, data: LaunchData, event: Spawned) -> Step:
    """The process exists: watch it until it is ready, or, if a stop came while it was being
    spawned, stop it now."""
    data = attrs.evolve(data, pid=event.pid, create_time=event.create_time, spawning=False)
    evidence: dict[str, Any] = {"pid": event.pid}
    if event.log_path:
        evidence["log_path"] = event.log_path
    if state is S.STOPPING:
        return Step(S.STOPPING, data, (Terminate(data.settings.stop_grace),), evidence=evidence)
    return Step(S.STARTING, data, (WatchReadiness(data.settings.stall_timeout),), evidence=evidence)


@guarded(S.FAILED)
def spawn_failed(state: S, data: LaunchData, event: SpawnFailed) -> Step:
    """No process at all: retrying the same binary cannot help."""
    return crash_step(data, event.reason, event.evidence, ExitVerdict.FATAL, ExitPhase.NEVER_READY, None)


@guarded(S.LOADING)
def load_started(state: S, data: LaunchData, event: LoadStarted) -> Step:
    return Step(S.LOADING, attrs.evolve(data, spawning=False), evidence=event.evidence)


@guarded(S.READY)
def ready(state: S, data: LaunchData, event: Ready) -> Step:
    data = attrs.evolve(data, reason=None, evidence={}, spawning=False, silent=False)
    text = f"ready on {data.plan.backend}" if data.plan else "ready"
    return Step(S.READY, data, serving_effects(data, text), evidence=event.evidence)


@guarded(S.READY)
def stable(state: S, data: LaunchData, event: Stable) -> Step:
    """Ready long enough: earlier crashes are forgotten, unless the engine is silent now."""
    if data.silent:
        return Step(S.READY, data, evidence={"crashes_forgotten": 0, "engine_silent": True})
    return Step(S.READY, attrs.evolve(data, crashes=0), evidence={"crashes_forgotten": data.crashes})


@guarded(S.READY, S.STOPPING)
def engine_silent(state: S, data: LaunchData, event: EngineSilent) -> Step:
    """No sign of life for `silent_for` seconds: hung past `hung_after` (stopped, a snapshot
    attempted, counted as a crash), otherwise remembered so that Stable forgives nothing."""
    evidence = {**event.evidence, "silent_for": event.silent_for, "hung_after": data.settings.hung_after}
    if is_hung(event.silent_for, data.settings.hung_after):
        return stop_step(data, AfterStop.HUNG, ReasonCode.SERVER_HUNG, evidence)
    return Step(S.READY, attrs.evolve(data, silent=True), evidence=evidence)


@guarded(S.READY)
def engine_answered(state: S, data: LaunchData, event: EngineAnswered) -> Step:
    """Signs of life again after a silence: Stable may forgive again, from now."""
    data = attrs.evolve(data, silent=False)
    return Step(S.READY, data, (ArmStableTimer(data.settings.stable_after),), evidence=event.evidence)


@guarded(S.CRASHED, S.FAILED)
def exited(state: S, data: LaunchData, event: ServerExited) -> Step:
    """An unasked exit: judged from its reason, the phase (this state) and the plan."""
    return exit_step(state, data, event)


@guarded(S.STOPPING)
def stall(state: S, data: LaunchData, event: StallTimeout) -> Step:
    evidence = {"stall_timeout": data.settings.stall_timeout, "state": state.value}
    return stop_step(data, AfterStop.CRASH, ReasonCode.SERVER_STALLED, evidence)


# The planned stops (down, restart, config change) of a ready server drain it first: the
# requests in flight through the front door finish, new ones are held meanwhile. A server not
# yet ready has none; a stall or a hang is no planned stop.


# The reason a stop records in history, by who asked for it (None: the user's or the daemon's own).
_DOWN_REASON = {DownCause.EVICTED: ReasonCode.PLACEMENT_EVICTED, DownCause.IDLE: ReasonCode.IDLE_UNLOADED}


@guarded(S.STOPPING)
def down(state: S, data: LaunchData, event: DownRequested) -> Step:
    data = attrs.evolve(data, down_cause=down_cause(data, event))
    reason = _DOWN_REASON.get(event.cause)
    return stop_step(data, AfterStop.STOP, reason, down_evidence(event), drain=state is S.READY)


@guarded(S.STOPPING)
def relaunch(state: S, data: LaunchData, event: RestartRequested | ConfigChanged) -> Step:
    if isinstance(event, ConfigChanged):
        data = attrs.evolve(data, settings=settings_of(data, event.settings))
    else:
        data = fresh_count(data)
    return stop_step(data, AfterStop.RESTART, drain=state is S.READY)


@guarded(S.STOPPING)
def retarget_stop(
    state: S, data: LaunchData, event: DownRequested | RestartRequested | UpRequested | ConfigChanged | ContextRequested
) -> Step:
    """Already stopping: the newest request decides where it leads.

    Down: stopped (or failed, for a server found at start-up while failed). Restart: a fresh
    start with a clean count. Up: come back up if this was going to stay down (a stall or a
    hang already comes back through backoff, counted). Config change, or a request's larger
    context: re-plan with it unless this was going to stay down.
    """
    after = data.after_stop
    idle = after in (AfterStop.STOP, AfterStop.FAIL)  # it was going to stay down
    if isinstance(event, DownRequested):
        after = AfterStop.FAIL if after is AfterStop.FAIL else AfterStop.STOP
        data = attrs.evolve(data, down_cause=down_cause(data, event))
    elif isinstance(event, RestartRequested):
        after = AfterStop.RESTART
        data = fresh_count(data)
    elif isinstance(event, ContextRequested):
        if not idle:
            after = AfterStop.RESTART
        data = attrs.evolve(data, ctx_size=event.ctx_size)
    elif isinstance(event, UpRequested):
        if idle:
            after = AfterStop.RESTART
            data = fresh_count(data)
        data = attrs.evolve(data, settings=settings_of(data, event.settings))
    else:  # ConfigChanged
        if not idle:
            after = AfterStop.RESTART
        data = attrs.evolve(data, settings=settings_of(data, event.settings))
    return Step(S.STOPPING, attrs.evolve(data, after_stop=after), evidence={"after_stop": after.value})


@guarded(S.STOPPED, S.PLANNING, S.CRASHED, S.FAILED)
def stopped(state: S, data: LaunchData, event: StopCompleted | ServerExited | SpawnFailed) -> Step:
    """The process is gone while stopping: go where `after_stop` says."""
    return stop_done_step(data, event)


@guarded(S.BACKOFF)
def backoff_started(state: S, data: LaunchData, event: BackoffStarted) -> Step:
    return Step(S.BACKOFF, data, evidence={"delay": event.delay, "attempt": data.crashes})


@guarded(S.STARTING, S.PLANNING)
def backoff_elapsed(state: S, data: LaunchData, event: BackoffElapsed) -> Step:
    """Come back: a new plan if the crash asked for one (or there is none), else respawn."""
    if data.replan_for is not None or data.plan is None:
        data, ask = ask_plan(data, data.replan_for)
        return Step(S.PLANNING, data, (ask,))
    return Step(
        S.STARTING,
        attrs.evolve(data, pid=None, create_time=None, spawning=True),
        (Spawn(data.plan),),
        evidence={"attempt": data.crashes},
    )


@guarded(S.PLANNING)
def retry_now(state: S, data: LaunchData, event: RestartRequested | ConfigChanged) -> Step:
    """Crashed or backing off: a user restart retries at once with a clean count; a config
    change retries at once but keeps the count, so a bad config still ends in crash_loop."""
    if isinstance(event, ConfigChanged):
        return plan_step(data, event.settings, reset=False)
    return plan_step(data, reset=True)


# --- the table --------------------------------------------------------------------------

_RUNNING: dict[type, Rule] = {
    DownRequested: down,
    RestartRequested: relaunch,
    ConfigChanged: relaunch,
    ContextRequested: relaunch_for_context,
    ServerExited: exited,
    StallTimeout: stall,
}

# At daemon start, before anything else: what the identity file proved (Reattach's answer).
_STOP_FOUND: dict[type, Rule] = {Adopted: adopted.only(S.STOPPING), OrphanFound: orphan_found}
# A crashed server and one waiting out its backoff answer the user alike: a restart, a new config
# or a larger context retries at once, down stops the retry.
_AWAITING_RETRY: dict[type, Rule] = {
    UpRequested: keep,
    DownRequested: stop_idle,
    RestartRequested: retry_now,
    ConfigChanged: retry_now,
    ContextRequested: replan_for_context,
    **_STOP_FOUND,
    NothingToAdopt: nothing_adopted.only(STAY),
}

TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.STOPPED: {
        UpRequested: start,
        RestartRequested: restart_now,
        DownRequested: down_again,
        ConfigChanged: new_settings_only,
        ContextRequested: remember_context,
        **_STOP_FOUND,
    },
    S.PLANNING: {
        PlanReady: plan_ready,
        PlanFailed: plan_failed,
        UpRequested: keep,
        DownRequested: stop_idle,
        RestartRequested: restart_now,
        ConfigChanged: replan_on_config,
        ContextRequested: replan_for_context,
        **_STOP_FOUND,
        NothingToAdopt: nothing_adopted.only(STAY),
    },
    S.STARTING: {
        **_RUNNING,
        UpRequested: keep,
        Spawned: spawned,
        SpawnFailed: spawn_failed,
        LoadStarted: load_started,
        Ready: ready,
        Adopted: adopted,
        OrphanFound: orphan_found,
        NothingToAdopt: nothing_adopted.only(STAY, S.CRASHED, S.FAILED),
    },
    S.LOADING: {
        **_RUNNING,
        UpRequested: keep,
        Ready: ready,
        Adopted: adopted,
        OrphanFound: orphan_found,
        NothingToAdopt: nothing_adopted.only(S.CRASHED, S.FAILED),
    },
    S.READY: {
        **{k: v for k, v in _RUNNING.items() if k is not StallTimeout},
        UpRequested: keep,
        Stable: stable,
        EngineSilent: engine_silent,
        EngineAnswered: engine_answered,
        Adopted: adopted,
        OrphanFound: orphan_found,
        NothingToAdopt: nothing_adopted.only(S.CRASHED, S.FAILED),
    },
    S.STOPPING: {
        StopCompleted: stopped,
        ServerExited: stopped,
        SpawnFailed: stopped,
        Spawned: spawned,  # a stop that came while spawning: now there is a process to stop
        DownRequested: retarget_stop,
        UpRequested: retarget_stop,
        RestartRequested: retarget_stop,
        ConfigChanged: retarget_stop,
        ContextRequested: retarget_stop,
        Adopted: adopted.only(STAY),
        OrphanFound: orphan_found,
        NothingToAdopt: nothing_adopted.only(S.STOPPED, S.PLANNING, S.CRASHED, S.FAILED),
    },
    S.CRASHED: {BackoffStarted: backoff_started, **_AWAITING_RETRY},
    S.BACKOFF: {
        BackoffElapsed: backoff_elapsed,
        BackoffStarted: backoff_started,  # re-armed after a daemon restart
        **_AWAITING_RETRY,
    },
    S.FAILED: {
        UpRequested: start,
        RestartRequested: restart_now,
        DownRequested: down_again,
        ConfigChanged: new_settings_only,
        ContextRequested: remember_context,
        **_STOP_FOUND,
    },
}

LAUNCH = MachineSpec(
    name="launch",
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
    effect_types=Effect,
)


def resume_effects(state: LaunchState, data: LaunchData) -> tuple[Effect, ...]:
    """What the daemon does first when it starts, whatever the store holds (a fresh machine
    too: the store may have been moved aside): read the identity file. Its answer (Adopted,
    OrphanFound, NothingToAdopt) is what resumes the machine, so nothing is planned, spawned
    or stopped before the server that outlived the last daemon is accounted for.
    """
    return (Reattach(data.pid, data.create_time),)
