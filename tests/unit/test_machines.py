"""MachineRunner: step, persist, publish; and hypothesis models of launch and probe over it."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event as hypothesis_event, settings, strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.machines import EffectDriver, MachineRunner, UnhandledEffect
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.probe import table as P
from stoker.states.pull import table as PL
from stoker.states.machine import IllegalTransition, MachineDefinitionError, data_to_json, event_from_json
from stoker.states.reasons import ReasonCode
from stoker.store import StoreError, open_store

PLAN = LR.LaunchPlan("cpu", "x86-64", "/b", "/b/llama-server", "/m.gguf", port=8091)
GPU_PLAN = LR.LaunchPlan("cuda", "avx2", "/c", "/c/llama-server", "/m.gguf", port=8091, n_gpu_layers="auto")


@pytest.fixture
def store():
    s = open_store(":memory:")
    yield s
    s.close()


def test_fire_persists_and_publishes(store):
    seen = []
    runner = MachineRunner(L.LAUNCH, "launch", store, seen.append)
    assert runner.state is LR.LaunchState.STOPPED and not runner.resumed
    result = runner.fire(LR.UpRequested())
    assert result.effects == (LR.MakePlan(request=1),)
    runner.fire(LR.PlanReady(PLAN))
    assert [m["topic"] for m in seen] == ["machine.launch.planning", "machine.launch.starting"]
    msg = seen[-1]
    assert {k: msg[k] for k in ("machine", "from", "to", "event", "reason", "seq")} == {
        "machine": "launch",
        "from": "planning",
        "to": "starting",
        "event": "PlanReady",
        "reason": None,
        "seq": 2,
    }
    assert msg["evidence"] == {"backend": "cpu", "variant": "x86-64"}
    assert isinstance(msg["at"], float)
    row = store.machine("launch")
    assert row.state == "starting" and row.data == data_to_json(runner.data)
    history = store.history(machine="launch")
    assert [t.event for t in history] == ["PlanReady", "UpRequested"]
    assert event_from_json(L.LAUNCH, history[0].event, history[0].event_data) == LR.PlanReady(PLAN)


def test_resume_from_the_store(store):
    first = MachineRunner(
        L.LAUNCH, "launch", store, initial_data=LR.LaunchData(settings=LR.LaunchSettings(max_restarts=1))
    )
    for event in (LR.UpRequested(), LR.PlanReady(PLAN), LR.Spawned(77, 3.25), LR.Ready({"layers": 0})):
        first.fire(event)
    again = MachineRunner(L.LAUNCH, "launch", store)
    assert again.resumed and again.state is LR.LaunchState.READY and again.data == first.data
    assert again.seq == 4 and again.data.settings.max_restarts == 1
    assert L.resume_effects(again.state, again.data) == (LR.Reattach(77, 3.25),)


def test_illegal_event_changes_nothing(store):
    seen = []
    runner = MachineRunner(L.LAUNCH, "launch", store, seen.append)
    assert not runner.accepts(LR.Ready())
    with pytest.raises(IllegalTransition):
        runner.fire(LR.Ready())
    assert runner.state is LR.LaunchState.STOPPED and store.machine("launch") is None and seen == []
    assert runner.accepts(LR.UpRequested())
    assert store.count_transitions() == 0


def test_failed_write_changes_nothing(store):
    seen = []
    runner = MachineRunner(L.LAUNCH, "launch", store, seen.append)
    runner.fire(LR.UpRequested())
    store.db.execute("CREATE TEMP TRIGGER refuse BEFORE INSERT ON transitions BEGIN SELECT RAISE(ABORT, 'no'); END")
    with pytest.raises(StoreError):
        runner.fire(LR.PlanReady(PLAN))
    assert runner.state is LR.LaunchState.PLANNING and runner.data.plan is None and len(seen) == 1
    assert store.machine("launch").state == "planning"


def test_machine_of_another_kind_is_refused(store):
    MachineRunner(P.PROBE, "probe:cuda", store).fire(P.ProbeRequested("cuda"))
    with pytest.raises(StoreError):
        MachineRunner(L.LAUNCH, "probe:cuda", store)


# --- the launch machine as a hypothesis model -------------------------------------------

MAX_RESTARTS = 2
LAUNCH_EVENTS = [
    LR.UpRequested(),
    LR.DownRequested(),
    LR.RestartRequested(),
    LR.ConfigChanged(),
    LR.ConfigChanged(LR.LaunchSettings(max_restarts=MAX_RESTARTS, stall_timeout=5.0)),
    LR.ContextRequested(8192, {"num_ctx": 8192}),
    LR.PlanReady(PLAN),
    LR.PlanReady(GPU_PLAN),
    LR.PlanFailed(ReasonCode.MODEL_MISSING, {"path": "/m.gguf"}),
    LR.Spawned(100, 1.0),
    LR.SpawnFailed(),
    LR.Adopted(100, 1.0),
    LR.Adopted(101, 2.0),
    LR.OrphanFound(100, 1.0),
    LR.NothingToAdopt(),
    LR.EngineSilent(1.0),
    LR.EngineSilent(100.0),
    LR.EngineAnswered(),
    LR.LoadStarted(),
    LR.Ready({"layers": 0}),
    LR.ServerExited(-9),
    LR.ServerExited(1, ReasonCode.MODEL_LOAD_FAILED),
    LR.ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION),
    LR.ServerExited(1, ReasonCode.PORT_IN_USE),
    LR.StallTimeout(),
    LR.BackoffStarted(0.5),
    LR.BackoffElapsed(),
    LR.Stable(),
    LR.StopCompleted(0),
]
FATAL = {ReasonCode.MODEL_MISSING, ReasonCode.MODEL_LOAD_FAILED, ReasonCode.SERVER_BAD_ARGUMENTS}
CRASHING = (LR.LaunchState.STARTING, LR.LaunchState.LOADING, LR.LaunchState.READY)


class LaunchModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = open_store(":memory:")
        self.published: list[dict] = []
        data = LR.LaunchData(settings=LR.LaunchSettings(max_restarts=MAX_RESTARTS, stall_timeout=5.0))
        self.runner = MachineRunner(L.LAUNCH, "launch", self.store, self.published.append, initial_data=data)
        self.accepted = 0

    def teardown(self) -> None:
        self.store.close()

    @initialize(running=st.booleans())
    def maybe_start(self, running):
        if running:
            for event in (LR.UpRequested(), LR.PlanReady(PLAN), LR.Spawned(100)):
                self.fire(event)

    @rule(event=st.sampled_from(LAUNCH_EVENTS))
    def fire(self, event):
        before_state, before_data = self.runner.state, self.runner.data
        before_row = self.store.machine("launch")
        try:
            result = self.runner.fire(event)
        except IllegalTransition:
            assert (self.runner.state, self.runner.data) == (before_state, before_data)
            assert self.store.machine("launch") == before_row
            return
        self.accepted += 1
        data = result.data
        newest = self.store.history(machine="launch", limit=1)[0]
        assert (newest.from_state, newest.event, newest.to_state) == (
            before_state.value,
            type(event).__name__,
            result.state.value,
        )
        assert newest.reason == (None if result.reason is None else str(result.reason))
        # the crash counter
        if isinstance(event, LR.ServerExited) and before_state in CRASHING:
            assert data.crashes == before_data.crashes + 1
            if event.reason in FATAL:
                assert result.state is LR.LaunchState.FAILED and result.reason is event.reason
            elif data.crashes > MAX_RESTARTS:
                assert result.state is LR.LaunchState.FAILED and result.reason is ReasonCode.CRASH_LOOP
            else:
                assert result.state is LR.LaunchState.CRASHED and result.effects[0] == LR.StartBackoff(data.crashes)
                assert data.restarts == before_data.restarts + 1
                # a new plan after SIGILL, or after a GPU server that never got ready
                never_ready = before_state is not LR.LaunchState.READY
                gpu = before_data.plan is not None and before_data.plan.backend != "cpu"
                replan = event.reason is ReasonCode.CPU_ILLEGAL_INSTRUCTION or (never_ready and gpu)
                assert (data.replan_for is not None) == replan
        if isinstance(event, LR.BackoffElapsed):
            asked = before_data.replan_for is not None or before_data.plan is None
            assert result.state is (LR.LaunchState.PLANNING if asked else LR.LaunchState.STARTING)
        if isinstance(event, LR.Stable):
            assert data.crashes == 0
        if isinstance(event, (LR.UpRequested, LR.RestartRequested)) and before_state in (
            LR.LaunchState.STOPPED,
            LR.LaunchState.FAILED,
        ):
            assert result.state is LR.LaunchState.PLANNING and data.crashes == 0 and data.restarts == 0
        found = (LR.Adopted, LR.OrphanFound)
        if before_state is LR.LaunchState.FAILED and not isinstance(event, (LR.UpRequested, LR.RestartRequested)):
            if isinstance(event, found):  # a server found at daemon start is stopped first
                assert result.state is LR.LaunchState.STOPPING and data.after_stop is LR.AfterStop.FAIL
            else:
                assert result.state is LR.LaunchState.FAILED  # sticky until the user starts it
        # one server at a time: a stop signals only once a spawn has answered, and always then
        if result.state is LR.LaunchState.STOPPING and before_state is not LR.LaunchState.STOPPING:
            asks = any(isinstance(e, LR.Terminate) for e in result.effects)
            assert asks == (not data.spawning)
        if isinstance(event, LR.Spawned) and before_state is LR.LaunchState.STOPPING:
            assert result.effects == (LR.Terminate(data.settings.stop_grace),)
        if isinstance(event, LR.EngineSilent) and before_state is LR.LaunchState.READY:
            hung = event.silent_for >= data.settings.hung_after > 0
            assert (result.reason is ReasonCode.SERVER_HUNG) == hung

    @rule(data=st.data())
    def fire_a_legal_one(self, data):
        """Bias towards long legal runs, so crash loops and stops mid-way are reached."""
        legal = [e for e in LAUNCH_EVENTS if self.runner.accepts(e)]
        event = data.draw(st.sampled_from(legal))
        self.fire(event)

    @precondition(lambda self: self.runner.state in CRASHING)
    @rule(back_up=st.booleans())
    def crash_and_come_back(self, back_up):
        """A whole crash cycle in one rule, so crash loops are common, not lucky."""
        for event in (LR.ServerExited(-9), LR.BackoffStarted(0.1), LR.BackoffElapsed(), LR.Spawned(101), LR.Ready()):
            if not self.runner.accepts(event):
                break
            self.fire(event)
            if not back_up and isinstance(event, LR.BackoffElapsed):
                break
        if self.runner.data.reason is ReasonCode.CRASH_LOOP:
            hypothesis_event("reached crash_loop")

    @invariant()
    def declared_state_and_one_row_per_transition(self):
        assert self.runner.state in set(LR.LaunchState)
        assert self.store.count_transitions("launch") == self.accepted == len(self.published)
        assert self.runner.seq == self.accepted

    @invariant()
    def flags_belong_to_their_states(self):
        state, data = self.runner.state, self.runner.data
        if data.spawning:
            assert state in (LR.LaunchState.STARTING, LR.LaunchState.STOPPING)
        if data.silent:
            assert state is LR.LaunchState.READY

    @invariant()
    def counter_bounds(self):
        state, data = self.runner.state, self.runner.data
        assert 0 <= data.crashes <= MAX_RESTARTS + 1
        if state in (LR.LaunchState.CRASHED, LR.LaunchState.BACKOFF):
            assert 1 <= data.crashes <= MAX_RESTARTS
        if state is LR.LaunchState.FAILED and data.reason is ReasonCode.CRASH_LOOP:
            assert data.crashes == MAX_RESTARTS + 1

    @invariant()
    def store_round_trips(self):
        if self.accepted:
            reloaded = MachineRunner(L.LAUNCH, "launch", self.store)
            assert (reloaded.state, reloaded.data) == (self.runner.state, self.runner.data)


TestLaunchModel = LaunchModel.TestCase
TestLaunchModel.settings = settings(
    max_examples=75, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# --- the probe machine as a hypothesis model ---------------------------------------------


class ProbeModel(RuleBasedStateMachine):
    started = Bundle("started")

    def __init__(self) -> None:
        super().__init__()
        self.store = open_store(":memory:")
        self.runner = MachineRunner(P.PROBE, "probe:cuda", self.store)
        self.accepted = 0
        self.newest = 0
        self.finished: set[int] = set()
        self.verdict_generation = 0
        self.drops = 0

    def teardown(self) -> None:
        self.store.close()

    def _fire(self, event):
        result = self.runner.fire(event)
        self.accepted += 1
        return result

    @initialize(target=started)
    def first(self):
        self._fire(P.ProbeRequested("cuda"))
        self.newest = 1
        return 1

    @rule(target=started)
    def request(self):
        result = self._fire(P.ProbeRequested())
        self.newest += 1
        assert result.effects == (P.RunProbe("cuda", self.newest, 10.0),)
        return self.newest

    @rule(gen=started, ok=st.booleans())
    def finish(self, gen, ok):
        event = P.ProbeSucceeded(gen, {"g": gen}) if ok else P.ProbeFailed(gen, ReasonCode.GPU_MISSING, {"g": gen})
        before = self.runner.state
        result = self._fire(event)
        fresh = gen == self.newest and gen not in self.finished
        self.finished.add(gen)
        newest_row = self.store.history(machine="probe:cuda", limit=1)[0]
        if fresh:
            self.verdict_generation = gen
            assert result.state is (P.ProbeState.AVAILABLE if ok else P.ProbeState.UNAVAILABLE)
            assert newest_row.reason in (None, "gpu_missing")
        else:
            self.drops += 1
            assert result.state is before
            assert newest_row.reason == "probe_result_stale"
            assert newest_row.evidence["dropped_generation"] == gen

    @precondition(lambda self: self.runner.state in (P.ProbeState.AVAILABLE, P.ProbeState.UNAVAILABLE))
    @rule()
    def expire(self):
        with pytest.raises(IllegalTransition):
            self.runner.fire(P.Expired(self.verdict_generation + 1))
        assert self._fire(P.Expired(self.verdict_generation)).state is P.ProbeState.IDLE

    @invariant()
    def verdict_is_the_newest_finished(self):
        data = self.runner.data
        assert data.generation == self.newest
        assert data.result_generation == self.verdict_generation
        assert data.dropped == self.drops
        if self.verdict_generation:
            assert data.evidence == {"g": self.verdict_generation}
        probing = self.newest not in self.finished
        assert (self.runner.state is P.ProbeState.PROBING) == probing
        assert self.store.count_transitions("probe:cuda") == self.accepted


TestProbeModel = ProbeModel.TestCase
TestProbeModel.settings = settings(
    max_examples=75, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_evidence_with_paths_and_enums_is_stored_as_json(store, tmp_path):
    runner = MachineRunner(L.LAUNCH, "launch", store)
    runner.fire(LR.UpRequested())
    runner.fire(LR.PlanFailed(ReasonCode.MODEL_MISSING, {"path": tmp_path / "m.gguf", "tried": (1, 2)}))
    row = store.history(limit=1)[0]
    assert row.evidence == {"path": str(tmp_path / "m.gguf"), "tried": [1, 2]}
    assert row.reason == "model_missing"


# --- the effect driver --------------------------------------------------------------------


def test_effect_driver_runs_each_effect_through_its_handler():
    ran = []
    driver = EffectDriver(
        P.PROBE, {P.RunProbe: lambda e, who: ran.append((who, e)) or "run", P.ArmExpiry: lambda e, who: "armed"}
    )
    assert driver.run(P.RunProbe("cuda", 1, 10.0), "svc") == "run"
    assert driver.run(P.ArmExpiry(1, 30.0), "svc") == "armed"
    assert ran == [("svc", P.RunProbe("cuda", 1, 10.0))]


def test_effect_driver_refuses_a_missing_or_stray_handler_when_built():
    with pytest.raises(MachineDefinitionError, match="missing \\['ArmExpiry'\\]"):
        EffectDriver(P.PROBE, {P.RunProbe: lambda e: None})
    with pytest.raises(MachineDefinitionError, match="not declared \\['Spawn'\\]"):
        EffectDriver(P.PROBE, {P.RunProbe: print, P.ArmExpiry: print, LR.Spawn: print})


def test_effect_driver_never_drops_an_unknown_effect():
    driver = EffectDriver(P.PROBE, {P.RunProbe: lambda e: None, P.ArmExpiry: lambda e: None})
    with pytest.raises(UnhandledEffect, match="Spawn"):
        driver.run(LR.Spawn(PLAN))


# --- the one effect loop and its failure policy -------------------------------------------


def pull_driver(resolve_raises: Exception, **policy):
    """A pull machine's driver whose Resolve raises; every other effect answers nothing."""

    async def resolve(effect, runner):
        raise resolve_raises

    async def nothing(effect, runner):
        return None

    return EffectDriver(PL.PULL, {t: nothing for t in PL.PULL.effect_types} | {PL.Resolve: resolve}, **policy)


