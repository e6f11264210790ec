"""The fallback machine: one per server instance, from the preferred backend to CPU.

    idle -> checking(backend) -> launching(backend) -> settled
                 |  ^
                 v  | (bundle installed: re-check)
             installing(backend)
    any failure -> record (backend, reason, evidence) -> checking(next) ... -> failed

Every launch request (the launch machine's MakePlan) arrives as `PlanRequested` with its
facts, and this table decides what it means: a non-CPU candidate whose server died before it
was ever ready is recorded as `<backend>_startup_failed` (the backend's own code, carried in
the event) and the next candidate is checked; anything else starts afresh from the first.
Only a missing bundle (`BundleMissing`: binary_missing_*_detected on present hardware, else
bundle_missing) is repaired in place: install once, re-check, retry. A GPU's bundle that only
a local build can give (no mirror entry, no build-cache hit: `slow`) is not waited for: it is
built beside (`InstallBeside`), the backend is recorded as `gpu_engine_building` and the next
candidate serves at once; once that build is installed (`EngineBuilt`), a server settled on a
later candidate is switched to the GPU by a planned restart (`Upgrade`, `gpu_engine_built`). A GPU check that passed
is judged on its free-VRAM reading (states/fallback/vram.py): no GPU with room for a layer
skips the backend with its vram_full code, and the plan gets only the GPUs with room. Every
other failure is recorded and the next candidate is tried, CPU last (the daemon orders the
candidates). The CPU's builds are tried fastest first; after a SIGILL, every build at or
above the one that faulted is out (`cpu_variant_order`). A forced backend has
no next candidate: its first unrepaired failure ends in `failed` with that reason. Once
settled, a server respawned with the same plan is proven again on every ready: one that is
no longer accelerated is a transition to the CPU with its reason (`chosen`, `reason`; the
proof is kept as `respawn_demotion`), one accelerated again is a transition back. Whether a
ready server is really accelerated is states/fallback/proof.py's verdict on what it proved.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.fallback.proof import AccelerationProof, acceleration_verdict, proof_evidence
from stoker.states.fallback.vram import VramCheck, devices_of, no_room
from stoker.states.launch.records import CPU_BACKEND, ExitPhase
from stoker.states.machine import (
    STAY,
    Failure,
    MachineSpec,
    Rule,
    Step,
    guarded,
    step_with_reason,
    as_evidence,
    as_tuple,
    int_tuple,
    str_tuple,
)
from stoker.states.reasons import ReasonCode, message_for


class FallbackState(enum.StrEnum):
    IDLE = "idle"
    CHECKING = "checking"
    INSTALLING = "installing"
    LAUNCHING = "launching"
    SETTLED = "settled"
    FAILED = "failed"


# The CPU builds from the fastest to the safest; `native` only when the user asks for it.
CPU_VARIANTS_BY_SAFETY = ("avx2", "compat")
X86 = frozenset({"x86_64", "amd64"})


def cpu_variant_order(
    setting: str, arch: str, failure: ReasonCode | None = None, faulted: str | None = None
) -> tuple[str, ...]:
    """The CPU builds to try, best first: `[backend] cpu_variant` first when set, the safest
    first off x86; after a SIGILL of the `faulted` build, every build at or above it is out
    (the safest stays)."""
    if setting != "auto":
        order = (setting, *(v for v in CPU_VARIANTS_BY_SAFETY if v != setting))
    elif arch.lower() in X86:
        order = CPU_VARIANTS_BY_SAFETY
    else:
        order = tuple(reversed(CPU_VARIANTS_BY_SAFETY))
    if failure == ReasonCode.CPU_ILLEGAL_INSTRUCTION and faulted in order:
        order = order[order.index(faulted) + 1 :] or (CPU_VARIANTS_BY_SAFETY[-1],)
    return order


@attrs.frozen
class BackendReason:
    """A backend, the reason code said of it, and the evidence that decided."""

    backend: str
    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class Skipped(BackendReason):
    """One backend given up on, and why."""


@attrs.frozen
class Demotion(BackendReason):
    """A server on `backend` that serves but is not really accelerated, and the proof."""


@attrs.frozen
class FallbackData:
    candidates: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    index: int = 0
    forced: bool = False
    installed: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)  # installs tried
    skipped: tuple[Skipped, ...] = attrs.field(default=(), converter=as_tuple)
    chosen: str | None = None  # the backend the server really runs on, once settled
    reason: ReasonCode | None = None  # why not the preferred one (or why failed)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    # Settled, then the same plan respawned after a crash and found not really accelerated.
    respawn_demotion: Demotion | None = None
    cpu_variants: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)  # the CPU builds to try, best first
    # GPU bundles being built beside while a later candidate serves, and those built since
    # (installed, not yet served): both outlive a new request, as the builds do.
    building: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    built: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    @property
    def current(self) -> str | None:
        return self.candidates[self.index] if self.index < len(self.candidates) else None


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class PlanRequested:
    """The launch machine asked for a plan (its MakePlan), with the facts of the request:
    the backends to try for the config in use (CPU last; `forced`: exactly that one) and,
    when a crash asked for the new plan, the previous plan's backend, the exit's reason and
    phase, that backend's own reason code for a start that failed (a plugin's fact), and
    the evidence that decided the exit (its line, a missing library, the log's tail). For the
    CPU's builds: `[backend] cpu_variant`, the machine's architecture and the previous plan's
    build (`previous_variant`)."""

    candidates: tuple[str, ...] = attrs.field(converter=str_tuple)
    forced: bool = False
    previous_backend: str | None = None
    previous_variant: str | None = None
    cpu_variant: str = "auto"
    arch: str = "x86_64"
    failure: ReasonCode | None = None
    phase: ExitPhase | None = None
    startup_failed: ReasonCode = ReasonCode.SERVER_CRASHED
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class CheckPassed:
    """The backend's hardware and a bundle that fits it are there; for a GPU, with the free
    VRAM read now (`vram`), from which the table decides whether any GPU has room for a layer
    and which GPUs the server gets."""

    backend: str
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    vram: VramCheck | None = None


@attrs.frozen
class CheckFailed(BackendReason):
    """The backend cannot run, and why, as its probe or plugin classified it."""


@attrs.frozen
class BundleMissing:
    """Usable hardware (or the CPU) and no engine bundle installed for it: the one failure an
    install repairs. `present`: the hardware is there; `binary_missing`: the backend's own
    code for that (binary_missing_*_detected; None where it declares none). `slow`: the
    install's first source that has one is a local build (no mirror entry, no build-cache
    hit): minutes to an hour, not worth serving nothing for."""

    backend: str
    present: bool = True
    binary_missing: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    slow: bool = False


@attrs.frozen
class BundleInstalled:
    """The missing bundle was installed: check again."""

    backend: str


@attrs.frozen
class BundleInstallFailed(BackendReason):
    """The missing bundle could not be installed: `reason` is cuda_bundle_install_failed or its analogue."""


@attrs.frozen
class EngineBuilt:
    """A bundle being built beside (InstallBeside) is installed."""

    backend: str
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class EngineBuildFailed(BackendReason):
    """A bundle being built beside could not be installed (the backend's install_failed code)."""


@attrs.frozen
class LaunchSucceeded:
    """The server is ready, with what its launch proved (`proof`, for a GPU plan): one not
    really accelerated (cuda_gpu_layers_zero, gpu_claimed_but_unused) serves, and the table
    says why on CPU. `adopted`: a server kept across a daemon restart, nothing new to prove."""

    backend: str
    proof: AccelerationProof | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    adopted: bool = False


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class ProbeCandidates:
    """Probe these backends at once (each in its own process), so that every check that
    follows reads a fresh cache instead of probing in turn. Nothing to answer."""

    backends: tuple[str, ...] = attrs.field(converter=str_tuple)


@attrs.frozen
class CheckBackend:
    """Probe the backend and look for its installed bundle (for the CPU: the first of
    `cpu_variants` installed); CheckPassed, CheckFailed or BundleMissing."""

    backend: str
    cpu_variants: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)


