"""The fallback orchestrator's table, driven directly."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, strategies as st

from stoker.states.fallback.table import (
    FALLBACK,
    BundleInstalled,
    BundleMissing,
    BundleInstallFailed,
    CheckBackend,
    CheckFailed,
    CheckPassed,
    Demotion,
    EngineBuildFailed,
    EngineBuilt,
    InstallBeside,
    Upgrade,
    FallbackData,
    FallbackState as S,
    GiveUp,
    InstallBundle,
    LaunchSucceeded,
    PlanRequested,
    ProbeCandidates,
    UsePlan,
    cpu_variant_order,
)
from stoker.states.fallback.proof import AccelerationProof, proof_evidence
from stoker.states.fallback.vram import FreeVram, VramCheck
from stoker.states.launch.records import ExitPhase
from stoker.states.machine import IllegalTransition, step
from stoker.states.reasons import ReasonCode as R


CPU_ORDER = ("avx2", "compat")  # the CPU builds on x86, fastest first
ZERO_LAYERS = AccelerationProof(0, 25, layers_zero=R.CUDA_GPU_LAYERS_ZERO, hint="free VRAM")


def startup_failed(backend, reason=R.CUDA_STARTUP_FAILED, phase=ExitPhase.NEVER_READY, **evidence):
    """The launch machine's MakePlan after a `backend` server died (before ready by default)."""
    return PlanRequested(
        ("cuda", "cpu"),
        previous_backend=backend,
        failure=R.SERVER_CRASHED,
        phase=phase,
        startup_failed=reason,
        evidence=evidence,
    )


def drive(*events, state=S.IDLE, data=None):
    data = FallbackData() if data is None else data
    result = None
    for event in events:
        result = step(FALLBACK, state, data, event)
        state, data = result.state, result.data
    return result


def test_preferred_backend_works():
    s = drive(PlanRequested(("cuda", "cpu")))
    assert s.state is S.CHECKING and s.effects == (ProbeCandidates(("cuda",)), CheckBackend("cuda"))
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"))
    assert s.state is S.LAUNCHING and s.effects == (UsePlan("cuda"),)
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda", evidence={"layers": 25}))
    assert s.state is S.SETTLED and s.data.chosen == "cuda" and s.reason is None


def test_missing_bundle_on_present_hardware_installs_rechecks_retries():
    s = drive(
        PlanRequested(("cuda", "cpu")),
        BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED, evidence={"gpu": "H200"}),
    )
    assert s.state is S.INSTALLING and s.effects == (InstallBundle("cuda"),)
    s = drive(BundleInstalled("cuda"), state=s.state, data=s.data)
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cuda"),)
    s = drive(CheckPassed("cuda"), LaunchSucceeded("cuda"), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.data.chosen == "cuda"


def test_install_is_tried_once_per_backend():
    s = drive(
        PlanRequested(("cuda", "cpu")),
        BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED),
        BundleInstalled("cuda"),
        BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED),
    )
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cpu", CPU_ORDER),)


def test_other_failures_move_on_with_reason_cpu_last():
    s = drive(
        PlanRequested(("cuda", "vulkan", "cpu")),
        CheckFailed("cuda", R.CUDA_UNAVAILABLE, {"driver": "470"}),
        CheckFailed("vulkan", R.GPU_MISSING),
        CheckPassed("cpu"),
        LaunchSucceeded("cpu"),
    )
    assert s.state is S.SETTLED and s.data.chosen == "cpu"
    assert s.reason is R.CUDA_UNAVAILABLE  # why not the preferred backend
    assert [(k.backend, k.reason) for k in s.data.skipped] == [("cuda", R.CUDA_UNAVAILABLE), ("vulkan", R.GPU_MISSING)]


