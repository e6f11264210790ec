"""The generic machinery: step, guards and their declared targets, JSON round trips."""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from stoker.states.config import table as C

from stoker.states.fallback import table as F

from stoker.states.install import table as I

from stoker.states.launch import records as LR

from stoker.states.probe import table as PR

from stoker.states.pull import table as P
from stoker.states.engine_update import records as EU
from stoker.states.worker import table as WK
from stoker.states.fallback import vram as FV
from stoker.states.fallback.proof import AccelerationProof, acceleration_verdict
from stoker.states.diagrams import SPECS, document, mermaid
from stoker.states.fallback.table import FallbackData, Skipped
from stoker.states.install.table import InstallData
from stoker.states.install.slot import Rejection, SlotBundle, SlotWriter
from stoker.states.launch.table import LAUNCH
from stoker.states.launch.records import LaunchData, LaunchPlan, PlanReady, ServerExited, UpRequested
from stoker.states.machine import (
    STAY,
    Guarded,
    IllegalTransition,
    MachineDefinitionError,
    MachineSpec,
    Step,
    data_from_json,
    data_to_json,
    event_from_json,
    event_to_json,
    guarded,
    step,
)
from stoker.states.probe.table import ProbeData
from stoker.states.reasons import ReasonCode

ROOT = Path(__file__).resolve().parents[2]


class Door(enum.StrEnum):
    OPEN = "open"
    SHUT = "shut"
    LOCKED = "locked"


@attrs.frozen
class DoorData:
    slams: int = 0


@attrs.frozen
class Push:
    pass


@attrs.frozen
class Slam:
    hard: bool = False


@attrs.frozen
class Lock:
    pass


@guarded(Door.SHUT, STAY)
def slam(state, data, event):
    if not event.hard:
        return None
    return Step(Door.SHUT, attrs.evolve(data, slams=data.slams + 1), ("bang",), ReasonCode.SERVER_CRASHED, {"n": 1})


@guarded(Door.OPEN)
def wander(state, data, event):
    return Step(Door.LOCKED, data)


DOOR = MachineSpec(
    name="door",
    initial=Door.OPEN,
    data_type=DoorData,
    transitions={Door.OPEN: {Slam: slam, Lock: wander}, Door.SHUT: {Push: Door.OPEN, Slam: slam}},
)


def test_plain_target_keeps_data():
    s = step(DOOR, Door.SHUT, DoorData(3), Push())
    assert s == Step(Door.OPEN, DoorData(3))


def test_guarded_handler_and_its_refusal():
    s = step(DOOR, Door.OPEN, DoorData(), Slam(hard=True))
    assert (s.state, s.data.slams, s.effects, s.reason, s.evidence) == (
        Door.SHUT,
        1,
        ("bang",),
        ReasonCode.SERVER_CRASHED,
        {"n": 1},
    )
    with pytest.raises(IllegalTransition, match="refused by slam"):
        step(DOOR, Door.OPEN, DoorData(), Slam(hard=False))


def test_unknown_event_and_state_without_row_are_illegal():
    with pytest.raises(IllegalTransition):
        step(DOOR, Door.OPEN, DoorData(), Push())
    with pytest.raises(IllegalTransition):
        step(DOOR, Door.LOCKED, DoorData(), Push())


def test_handler_leaving_its_declared_targets_is_a_bug():
    with pytest.raises(MachineDefinitionError, match="does not declare"):
        step(DOOR, Door.OPEN, DoorData(), Lock())


def test_stay_means_the_current_state():
    rule = Guarded(lambda s, d, e: None, {STAY, Door.OPEN})
    assert rule.targets_from(Door.SHUT) == {Door.SHUT, Door.OPEN}
    assert rule.only(STAY).targets_from(Door.LOCKED) == {Door.LOCKED}
    assert (Door.SHUT, "Slam", Door.SHUT) in DOOR.edges()


def test_spec_rejects_inconsistent_tables():
    class Other(enum.StrEnum):
        X = "x"

    with pytest.raises(MachineDefinitionError):
        MachineSpec("bad", Door.OPEN, DoorData, {Other.X: {Push: Door.OPEN}})
    with pytest.raises(MachineDefinitionError):
        MachineSpec("bad", Door.OPEN, DoorData, {Door.OPEN: {Push: Other.X}})
    with pytest.raises(MachineDefinitionError):
        MachineSpec("bad", Door.OPEN, DoorData, {Door.OPEN: {int: Door.SHUT}})