@attrs.frozen
class InstallBundle:
    """Run the install machine for this backend; BundleInstalled or BundleInstallFailed."""

    backend: str


@attrs.frozen
class InstallBeside:
    """Run the install machine for this backend in the background (the plan goes on without
    it); EngineBuilt or EngineBuildFailed when it ends. One already running is not repeated."""

    backend: str


@attrs.frozen
class Upgrade:
    """Restart the server to re-plan it (a planned restart: requests held, conversations
    saved and restored): `backend`, preferred to the one serving, is installed now."""

    backend: str
    serving: str


@attrs.frozen
class UsePlan:
    """Plan the launch on this backend (the launch machine's PlanReady), on `devices` (the GPUs
    with room for a layer when not all have it; empty: all of them)."""

    backend: str
    devices: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)


@attrs.frozen
class GiveUp(Failure):
    """No backend is left (or the forced one failed): the launch machine's PlanFailed."""


Effect = ProbeCandidates | CheckBackend | InstallBundle | InstallBeside | Upgrade | UsePlan | GiveUp

S = FallbackState


def _check(data: FallbackData, backend: str) -> CheckBackend:
    """Check `backend`; the CPU with the builds this request may use."""
    return CheckBackend(backend, data.cpu_variants if backend == CPU_BACKEND else ())


