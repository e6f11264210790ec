"""Where the layers go when RPC workers are configured: a pure decision from measured facts.

The head checks each `[[workers]]` entry through the engine's own RPC protocol (HELLO, the
device count, each device's free memory: daemon/workers/rpc_wire.py) right before it plans,
and hands the readings here. This table decides, for each worker:

    used                    it answered, speaks exactly this bundle's `rpc_protocol`, and has a
                            device with free memory
    rpc_version_mismatch    it answered with another protocol version (the engine itself only
                            compares major and minor, but the patch moves with ggml's op count:
                            a head and a worker that disagree on it fail mid-load or mid-graph,
                            so Stoker asks for the exact version), or this bundle has no RPC
    rpc_worker_lost         it does not answer now and the plan it was in just ended because
                            the engine lost an RPC connection (the previous plan named it)
    rpc_worker_failed       it answers now, but the plan it was in just ended because the engine
                            lost an RPC connection and none of that plan's workers is gone: the
                            engine failed with a worker that passes the check (which one it does
                            not say), so each of that plan's workers is left out of this one
    rpc_worker_unreachable  it does not answer now (refused, timed out, not the RPC protocol)

and the tensor split: one share per device, RPC devices first in `--rpc` order (the engine
puts them at the front of its device list), then the local GPUs the plan keeps, each in
proportion to the free memory read now. A worker left out is recorded with its evidence and
the plan goes on without it: on the other workers, or local GPUs, or the CPU.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from stoker.states.machine import as_evidence, as_tuple, float_tuple, int_tuple, str_tuple
from stoker.states.reasons import ReasonCode

MIB = 2**20
_RPC_BUFFER = re.compile(r"^RPC\d+\[(.+)\]$")


@attrs.frozen
class RemoteDevice:
    """One device a worker exposes, as GET_DEVICE_MEMORY answered it."""

    index: int
    free_bytes: int
    total_bytes: int


@attrs.frozen
class WorkerReading:
    """What checking one worker found: whether it answered the RPC handshake, the protocol
    version it reported, its devices; `error` says why not (refused, timed out, not RPC)."""

    address: str
    reachable: bool
    version: str | None = None
    devices: tuple[RemoteDevice, ...] = attrs.field(default=(), converter=as_tuple)
    error: str | None = None
    elapsed_ms: float | None = None

    def to_evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"address": self.address, "reachable": self.reachable}
        if self.version is not None:
            out["version"] = self.version
        if self.devices:
            out["devices"] = [
                {"index": d.index, "free_mib": d.free_bytes // MIB, "total_mib": d.total_bytes // MIB}
                for d in self.devices
            ]
        if self.error:
            out["error"] = self.error
        if self.elapsed_ms is not None:
            out["elapsed_ms"] = round(self.elapsed_ms, 1)
        return out


@attrs.frozen
class LocalDevice:
    """A local GPU the plan keeps, and its free memory in the reading that decided the plan."""

    name: str
    free_mib: int


@attrs.frozen
class PlacedWorker:
    """A worker the plan uses: its address, its devices' engine names (RPC0, RPC1, ...) and
    the free memory each had when the plan was made."""

    address: str
    version: str
    device_names: tuple[str, ...] = attrs.field(converter=str_tuple)
    free_mib: tuple[int, ...] = attrs.field(converter=int_tuple)


@attrs.frozen
class LeftOut:
    """A configured worker the plan does without, and why (a reason code with its evidence)."""

    address: str
    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class RpcPlacement:
    """The placement over workers a plan records: the workers it uses, those it left out with
    their reasons, and the tensor split (one share per device: the workers' devices in order,
    then the local GPUs). `args` is what llama-server gets for it."""

    protocol: str | None
    used: tuple[PlacedWorker, ...] = attrs.field(default=(), converter=as_tuple)
    left_out: tuple[LeftOut, ...] = attrs.field(default=(), converter=as_tuple)
    split: tuple[float, ...] = attrs.field(default=(), converter=float_tuple)
    local_devices: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(w.address for w in self.used)

    @property
    def args(self) -> tuple[str, ...]:
        """`--rpc a,b --tensor-split x,y,...` (nothing when no worker is used)."""
        if not self.used:
            return ()
        shares = ",".join(f"{s:g}" for s in self.split)
        return ("--rpc", ",".join(self.endpoints), "--tensor-split", shares)

    @property
    def reason(self) -> ReasonCode | None:
        """The first left-out worker's reason (what status and history show first)."""
        return self.left_out[0].reason if self.left_out else None


