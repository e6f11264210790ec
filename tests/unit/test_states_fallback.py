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
    FallbackCancelled,
    FallbackData,
    FallbackStarted,
    FallbackState as S,
    GiveUp,
    InstallBundle,
    LaunchFailed,
    LaunchSucceeded,
    UsePlan,
)
from states.machine import IllegalTransition, step
from states.reasons import ReasonCode as R


def drive(*events, state=S.IDLE, data=None):
    data = FallbackData() if data is None else data
    result = None
    for event in events:
        result = step(FALLBACK, state, data, event)
        state, data = result.state, result.data
    return result


def test_preferred_backend_works():
    s = drive(FallbackStarted(("cuda", "cpu")))
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cuda"),)
    s = drive(FallbackStarted(("cuda", "cpu")), CheckPassed("cuda"))
    assert s.state is S.LAUNCHING and s.effects == (UsePlan("cuda"),)
    s = drive(FallbackStarted(("cuda", "cpu")), CheckPassed("cuda"), LaunchSucceeded("cuda", evidence={"layers": 25}))
    assert s.state is S.SETTLED and s.data.chosen == "cuda" and s.reason is None


def test_missing_bundle_on_present_hardware_installs_rechecks_retries():
    s = drive(FallbackStarted(("cuda", "cpu")), CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED, {"gpu": "H200"}))
    assert s.state is S.INSTALLING and s.effects == (InstallBundle("cuda"),)
    s = drive(BundleInstalled("cuda"), state=s.state, data=s.data)
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cuda"),)
    s = drive(CheckPassed("cuda"), LaunchSucceeded("cuda"), state=s.state, data=s.data)
    assert s.state is S.SETTLED and s.data.chosen == "cuda"


def test_install_is_tried_once_per_backend():
    s = drive(
        FallbackStarted(("cuda", "cpu")),
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED),
        BundleInstalled("cuda"),
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED),
    )
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cpu"),)


def test_other_failures_move_on_with_reason_cpu_last():
    s = drive(
        FallbackStarted(("cuda", "vulkan", "cpu")),
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
        FallbackStarted(("cuda", "cpu")),
        CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED),
        BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED, {"step": "verifying"}),
    )
    assert s.state is S.CHECKING and s.reason is R.CUDA_BUNDLE_INSTALL_FAILED
    s = drive(FallbackStarted(("cuda", "cpu")), CheckPassed("cuda"), LaunchFailed("cuda", R.CUDA_STARTUP_FAILED))
    assert s.state is S.CHECKING and s.effects == (CheckBackend("cpu"),)


def test_gpu_claimed_but_cpu_in_fact_settles_with_reason():
    s = drive(FallbackStarted(("cuda", "cpu")), CheckPassed("cuda"),
              LaunchSucceeded("cuda", effective_backend="cpu", reason=R.CUDA_GPU_LAYERS_ZERO))
    assert s.state is S.SETTLED and s.data.chosen == "cpu" and s.reason is R.CUDA_GPU_LAYERS_ZERO


@pytest.mark.parametrize(
    "failure",
    [
        CheckFailed("cuda", R.CUDA_UNAVAILABLE),
        LaunchFailed("cuda", R.CUDA_STARTUP_FAILED),
    ],
)
def test_forced_backend_never_falls_back(failure):
    events = [FallbackStarted(("cuda",), forced=True)]
    if isinstance(failure, LaunchFailed):
        events.append(CheckPassed("cuda"))
    s = drive(*events, failure)
    assert s.state is S.FAILED and s.reason is failure.reason
    assert s.effects == (GiveUp(failure.reason, s.evidence),)
    assert s.evidence["forced"] is True


def test_forced_backend_still_installs_its_missing_bundle():
    s = drive(FallbackStarted(("cuda",), forced=True), CheckFailed("cuda", R.BINARY_MISSING_NVIDIA_DETECTED))
    assert s.state is S.INSTALLING
    s = drive(BundleInstallFailed("cuda", R.CUDA_BUNDLE_INSTALL_FAILED), state=s.state, data=s.data)
    assert s.state is S.FAILED and s.reason is R.CUDA_BUNDLE_INSTALL_FAILED


def test_all_exhausted_fails_with_last_reason_and_summary():
    s = drive(FallbackStarted(("cuda", "cpu")), CheckFailed("cuda", R.GPU_MISSING), CheckFailed("cpu", R.BUNDLE_BUILD_FAILED))
    assert s.state is S.FAILED and s.reason is R.BUNDLE_BUILD_FAILED
    assert s.evidence["skipped"] == [{"backend": "cuda", "reason": "gpu_missing"}, {"backend": "cpu", "reason": "bundle_build_failed"}]


def test_results_for_another_backend_are_illegal_and_cancel_works():
    s = drive(FallbackStarted(("cuda", "cpu")))
    with pytest.raises(IllegalTransition):
        step(FALLBACK, s.state, s.data, CheckPassed("cpu"))
    with pytest.raises(IllegalTransition):
        drive(FallbackStarted(()))
    with pytest.raises(IllegalTransition):
        drive(FallbackStarted(("cuda", "cpu"), forced=True))
    assert drive(FallbackCancelled(), state=s.state, data=s.data).state is S.IDLE
    again = drive(FallbackStarted(("cpu",)), state=S.FAILED, data=s.data)
    assert again.data == FallbackData(candidates=("cpu",))
