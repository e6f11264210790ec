"""The probe machine: one backend's capability, with a generation token per probe.

    idle -> probing(generation) -> available | unavailable(reason)

Every ProbeRequested starts a new generation, and only the newest generation's result
counts. A result from an older probe (or a duplicate) is accepted as an event but dropped:
the machine stays where it is, the data keep the fresher verdict, and the transition is
recorded with reason `probe_result_stale` so the drop is visible in history. A verdict is
cached for `cache_ttl` seconds (`ArmExpiry`); `Expired` for that verdict returns to idle.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.machine import STAY, MachineSpec, Rule, Step, guarded, as_evidence
from stoker.states.reasons import ReasonCode


class ProbeState(enum.StrEnum):
    IDLE = "idle"
    PROBING = "probing"
    AVAILABLE = "available"
    UNAVAILABLE = "unavailable"


@attrs.frozen
class ProbeData:
    backend: str = ""
    timeout: float = 10.0  # the out-of-process probe's time limit
    cache_ttl: float = 30.0  # how long a verdict stands
    generation: int = 0  # the newest probe started
    result_generation: int = 0  # the probe whose verdict the machine holds
    dropped: int = 0  # stale results dropped so far
    reason: ReasonCode | None = None  # why unavailable
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class ProbeRequested:
    """Start a new probe: a new generation that supersedes any in flight."""

    backend: str | None = None  # set on the first request; later ones may omit it


@attrs.frozen
class ProbeSucceeded:
    """Probe `generation` found the backend usable."""

    generation: int
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class ProbeFailed:
    """Probe `generation` found it unusable, with the reason."""

    generation: int
    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class Expired:
    """The verdict of probe `generation` is older than `cache_ttl`."""

    generation: int


@attrs.frozen
class RunProbe:
    """Run the backend's probe out of process within `timeout`; answer with `generation`."""

    backend: str
    generation: int
    timeout: float


@attrs.frozen
class ArmExpiry:
    """After `after` seconds fire Expired(generation)."""

    generation: int
    after: float


Effect = RunProbe | ArmExpiry

S = ProbeState


@guarded(S.PROBING)
def start(state: S, data: ProbeData, event: ProbeRequested) -> Step | None:
    backend = event.backend or data.backend
    if not backend:
        return None
    data = attrs.evolve(data, backend=backend, generation=data.generation + 1)
    return Step(
        S.PROBING, data, (RunProbe(backend, data.generation, data.timeout),), evidence={"generation": data.generation}
    )


@guarded(STAY, S.AVAILABLE, S.UNAVAILABLE)
def result(state: S, data: ProbeData, event: ProbeSucceeded | ProbeFailed) -> Step | None:
    if not 1 <= event.generation <= data.generation:
        return None  # a generation that was never started
    if event.generation != data.generation or event.generation <= data.result_generation:
        evidence = {
            "dropped_generation": event.generation,
            "newest_generation": data.generation,
            "result_generation": data.result_generation,
        }
        return Step(state, attrs.evolve(data, dropped=data.dropped + 1), (), ReasonCode.PROBE_RESULT_STALE, evidence)
    if isinstance(event, ProbeSucceeded):
        target, reason = S.AVAILABLE, None
    else:
        target, reason = S.UNAVAILABLE, event.reason
    data = attrs.evolve(data, result_generation=event.generation, reason=reason, evidence=event.evidence)
    return Step(
        target,
        data,
        (ArmExpiry(event.generation, data.cache_ttl),),
        reason,
        {"generation": event.generation, **event.evidence},
    )


@guarded(S.IDLE)
def expired(state: S, data: ProbeData, event: Expired) -> Step | None:
    if event.generation != data.result_generation:
        return None  # a timer from an older verdict
    return Step(S.IDLE, data, evidence={"generation": event.generation})


# Outside `probing` the newest probe's verdict is already in: any result is stale.
_STALE = {ProbeSucceeded: result.only(STAY), ProbeFailed: result.only(STAY)}

TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.IDLE: {ProbeRequested: start, **_STALE},
    S.PROBING: {
        ProbeRequested: start,
        ProbeSucceeded: result.only(STAY, S.AVAILABLE),
        ProbeFailed: result.only(STAY, S.UNAVAILABLE),
    },
    S.AVAILABLE: {ProbeRequested: start, Expired: expired, **_STALE},
    S.UNAVAILABLE: {ProbeRequested: start, Expired: expired, **_STALE},
}

PROBE = MachineSpec(
    name="probe",
    initial=S.IDLE,
    data_type=ProbeData,
    transitions=TRANSITIONS,
    terminal={S.IDLE, S.AVAILABLE, S.UNAVAILABLE},
    description="One backend's capability; the newest probe's verdict wins.",
    effect_types=Effect,
)
