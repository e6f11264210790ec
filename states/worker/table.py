"""The RPC worker machine: one per `stoker worker`, supervising this host's ggml-rpc-server.

    stopped -> starting -> serving --(exit)--> backoff -> starting ...
        ^          |          |                   |
        |          v          v                   v
        +----- stopping <-- (stop)             failed (fatal exit, or a crash loop)

`starting` lasts until the server answers the engine's RPC handshake with this bundle's
protocol version (the daemon checks it through the real protocol and reports `Answered` with
the version and each device's free memory); an exit while starting or serving is judged here:
a bad command line or no device is fatal (no retry helps), a version that differs from the
bundle's is fatal (a worker the head would refuse anyway), anything else is a crash counted
against `max_restarts` and retried after a capped backoff. `Stable` after `stable_after`
seconds of serving forgives earlier crashes. At start the identity file may prove that a
server of ours outlived the last `stoker worker`: it is adopted (`Adopted`) and served as is.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.machine import STAY, MachineSpec, Rule, Step, guarded, step_with_reason, as_evidence
from stoker.states.reasons import ReasonCode
from stoker.states.server_process import ProcessExit, SpawnFailure, crash_loop


class WorkerState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    SERVING = "serving"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    FAILED = "failed"


def _devices(value: Any) -> tuple[dict[str, Any], ...]:
    return tuple(dict(v) for v in value or ())


@attrs.frozen
class WorkerSettings:
    max_restarts: int = 5  # more consecutive crashes than this without Stable: failed (crash_loop)
    stable_after: float = 30.0  # seconds serving before the crash count resets
    stop_grace: float = 5.0  # seconds between TERM and KILL


@attrs.frozen
class WorkerData:
    settings: WorkerSettings = WorkerSettings()
    address: str | None = None  # host:port it binds
    protocol: str | None = None  # the bundle's rpc_protocol, which it must answer with
    crashes: int = 0
    restarts: int = 0
    pid: int | None = None
    create_time: float | None = None
    version: str | None = None  # what its HELLO answered
    devices: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=_devices)  # name, free/total MiB
    reason: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class StartRequested:
    """`stoker worker` starts: serve `address` with the bundle whose protocol is `protocol`."""

    address: str
    protocol: str | None
    settings: WorkerSettings = WorkerSettings()


@attrs.frozen
class Spawned:
    pid: int
    create_time: float | None = None


@attrs.frozen
class Answered:
    """The server answered HELLO (its version) and reported its devices (names from its own
    start-up lines, free and total memory through GET_DEVICE_MEMORY)."""

    version: str
    devices: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=_devices)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class Exited(ProcessExit):
    """The server process ended unasked: its status and classified reason, with evidence."""


@attrs.frozen
class SpawnFailed(SpawnFailure):
    """ggml-rpc-server could not be started at all (the binary will not execute)."""


@attrs.frozen
class BackoffElapsed:
    pass


@attrs.frozen
class Stable:
    pass


@attrs.frozen
class StopRequested:
    pass


@attrs.frozen
class StopCompleted:
    returncode: int | None = None


@attrs.frozen
class Adopted:
    """At start: the identity file proves a live server of ours (pid, start time, executable,
    command line) serving `address`: keep it."""

    address: str
    protocol: str | None
    pid: int
    create_time: float | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    settings: WorkerSettings = WorkerSettings()


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class SpawnServer:
    """Start ggml-rpc-server on the address; answer Spawned or SpawnFailed, then Answered
    once it speaks, and Exited when it ends."""

    address: str


@attrs.frozen
class WatchServer:
    """Follow a server this process did not start (adopted): Exited when it is gone."""

    pid: int


@attrs.frozen
class StartBackoff:
    attempt: int


@attrs.frozen
class ArmStableTimer:
    after: float


@attrs.frozen
class TerminateServer:
    grace: float


Effect = SpawnServer | WatchServer | StartBackoff | ArmStableTimer | TerminateServer

S = WorkerState

# Exits no retry helps: the engine refused its command line (an unknown device), has no device.
FATAL_EXITS = frozenset({ReasonCode.SERVER_BAD_ARGUMENTS, ReasonCode.RPC_VERSION_MISMATCH})


@guarded(S.STARTING)
def start(state: S, data: WorkerData, event: StartRequested) -> Step | None:
    """A `stoker worker` starts. From any state but stopped or failed, the last one ended
    without stopping its server and no server of it was proven alive (else: Adopted)."""
    evidence: dict[str, Any] = {"address": event.address, "protocol": event.protocol}
    if state not in (S.STOPPED, S.FAILED):
        evidence["previous_run_left"] = state.value
    data = WorkerData(event.settings, event.address, event.protocol, restarts=0)
    return Step(S.STARTING, data, (SpawnServer(event.address),), evidence=evidence)


@guarded(STAY)
def spawned(state: S, data: WorkerData, event: Spawned) -> Step | None:
    return Step(state, attrs.evolve(data, pid=event.pid, create_time=event.create_time), evidence={"pid": event.pid})


@guarded(S.SERVING, S.FAILED)
def answered(state: S, data: WorkerData, event: Answered) -> Step | None:
    evidence = {"version": event.version, "devices": list(event.devices), **event.evidence}
    data = attrs.evolve(data, version=event.version, devices=event.devices, reason=None, evidence=evidence)
    if data.protocol is not None and event.version != data.protocol:
        reason = ReasonCode.RPC_VERSION_MISMATCH
        evidence = {**evidence, "expected": data.protocol}
        return step_with_reason(S.FAILED, data, (TerminateServer(data.settings.stop_grace),), reason, evidence)
    return Step(S.SERVING, data, (ArmStableTimer(data.settings.stable_after),), evidence=evidence)


@guarded(S.BACKOFF, S.FAILED)
def exited(state: S, data: WorkerData, event: Exited | SpawnFailed) -> Step | None:
    """An unasked end: fatal, a crash loop, or a retry after a backoff."""
    evidence = {"returncode": getattr(event, "returncode", None), **event.evidence, "was": state.value}
    crashes = data.crashes + 1
    data = attrs.evolve(data, pid=None, create_time=None, crashes=crashes, reason=event.reason, evidence=evidence)
    if event.reason in FATAL_EXITS or isinstance(event, SpawnFailed):
        return Step(S.FAILED, data, (), event.reason, evidence)
    if crash_loop(crashes, data.settings.max_restarts):
        evidence = {**evidence, "crashes": crashes, "last_reason": str(event.reason)}
        return step_with_reason(S.FAILED, data, (), ReasonCode.CRASH_LOOP, evidence)
    return Step(S.BACKOFF, data, (StartBackoff(crashes),), event.reason, evidence)


@guarded(S.STARTING)
def backoff_elapsed(state: S, data: WorkerData, event: BackoffElapsed) -> Step | None:
    address = data.address
    if address is None:
        return None
    data = attrs.evolve(data, restarts=data.restarts + 1)
    return Step(S.STARTING, data, (SpawnServer(address),), evidence={"restarts": data.restarts})


@guarded(STAY)
def stable(state: S, data: WorkerData, event: Stable) -> Step | None:
    return Step(state, attrs.evolve(data, crashes=0), evidence={"forgiven": data.crashes})


@guarded(S.STOPPING)
def stop(state: S, data: WorkerData, event: StopRequested) -> Step | None:
    return Step(S.STOPPING, data, (TerminateServer(data.settings.stop_grace),))


@guarded(S.STOPPED)
def stop_idle(state: S, data: WorkerData, event: StopRequested) -> Step | None:
    return Step(S.STOPPED, attrs.evolve(data, pid=None, create_time=None))


@guarded(S.STOPPED)
def stopped(state: S, data: WorkerData, event: StopCompleted | Exited) -> Step | None:
    return Step(S.STOPPED, attrs.evolve(data, pid=None, create_time=None), evidence={"after": "stop"})


@guarded(STAY)
def terminated_after_failure(state: S, data: WorkerData, event: StopCompleted | Exited) -> Step | None:
    return Step(state, attrs.evolve(data, pid=None, create_time=None))


@guarded(S.SERVING)
def adopted(state: S, data: WorkerData, event: Adopted) -> Step | None:
    data = WorkerData(
        event.settings,
        event.address,
        event.protocol,
        pid=event.pid,
        create_time=event.create_time,
        evidence=event.evidence,
    )
    return Step(
        S.SERVING,
        data,
        (WatchServer(event.pid), ArmStableTimer(event.settings.stable_after)),
        evidence={"adopted": True, **event.evidence},
    )


TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.STOPPED: {StartRequested: start, Adopted: adopted, StopRequested: stop_idle},
    S.STARTING: {
        StartRequested: start,
        Adopted: adopted,
        Spawned: spawned,
        Answered: answered,
        Exited: exited,
        SpawnFailed: exited,
        StopRequested: stop,
    },
    S.SERVING: {
        StartRequested: start,
        Adopted: adopted,
        Spawned: spawned,
        Exited: exited,
        Stable: stable,
        StopRequested: stop,
    },
    S.BACKOFF: {StartRequested: start, Adopted: adopted, BackoffElapsed: backoff_elapsed, StopRequested: stop_idle},
    S.STOPPING: {StartRequested: start, Adopted: adopted, StopCompleted: stopped, Exited: stopped, StopRequested: stop},
    S.FAILED: {
        StartRequested: start,
        Adopted: adopted,
        StopRequested: stop_idle,
        StopCompleted: terminated_after_failure,
        Exited: terminated_after_failure,
    },
}

WORKER = MachineSpec(
    name="worker",
    initial=S.STOPPED,
    data_type=WorkerData,
    transitions=TRANSITIONS,
    terminal={S.STOPPED, S.FAILED},
    description=(
        "This host's RPC worker (ggml-rpc-server): serving once it answers the RPC handshake with the bundle's "
        "protocol; a crash is retried with backoff up to max_restarts; a bad command line or another protocol "
        "version fails at once; a server that outlived the last `stoker worker` is adopted when its identity is proven."
    ),
    effect_types=Effect,
)
