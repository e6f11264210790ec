"""The launch machine's table, driven directly: no daemon, no store, no clock."""

from __future__ import annotations

import attrs
import pytest

from stoker.states.launch.table import LAUNCH, resume_effects
from stoker.states.launch.exits import ExitVerdict, judge_exit, judge_stall
from stoker.states.launch.records import (
    Adopted,
    AfterStop,
    ArmStableTimer,
    BackoffElapsed,
    BackoffStarted,
    ConfigChanged,
    DownRequested,
    ExitPhase,
    LaunchData,
    LaunchPlan,
    LaunchSettings,
    EngineAnswered,
    EngineSilent,
    LaunchState as S,
    LoadStarted,
    MakePlan,
    NothingToAdopt,
    Notify,
    OrphanFound,
    PlanFailed,
    PlanFailure,
    PlanReady,
    Ready,
    Reattach,
    RestartRequested,
    ServerExited,
    Spawn,
    SpawnFailed,
    Spawned,
    Stable,
    StallTimeout,
    StartBackoff,
    StopCompleted,
    Terminate,
    UpRequested,
    WatchLiveness,
    WatchReadiness,
)
from stoker.states.machine import IllegalTransition, step
from stoker.states.reasons import ReasonCode

PLAN = LaunchPlan("cpu", "x86-64-v3", "/b", "/b/llama-server", "/m.gguf", port=8099)
GPU_PLAN = LaunchPlan("cuda", "avx2", "/c", "/c/llama-server", "/m.gguf", n_gpu_layers="auto")


def drive(*events, state=S.STOPPED, data=None):
    data = LaunchData() if data is None else data
    result = None
    for event in events:
        result = step(LAUNCH, state, data, event)
        state, data = result.state, result.data
    return result


def running(*more, settings=LaunchSettings(), plan=PLAN):
    return drive(UpRequested(settings), PlanReady(plan), Spawned(42, 1.5), LoadStarted(), Ready({"layers": 0}), *more)


def test_happy_path_and_effects():
    s = drive(UpRequested())
    assert s.state is S.PLANNING and s.effects == (MakePlan(request=1),)
    s = drive(UpRequested(), PlanReady(PLAN))
    assert s.state is S.STARTING
    assert s.effects == (Spawn(PLAN),)
    assert s.data.plan == PLAN
    s = drive(UpRequested(), PlanReady(PLAN), Spawned(42, 1.5))
    assert (s.state, s.data.pid, s.data.create_time) == (S.STARTING, 42, 1.5)
    assert s.effects == (WatchReadiness(120.0),)  # the process exists: watch it
    s = running()
    assert s.state is S.READY
    assert s.effects == (ArmStableTimer(60.0), WatchLiveness(5.0, 5.0), Notify("ready", "ready on cpu"))
    assert s.evidence == {"layers": 0}
    s = running(DownRequested())
    assert s.state is S.STOPPING and s.effects[0] == Terminate(10.0, 30.0)  # drained first
    s = running(DownRequested(), StopCompleted(0))
    assert s.state is S.STOPPED and s.data.pid is None


def test_ready_straight_from_starting():
    s = drive(UpRequested(), PlanReady(PLAN), Spawned(1), Ready())
    assert s.state is S.READY


def test_crash_backs_off_and_respawns_same_plan():
    s = running(ServerExited(-9, evidence={"signal": 9}))
    assert s.state is S.CRASHED
    assert s.reason is ReasonCode.SERVER_CRASHED
    assert s.effects[0] == StartBackoff(1)
    assert s.data.crashes == 1 and s.evidence["signal"] == 9
    s = running(ServerExited(-9), BackoffStarted(0.7))
    assert s.state is S.BACKOFF and s.evidence == {"delay": 0.7, "attempt": 1}
    s = running(ServerExited(-9), BackoffStarted(0.7), BackoffElapsed())
    assert s.state is S.STARTING and s.effects == (Spawn(PLAN),)
    assert s.evidence["attempt"] == 1