def test_install_failure_and_launch_failure_fall_back():
    s = drive(
        PlanRequested(("cuda", "cpu")),
        BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED),
        BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED, {"step": "verifying"}),
    )
    assert s.state is S.CHECKING and s.reason is R.CUDA_BUNDLE_INSTALL_FAILED
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), startup_failed("cuda", line="libcuda.so.1"))
    assert (
        s.state is S.CHECKING and s.effects == (CheckBackend("cpu", CPU_ORDER),) and s.reason is R.CUDA_STARTUP_FAILED
    )
    assert s.data.skipped[0].evidence == {"exit_reason": "server_crashed", "line": "libcuda.so.1"}


@pytest.mark.parametrize(
    "request_",
    [
        PlanRequested(("cuda", "cpu")),  # a user start or config change: no failure
        startup_failed("cuda", phase=ExitPhase.AFTER_READY),  # it was serving: not a failed start
        startup_failed("rocm"),  # about another backend than the one launching
    ],
)
def test_any_other_request_while_launching_starts_afresh(request_):
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), request_)
    assert s.state is S.CHECKING and s.effects[-1] == CheckBackend("cuda") and s.data.skipped == ()
    assert s.evidence["abandoned"] == "launching"


def test_a_cpu_server_that_never_got_ready_is_planned_afresh():
    """SIGILL before ready: the CPU is not skipped (nothing is left after it); the planner steps
    its variant down from the failure it is given."""
    s = drive(
        PlanRequested(("cuda", "cpu")),
        CheckFailed("cuda", R.GPU_MISSING),
        CheckPassed("cpu"),
        PlanRequested(
            ("cuda", "cpu"), previous_backend="cpu", failure=R.CPU_ILLEGAL_INSTRUCTION, phase=ExitPhase.NEVER_READY
        ),
    )
    assert s.state is S.CHECKING and s.data.index == 0 and s.data.skipped == ()
    assert s.data.cpu_variants == CPU_ORDER  # no build named as the one that faulted: none ruled out


def test_gpu_claimed_but_cpu_in_fact_settles_with_reason():
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda", ZERO_LAYERS))
    assert s.state is S.SETTLED and s.data.chosen == "cpu" and s.reason is R.CUDA_GPU_LAYERS_ZERO
    assert s.data.evidence["hint"] == ZERO_LAYERS.hint  # the plan's figures say why


@pytest.mark.parametrize(
    "failure, reason",
    [(CheckFailed("cuda", R.CUDA_UNAVAILABLE), R.CUDA_UNAVAILABLE), (startup_failed("cuda"), R.CUDA_STARTUP_FAILED)],
)
def test_forced_backend_never_falls_back(failure, reason):
    events = [PlanRequested(("cuda",), forced=True)]
    assert drive(*events).effects == (CheckBackend("cuda"),)  # nothing else to probe
    if isinstance(failure, PlanRequested):
        events.append(CheckPassed("cuda"))
    s = drive(*events, failure)
    assert s.state is S.FAILED and s.reason is reason
    assert s.effects == (GiveUp(reason, s.evidence),)
    assert s.evidence["forced"] is True


def test_forced_backend_still_installs_its_missing_bundle():
    s = drive(
        PlanRequested(("cuda",), forced=True), BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED)
    )
    assert s.state is S.INSTALLING
    s = drive(BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED), state=s.state, data=s.data)
    assert s.state is S.FAILED and s.reason is R.CUDA_BUNDLE_INSTALL_FAILED


def test_all_exhausted_fails_with_last_reason_and_summary():
    s = drive(
        PlanRequested(("cuda", "cpu")), CheckFailed("cuda", R.GPU_MISSING), CheckFailed("cpu", R.BUNDLE_BUILD_FAILED)
    )
    assert s.state is S.FAILED and s.reason is R.BUNDLE_BUILD_FAILED
    assert s.evidence["skipped"] == [
        {"backend": "cuda", "reason": "gpu_missing"},
        {"backend": "cpu", "reason": "bundle_build_failed"},
    ]


