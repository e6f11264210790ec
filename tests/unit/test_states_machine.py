"""The generic machinery: step, guards and their declared targets, JSON round trips."""

from __future__ import annotations

import enum
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings, strategies as st

from states import config as C, fallback as F, install as I, launch as L, probe as PR
from states.diagrams import SPECS, document, mermaid
from states.fallback import FallbackData, Skipped
from states.install import InstallData
from states.launch import LAUNCH, LaunchData, LaunchPlan, PlanReady, ServerExited, UpRequested
from states.machine import (
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
from states.probe import ProbeData
from states.reasons import ReasonCode

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
    states=Door,
    initial=Door.OPEN,
    data_type=DoorData,
    transitions={
        Door.OPEN: {Slam: slam, Lock: wander},
        Door.SHUT: {Push: Door.OPEN, Slam: slam},
    },
)


def test_plain_target_keeps_data():
    s = step(DOOR, Door.SHUT, DoorData(3), Push())
    assert s == Step(Door.OPEN, DoorData(3))


def test_guarded_handler_and_its_refusal():
    s = step(DOOR, Door.OPEN, DoorData(), Slam(hard=True))
    assert (s.state, s.data.slams, s.effects, s.reason, s.evidence) == (
        Door.SHUT, 1, ("bang",), ReasonCode.SERVER_CRASHED, {"n": 1})
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
        MachineSpec("bad", Door, Other.X, DoorData, {})
    with pytest.raises(MachineDefinitionError):
        MachineSpec("bad", Door, Door.OPEN, DoorData, {Door.OPEN: {Push: Other.X}})
    with pytest.raises(MachineDefinitionError):
        MachineSpec("bad", Door, Door.OPEN, DoorData, {Door.OPEN: {int: Door.SHUT}})


PLAN = LaunchPlan("cuda", "sm90", "/b", "/b/llama-server", "/m.gguf", n_gpu_layers=99, extra_args=("--jinja",))


@pytest.mark.parametrize(
    "event",
    [UpRequested(), PlanReady(PLAN), ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION, {"sig": "SIGILL"}, replan=True)],
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
    done = subprocess.run([sys.executable, str(ROOT / "docs/states/generate.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


# --- every table under random event sequences -------------------------------------------
SAMPLES = {
    "launch": [
        L.UpRequested(), L.DownRequested(), L.RestartRequested(), L.ConfigChanged(), L.PlanReady(PLAN),
        L.PlanFailed(ReasonCode.MODEL_MISSING), L.Spawned(1), L.Adopted(1), L.LoadStarted(), L.Ready(),
        L.ServerExited(1), L.ServerExited(-4, ReasonCode.CPU_ILLEGAL_INSTRUCTION, replan=True),
        L.ServerExited(1, ReasonCode.PORT_IN_USE, fatal=True), L.StallTimeout(), L.BackoffStarted(1.0),
        L.BackoffElapsed(), L.Stable(), L.StopCompleted(0),
    ],
    "install": [
        I.InstallRequested("cuda", "sm90"), I.Resolved("http://x/b.zip", "aa", 3), I.Downloaded("/a", "aa", 3),
        I.Verified(), I.Unpacked("/s"), I.Validated(), I.SmokePassed(), I.Resumed(),
        I.InstallFailed(ReasonCode.BUNDLE_VERIFY_FAILED),
    ],
    "probe": [
        PR.ProbeRequested("cuda"), PR.ProbeRequested(), *[PR.ProbeSucceeded(g) for g in (1, 2, 3)],
        *[PR.ProbeFailed(g, ReasonCode.GPU_MISSING) for g in (1, 2, 3)], *[PR.Expired(g) for g in (1, 2, 3)],
    ],
    "fallback": [
        F.FallbackStarted(("cuda", "cpu")), F.FallbackStarted(("cuda",), forced=True),
        *[F.CheckPassed(b) for b in ("cuda", "cpu")],
        *[F.CheckFailed(b, r) for b in ("cuda", "cpu") for r in (ReasonCode.BINARY_MISSING_NVIDIA_DETECTED, ReasonCode.GPU_MISSING)],
        *[F.BundleInstalled(b) for b in ("cuda", "cpu")],
        F.BundleInstallFailed("cuda", ReasonCode.CUDA_BUNDLE_INSTALL_FAILED),
        *[F.LaunchSucceeded(b) for b in ("cuda", "cpu")], F.LaunchFailed("cuda", ReasonCode.CUDA_STARTUP_FAILED),
        F.FallbackCancelled(),
    ],
    "config": [
        C.ConfigAccepted(), C.ConfigAccepted(("server.ctx_size",), relaunch=True),
        C.ConfigRejected(("server.ctx_size: must be an integer",)),
    ],
}


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.name)
def test_random_sequences_stay_inside_the_table(spec):
    samples = SAMPLES[spec.name]
    assert {type(e) for e in samples} == set(spec.event_types.values())

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.sampled_from(samples), max_size=60))
    def run(events):
        state, data = spec.initial, spec.initial_data()
        for event in events:
            try:
                result = step(spec, state, data, event)
            except IllegalTransition:
                continue  # MachineDefinitionError would fail the test: a handler off its edges
            assert result.state in set(spec.states)
            assert (state, type(event).__name__, result.state) in spec.edges()
            assert data_from_json(spec, data_to_json(result.data)) == result.data
            name, payload = event_to_json(event)
            assert event_from_json(spec, name, payload) == event
            state, data = result.state, result.data

    run()
