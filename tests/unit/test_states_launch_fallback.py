"""The launch and fallback tables together, as the daemon wires them, with no daemon at all.

The glue here is only what the orchestrator and the supervisor pass between the two tables
(MakePlan's facts into PlanRequested, a UsePlan into PlanReady, an exit's facts into
ServerExited); every decision is the tables'. Hypothesis then plays servers that die before
ready, die after ready or serve, and checks the policy a user sees: a GPU that never gets its
server ready is given up with `<backend>_startup_failed` and the CPU serves; a CPU server that
dies is respawned until the crash loop; a forced backend never falls back.
"""

from __future__ import annotations

import enum

import attrs
from hypothesis import given, settings, strategies as st

from stoker.states.fallback import table as F
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.machine import step
from stoker.states.reasons import ReasonCode as R

CANDIDATES = ("cuda", "cpu")
STARTUP_FAILED = {"cuda": R.CUDA_STARTUP_FAILED}


class Fate(enum.Enum):
    """What one spawned server does."""

    DIES_LOADING = "dies before ready"
    DIES_SERVING = "dies after ready"
    SERVES = "serves"


def plan_for(backend: str) -> LR.LaunchPlan:
    layers = 0 if backend == "cpu" else "auto"
    return LR.LaunchPlan(backend, "v", f"/{backend}", f"/{backend}/llama-server", "/m.gguf", n_gpu_layers=layers)


@attrs.define
class Wiring:
    """Both machines and the glue between them; `log` is what a user could read in history."""

    forced: bool = False
    launch: tuple = (LR.LaunchState.STOPPED, LR.LaunchData(settings=LR.LaunchSettings(max_restarts=2)))
    fallback: tuple = (F.FallbackState.IDLE, F.FallbackData())
    spawned: list = attrs.Factory(list)
    plan_failed: LR.PlanFailed | None = None

    def fire_launch(self, event) -> None:
        result = step(L.LAUNCH, *self.launch, event)
        self.launch = (result.state, result.data)
        for effect in result.effects:
            if isinstance(effect, LR.MakePlan):
                self.make_plan(effect)
            elif isinstance(effect, LR.Spawn):
                self.spawned.append(effect.plan.backend)
                self.fire_launch(LR.Spawned(len(self.spawned)))
            elif isinstance(effect, LR.StartBackoff):
                self.fire_launch(LR.BackoffStarted(0.1))
                self.fire_launch(LR.BackoffElapsed())

    def make_plan(self, effect: LR.MakePlan) -> None:
        """The orchestrator's part: MakePlan's facts in, the fallback's effects carried out."""
        failure, previous = effect.failure, effect.previous
        candidates = ("cuda",) if self.forced else CANDIDATES
        request = F.PlanRequested(
            candidates,
            self.forced,
            previous_backend=previous.backend if previous else None,
            failure=failure.reason if failure else None,
            phase=failure.phase if failure else None,
            startup_failed=STARTUP_FAILED.get(previous.backend, R.SERVER_CRASHED) if previous else R.SERVER_CRASHED,
        )
        effects = list(self.fire_fallback(request))
        while effects:
            eff = effects.pop(0)
            if isinstance(eff, F.CheckBackend):
                effects += self.fire_fallback(F.CheckPassed(eff.backend))
            elif isinstance(eff, F.UsePlan):
                self.fire_launch(LR.PlanReady(plan_for(eff.backend)))
            elif isinstance(eff, F.GiveUp):
                self.plan_failed = LR.PlanFailed(eff.reason, eff.evidence)
                self.fire_launch(self.plan_failed)

    def fire_fallback(self, event) -> tuple:
        result = step(F.FALLBACK, *self.fallback, event)
        self.fallback = (result.state, result.data)
        return result.effects

    def play(self, fate: Fate) -> None:
        """The server now spawned does what `fate` says."""
        state, data = self.launch
        if fate is Fate.DIES_LOADING:
            self.fire_launch(LR.ServerExited(1, R.SERVER_CRASHED, {"line": "boom"}))
            return
        self.fire_launch(LR.Ready())
        if self.fallback[0] is F.FallbackState.LAUNCHING:
            self.fire_fallback(F.LaunchSucceeded(data.plan.backend))
        if fate is Fate.DIES_SERVING:
            self.fire_launch(LR.ServerExited(-11))


@settings(max_examples=200, deadline=None)
@given(fates=st.lists(st.sampled_from(Fate), min_size=1, max_size=12), forced=st.booleans())
def test_servers_that_fail_to_start_move_the_fallback_on(fates, forced):
    w = Wiring(forced=forced)
    w.fire_launch(LR.UpRequested())
    for fate in fates:
        if w.launch[0] not in (LR.LaunchState.STARTING, LR.LaunchState.LOADING):
            break
        backend = w.spawned[-1]
        before = list(w.spawned)
        first_try = w.fallback[0] is F.FallbackState.LAUNCHING  # not yet ready since the fallback began
        w.play(fate)
        state, data = w.launch
        skipped = [(s.backend, s.reason) for s in w.fallback[1].skipped]
        looped = state is LR.LaunchState.FAILED and data.reason is R.CRASH_LOOP  # no new plan after that
        if fate is Fate.DIES_LOADING and backend == "cuda" and first_try and not looped:
            # never got ready: cuda is out with its own code; the CPU next (or nothing, forced)
            assert skipped == [("cuda", R.CUDA_STARTUP_FAILED)]
            if forced:
                assert state is LR.LaunchState.FAILED and data.reason is R.CUDA_STARTUP_FAILED
                assert w.plan_failed.evidence["forced"] is True and len(w.spawned) == len(before)
            else:
                assert w.spawned[-1] == "cpu" and data.plan.backend == "cpu"
        elif fate is Fate.DIES_LOADING and backend == "cuda" and not looped:
            # it had served: a respawn that fails to start is planned afresh, cuda first again
            assert skipped == [] and w.spawned[-1] == "cuda"
        elif state is not LR.LaunchState.FAILED and fate is not Fate.SERVES:
            # a CPU server that died, or any that died while serving: the same plan again
            assert w.spawned[-1] == backend and data.plan.backend == backend
        if fate is Fate.SERVES:
            assert state is LR.LaunchState.READY and w.fallback[0] is F.FallbackState.SETTLED
        assert "cuda" not in w.spawned[w.spawned.index("cpu") :] if "cpu" in w.spawned else True
        if state is LR.LaunchState.FAILED and data.reason is R.CRASH_LOOP:
            assert data.crashes == data.settings.max_restarts + 1


def test_a_gpu_that_never_gets_ready_ends_on_the_cpu_with_the_reason():
    w = Wiring()
    w.fire_launch(LR.UpRequested())
    assert w.spawned == ["cuda"]
    w.play(Fate.DIES_LOADING)
    assert w.spawned == ["cuda", "cpu"]
    w.play(Fate.SERVES)
    state, data = w.fallback
    assert state is F.FallbackState.SETTLED and data.chosen == "cpu" and data.reason is R.CUDA_STARTUP_FAILED
    assert data.skipped[0].evidence["exit_reason"] == "server_crashed"
