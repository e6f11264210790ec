"""The fallback orchestrator's table, driven directly."""

from __future__ import annotations

import pytest

from states.fallback import (
    FALLBACK,
    BundleInstalled,
    BundleInstallFailed,
    CheckBackend,
    CheckFailed,
    CheckPassed,
    Demotion,
    FallbackData,
    FallbackState as S,
    GiveUp,
    InstallBundle,
    LaunchSucceeded,
    PlanRequested,
    ProbeCandidates,
    UsePlan,
)
from states.launch_records import ExitPhase
from states.machine import IllegalTransition, step
from states.reasons import ReasonCode as R


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
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED, {"gpu": "H200"}, bundle_missing=True),
    )
    assert s.state is S.INSTALLING and s.effects == (InstallBundle("cuda"),)
    s = drive(BundleInstalled("cuda"), state=s.state, data=s.data)
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cuda"),)
    s = drive(CheckPassed("cuda"), LaunchSucceeded("cuda"), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.data.chosen == "cuda"


def test_install_is_tried_once_per_backend():
    s = drive(
        PlanRequested(("cuda", "cpu")),
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED, bundle_missing=True),
        BundleInstalled("cuda"),
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED, bundle_missing=True),
    )
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cpu"),)


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
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED, bundle_missing=True),
        BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED, {"step": "verifying"}),
    )
    assert s.state is S.CHECKING and s.reason is R.CUDA_BUNDLE_INSTALL_FAILED
    s = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), startup_failed("cuda", line="libcuda.so.1"))
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cpu"),) and s.reason is R.CUDA_STARTUP_FAILED
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


def test_gpu_claimed_but_cpu_in_fact_settles_with_reason():
    s = drive(
        PlanRequested(("cuda", "cpu")),
        CheckPassed("cuda"),
        LaunchSucceeded("cuda", effective_backend="cpu", reason=R.CUDA_GPU_LAYERS_ZERO),
    )
    assert s.state is S.SETTLED and s.data.chosen == "cpu" and s.reason is R.CUDA_GPU_LAYERS_ZERO


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
        PlanRequested(("cuda",), forced=True),
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED, bundle_missing=True),
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
    assert over.evidence["abandoned"] == "checking" and over.effects == (CheckBackend("cpu"),)
    again = drive(PlanRequested(("cpu",)), state=S.FAILED, data=s.data)
    assert again.data == FallbackData(candidates=("cpu",))


def test_a_respawned_server_is_proven_again_and_the_verdict_kept():
    settled = drive(PlanRequested(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda"))
    assert settled.data.chosen == "cuda" and settled.data.reason is None
    proof = {"offloaded_layers": 0}
    s = drive(LaunchSucceeded("cuda", "cpu", R.CUDA_GPU_LAYERS_ZERO, proof), state=settled.state, data=settled.data)
    assert s.state is S.SETTLED and s.reason is R.CUDA_GPU_LAYERS_ZERO and s.evidence["after"] == "respawn"
    assert s.data.respawn_demotion == Demotion("cuda", R.CUDA_GPU_LAYERS_ZERO, proof)
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
    demoted = drive(LaunchSucceeded("cuda", "cpu", R.CUDA_GPU_LAYERS_ZERO), state=settled.state, data=settled.data)
    assert demoted.data.reason is R.CUDA_GPU_LAYERS_ZERO and demoted.data.chosen == "cpu"
    again = drive(LaunchSucceeded("cuda"), state=demoted.state, data=demoted.data)
    assert again.data.reason is R.GPU_MISSING and again.data.chosen == "cuda"