def _next(data: FallbackData, backend: str, reason: ReasonCode, evidence: dict[str, Any]) -> Step:
    """Record why `backend` is out and try the next candidate, or fail."""
    skipped = data.skipped + (Skipped(backend, reason, evidence),)
    data = attrs.evolve(data, skipped=skipped, reason=_headline(skipped))
    if not data.forced and data.index + 1 < len(data.candidates):
        data = attrs.evolve(data, index=data.index + 1)
        return Step(
            S.CHECKING,
            data,
            (_check(data, data.candidates[data.index]),),
            reason,
            {"backend": backend, "next": data.candidates[data.index], **evidence},
        )
    summary = {
        "forced": data.forced,
        "skipped": [{"backend": s.backend, "reason": str(s.reason)} for s in skipped],
        **evidence,
    }
    return step_with_reason(S.FAILED, data, (GiveUp(reason, summary),), reason, summary)


# An RPC worker's failure is the worker's, never the local backend's: the new plan checks the
# workers again (states/fleet/rpc_placement.py) on the same backend. A stall asks for a new plan
# only when the plan used workers (states/launch/exits.py `judge_stall`): a worker held it.
_WORKER_FAILURES = frozenset({ReasonCode.RPC_WORKER_LOST, ReasonCode.RPC_VERSION_MISMATCH, ReasonCode.SERVER_STALLED})


def _startup_failed(data: FallbackData, event: PlanRequested) -> bool:
    """The candidate being launched got a server that died before it was ever ready (not
    because an RPC worker failed it)."""
    return (
        event.failure is not None
        and event.failure not in _WORKER_FAILURES
        and event.phase is ExitPhase.NEVER_READY
        and event.previous_backend == data.current
        and event.previous_backend != CPU_BACKEND
    )


@guarded(S.CHECKING, S.FAILED)
def requested(state: S, data: FallbackData, event: PlanRequested) -> Step | None:
    """A launch request: the next candidate after a failed start, else afresh from the first."""
    if state is S.LAUNCHING and _startup_failed(data, event):
        backend = data.candidates[data.index]
        return _next(data, backend, event.startup_failed, {"exit_reason": str(event.failure), **event.evidence})
    if not event.candidates or (event.forced and len(event.candidates) != 1):
        return None
    variants = cpu_variant_order(event.cpu_variant, event.arch, event.failure, event.previous_variant)
    data = FallbackData(
        candidates=event.candidates,
        forced=event.forced,
        cpu_variants=variants,
        building=data.building,  # a build beside is not started twice
        built=data.built,
    )
    others = tuple(b for b in event.candidates if b != CPU_BACKEND)
    effects: tuple[Effect, ...] = (_check(data, event.candidates[0]),)
    if others and not event.forced:
        effects = (ProbeCandidates(others), *effects)
    evidence: dict[str, Any] = {"candidates": list(event.candidates), "forced": event.forced}
    if variants != cpu_variant_order(event.cpu_variant, event.arch):
        evidence["cpu_variants"] = list(variants)  # stepped down after a SIGILL
        evidence["faulted_variant"] = event.previous_variant
    if state in (S.CHECKING, S.INSTALLING, S.LAUNCHING):
        evidence["abandoned"] = state.value  # an earlier request never finished
    return Step(S.CHECKING, data, effects, evidence=evidence)


@guarded(S.LAUNCHING, S.CHECKING, S.FAILED)
def check_passed(state: S, data: FallbackData, event: CheckPassed) -> Step | None:
    """Plan on the backend, on the GPUs with room for a layer; none with room: skip it."""
    if event.backend != data.current:
        return None
    if event.vram is None:
        return Step(S.LAUNCHING, data, (UsePlan(event.backend),), evidence=event.evidence)
    full = no_room(event.backend, event.vram)
    if full is not None:
        return _next(data, event.backend, *full)
    return Step(S.LAUNCHING, data, (UsePlan(event.backend, devices_of(event.vram)),), evidence=event.evidence)


@guarded(S.CHECKING, S.FAILED)
def check_failed(state: S, data: FallbackData, event: CheckFailed) -> Step | None:
    if event.backend != data.current:
        return None
    return _next(data, event.backend, event.reason, event.evidence)