def test_results_for_another_backend_are_illegal_and_a_new_request_starts_over():
    s = drive(PlanRequested(("cuda", "cpu")))
    with pytest.raises(IllegalTransition):
        step(FALLBACK, s.state, s.data, CheckPassed("cpu"))
    with pytest.raises(IllegalTransition):
        drive(PlanRequested(()))
    with pytest.raises(IllegalTransition):
        drive(PlanRequested(("cuda", "cpu"), forced=True))
    over = drive(PlanRequested(("cpu",)), state=s.state, data=s.data)
    assert over.evidence["abandoned"] == "checking" and over.effects == (CheckBackend("cpu", CPU_ORDER),)
    again = drive(PlanRequested(("cpu",)), state=S.FAILED, data=s.data)
    assert again.data == FallbackData(candidates=("cpu",), cpu_variants=CPU_ORDER)


def test_a_respawned_server_is_proven_again_and_the_verdict_kept():
    settled = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda"))
    assert settled.data.chosen == "cuda" and settled.data.reason is None
    s = drive(LaunchSucceeded("cuda", ZERO_LAYERS), state=settled.state, data=settled.data)
    assert s.state is S.SETTLED and s.reason is R.CUDA_GPU_LAYERS_ZERO and s.evidence["after"] == "respawn"
    assert s.data.respawn_demotion == Demotion("cuda", R.CUDA_GPU_LAYERS_ZERO, proof_evidence("cuda", ZERO_LAYERS))
    # The demotion is the machine's new truth: what serves now, and why not the preferred one
    # (status's backend and fallback_reason read these, nothing beside the machine).
    assert s.data.chosen == "cpu" and s.data.reason is R.CUDA_GPU_LAYERS_ZERO
    assert s.data.evidence["after"] == "respawn" and s.data.evidence["offloaded_layers"] == 0
    kept = drive(LaunchSucceeded("cuda", adopted=True), state=s.state, data=s.data)
    assert kept.data == s.data  # the same process, nothing new
    cleared = drive(LaunchSucceeded("cuda"), state=s.state, data=s.data)
    assert cleared.data.respawn_demotion is None
    assert cleared.data.chosen == "cuda" and cleared.data.reason is None  # accelerated again
    with pytest.raises(IllegalTransition):
        step(FALLBACK, s.state, s.data, LaunchSucceeded("cpu"))


def test_a_respawn_accelerated_again_keeps_why_the_preferred_one_was_passed_over():
    """Settled on cuda after rocm was skipped: a demoted respawn says cuda_gpu_layers_zero, and
    the next accelerated respawn goes back to rocm's reason, not to None."""
    settled = drive(
        PlanRequested(("rocm", "cuda", "cpu")),
        CheckFailed("rocm", R.GPU_MISSING),
        CheckPassed("cuda"),
        LaunchSucceeded("cuda"),
    )
    assert settled.data.reason is R.GPU_MISSING
    demoted = drive(LaunchSucceeded("cuda", ZERO_LAYERS), state=settled.state, data=settled.data)
    assert demoted.data.reason is R.CUDA_GPU_LAYERS_ZERO and demoted.data.chosen == "cpu"
    again = drive(LaunchSucceeded("cuda"), state=demoted.state, data=demoted.data)
    assert again.data.reason is R.GPU_MISSING and again.data.chosen == "cuda"


# --- the CPU's builds ----------------------------------------------------------------------


def sigill(variant, **facts):
    """The MakePlan after a CPU server of `variant` died of SIGILL before it was ready."""
    return PlanRequested(
        ("cuda", "cpu"),
        previous_backend="cpu",
        previous_variant=variant,
        failure=R.CPU_ILLEGAL_INSTRUCTION,
        phase=ExitPhase.NEVER_READY,
        **facts,
    )


def test_after_a_sigill_the_cpu_steps_down_to_a_safer_build():
    s = drive(PlanRequested(("cpu",)))
    assert s.effects == (CheckBackend("cpu", ("avx2", "compat")),)
    s = drive(PlanRequested(("cpu",)), CheckPassed("cpu"), sigill("avx2"))
    assert s.effects[-1] == CheckBackend("cuda")  # the GPU first again: its check is not the CPU's
    s = drive(CheckFailed("cuda", R.GPU_MISSING), state=s.state, data=s.data)
    assert s.effects == (CheckBackend("cpu", ("compat",)),)  # avx2 faulted: only the safer build