PLAN = LaunchPlan("cuda", "sm90", "/b", "/b/llama-server", "/m.gguf", n_gpu_layers=99, extra_args=("--jinja",))
AUTO_PLAN = LaunchPlan(
    "cuda",
    "sm90",
    "/b",
    "/b/llama-server",
    "/m.gguf",
    n_gpu_layers="auto",
    threads=4,
    flash_attn="auto",
    slot_save_path="/s",
    extra_args=("--metrics", "--swa-full"),
)
CPU_PLAN = LaunchPlan("cpu", "avx2", "/c", "/c/llama-server", "/m.gguf")


@pytest.mark.parametrize(
    "event",
    [
        UpRequested(),
        PlanReady(PLAN),
        PlanReady(AUTO_PLAN),
        ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION, {"sig": "SIGILL"}),
    ],
)
def test_event_json_round_trip(event):
    name, payload = event_to_json(event)
    assert name == type(event).__name__
    assert event_from_json(LAUNCH, name, payload) == event


@pytest.mark.parametrize(
    "spec_data",
    [
        LaunchData(plan=PLAN, crashes=2, reason=ReasonCode.SERVER_CRASHED, evidence={"a": [1, 2]}),
        InstallData(backend="cuda", variant="sm90", size=10, reason=ReasonCode.BUNDLE_DIGEST_MISMATCH),
        ProbeData(backend="cuda", generation=4, result_generation=3),
        FallbackData(candidates=("cuda", "cpu"), skipped=(Skipped("cuda", ReasonCode.GPU_MISSING, {"x": 1}),)),
    ],
)
def test_data_json_round_trip(spec_data):
    spec = next(s for s in SPECS if s.data_type is type(spec_data))
    assert data_from_json(spec, data_to_json(spec_data)) == spec_data


def test_data_missing_fields_take_defaults():
    assert data_from_json(LAUNCH, {"crashes": 3}) == LaunchData(crashes=3)


def test_gpu_layers_have_one_spelling_and_old_rows_are_read_into_it():
    assert data_to_json(AUTO_PLAN)["n_gpu_layers"] == "auto"
    old_row = {**data_to_json(PLAN), "n_gpu_layers": -1}  # written before "auto" had one spelling
    del old_row["backend_args"]  # ... and before the backend plugin was asked for its arguments
    old_plan = data_from_json(LAUNCH, {"plan": old_row, "replan": True}).plan
    assert old_plan.n_gpu_layers == "auto" and old_plan.backend_args == ("-ngl", "auto")  # as it was run
    with pytest.raises(ValueError):
        LaunchPlan("cuda", "sm90", "/b", "/b/llama-server", "/m.gguf", n_gpu_layers="all")


def test_unknown_event_name_is_a_key_error():
    with pytest.raises(KeyError):
        event_from_json(LAUNCH, "Teleported", {})


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_every_state_reachable_and_every_event_round_trips(spec):
    assert spec.reachable() == set(spec.states)
    for name, event_type in spec.event_types.items():
        assert name == event_type.__name__


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_committed_diagrams_are_current(spec):
    page = ROOT / "docs" / "states" / f"{spec.name}.md"
    assert page.read_text() == document(spec), "run: python docs/states/generate.py"
    assert mermaid(spec).startswith("stateDiagram-v2")