def missing_reason(event: BundleMissing) -> ReasonCode:
    """A missing bundle's code: the backend's binary_missing code when its hardware is there."""
    if event.present and event.binary_missing is not None:
        return event.binary_missing
    return ReasonCode.BUNDLE_MISSING


@guarded(S.INSTALLING, S.CHECKING, S.FAILED)
def bundle_missing(state: S, data: FallbackData, event: BundleMissing) -> Step | None:
    """Install a missing bundle once, then check again; missing again: the next candidate."""
    if event.backend != data.current:
        return None
    reason = missing_reason(event)
    if (event.slow or event.backend in data.building) and _can_serve_meanwhile(data, event.backend):
        return _build_beside(data, event, reason)
    if event.backend not in data.installed:
        data = attrs.evolve(data, installed=data.installed + (event.backend,))
        return Step(S.INSTALLING, data, (InstallBundle(event.backend),), reason, event.evidence)
    return _next(data, event.backend, reason, event.evidence)


def _can_serve_meanwhile(data: FallbackData, backend: str) -> bool:
    """A GPU backend, not forced, with a candidate after it to serve while it is built."""
    return backend != CPU_BACKEND and not data.forced and data.index + 1 < len(data.candidates)


def _build_beside(data: FallbackData, event: BundleMissing, missing: ReasonCode) -> Step:
    """Build the bundle in the background and serve on the next candidate meanwhile."""
    evidence = {**event.evidence, "missing": str(missing), "building": event.backend}
    if "message" in evidence:  # the check's own sentence stays as detail; this one says what happens
        evidence["detail"] = evidence.pop("message")
    evidence["message"] = message_for(ReasonCode.GPU_ENGINE_BUILDING)
    if event.backend not in data.building:
        data = attrs.evolve(
            data, installed=data.installed + (event.backend,), building=data.building + (event.backend,)
        )
    step = _next(data, event.backend, ReasonCode.GPU_ENGINE_BUILDING, evidence)
    # Asked again for a build already running: the orchestrator runs one per backend, and a
    # daemon restarted mid-build (its `building` read back, its task gone) starts it again.
    return attrs.evolve(step, effects=(InstallBeside(event.backend), *step.effects))


def _ranks_before(data: FallbackData, backend: str, serving: str | None) -> bool:
    """`backend` is a candidate tried before the one serving."""
    if backend not in data.candidates:
        return False
    if serving is None or serving not in data.candidates:
        return True
    return data.candidates.index(backend) < data.candidates.index(serving)


def _upgrades(data: FallbackData) -> tuple[Effect, ...]:
    """Settled on a plan for `current`: the planned restart onto a built bundle ranked before
    it (the first). Against the planned backend, not the proven one: a GPU plan demoted to the
    CPU by its proof was already given its chance."""
    better = [b for b in data.built if _ranks_before(data, b, data.current)]
    return (Upgrade(better[0], data.current or ""),) if better else ()


@guarded(STAY)
def engine_built(state: S, data: FallbackData, event: EngineBuilt) -> Step | None:
    """A build beside is installed: settled on a later candidate, switch to it now (a planned
    restart re-plans from the first candidate); anywhere else, when the launch in progress
    settles."""
    building = tuple(b for b in data.building if b != event.backend)
    built = data.built + (() if event.backend in data.built else (event.backend,))
    data = attrs.evolve(data, building=building, built=built)
    evidence = {"backend": event.backend, "serving": data.chosen, **event.evidence}
    effects = _upgrades(data) if state is S.SETTLED else ()
    if not effects:
        return Step(state, data, (), evidence=evidence)
    return Step(state, data, effects, ReasonCode.GPU_ENGINE_BUILT, evidence)


@guarded(STAY)
def engine_build_failed(state: S, data: FallbackData, event: EngineBuildFailed) -> Step | None:
    """A build beside failed: the backend's skip (and the reason shown, when it was the one
    that said "building") becomes the install's failure."""
    building = tuple(b for b in data.building if b != event.backend)
    skipped = tuple(
        Skipped(s.backend, event.reason, {**s.evidence, **event.evidence})
        if s.backend == event.backend and s.reason == ReasonCode.GPU_ENGINE_BUILDING
        else s
        for s in data.skipped
    )
    data = attrs.evolve(data, building=building, skipped=skipped, reason=_headline(skipped) or data.reason)
    return Step(state, data, (), event.reason, {"backend": event.backend, **event.evidence})


@guarded(S.CHECKING)
def installed(state: S, data: FallbackData, event: BundleInstalled) -> Step | None:
    if event.backend != data.current:
        return None
    return Step(S.CHECKING, data, (_check(data, event.backend),), evidence={"installed": event.backend})