def test_the_step_down_is_recorded_with_the_build_that_faulted():
    s = drive(sigill("avx2"))
    assert s.evidence["cpu_variants"] == ["compat"] and s.evidence["faulted_variant"] == "avx2"
    assert "cpu_variants" not in drive(PlanRequested(("cuda", "cpu"))).evidence  # nothing stepped down


@pytest.mark.parametrize(
    "setting, arch, faulted, order",
    [
        ("auto", "x86_64", None, ("avx2", "compat")),
        ("auto", "aarch64", None, ("compat", "avx2")),  # off x86 the safest first
        ("native", "x86_64", None, ("native", "avx2", "compat")),  # the user's build first
        ("compat", "x86_64", None, ("compat", "avx2")),
        ("native", "x86_64", "native", ("avx2", "compat")),
        ("auto", "x86_64", "compat", ("compat",)),  # nothing safer: the safest is tried again
        ("auto", "x86_64", "cuda12", ("avx2", "compat")),  # a GPU build's SIGILL rules out no CPU build
    ],
)
def test_which_cpu_builds_a_plan_may_use(setting, arch, faulted, order):
    failure = R.CPU_ILLEGAL_INSTRUCTION if faulted else None
    assert cpu_variant_order(setting, arch, failure, faulted) == order
    assert cpu_variant_order(setting, arch, R.SERVER_CRASHED, faulted) == cpu_variant_order(setting, arch)


# --- a missing bundle --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event, reason",
    [
        (BundleMissing("cuda", True, R.BINARY_MISSING_NVIDIA_DETECTED), R.BINARY_MISSING_NVIDIA_DETECTED),
        (BundleMissing("cuda", False, R.BINARY_MISSING_NVIDIA_DETECTED), R.BUNDLE_MISSING),  # no GPU seen
        (BundleMissing("cuda", True, None), R.BUNDLE_MISSING),  # a plugin that declares no code
    ],
)
def test_a_missing_bundle_is_installed_once_with_the_backends_code(event, reason):
    s = drive(PlanRequested(("cuda", "cpu")), event)
    assert s.state is S.INSTALLING and s.reason is reason and s.effects == (InstallBundle("cuda"),)
    s = drive(BundleInstalled("cuda"), event, state=s.state, data=s.data)
    assert s.state is S.CHECKING and s.data.skipped[-1].reason is reason


def test_a_check_that_failed_otherwise_is_never_repaired_by_an_install():
    s = drive(PlanRequested(("cuda", "cpu")), CheckFailed("cuda", R.CUDA_UNAVAILABLE))
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cpu", CPU_ORDER),)


# --- room on the GPUs --------------------------------------------------------------------------

RESERVE = 524  # CUDA's runtime share per GPU, measured on an H200


def vram(*free, layers="auto", reason=R.CUDA_VRAM_FULL, margin=1024):
    return VramCheck(
        FreeVram(dict(enumerate(free)), {i: "H200" for i in range(len(free))}), margin, RESERVE, layers, reason
    )


def test_a_gpu_without_room_for_a_layer_is_skipped_with_its_vram_full_code():
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda", vram=vram(699)))
    assert s.state is S.CHECKING and s.reason is R.CUDA_VRAM_FULL and s.effects == (CheckBackend("cpu", CPU_ORDER),)
    skipped = s.data.skipped[0].evidence
    assert skipped["free_vram_mib"] == {"0": 699} and "No cuda GPU has room for a layer" in skipped["message"]
    assert '["-fitt", "87"]' in skipped["hint"]  # 699 - 524 = 175 MiB left: half of it as the margin


def test_the_plan_gets_only_the_gpus_with_room():
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda", vram=vram(300, 143150)))
    assert s.state is S.LAUNCHING and s.effects == (UsePlan("cuda", (1,)),)
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda", vram=vram(9000, 143150)))
    assert s.effects == (UsePlan("cuda"),)  # every GPU has room: all of them


