"""The fallback orchestrator: one per launch request, from the preferred backend to CPU.

    idle -> checking(backend) -> launching(backend) -> settled
                 |  ^
                 v  | (bundle installed: re-check)
             installing(backend)
    any failure -> record (backend, reason, evidence) -> checking(next) ... -> failed

Only a missing bundle on present hardware (binary_missing_*_detected, bundle_missing) is
repaired in place: install once, re-check, retry. Every other failure is recorded and the
next candidate is tried, CPU last (the daemon orders the candidates). A forced backend has
no next candidate: its first unrepaired failure ends in `failed` with that reason.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from states.machine import MachineSpec, Step, guarded
from states.reasons import ReasonCode


class FallbackState(enum.StrEnum):
    IDLE = "idle"
    CHECKING = "checking"
    INSTALLING = "installing"
    LAUNCHING = "launching"
    SETTLED = "settled"
    FAILED = "failed"


# Failures that an install repairs: the hardware is there, only the engine is missing.
INSTALLABLE = frozenset(
    {
        ReasonCode.BINARY_MISSING_NVIDIA_DETECTED,
        ReasonCode.BINARY_MISSING_AMD_DETECTED,
        ReasonCode.BINARY_MISSING_VULKAN_DETECTED,
        ReasonCode.BINARY_MISSING_METAL_DETECTED,
        ReasonCode.BUNDLE_MISSING,
    }
)


def _evidence(value: Any) -> dict[str, Any]:
    return dict(value or {})


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.frozen
class Skipped:
    """One backend given up on, and why."""

    backend: str
    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class FallbackData:
    candidates: tuple[str, ...] = attrs.field(default=(), converter=_names)
    index: int = 0
    forced: bool = False
    installed: tuple[str, ...] = attrs.field(default=(), converter=_names)  # installs tried
    skipped: tuple[Skipped, ...] = attrs.field(default=(), converter=tuple)
    chosen: str | None = None  # the backend the server really runs on, once settled
    reason: ReasonCode | None = None  # why not the preferred one (or why failed)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)

    @property
    def current(self) -> str | None:
        return self.candidates[self.index] if self.index < len(self.candidates) else None


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class FallbackStarted:
    """Try these backends in order (CPU last); `forced`: exactly one, no fallback."""

    candidates: tuple[str, ...] = attrs.field(converter=_names)
    forced: bool = False


@attrs.frozen
class CheckPassed:
    """The backend's hardware and bundle are there."""

    backend: str
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class CheckFailed:
    """The backend cannot run, and why."""

    backend: str
    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class BundleInstalled:
    """The missing bundle was installed: check again."""

    backend: str


@attrs.frozen
class BundleInstallFailed:
    backend: str
    reason: ReasonCode  # cuda_bundle_install_failed or its analogue
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class LaunchSucceeded:
    """The server is ready. `effective_backend`/`reason` when it is not really accelerated
    (cuda_gpu_layers_zero, gpu_claimed_but_unused): it serves, and says why on CPU."""

    backend: str
    effective_backend: str | None = None
    reason: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class LaunchFailed:
    """The server on this backend failed (cuda_startup_failed, ...)."""

    backend: str
    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class FallbackCancelled:
    """The launch was called off (the user stopped the server)."""


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class CheckBackend:
    """Probe the backend and look for its installed bundle; CheckPassed or CheckFailed."""

    backend: str


@attrs.frozen
class InstallBundle:
    """Run the install machine for this backend; BundleInstalled or BundleInstallFailed."""

    backend: str


@attrs.frozen
class UsePlan:
    """Plan the launch on this backend (the launch machine's PlanReady)."""

    backend: str


@attrs.frozen
class GiveUp:
    """No backend is left (or the forced one failed): the launch machine's PlanFailed."""

    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


S = FallbackState