@guarded(S.CHECKING, S.FAILED)
def install_failed(state: S, data: FallbackData, event: BundleInstallFailed) -> Step | None:
    if event.backend != data.current:
        return None
    return _next(data, event.backend, event.reason, event.evidence)


def _headline(skipped: tuple[Skipped, ...]) -> ReasonCode | None:
    """The one reason for all the skips: a GPU engine being built (there is a GPU, and it will
    be used), else the first candidate's."""
    building = [s for s in skipped if s.reason == ReasonCode.GPU_ENGINE_BUILDING]
    first = (building or list(skipped))[:1]
    return first[0].reason if first else None


def _passed_over(data: FallbackData, effective: str) -> ReasonCode | None:
    """Why the preferred backend is not the one serving: the first candidate's skip reason, or
    that a GPU engine is being built (None when the preferred one serves)."""
    if effective == data.candidates[0] or not data.skipped:
        return None
    return _headline(data.skipped)


def _proven(event: LaunchSucceeded) -> tuple[str, ReasonCode | None, dict[str, Any]]:
    """The backend really serving, why not the planned one (None: it is), and the proof."""
    if event.proof is None:
        return event.backend, None, event.evidence
    demoted = acceleration_verdict(event.proof)
    evidence = {**proof_evidence(event.backend, event.proof), **event.evidence}
    return (event.backend if demoted is None else CPU_BACKEND), demoted, evidence


@guarded(S.SETTLED)
def launched(state: S, data: FallbackData, event: LaunchSucceeded) -> Step | None:
    if event.backend != data.current:
        return None
    effective, demoted, proof = _proven(event)
    reason = demoted or _passed_over(data, effective)
    evidence = {"backend": event.backend, "effective_backend": effective, **proof}
    step = step_with_reason(S.SETTLED, data, (), reason, evidence, chosen=effective, respawn_demotion=None)
    built = tuple(b for b in step.data.built if _ranks_before(step.data, b, event.backend))
    settled = attrs.evolve(step.data, built=built)  # planned now, or never to be switched to
    return attrs.evolve(step, data=settled, effects=_upgrades(settled))


@guarded(STAY)
def relaunched(state: S, data: FallbackData, event: LaunchSucceeded) -> Step | None:
    """Settled, and the same plan is ready again after a crash: proven again every time (an
    adopted server has nothing new to prove and keeps what was found before). The verdict is
    the machine's new truth: a respawn found not accelerated moves `chosen` to the CPU with
    its reason (status's backend and fallback_reason), one accelerated again moves it back."""
    if event.backend != data.current:
        return None
    if event.adopted:
        return Step(S.SETTLED, data, evidence={"adopted": True})
    effective, demoted, proof = _proven(event)
    demotion = None if demoted is None else Demotion(event.backend, demoted, proof)
    reason = demoted or _passed_over(data, effective)
    evidence = {"backend": event.backend, "effective_backend": effective, **proof, "after": "respawn"}
    data = attrs.evolve(data, chosen=effective, reason=reason, evidence=evidence, respawn_demotion=demotion)
    return Step(S.SETTLED, data, (), demoted, evidence)


# Only a request while launching can be about the candidate being launched; anywhere else
# it starts afresh.
afresh = requested.only(S.CHECKING)

_BESIDE: dict[type, Rule] = {EngineBuilt: engine_built, EngineBuildFailed: engine_build_failed}

TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.IDLE: {PlanRequested: afresh, **_BESIDE},
    S.CHECKING: {
        CheckPassed: check_passed,
        CheckFailed: check_failed,
        BundleMissing: bundle_missing,
        PlanRequested: afresh,
        **_BESIDE,
    },
    S.INSTALLING: {BundleInstalled: installed, BundleInstallFailed: install_failed, PlanRequested: afresh, **_BESIDE},
    S.LAUNCHING: {LaunchSucceeded: launched, PlanRequested: requested, **_BESIDE},
    S.SETTLED: {LaunchSucceeded: relaunched, PlanRequested: afresh, **_BESIDE},
    S.FAILED: {PlanRequested: afresh, **_BESIDE},
}

FALLBACK = MachineSpec(
    name="fallback",
    initial=S.IDLE,
    data_type=FallbackData,
    transitions=TRANSITIONS,
    terminal={S.IDLE, S.SETTLED, S.FAILED},
    description=(
        "One server instance's backend: preferred first, install a missing bundle once, CPU last; "
        "a non-CPU server that dies before ready moves on to the next; forced never falls back."
    ),
    effect_types=Effect,
)