def pull_failed(failure, runner):
    return PL.PullFailed(failure.reason or ReasonCode.PULL_FAILED, dict(failure.evidence))


async def test_a_handler_that_raises_is_heard_as_the_machines_failure_event(store):
    runner = MachineRunner(PL.PULL, "pull:m", store)
    heard = []
    driver = pull_driver(
        StokerError(ReasonCode.PULL_NOT_FOUND, "/x is not a file.", {"path": "/x"}),
        failed=lambda failure, runner: heard.append(failure) or pull_failed(failure, runner),
    )
    await driver.drive(runner, runner.fire(PL.PullRequested("/x", "m")).effects, runner)
    assert runner.state is PL.PullState.FAILED and runner.data.reason == ReasonCode.PULL_NOT_FOUND
    assert heard[0].cause == {"cause": "pull_not_found", "message": "/x is not a file.", "path": "/x"}
    assert store.history(machine="pull:m", limit=1)[0].reason == "pull_not_found"


async def test_a_bug_in_a_handler_is_an_internal_error_that_names_the_effect(store):
    runner = MachineRunner(PL.PULL, "pull:m", store)
    heard = []
    driver = pull_driver(KeyError("size"), failed=lambda f, r: heard.append(f) or pull_failed(f, r))
    await driver.drive(runner, runner.fire(PL.PullRequested("/x", "m")).effects, runner)
    assert runner.state is PL.PullState.FAILED and runner.data.reason == ReasonCode.PULL_FAILED
    assert heard[0].reason is None and heard[0].evidence == {"effect": "Resolve"}
    assert heard[0].cause["cause"] == "internal_error" and "KeyError" in heard[0].cause["message"]


