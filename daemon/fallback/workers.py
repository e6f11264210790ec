"""The RPC workers in a plan: read them now, let states/fleet/rpc_placement.py decide, prove it after load.

Called by the orchestrator when the config lists `[[workers]]`: every worker is checked at once
through the engine's RPC protocol (daemon/workers/rpc_wire.py: reachable, protocol version,
each device's free memory), right before the plan is completed, so the split is from a reading
of this moment. After the server is ready, `confirm_placement` reads the engine's load lines
(`RPC0[host:port] model buffer size`) to show where the layers really went.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

from stoker.daemon.config.model import Config
from stoker.daemon.workers.rpc_wire import read_workers
from stoker.states.launch import records as LR
from stoker.states.fallback.vram import FreeVram
from stoker.states.fleet.rpc_placement import LocalDevice, RpcPlacement, confirm, lost_workers, place

log = logging.getLogger(__name__)


async def plan_workers(
    config: Config, protocol: str | None, effect: LR.MakePlan, free: FreeVram | None, devices: tuple[int, ...]
) -> RpcPlacement | None:
    """The placement over the configured workers (None: none configured), from readings taken
    now; `free`/`devices` are the local GPUs' reading and the ones the plan keeps (empty: all)."""
    if not config.workers:
        return None
    readings = await read_workers(tuple(w.address for w in config.workers), protocol)
    local: tuple[LocalDevice, ...] = ()
    if free is not None:
        kept = set(devices) if devices else None
        local = tuple(LocalDevice(free.label(i), mib) for i, mib in free.mib if kept is None or i in kept)
    previous, failure = effect.previous, effect.failure
    lost = lost_workers(failure.reason if failure else None, previous.rpc if previous else None)
    placement = place(readings, protocol, lost=lost, local=local)
    for out in placement.left_out:
        log.warning("RPC worker %s left out of the plan: %s (%s)", out.address, out.reason, out.evidence.get("error"))
    return placement


def with_worker_layers(backend_args: list[str], placement: RpcPlacement | None, layers: LR.GpuLayers) -> list[str]:
    """The backend's arguments with the workers': every layer the config asks for (all of them
    for "auto": the engine's own fit would move the split the plan records) goes to the
    devices, the workers' first, shared by `--tensor-split`."""
    if placement is None or not placement.used:
        return backend_args
    args = list(backend_args)
    if "-ngl" in args:
        at = args.index("-ngl")
        del args[at : at + 2]
    return ["-ngl", "all" if layers == "auto" else str(layers), *args, *placement.args]


def confirm_placement(plan: LR.LaunchPlan | None, ready: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Where the layers are, from the engine's load lines, for status (None: no workers)."""
    if plan is None or plan.rpc is None:
        return None
    placement = plan.rpc
    buffers = list((ready or {}).get("buffers") or [])
    proof = confirm(placement, buffers) if ready else {"confirmed": None}
    return {
        "protocol": placement.protocol,
        "used": [
            {"address": w.address, "version": w.version, "devices": list(w.device_names), "free_mib": list(w.free_mib)}
            for w in placement.used
        ],
        "left_out": [
            {"address": o.address, "reason": str(o.reason), "evidence": dict(o.evidence)} for o in placement.left_out
        ],
        "tensor_split": list(placement.split),
        "local_devices": list(placement.local_devices),
        **proof,
    }