def test_generator_check_mode_passes():
    done = subprocess.run(
        [sys.executable, str(ROOT / "docs/states/generate.py"), "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


# --- every table under random event sequences -------------------------------------------
SLOT_B0, SLOT_B1 = SlotBundle("0" * 64, "b0"), SlotBundle("1" * 64, "b1", "aa")

SAMPLES = {
    "launch": [
        LR.UpRequested(),
        LR.DownRequested(),
        LR.RestartRequested(),
        LR.ConfigChanged(),
        LR.ContextRequested(8192),
        LR.PlanReady(AUTO_PLAN),
        LR.PlanReady(CPU_PLAN),
        LR.PlanFailed(ReasonCode.MODEL_MISSING),
        LR.Spawned(1),
        LR.Adopted(1),
        LR.OrphanFound(1),
        LR.NothingToAdopt(),
        LR.EngineSilent(1.0),
        LR.EngineAnswered(),
        LR.SpawnFailed(),
        LR.LoadStarted(),
        LR.Ready(),
        LR.ServerExited(1),
        LR.ServerExited(-9),
        LR.ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION),
        LR.ServerExited(1, ReasonCode.MODEL_LOAD_FAILED),
        LR.ServerExited(1, ReasonCode.PORT_IN_USE),
        LR.StallTimeout(),
        LR.BackoffStarted(1.0),
        LR.BackoffElapsed(),
        LR.Stable(),
        LR.StopCompleted(0),
    ],
    "install": [
        I.InstallRequested("cuda", "sm90"),
        I.InstallRequested("cuda", "sm90", ("file",)),
        I.Resolved("http://x/b.zip", "aa", 3),
        I.SourceUnavailable(ReasonCode.CUDA_BUNDLE_INSTALL_FAILED, {"cause": "bundle_missing"}),
        I.SourceUnavailable(ReasonCode.CUDA_BUNDLE_INSTALL_FAILED, cause=ReasonCode.MANIFEST_EXPIRED),
        I.ToolchainReady(),
        I.Downloaded("/a", "aa", 3),
        I.Verified(),
        I.Unpacked("/s"),
        I.Validated(),
        I.SmokePassed(),
        I.Promoted(SLOT_B1, SLOT_B0),
        I.SlotChanged(attrs.evolve(SLOT_B0, by=SlotWriter.ENGINE_ROLLBACK), SLOT_B1),
        I.Resolved("file:///b1.zip", "aa", 3, now=SLOT_B1, digest=SLOT_B1.digest),
        I.Resolved("http://x/b2.zip", "bb", 3, now=SLOT_B1, rejection=Rejection("b2", "engine_update_rolled_back")),
        I.Resolved("http://x/b2.zip", "bb", 3, rejection=Rejection("b2", "engine_update_rejected", "tokens", ("bb",))),
        I.Validated(now=SLOT_B1, digest=SLOT_B1.digest),
        I.Validated(digest="bb", rejection=Rejection("b2", "engine_update_rejected", "tokens", ("bb",))),
        I.Resumed(),
        I.InstallFailed(ReasonCode.BUNDLE_VERIFY_FAILED),
    ],
    "probe": [
        PR.ProbeRequested("cuda"),
        PR.ProbeRequested(),
        *[PR.ProbeSucceeded(g) for g in (1, 2, 3)],
        *[PR.ProbeFailed(g, ReasonCode.GPU_MISSING) for g in (1, 2, 3)],
        *[PR.Expired(g) for g in (1, 2, 3)],
    ],
    "fallback": [
        F.PlanRequested(("cuda", "cpu")),
        F.PlanRequested(("cuda",), forced=True),
        *[
            F.PlanRequested(
                ("cuda", "cpu"),
                previous_backend=b,
                failure=ReasonCode.SERVER_CRASHED,
                phase=p,
                startup_failed=ReasonCode.CUDA_STARTUP_FAILED,
            )
            for b in ("cuda", "cpu")
            for p in LR.ExitPhase
        ],
        F.PlanRequested(
            ("cuda", "cpu"),
            previous_backend="cpu",
            previous_variant="avx2",
            failure=ReasonCode.CPU_ILLEGAL_INSTRUCTION,
            phase=LR.ExitPhase.NEVER_READY,
        ),
        *[F.CheckPassed(b) for b in ("cuda", "cpu")],
        *[F.CheckFailed(b, ReasonCode.GPU_MISSING) for b in ("cuda", "cpu")],
        *[F.BundleMissing(b, binary_missing=ReasonCode.BINARY_MISSING_NVIDIA_DETECTED) for b in ("cuda", "cpu")],
        F.CheckPassed("cuda", vram=FV.VramCheck(FV.FreeVram({0: 699}), 1024, 524, "auto", ReasonCode.CUDA_VRAM_FULL)),
        F.CheckPassed("cuda", vram=FV.VramCheck(FV.FreeVram({0: 300, 1: 9000}), 1024, 524, "auto")),
        *[F.BundleInstalled(b) for b in ("cuda", "cpu")],
        F.BundleInstallFailed("cuda", ReasonCode.CUDA_BUNDLE_INSTALL_FAILED),
        F.BundleMissing("cuda", binary_missing=ReasonCode.BINARY_MISSING_NVIDIA_DETECTED, slow=True),
        F.EngineBuilt("cuda", {"seconds": 369}),
        F.EngineBuildFailed("cuda", ReasonCode.CUDA_BUNDLE_INSTALL_FAILED),
        *[F.LaunchSucceeded(b) for b in ("cuda", "cpu")],
        F.LaunchSucceeded("cuda", adopted=True),
        F.LaunchSucceeded("cuda", AccelerationProof(0, 25, layers_zero=ReasonCode.CUDA_GPU_LAYERS_ZERO)),
        F.LaunchSucceeded("cuda", AccelerationProof(25, 25, process_vram_mib=0)),
        F.LaunchSucceeded("cuda", AccelerationProof(25, 25, process_vram_mib=900)),
    ],
    "pull": [
        P.PullRequested("org/repo:q4_k_m", "repo"),
        P.PullRequested("./m.gguf", "m"),
        P.Resolved("hf", "org/repo@c/m.gguf", "/models/m.gguf", 3, "aa", "c", (P.Piece("http://x/m", 3, "aa"),), "/p"),
        P.Resolved("hf", "org/repo@c/m.gguf", "/models/m.gguf", 3, None, "c", (P.Piece("http://x/m", 3),), "/p"),
        P.Resolved("local", "/m.gguf", "/m.gguf", 3, "aa", owned=False),
        P.Fetched("/p", 3, "aa", ("aa",)),
        P.Fetched("/p", 3, "bb", ("bb",)),  # the bytes do not match the source's sha256
        P.Fetched("/p", 2, "aa", ("aa",)),  # nor its size
        P.HeaderRead({"architecture": "llama"}),
        P.PullFailed(ReasonCode.PULL_NOT_FOUND),
        P.PullFailed(ReasonCode.PULL_SOURCE_UNREACHABLE),
        P.PullFailed(ReasonCode.PULL_DISK_FULL),
        P.RemoveRequested(),
        P.RemoveRequested(in_use=True),
        P.RemoveRequested(in_use=True, shared_with=("other",)),
        P.RemoveRequested(in_use=True, shared_with=("other",), launched_by_name=True),
        P.Resumed(),
    ],
    "config": [
        C.ConfigAccepted(),
        C.ConfigAccepted(("server.ctx_size",), relaunch=True),
        C.ConfigRejected(("server.ctx_size: must be an integer",)),
    ],
    "engine_update": [
        EU.UpdateRequested("cpu", "avx2"),
        EU.UpdateRequested("cpu", "avx2", bundle="/b.zip"),
        EU.Resolved(EU.BundleFacts("b1", "a" * 64), EU.Candidate("b2", "ref2", "file:///b2.zip")),
        EU.Resolved(None, EU.Candidate("b1", "ref1", "file:///b1.zip")),
        EU.Staged(EU.BundleFacts("b2", "b" * 64), "/s", (1, 2, 3)),
        EU.GateFailed(EU.Gate.SMOKE),
        EU.GateFailed(EU.Gate.FETCH),
        EU.TokensCompared((1, 2, 3)),
        EU.TokensCompared((1, 2, 4)),
        EU.Switched((EU.ServerBaseline("default", 3, 3),)),
        EU.ServersRestarted((EU.ServerVerdict("default", EU.Outcome.READY, "cpu", 3, 3),)),
        EU.ServersRestarted((EU.ServerVerdict("default", EU.Outcome.EXITED),)),
        EU.RollbackRequested("cpu", "avx2", EU.BundleFacts("b2", "b" * 64), EU.BundleFacts("b1", "a" * 64)),
        EU.RolledBack(),
        EU.RollbackFailed(),
        EU.Resumed(),
    ],
    "worker": [
        WK.StartRequested("127.0.0.1:50052", "7.0.0", WK.WorkerSettings(max_restarts=2)),
        WK.Spawned(10, 1.0),
        WK.Answered("7.0.0", ({"index": 0, "free_mib": 1, "total_mib": 2},)),
        WK.Answered("6.0.0"),
        WK.Exited(-9, ReasonCode.SERVER_CRASHED),
        WK.Exited(0, ReasonCode.SERVER_BAD_ARGUMENTS),
        WK.SpawnFailed(),
        WK.BackoffElapsed(),
        WK.Stable(),
        WK.StopRequested(),
        WK.StopCompleted(0),
        WK.Adopted("127.0.0.1:50052", "7.0.0", 11, 2.0),
    ],
}


# --- the policies the tables decide, checked on every accepted step ----------------------
# Written from the rules as the docs state them, not from the handlers: a handler that drifts
# from the stated policy fails here under random sequences.

FATAL = {ReasonCode.MODEL_MISSING, ReasonCode.MODEL_LOAD_FAILED, ReasonCode.SERVER_BAD_ARGUMENTS}
RUNNING = (LR.LaunchState.STARTING, LR.LaunchState.LOADING, LR.LaunchState.READY)


def launch_policy(state, data, event, result):
    new = result.data
    if isinstance(event, LR.ServerExited) and state in RUNNING:
        phase = LR.ExitPhase.AFTER_READY if state is LR.LaunchState.READY else LR.ExitPhase.NEVER_READY
        assert new.crashes == data.crashes + 1
        if event.reason in FATAL:
            assert (result.state, new.reason) == (LR.LaunchState.FAILED, event.reason)
        elif new.crashes > new.settings.max_restarts:
            assert (result.state, new.reason) == (LR.LaunchState.FAILED, ReasonCode.CRASH_LOOP)
        else:
            assert result.state is LR.LaunchState.CRASHED and new.restarts == data.restarts + 1
            gpu_start = phase is LR.ExitPhase.NEVER_READY and data.plan is not None and data.plan.backend != "cpu"
            wants_plan = event.reason is ReasonCode.CPU_ILLEGAL_INSTRUCTION or gpu_start
            assert (new.replan_for is not None) == wants_plan
            if wants_plan:
                assert (new.replan_for.reason, new.replan_for.phase) == (event.reason, phase)
    if isinstance(event, LR.SpawnFailed) and state is LR.LaunchState.STARTING:
        assert (result.state, new.reason) == (LR.LaunchState.FAILED, event.reason)
    if isinstance(event, LR.BackoffElapsed):
        if data.replan_for is not None or data.plan is None:
            asked = LR.MakePlan(
                previous=data.plan, failure=data.replan_for, request=data.plan_requests + 1, ctx_size=data.ctx_size
            )
            assert result.effects == (asked,)
        else:
            assert result.effects == (LR.Spawn(data.plan),)
    if isinstance(event, (LR.UpRequested, LR.RestartRequested, LR.ConfigChanged)):
        # a start, restart or config change plans afresh: no crash's failure rides along
        assert all(e.failure is None for e in result.effects if isinstance(e, LR.MakePlan))
    if isinstance(event, LR.Spawned):
        # watched until ready; or, when a stop came while it was being spawned, stopped now
        stopping = state is LR.LaunchState.STOPPING
        assert result.effects == (
            (LR.Terminate(new.settings.stop_grace),) if stopping else (LR.WatchReadiness(new.settings.stall_timeout),)
        )
    if isinstance(event, LR.Stable):
        # crashes are forgotten, unless the liveness watchdog finds the engine silent
        assert new.crashes == (data.crashes if data.silent else 0) and new.restarts == data.restarts
    # A request's larger context rides every plan asked until the server stops for good.
    assert all(e.ctx_size == new.ctx_size for e in result.effects if isinstance(e, LR.MakePlan))
    if isinstance(event, LR.ContextRequested):
        assert new.ctx_size == event.ctx_size
    if result.state is LR.LaunchState.STOPPED and isinstance(event, (LR.StopCompleted, LR.DownRequested)):
        assert state is LR.LaunchState.STOPPED or new.ctx_size is None


def fallback_policy(state, data, event, result):
    new = result.data
    if isinstance(event, F.PlanRequested):
        failed_start = (
            state is F.FallbackState.LAUNCHING
            and event.failure is not None
            and event.phase is LR.ExitPhase.NEVER_READY
            and event.previous_backend == data.current
            and event.previous_backend != "cpu"
        )
        if failed_start:
            assert new.skipped[-1].backend == data.current and new.skipped[-1].reason is event.startup_failed
            assert len(new.skipped) == len(data.skipped) + 1
            assert result.state is (
                F.FallbackState.CHECKING
                if data.index + 1 < len(data.candidates) and not data.forced
                else F.FallbackState.FAILED
            )
        else:
            assert result.state is F.FallbackState.CHECKING
            variants = F.cpu_variant_order(event.cpu_variant, event.arch, event.failure, event.previous_variant)
            assert new == F.FallbackData(
                candidates=event.candidates,
                forced=event.forced,
                cpu_variants=variants,
                building=data.building,  # the builds beside go on
                built=data.built,
            )
            assert result.effects[-1].backend == event.candidates[0]
            assert any(isinstance(e, F.ProbeCandidates) for e in result.effects) == (not event.forced)
    if isinstance(event, F.PlanRequested) and event.failure is ReasonCode.CPU_ILLEGAL_INSTRUCTION:
        if result.state is F.FallbackState.CHECKING and event.previous_backend == "cpu":
            # the CPU build that faulted is never checked again for this request
            assert event.previous_variant not in new.cpu_variants and new.cpu_variants
    if isinstance(event, F.BundleMissing):
        reason = F.missing_reason(event)
        beside = (event.slow or event.backend in data.building) and F._can_serve_meanwhile(data, event.backend)
        if beside:
            # never waited for: built beside (once), the next candidate checked now
            assert new.skipped[-1].reason is ReasonCode.GPU_ENGINE_BUILDING and event.backend in new.building
            assert result.state is F.FallbackState.CHECKING
            assert [type(e) for e in result.effects] == [F.InstallBeside, F.CheckBackend]
        elif event.backend not in data.installed:
            assert result.state is F.FallbackState.INSTALLING and result.effects == (F.InstallBundle(event.backend),)
        else:
            assert new.skipped[-1] == F.Skipped(event.backend, reason)
    if isinstance(event, F.CheckPassed) and event.vram is not None:
        full = FV.no_room(event.backend, event.vram)
        if full is not None:
            assert new.skipped[-1].reason == full[0] and result.state is not F.FallbackState.LAUNCHING
        else:
            (use,) = result.effects
            assert set(use.devices) <= set(event.vram.free.indices if event.vram.free else ())
    if isinstance(event, F.CheckFailed):
        assert result.state is not F.FallbackState.INSTALLING  # only a missing bundle is installed
    if isinstance(event, F.LaunchSucceeded) and state is F.FallbackState.SETTLED:
        if event.adopted:
            assert new == data
        else:
            demoted = event.proof is not None and acceleration_verdict(event.proof) is not None
            assert (new.respawn_demotion is None) == (not demoted)
            assert new.chosen == ("cpu" if demoted else event.backend)
    if isinstance(event, (F.EngineBuilt, F.EngineBuildFailed)):
        assert result.state is state and event.backend not in new.building
    if any(isinstance(e, F.Upgrade) for e in result.effects):
        # a switch only from a settled server to a built backend tried before the one serving
        (up,) = result.effects
        assert result.state is F.FallbackState.SETTLED and up.backend in new.built
        assert new.candidates.index(up.backend) < new.candidates.index(new.current)
    if result.state is F.FallbackState.FAILED and state is not F.FallbackState.FAILED:
        assert result.effects == (F.GiveUp(new.reason, result.evidence),)


POLICIES = {"launch": launch_policy, "fallback": fallback_policy}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_random_sequences_stay_inside_the_table(spec):
    samples = SAMPLES[spec.name]
    assert {type(e) for e in samples} == set(spec.event_types.values())
    policy = POLICIES.get(spec.name)

    def legal(state, data):
        out = []
        for event in samples:
            try:
                step(spec, state, data, event)
            except IllegalTransition:
                continue
            out.append(event)
        return out

    @settings(max_examples=200, deadline=None)
    @given(st.data())
    def run(draw):
        state, data = spec.initial, spec.initial_data()
        for _ in range(draw.draw(st.integers(0, 60))):
            # Half the time a legal event, so that deep paths (a crash loop, a fallback's last
            # candidate) are reached; otherwise any, so that refusals change nothing.
            accepted = legal(state, data)
            event = draw.draw(st.sampled_from(accepted if accepted and draw.draw(st.booleans()) else samples))
            try:
                result = step(spec, state, data, event)
            except IllegalTransition:
                continue  # MachineDefinitionError would fail the test: a handler off its edges
            assert result.state in set(spec.states)
            assert (state, type(event).__name__, result.state) in spec.edges()
            if policy is not None:
                policy(state, data, event, result)
            assert data_from_json(spec, data_to_json(result.data)) == result.data
            name, payload = event_to_json(event)
            assert event_from_json(spec, name, payload) == event
            state, data = result.state, result.data

    run()