async def test_without_a_failure_event_the_error_reaches_the_caller(store):
    runner = MachineRunner(PL.PULL, "pull:m", store)
    with pytest.raises(StokerError, match="pull_not_found"):
        await pull_driver(StokerError(ReasonCode.PULL_NOT_FOUND)).drive(
            runner, runner.fire(PL.PullRequested("/x", "m")).effects, runner
        )
    assert runner.state is PL.PullState.RESOLVING


async def test_a_stop_on_purpose_leaves_the_machine_where_it_was_to_be_resumed(store):
    class Stopped(Exception):
        pass

    runner = MachineRunner(PL.PULL, "pull:m", store)
    driver = pull_driver(Stopped(), failed=pull_failed, stops=(Stopped,))
    await driver.drive(runner, runner.fire(PL.PullRequested("/x", "m")).effects, runner)
    assert runner.state is PL.PullState.RESOLVING


def test_a_download_that_failed_names_its_precise_cause_under_the_callers_reason():
    from stoker.daemon.core.machines import Failure
    from stoker.daemon.core.download_records import DownloadError, DownloadErrorKind

    reason = ReasonCode.CUDA_BUNDLE_INSTALL_FAILED
    digest = Failure.of(PL.Resolve("x", "m"), DownloadError(DownloadErrorKind.DIGEST_MISMATCH, reason, {"url": "u"}))
    status = Failure.of(PL.Resolve("x", "m"), DownloadError(DownloadErrorKind.HTTP_STATUS, reason, {"status": 404}))
    assert digest.reason == reason and digest.cause["cause"] == "bundle_digest_mismatch"
    assert status.cause["cause"] == "download_failed" and status.cause["status"] == 404