def test_sigill_asks_for_a_new_plan_that_knows_why():
    s = running(ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION, {"signal": "SIGILL"}))
    assert s.state is S.CRASHED and s.evidence["verdict"] == "replan" and s.evidence["phase"] == "after_ready"
    s = drive(BackoffStarted(0.1), BackoffElapsed(), state=s.state, data=s.data)
    assert s.state is S.PLANNING
    (effect,) = s.effects
    assert effect.previous == PLAN and effect.failure.reason is ReasonCode.CPU_ILLEGAL_INSTRUCTION
    assert effect.failure.phase is ExitPhase.AFTER_READY and effect.failure.evidence["signal"] == "SIGILL"
    # the new plan is spawned; nothing of the old failure is left over for the next one
    s = drive(PlanReady(PLAN), state=s.state, data=s.data)
    assert s.state is S.STARTING and s.data.replan_for is None


def test_a_gpu_server_that_never_got_ready_asks_for_a_new_plan():
    evidence = {"returncode": 127, "line": "error while loading shared libraries: libggml-cuda.so.0: cannot open"}
    s = drive(
        UpRequested(),
        PlanReady(GPU_PLAN),
        Spawned(7),
        LoadStarted(),
        ServerExited(127, evidence=evidence),
        BackoffStarted(0.1),
        BackoffElapsed(),
    )
    assert s.state is S.PLANNING
    (effect,) = s.effects
    assert effect.previous == GPU_PLAN
    assert effect.failure.reason is ReasonCode.SERVER_CRASHED and effect.failure.phase is ExitPhase.NEVER_READY
    assert effect.failure.evidence["line"] == evidence["line"] and effect.failure.evidence["returncode"] == 127


def test_a_gpu_server_that_crashes_after_ready_is_respawned_with_its_plan():
    s = running(ServerExited(-11), BackoffStarted(0.1), BackoffElapsed(), plan=GPU_PLAN)
    assert s.state is S.STARTING and s.effects == (Spawn(GPU_PLAN),)


def test_a_cpu_server_that_never_got_ready_is_respawned():
    s = drive(UpRequested(), PlanReady(PLAN), Spawned(7), ServerExited(-9), BackoffStarted(0.1), BackoffElapsed())
    assert s.state is S.STARTING and s.effects == (Spawn(PLAN),)


@pytest.mark.parametrize(
    "reason, phase, plan, verdict",
    [
        (ReasonCode.MODEL_MISSING, ExitPhase.NEVER_READY, PLAN, ExitVerdict.FATAL),
        (ReasonCode.MODEL_LOAD_FAILED, ExitPhase.NEVER_READY, GPU_PLAN, ExitVerdict.FATAL),
        (ReasonCode.SERVER_BAD_ARGUMENTS, ExitPhase.AFTER_READY, PLAN, ExitVerdict.FATAL),
        (ReasonCode.CPU_ILLEGAL_INSTRUCTION, ExitPhase.AFTER_READY, PLAN, ExitVerdict.REPLAN),
        (ReasonCode.CPU_ILLEGAL_INSTRUCTION, ExitPhase.NEVER_READY, PLAN, ExitVerdict.REPLAN),
        (ReasonCode.SERVER_CRASHED, ExitPhase.NEVER_READY, GPU_PLAN, ExitVerdict.REPLAN),
        (ReasonCode.OUT_OF_MEMORY, ExitPhase.NEVER_READY, GPU_PLAN, ExitVerdict.REPLAN),
        (ReasonCode.SERVER_CRASHED, ExitPhase.AFTER_READY, GPU_PLAN, ExitVerdict.RESPAWN),
        (ReasonCode.SERVER_CRASHED, ExitPhase.NEVER_READY, PLAN, ExitVerdict.RESPAWN),
        (ReasonCode.PORT_IN_USE, ExitPhase.NEVER_READY, PLAN, ExitVerdict.RESPAWN),
        (ReasonCode.SERVER_CRASHED, ExitPhase.NEVER_READY, None, ExitVerdict.RESPAWN),
    ],
)
def test_the_exit_policy(reason, phase, plan, verdict):
    assert judge_exit(reason, phase, plan) is verdict