@pytest.mark.parametrize(
    "check",
    [vram(699, layers=8), vram(699, reason=None), VramCheck(None, 1024, RESERVE, "auto", R.CUDA_VRAM_FULL)],
    ids=["a fixed layer count", "no vram_full code", "nothing read"],
)
def test_the_engine_is_left_to_fit_where_stoker_cannot_judge(check):
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda", vram=check))
    assert s.state is S.LAUNCHING and s.effects == (UsePlan("cuda"),)


@given(
    free=st.lists(st.integers(0, 200_000), min_size=1, max_size=4),
    margin=st.integers(0, 4096),
    layers=st.sampled_from(["auto", 0, 12]),
)
def test_a_gpu_backend_is_skipped_exactly_when_no_gpu_has_room(free, margin, layers):
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda", vram=vram(*free, layers=layers, margin=margin)))
    room = [i for i, mib in enumerate(free) if mib >= RESERVE + margin]
    if layers == "auto" and not room:
        assert s.state is S.CHECKING and s.data.skipped[-1].reason is R.CUDA_VRAM_FULL
        return
    (use,) = s.effects
    assert s.state is S.LAUNCHING and use.backend == "cuda"
    assert use.devices == (tuple(room) if layers == "auto" and len(room) < len(free) else ())


# --- the proof of acceleration ----------------------------------------------------------------


@pytest.mark.parametrize(
    "proof, chosen, reason",
    [
        (AccelerationProof(25, 25, process_vram_mib=900), "cuda", None),
        (AccelerationProof(25, 25), "cuda", None),  # no per-process reading: the lines prove it
        (ZERO_LAYERS, "cpu", R.CUDA_GPU_LAYERS_ZERO),
        (AccelerationProof(25, 25, process_vram_mib=0), "cpu", R.GPU_CLAIMED_BUT_UNUSED),
        (
            AccelerationProof(3, 3, software_devices=("llvmpipe",), software_device=R.VULKAN_SOFTWARE_DEVICE),
            "cpu",
            R.VULKAN_SOFTWARE_DEVICE,
        ),
    ],
)
def test_a_ready_gpu_server_is_reported_as_what_it_proved(proof, chosen, reason):
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda", proof))
    assert s.state is S.SETTLED and (s.data.chosen, s.reason) == (chosen, reason)
    assert s.data.evidence["effective_backend"] == chosen


# --- serve now, upgrade beside ----------------------------------------------------------------

SLOW = BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED, slow=True)


def test_a_gpu_bundle_only_a_local_build_can_give_is_built_beside_while_the_cpu_serves():
    s = drive(PlanRequested(("cuda", "cpu")), SLOW)
    assert s.state is S.CHECKING and s.effects == (InstallBeside("cuda"), CheckBackend("cpu", CPU_ORDER))
    assert s.reason is R.GPU_ENGINE_BUILDING and s.data.building == ("cuda",)
    s = drive(CheckPassed("cpu"), LaunchSucceeded("cpu"), state=s.state, data=s.data)
    assert s.state is S.SETTLED and (s.data.chosen, s.data.reason) == ("cpu", R.GPU_ENGINE_BUILDING)
    assert s.effects == ()


def test_a_fast_source_or_a_forced_gpu_is_still_waited_for():
    fast = drive(PlanRequested(("cuda", "cpu")), attrs.evolve(SLOW, slow=False))
    assert fast.state is S.INSTALLING and fast.effects == (InstallBundle("cuda"),)
    forced = drive(PlanRequested(("cuda",), forced=True), SLOW)
    assert forced.state is S.INSTALLING and forced.effects == (InstallBundle("cuda"),)