def buffer_worker(name: str) -> str | None:
    """The worker a buffer of the engine's load lines is on: `RPC<i>[host:port]` (i: the device's
    index on that worker, not its global RPCn) -> host:port; None for a local buffer."""
    match = _RPC_BUFFER.match(name)
    return match.group(1) if match else None


def _judge(reading: WorkerReading, protocol: str | None, lost: frozenset[str], failed: bool) -> LeftOut | None:
    """Why a worker cannot be used now (None: it can). `failed`: the engine failed with the
    workers in `lost` though each still answers the check."""
    evidence = reading.to_evidence()
    if not reading.reachable:
        if reading.address in lost:
            return LeftOut(reading.address, ReasonCode.RPC_WORKER_LOST, {**evidence, "was_in_plan": True})
        return LeftOut(reading.address, ReasonCode.RPC_WORKER_UNREACHABLE, evidence)
    if failed and reading.address in lost:
        return LeftOut(reading.address, ReasonCode.RPC_WORKER_FAILED, {**evidence, "was_in_plan": True})
    if protocol is None or reading.version != protocol:
        return LeftOut(reading.address, ReasonCode.RPC_VERSION_MISMATCH, {**evidence, "expected": protocol})
    if not any(d.free_bytes > 0 for d in reading.devices):
        return LeftOut(
            reading.address, ReasonCode.RPC_WORKER_UNREACHABLE, {**evidence, "error": "it reports no free memory"}
        )
    return None


def lost_workers(exit_reason: ReasonCode | None, previous: RpcPlacement | None) -> frozenset[str]:
    """The workers of the plan that just ended, when its engine ended because it lost an RPC
    worker (which one the engine does not say: each is checked again, none trusted)."""
    if previous is None or exit_reason != ReasonCode.RPC_WORKER_LOST:
        return frozenset()
    return frozenset(previous.endpoints)


def place(
    readings: tuple[WorkerReading, ...],
    protocol: str | None,
    *,
    lost: frozenset[str] = frozenset(),
    local: tuple[LocalDevice, ...] = (),
) -> RpcPlacement:
    """The placement from this moment's readings: `protocol` is the bundle's rpc_protocol
    (None: built without RPC), `lost` the workers of the plan that just ended because the
    engine lost one, `local` the local GPUs the plan keeps with their free memory."""
    used: list[PlacedWorker] = []
    left_out: list[LeftOut] = []
    split: list[float] = []
    next_device = 0
    # The engine lost an RPC connection: a worker of that plan that is gone now explains it (the
    # others are trusted); with none gone, a worker that answers the check failed inside the
    # engine, and readmitting it would fail the same way, plan after plan, into crash_loop.
    gone = {r.address for r in readings if not r.reachable}
    failed = bool(lost) and not (lost & gone)
    for reading in readings:
        verdict = _judge(reading, protocol, lost, failed)
        if verdict is not None:
            left_out.append(verdict)
            continue
        names = tuple(f"RPC{next_device + i}" for i in range(len(reading.devices)))
        next_device += len(reading.devices)
        free = tuple(d.free_bytes // MIB for d in reading.devices)
        used.append(PlacedWorker(reading.address, str(reading.version), names, free))
        split.extend(float(f) for f in free)
    if used:
        split.extend(float(d.free_mib) for d in local)
    return RpcPlacement(
        protocol,
        tuple(used),
        tuple(left_out),
        tuple(split) if used else (),
        tuple(d.name for d in local) if used else (),
    )


def confirm(placement: RpcPlacement, buffers: list[dict[str, Any]]) -> dict[str, Any]:
    """The placement as the engine's load lines show it: the model buffer each planned worker
    holds (MiB, from `load_tensors: RPC0[host:port] model buffer size = ...`) and the local
    ones; `confirmed` when every used worker holds part of the model."""
    per_worker: dict[str, float] = {w.address: 0.0 for w in placement.used}
    local: dict[str, float] = {}
    for buf in buffers:
        if buf.get("kind") != "model":
            continue
        name, mib = str(buf.get("device")), float(buf.get("mib") or 0.0)
        address = buffer_worker(name)
        if address is not None:
            per_worker[address] = per_worker.get(address, 0.0) + mib
        else:
            local[name] = local.get(name, 0.0) + mib
    missing = [address for address, mib in per_worker.items() if mib <= 0.0]
    return {
        "confirmed": bool(placement.used) and not missing,
        "workers_model_mib": {a: round(m, 2) for a, m in per_worker.items()},
        "local_model_mib": {n: round(m, 2) for n, m in local.items()},
        **({"missing": missing} if missing else {}),
    }