def test_a_stall_is_re_planned_only_where_rpc_workers_may_hold_the_engine():
    """A server silent before it reads the model: respawned on the same plan, unless that plan
    places layers on RPC workers (one busy with another head holds the engine: the new plan
    reads the workers again and leaves a busy one out)."""
    from stoker.states.fleet.rpc_placement import PlacedWorker, RpcPlacement

    over_worker = attrs.evolve(
        PLAN, rpc=RpcPlacement("7.0.0", (PlacedWorker("127.0.0.1:50052", "7.0.0", ("RPC0",), (1024,)),), (), (1.0,))
    )
    verdicts = {}
    for name, plan in (("local", PLAN), ("workers", over_worker)):
        s = drive(UpRequested(), PlanReady(plan), Spawned(7), StallTimeout())
        assert s.state is S.STOPPING and s.reason is ReasonCode.SERVER_STALLED
        s = drive(StopCompleted(-15), state=s.state, data=s.data)
        assert s.state is S.CRASHED
        verdicts[name] = (s.evidence["verdict"], s.data.replan_for is not None)
    assert verdicts == {"local": ("respawn", False), "workers": ("replan", True)}
    assert judge_stall(hung=True, plan=over_worker) is ExitVerdict.RESPAWN  # a hang after ready: the plan worked


@pytest.mark.parametrize("reason", [ReasonCode.MODEL_LOAD_FAILED, ReasonCode.SERVER_BAD_ARGUMENTS])
def test_fatal_exit_fails_at_once(reason):
    s = drive(UpRequested(), PlanReady(PLAN), ServerExited(1, reason))
    assert s.state is S.FAILED and s.reason is reason and s.evidence["verdict"] == "fatal"


def test_a_binary_that_cannot_start_fails_at_once():
    s = drive(UpRequested(), PlanReady(PLAN), SpawnFailed(ReasonCode.SERVER_SPAWN_FAILED, {"errno": 8}))
    assert s.state is S.FAILED and s.reason is ReasonCode.SERVER_SPAWN_FAILED and s.data.evidence["errno"] == 8
    # asked to stop while spawning: the failed spawn completes the stop
    s = drive(UpRequested(), PlanReady(PLAN), DownRequested(), SpawnFailed())
    assert s.state is S.STOPPED


@pytest.mark.parametrize("max_restarts", [0, 1, 3])
def test_crash_loop_after_max_restarts(max_restarts):
    settings = LaunchSettings(max_restarts=max_restarts)
    s = drive(UpRequested(settings), PlanReady(PLAN))
    for attempt in range(1, max_restarts + 1):
        s = drive(ServerExited(1, ReasonCode.OUT_OF_MEMORY), state=s.state, data=s.data)
        assert s.state is S.CRASHED and s.effects[0] == StartBackoff(attempt)
        s = drive(BackoffStarted(0.1), BackoffElapsed(), state=s.state, data=s.data)
        assert s.state is S.STARTING
    s = drive(ServerExited(1, ReasonCode.OUT_OF_MEMORY), state=s.state, data=s.data)
    assert s.state is S.FAILED and s.reason is ReasonCode.CRASH_LOOP
    assert s.evidence["last_reason"] == "out_of_memory"
    assert s.data.reason is ReasonCode.CRASH_LOOP
    # failed stays failed until the user starts it again
    for event in (DownRequested(), ConfigChanged()):
        s = drive(event, state=s.state, data=s.data)
        assert s.state is S.FAILED
    for event in (BackoffElapsed(), Ready(), StallTimeout(), Stable()):
        with pytest.raises(IllegalTransition):
            step(LAUNCH, s.state, s.data, event)
    s = drive(UpRequested(), state=s.state, data=s.data)
    assert s.state is S.PLANNING and s.data.crashes == 0 and s.data.reason is None