def test_the_built_engine_switches_a_settled_cpu_server_to_the_gpu():
    s = drive(PlanRequested(("cuda", "cpu")), SLOW, CheckPassed("cpu"), LaunchSucceeded("cpu"))
    s = drive(EngineBuilt("cuda", {"seconds": 369}), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.effects == (Upgrade("cuda", "cpu"),) and s.reason is R.GPU_ENGINE_BUILT
    assert s.data.building == () and s.data.built == ("cuda",)
    # the planned restart re-plans from the first candidate: the GPU serves, no reason left
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda"), state=s.state, data=s.data)
    assert (s.data.chosen, s.data.reason, s.data.built, s.effects) == ("cuda", None, (), ())


def test_a_build_that_ends_while_the_cpu_is_launching_switches_once_it_is_ready():
    s = drive(PlanRequested(("cuda", "cpu")), SLOW, CheckPassed("cpu"), EngineBuilt("cuda"))
    assert s.state is S.LAUNCHING and s.effects == ()
    s = drive(LaunchSucceeded("cpu"), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.effects == (Upgrade("cuda", "cpu"),)


def test_a_new_request_while_building_serves_meanwhile_again():
    # The build is asked for again (the orchestrator runs one per backend; after a daemon
    # restart, this starts it again), and the request is not held for it.
    s = drive(PlanRequested(("cuda", "cpu")), SLOW, CheckPassed("cpu"), LaunchSucceeded("cpu"))
    s = drive(PlanRequested(("cuda", "cpu")), attrs.evolve(SLOW, slow=False), state=s.state, data=s.data)
    assert s.effects == (InstallBeside("cuda"), CheckBackend("cpu", CPU_ORDER)) and s.data.building == ("cuda",)


def test_a_failed_build_beside_says_so_and_keeps_serving():
    s = drive(PlanRequested(("cuda", "cpu")), SLOW, CheckPassed("cpu"), LaunchSucceeded("cpu"))
    s = drive(EngineBuildFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED, {"step": "compile"}), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.effects == () and s.data.building == ()
    assert s.data.reason is R.CUDA_BUNDLE_INSTALL_FAILED and s.data.skipped[0].reason is R.CUDA_BUNDLE_INSTALL_FAILED


def test_without_the_cuda_toolkit_a_vulkan_engine_built_beside_is_the_upgrade():
    # No mirror, no cache, no nvcc: the CUDA install fails at once (not slow, so tried in place);
    # Vulkan's build needs no toolkit, so it is built beside while the CPU serves, then switched to.
    order = ("cuda", "vulkan", "cpu")
    s = drive(PlanRequested(order), BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED))
    assert s.effects == (InstallBundle("cuda"),)
    s = drive(
        BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED, {"cause": "build_toolchain_missing"}),
        BundleMissing("vulkan", binary_missing=R.BINARY_MISSING_VULKAN_DETECTED, slow=True),
        state=s.state,
        data=s.data,
    )
    assert s.effects == (InstallBeside("vulkan"), CheckBackend("cpu", CPU_ORDER))
    s = drive(CheckPassed("cpu"), LaunchSucceeded("cpu"), EngineBuilt("vulkan"), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.effects == (Upgrade("vulkan", "cpu"),)
    # the restart's plan: CUDA still cannot be installed, Vulkan now can serve
    s = drive(
        PlanRequested(order),
        BundleMissing("cuda", binary_missing=R.BINARY_MISSING_NVIDIA_DETECTED),
        BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED),
        CheckPassed("vulkan"),
        LaunchSucceeded("vulkan"),
        state=s.state,
        data=s.data,
    )
    assert (s.data.chosen, s.data.reason, s.effects) == ("vulkan", R.CUDA_BUNDLE_INSTALL_FAILED, ())


def test_a_gpu_plan_its_proof_demotes_is_not_switched_to_again():
    s = drive(PlanRequested(("cuda", "cpu")), SLOW, CheckPassed("cpu"), LaunchSucceeded("cpu"), EngineBuilt("cuda"))
    s = drive(
        PlanRequested(("cuda", "cpu")),
        CheckPassed("cuda"),
        LaunchSucceeded("cuda", ZERO_LAYERS),
        state=s.state,
        data=s.data,
    )
    assert (s.data.chosen, s.reason, s.effects, s.data.built) == ("cpu", R.CUDA_GPU_LAYERS_ZERO, (), ())