def _next(data: FallbackData, backend: str, reason: ReasonCode, evidence: dict[str, Any]) -> Step:
    """Record why `backend` is out and try the next candidate, or fail."""
    skipped = data.skipped + (Skipped(backend, reason, evidence),)
    data = attrs.evolve(data, skipped=skipped, reason=data.reason or reason)
    if not data.forced and data.index + 1 < len(data.candidates):
        data = attrs.evolve(data, index=data.index + 1)
        return Step(S.CHECKING, data, (CheckBackend(data.candidates[data.index]),), reason,
                    {"backend": backend, "next": data.candidates[data.index], **evidence})
    summary = {
        "forced": data.forced,
        "skipped": [{"backend": s.backend, "reason": str(s.reason)} for s in skipped],
        **evidence,
    }
    data = attrs.evolve(data, reason=reason, evidence=summary)
    return Step(S.FAILED, data, (GiveUp(reason, summary),), reason, summary)


@guarded(S.CHECKING)
def started(state: S, data: FallbackData, event: FallbackStarted) -> Step | None:
    if not event.candidates or (event.forced and len(event.candidates) != 1):
        return None
    data = FallbackData(candidates=event.candidates, forced=event.forced)
    return Step(S.CHECKING, data, (CheckBackend(event.candidates[0]),),
                evidence={"candidates": list(event.candidates), "forced": event.forced})


@guarded(S.LAUNCHING)
def check_passed(state: S, data: FallbackData, event: CheckPassed) -> Step | None:
    if event.backend != data.current:
        return None
    return Step(S.LAUNCHING, data, (UsePlan(event.backend),), evidence=event.evidence)


@guarded(S.INSTALLING, S.CHECKING, S.FAILED)
def check_failed(state: S, data: FallbackData, event: CheckFailed) -> Step | None:
    if event.backend != data.current:
        return None
    if event.reason in INSTALLABLE and event.backend not in data.installed:
        data = attrs.evolve(data, installed=data.installed + (event.backend,))
        return Step(S.INSTALLING, data, (InstallBundle(event.backend),), event.reason, event.evidence)
    return _next(data, event.backend, event.reason, event.evidence)


@guarded(S.CHECKING)
def installed(state: S, data: FallbackData, event: BundleInstalled) -> Step | None:
    if event.backend != data.current:
        return None
    return Step(S.CHECKING, data, (CheckBackend(event.backend),), evidence={"installed": event.backend})


@guarded(S.CHECKING, S.FAILED)
def install_failed(state: S, data: FallbackData, event: BundleInstallFailed) -> Step | None:
    if event.backend != data.current:
        return None
    return _next(data, event.backend, event.reason, event.evidence)


@guarded(S.SETTLED)
def launched(state: S, data: FallbackData, event: LaunchSucceeded) -> Step | None:
    if event.backend != data.current:
        return None
    effective = event.effective_backend or event.backend
    preferred = data.candidates[0]
    reason = event.reason or (data.reason if effective != preferred else None)
    evidence = {"backend": event.backend, "effective_backend": effective, **event.evidence}
    data = attrs.evolve(data, chosen=effective, reason=reason, evidence=evidence)
    return Step(S.SETTLED, data, (), reason, evidence)


@guarded(S.CHECKING, S.FAILED)
def launch_failed(state: S, data: FallbackData, event: LaunchFailed) -> Step | None:
    if event.backend != data.current:
        return None
    return _next(data, event.backend, event.reason, event.evidence)


@guarded(S.IDLE)
def cancelled(state: S, data: FallbackData, event: FallbackCancelled) -> Step:
    return Step(S.IDLE, data, evidence={"cancelled_in": state.value})


_CANCEL = {FallbackCancelled: cancelled}

TRANSITIONS: dict[FallbackState, dict[type, Any]] = {
    S.IDLE: {FallbackStarted: started},
    S.CHECKING: {CheckPassed: check_passed, CheckFailed: check_failed, **_CANCEL},
    S.INSTALLING: {BundleInstalled: installed, BundleInstallFailed: install_failed, **_CANCEL},
    S.LAUNCHING: {LaunchSucceeded: launched, LaunchFailed: launch_failed, **_CANCEL},
    S.SETTLED: {FallbackStarted: started},
    S.FAILED: {FallbackStarted: started},
}

FALLBACK = MachineSpec(
    name="fallback",
    states=FallbackState,
    initial=S.IDLE,
    data_type=FallbackData,
    transitions=TRANSITIONS,
    terminal={S.IDLE, S.SETTLED, S.FAILED},
    description="Preferred backend first, install a missing bundle once, CPU last; forced never falls back.",
    effect_types=(CheckBackend, InstallBundle, UsePlan, GiveUp),
)