def test_stable_resets_crash_counter():
    settings = LaunchSettings(max_restarts=1)
    s = running(ServerExited(1), BackoffStarted(0), BackoffElapsed(), Spawned(2), Ready(), settings=settings)
    assert s.data.crashes == 1
    s2 = drive(ServerExited(1), state=s.state, data=s.data)
    assert s2.state is S.FAILED  # a second crash without Stable is a loop
    s = drive(Stable(), state=s.state, data=s.data)
    assert s.data.crashes == 0 and s.evidence == {"crashes_forgotten": 1}
    s = drive(ServerExited(1), state=s.state, data=s.data)
    assert s.state is S.CRASHED


def test_restarts_count_every_restart_since_the_user_started_it():
    s = running(ServerExited(-9), BackoffStarted(0), BackoffElapsed(), Spawned(2), Ready(), Stable(), ServerExited(-9))
    assert s.data.restarts == 2 and s.data.crashes == 1  # Stable forgets crashes, not restarts
    s = drive(RestartRequested(), state=s.state, data=s.data)
    assert s.data.restarts == 0
    s = running(ServerExited(-9), BackoffStarted(0), BackoffElapsed(), Spawned(2), Ready(), RestartRequested())
    assert s.data.restarts == 0
    s = running(ServerExited(1, ReasonCode.MODEL_LOAD_FAILED))
    assert s.state is S.FAILED and s.data.restarts == 0  # failed: no restart followed


@pytest.mark.parametrize(
    "prefix",
    [
        (UpRequested(),),  # planning
        (UpRequested(), PlanReady(PLAN)),  # starting
        (UpRequested(), PlanReady(PLAN), Spawned(3), LoadStarted()),  # loading
        (UpRequested(), PlanReady(PLAN), Spawned(3), ServerExited(1)),  # crashed
        (UpRequested(), PlanReady(PLAN), Spawned(3), ServerExited(1), BackoffStarted(2.0)),  # backoff
    ],
)
def test_stop_works_from_every_transient_state(prefix):
    s = drive(*prefix, DownRequested())
    if s.state is S.STOPPING and s.data.spawning:
        # A spawn is under way: nothing to signal until it answers, then what it spawned.
        assert not any(isinstance(e, Terminate) for e in s.effects)
        s = drive(Spawned(3), state=s.state, data=s.data)
    if s.state is S.STOPPING:
        assert isinstance(s.effects[0], Terminate)
        s = drive(StopCompleted(0), state=s.state, data=s.data)
    assert s.state is S.STOPPED
    assert s.data.reason is None


def test_stall_stops_then_counts_as_crash():
    s = drive(UpRequested(), PlanReady(PLAN), Spawned(5), LoadStarted(), StallTimeout())
    assert s.state is S.STOPPING and s.reason is ReasonCode.SERVER_STALLED
    assert s.data.after_stop is AfterStop.CRASH
    s = drive(StopCompleted(-15), state=s.state, data=s.data)
    assert s.state is S.CRASHED and s.reason is ReasonCode.SERVER_STALLED and s.data.crashes == 1


def test_stall_then_user_down_just_stops():
    s = drive(UpRequested(), PlanReady(PLAN), StallTimeout(), DownRequested(), StopCompleted(0))
    assert s.state is S.STOPPED and s.data.crashes == 0


def test_restart_and_config_change_relaunch():
    s = running(RestartRequested())
    assert s.state is S.STOPPING and s.data.after_stop is AfterStop.RESTART
    s = drive(StopCompleted(0), state=s.state, data=s.data)
    assert s.state is S.PLANNING and s.effects == (MakePlan(previous=PLAN, request=2),)
    # a config change after a crash that asked for a new plan is a fresh plan, not a retry
    s = running(ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION), ConfigChanged())
    assert s.state is S.PLANNING and s.effects == (MakePlan(previous=PLAN, request=2),)
    new = LaunchSettings(stall_timeout=5.0)
    s = running(ConfigChanged(new), ServerExited(0))  # exit while stopping = stop completed
    assert s.state is S.PLANNING and s.data.settings == new


def test_up_while_stopping_comes_back():
    s = running(DownRequested(), UpRequested(), StopCompleted(0))
    assert s.state is S.PLANNING
    s = running(RestartRequested(), DownRequested(), StopCompleted(0))
    assert s.state is S.STOPPED


def test_only_the_newest_plan_request_is_answered():
    """A restart or config change while a plan is made asks again; the older answer (made
    from the older config) is refused, the newest is spawned."""
    new = LaunchSettings(stall_timeout=5.0)
    s = drive(UpRequested(), ConfigChanged(new), RestartRequested())
    assert s.state is S.PLANNING and s.effects == (MakePlan(request=3),) and s.data.plan_requests == 3
    for old in (
        PlanReady(PLAN, request=1),
        PlanReady(PLAN, request=2),
        PlanFailed(ReasonCode.MODEL_MISSING, request=2),
    ):
        with pytest.raises(IllegalTransition):
            step(LAUNCH, s.state, s.data, old)
    s = drive(PlanReady(GPU_PLAN, request=3), state=s.state, data=s.data)
    assert s.state is S.STARTING and s.effects == (Spawn(GPU_PLAN),)


def test_plan_failed_is_failed_with_its_reason():
    s = drive(UpRequested(), PlanFailed(ReasonCode.MODEL_MISSING, {"path": "/nope"}))
    assert s.state is S.FAILED and s.reason is ReasonCode.MODEL_MISSING
    assert s.data.evidence == {"path": "/nope"}


def test_config_change_when_not_running_only_updates_settings():
    new = LaunchSettings(max_restarts=9)
    s = drive(ConfigChanged(new))
    assert s.state is S.STOPPED and s.effects == () and s.data.settings == new


def test_illegal_events_raise_and_say_so():
    with pytest.raises(IllegalTransition) as info:
        step(LAUNCH, S.STOPPED, LaunchData(), Ready())
    assert info.value.reason is ReasonCode.ILLEGAL_TRANSITION
    assert "Ready" in str(info.value) and "stopped" in str(info.value)
    s = running()
    for event in (StallTimeout(), PlanReady(PLAN), BackoffElapsed(), StopCompleted()):
        with pytest.raises(IllegalTransition):
            step(LAUNCH, s.state, s.data, event)


def test_adopt_after_daemon_restart():
    s = running()
    assert resume_effects(s.state, s.data) == (Reattach(42, 1.5),)
    s = drive(Adopted(42, 1.5, {"proof": "api_key"}), state=s.state, data=s.data)
    assert s.state is S.READY and isinstance(s.effects[0], ArmStableTimer)
    s = drive(UpRequested(), PlanReady(PLAN), Spawned(7))
    s = drive(Adopted(7, 2.0), state=s.state, data=s.data)
    assert s.state is S.STARTING and s.effects == (WatchReadiness(120.0),)


def test_resume_effects_per_state():
    """At daemon start the identity file is read first, in every state; its answer resumes."""
    data = LaunchData(plan=PLAN, crashes=2, pid=9)
    for state in S:
        assert resume_effects(state, data) == (Reattach(9, None),)
    assert resume_effects(S.STOPPED, LaunchData()) == (Reattach(None, None),)  # a fresh store too
    nothing = NothingToAdopt({"adoption": "no identity file"})
    assert drive(nothing, state=S.PLANNING, data=data).effects == (MakePlan(previous=PLAN, request=1),)
    failure = PlanFailure(ReasonCode.CPU_ILLEGAL_INSTRUCTION, ExitPhase.NEVER_READY, {"signal": "SIGILL"})
    replanning = LaunchData(plan=PLAN, crashes=1, replan_for=failure)
    again = drive(nothing, state=S.PLANNING, data=replanning).effects
    assert again == (MakePlan(previous=PLAN, failure=failure, request=1),)
    assert drive(nothing, state=S.CRASHED, data=data).effects == (StartBackoff(2),)
    assert drive(nothing, state=S.BACKOFF, data=data).effects == (StartBackoff(2),)
    assert drive(nothing, state=S.STOPPING, data=data).state is S.STOPPED
    for state in (S.STOPPED, S.FAILED):  # nothing to resume, nothing recorded
        with pytest.raises(IllegalTransition):
            step(LAUNCH, state, data, nothing)
    gone = drive(nothing, state=S.READY, data=data)  # the server it ran is gone: its exit
    assert gone.state is S.CRASHED and gone.reason is ReasonCode.SERVER_CRASHED
    spawning = LaunchData(plan=PLAN, spawning=True)  # died mid-spawn: nothing ran, spawn again
    again = drive(nothing, state=S.STARTING, data=spawning)
    assert again.state is S.STARTING and again.effects == (Spawn(PLAN),) and again.data.crashes == 0
    # backoff re-armed after a restart is accepted where it was left
    assert step(LAUNCH, S.BACKOFF, data, BackoffStarted(1.0)).state is S.BACKOFF


# --- killed while stopping; the identity file is evidence on its own -----------------------


def test_resume_while_stopping_proves_the_server_before_it_stops_it():
    """Restart recorded, daemon killed before its TERM: the stop waits for the proof, then
    stops what was proven, and only then plans."""
    s = running(RestartRequested())
    assert resume_effects(s.state, s.data) == (Reattach(42, 1.5),)  # no Terminate racing it
    s = drive(Adopted(42, 1.5, {"port": 8099}), state=s.state, data=s.data)
    assert s.state is S.STOPPING and s.effects[0] == Terminate(10.0) and s.data.pid == 42
    assert s.evidence["kept"] is False and s.evidence["after_stop"] == "restart"
    s = drive(StopCompleted(-15), state=s.state, data=s.data)
    assert s.state is S.PLANNING and s.effects == (MakePlan(previous=PLAN, request=2),)
    # after a down, the same, then stopped
    s = running(DownRequested(), Adopted(42, 1.5), StopCompleted(-15))
    assert s.state is S.STOPPED


@pytest.mark.parametrize(
    "prefix,after",
    [
        ((), "stop"),  # a fresh machine: the store was moved aside
        ((UpRequested(),), "restart"),  # planning
        ((UpRequested(), PlanReady(PLAN), Spawned(3), ServerExited(1)), "restart"),  # crashed
        ((UpRequested(), PlanReady(PLAN), Spawned(3), ServerExited(1), BackoffStarted(1.0)), "restart"),
        ((UpRequested(), PlanReady(PLAN), Spawned(3), Ready()), "restart"),  # ready, but another pid
    ],
)
def test_a_server_the_machine_does_not_run_is_stopped_before_anything_else(prefix, after):
    s = drive(*prefix) if prefix else None
    state, data = (s.state, s.data) if s else (S.STOPPED, LaunchData())
    for found in (Adopted(77, 9.0, {"port": 1}), OrphanFound(77, 9.0, {"health": "timeout"})):
        s = drive(found, state=state, data=data)
        assert s.state is S.STOPPING and s.effects[0] == Terminate(10.0)
        assert (s.data.pid, s.data.create_time, s.data.after_stop.value) == (77, 9.0, after)
        done = drive(StopCompleted(-15), state=s.state, data=s.data)
        assert done.state is (S.STOPPED if after == "stop" else S.PLANNING)
    # The daemon's autostart after a fresh store: up while that stop runs comes back up.
    s = drive(Adopted(77, 9.0), UpRequested(), StopCompleted(-15))
    assert s.state is S.PLANNING


def test_a_server_found_while_failed_is_stopped_and_the_failure_stays():
    failed = drive(UpRequested(), PlanFailed(ReasonCode.MODEL_MISSING, {"path": "/nope"}))
    s = drive(Adopted(77, 9.0), state=failed.state, data=failed.data)
    assert s.state is S.STOPPING and s.data.after_stop is AfterStop.FAIL
    s = drive(StopCompleted(-15), state=s.state, data=s.data)
    assert s.state is S.FAILED and s.data.reason is ReasonCode.MODEL_MISSING and s.data.pid is None
    s = drive(Adopted(77, 9.0), DownRequested(), StopCompleted(-15), state=failed.state, data=failed.data)
    assert s.state is S.FAILED
    s = drive(Adopted(77, 9.0), UpRequested(), StopCompleted(-15), state=failed.state, data=failed.data)
    assert s.state is S.PLANNING


def test_the_running_server_is_kept_and_an_unproven_one_is_stopped():
    s = running()
    kept = drive(Adopted(42, 1.5), state=s.state, data=s.data)
    assert kept.state is S.READY and kept.evidence["kept"] is True
    unproven = drive(OrphanFound(42, 1.5), state=s.state, data=s.data)
    assert unproven.state is S.STOPPING and unproven.data.after_stop is AfterStop.RESTART
    # the spawn under way when the daemon died: its server is the machine's
    spawning = drive(UpRequested(), PlanReady(PLAN))
    s = drive(Adopted(5, 2.0), state=spawning.state, data=spawning.data)
    assert s.state is S.STARTING and s.effects == (WatchReadiness(120.0),) and not s.data.spawning


# --- a stop while a spawn is under way ------------------------------------------------------


def test_a_stop_while_spawning_waits_for_the_spawn_and_stops_what_it_spawned():
    s = drive(UpRequested(), PlanReady(PLAN), DownRequested())
    assert s.state is S.STOPPING and s.data.spawning
    assert not any(isinstance(e, Terminate) for e in s.effects)  # nothing to signal yet
    s = drive(Spawned(7, 2.0), state=s.state, data=s.data)
    assert s.state is S.STOPPING and s.effects == (Terminate(10.0),) and s.data.pid == 7
    assert drive(StopCompleted(-15), state=s.state, data=s.data).state is S.STOPPED
    # a restart, twice, while spawning: still one stop of what was spawned, then a plan
    s = drive(UpRequested(), PlanReady(PLAN), RestartRequested(), RestartRequested(), Spawned(7), StopCompleted(0))
    assert s.state is S.PLANNING and s.effects == (MakePlan(previous=PLAN, request=2),)
    # nothing was spawned after all
    s = drive(UpRequested(), PlanReady(PLAN), DownRequested(), SpawnFailed())
    assert s.state is S.STOPPED and not s.data.spawning
    # the respawn after a backoff is a spawn under way too
    s = running(ServerExited(-9), BackoffStarted(0.1), BackoffElapsed(), DownRequested())
    assert s.data.spawning and not any(isinstance(e, Terminate) for e in s.effects)


# --- a hung engine -------------------------------------------------------------------------


def test_a_silent_engine_is_hung_after_hung_after_and_counted_as_a_crash():
    settings = LaunchSettings(hung_after=12.0)
    s = running(settings=settings)
    assert WatchLiveness(3.0, 3.0) in s.effects
    s = drive(EngineSilent(3.0, {"health": "timeout"}), state=s.state, data=s.data)
    assert s.state is S.READY and s.data.silent and s.effects == ()
    s = drive(EngineSilent(12.5, {"health": "timeout", "process": "stopped"}), state=s.state, data=s.data)
    assert s.state is S.STOPPING and s.reason is ReasonCode.SERVER_HUNG
    assert s.data.after_stop is AfterStop.HUNG and s.effects[0] == Terminate(10.0)
    assert s.evidence["silent_for"] == 12.5 and s.evidence["process"] == "stopped"
    s = drive(StopCompleted(-9), state=s.state, data=s.data)
    assert s.state is S.CRASHED and s.reason is ReasonCode.SERVER_HUNG and s.data.crashes == 1
    assert s.effects[0] == StartBackoff(1) and s.evidence["phase"] == "after_ready"
    s = drive(BackoffStarted(0.1), BackoffElapsed(), state=s.state, data=s.data)
    assert s.state is S.STARTING and s.effects == (Spawn(PLAN),)  # the same plan: it worked


def test_stable_forgives_nothing_while_the_engine_is_silent():
    s = running(ServerExited(-9), BackoffStarted(0.1), BackoffElapsed(), Spawned(43), Ready())
    assert s.data.crashes == 1
    s = drive(EngineSilent(5.0), Stable(), state=s.state, data=s.data)
    assert s.data.crashes == 1 and s.evidence["engine_silent"] is True
    s = drive(EngineAnswered({"health": "ok"}), state=s.state, data=s.data)
    assert s.effects == (ArmStableTimer(60.0),) and not s.data.silent
    assert drive(Stable(), state=s.state, data=s.data).data.crashes == 0


def test_an_engine_that_hangs_at_every_start_ends_in_crash_loop():
    """Stable comes while it is already silent: it forgives nothing, so the hangs add up."""
    settings = LaunchSettings(hung_after=10.0, max_restarts=2)
    s = running(settings=settings)
    for n in range(3):
        s = drive(EngineSilent(3.0), Stable(), EngineSilent(11.0), StopCompleted(-9), state=s.state, data=s.data)
        if s.state is S.FAILED:
            break
        s = drive(BackoffStarted(0.1), BackoffElapsed(), Spawned(50 + n), Ready(), state=s.state, data=s.data)
    assert s.state is S.FAILED and s.reason is ReasonCode.CRASH_LOOP
    assert s.evidence["last_reason"] == "server_hung"


def test_no_watchdog_when_hung_after_is_zero():
    s = running(settings=LaunchSettings(hung_after=0.0))
    assert not any(isinstance(e, WatchLiveness) for e in s.effects)
    s = drive(EngineSilent(10_000.0), state=s.state, data=s.data)
    assert s.state is S.READY


def test_every_state_is_reachable_and_has_a_row():
    assert LAUNCH.reachable() == set(S)
    assert set(LAUNCH.transitions) == set(S)


def test_requests_while_stopping_after_a_stall():
    stalled = drive(UpRequested(), PlanReady(PLAN), Spawned(5), StallTimeout())
    up = drive(UpRequested(), StopCompleted(-15), state=stalled.state, data=stalled.data)
    assert up.state is S.CRASHED and up.data.crashes == 1  # still counted: it comes back via backoff
    restart = drive(RestartRequested(), StopCompleted(-15), state=stalled.state, data=stalled.data)
    assert restart.state is S.PLANNING and restart.data.crashes == 0
    config = drive(ConfigChanged(), StopCompleted(-15), state=stalled.state, data=stalled.data)
    assert config.state is S.PLANNING
    plain = drive(UpRequested(), PlanReady(PLAN), DownRequested(), ConfigChanged(), StopCompleted(0))
    assert plain.state is S.STOPPED


# --- a planned stop lets the front door's requests in flight finish ---------------


@pytest.mark.parametrize("request_", [DownRequested(), RestartRequested(), ConfigChanged()])
def test_a_planned_stop_of_a_ready_server_drains_it_before_the_term(request_):
    """llama-server given TERM with a request in flight hangs until the KILL after stop_grace,
    cutting the stream; a planned stop of a ready server waits for the requests in flight."""
    settings = LaunchSettings(stop_grace=3.0, drain_timeout=20.0)
    s = running(request_, settings=settings)
    assert s.state is S.STOPPING and s.effects[0] == Terminate(3.0, drain=20.0)
    # Not ready yet: nothing was sent to it, nothing to wait for.
    s = drive(UpRequested(settings), PlanReady(PLAN), Spawned(42, 1.5), LoadStarted(), request_)
    assert s.state is S.STOPPING and s.effects[0] == Terminate(3.0, drain=0.0)


def test_a_hung_or_found_server_is_stopped_without_draining():
    settings = LaunchSettings(stop_grace=3.0, hung_after=12.0, drain_timeout=20.0)
    s = running(EngineSilent(12.5, {"health": "timeout"}), settings=settings)
    assert s.data.after_stop is AfterStop.HUNG and s.effects[0] == Terminate(3.0, drain=0.0)
    s = drive(UpRequested(settings), OrphanFound(77, 9.0, {"health": "timeout"}))
    assert s.state is S.STOPPING and s.effects[0] == Terminate(3.0, drain=0.0)
