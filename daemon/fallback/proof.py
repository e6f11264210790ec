"""The proof of acceleration gathered: what a ready GPU server's own lines and the platform say.

A GPU plan that reaches ready proves nothing by itself. After the launch the orchestrator asks
`read_proof` for the facts (the engine's `offloaded N/M layers` line, the devices it used and,
where the platform reports it (NVML per-process memory), the server's own VRAM) with the
backend's own codes for each way of not being accelerated; the fallback table judges them
(states/fallback/proof.py). The hint for a server that offloaded nothing is built from the
figures that decided the plan (the free VRAM the engine itself saw on each device, else the
reading the plan was made on, never one older than the launch) and names the one setting
that changes it.
"""

from __future__ import annotations

from typing import Any, Mapping

import trio

from stoker.daemon.backends.base import Backend, ReasonKind, TelemetryRequest
from stoker.daemon.backends.registry import family_reason
from stoker.daemon.fallback.layers import LayerEstimate, engine_free, fit_margin
from stoker.states.launch import records as LR
from stoker.states.fallback.proof import AccelerationProof
from stoker.states.fallback.vram import mib_text
from stoker.states.reasons import ReasonCode


async def read_proof(
    backends: Mapping[str, Backend],
    backend: str,
    evidence: Mapping[str, Any],
    plan: LR.LaunchPlan | None = None,
    estimate: LayerEstimate | None = None,
) -> AccelerationProof:
    """What the ready `backend` server proved, from its ready evidence and the platform."""
    offloaded = evidence.get("offloaded_layers")
    plugin = backends.get(backend)
    # The engine's own `using device` lines: a software rasteriser's layers are on the CPU.
    software = plugin.software_devices(evidence.get("devices") or ()) if plugin is not None else ()
    # The server's own VRAM is read only where the engine's lines claim layers on a real device:
    # otherwise they already say enough, and no vendor library is loaded for nothing.
    vram = await process_vram(backends, backend, evidence.get("pid")) if offloaded and not software else None
    return AccelerationProof(
        offloaded_layers=offloaded,
        total_layers=evidence.get("total_layers"),
        offload_line=(evidence.get("evidence_lines") or {}).get("offloaded"),
        software_devices=software,
        process_vram_mib=vram,
        layers_zero=family_reason(backends, backend, ReasonKind.GPU_LAYERS_ZERO, ReasonCode.GPU_CLAIMED_BUT_UNUSED),
        software_device=family_reason(backends, backend, ReasonKind.SOFTWARE_DEVICE, ReasonCode.GPU_CLAIMED_BUT_UNUSED),
        hint=zero_layers_hint(plan, estimate, evidence),
    )


def zero_layers_hint(
    plan: LR.LaunchPlan | None, estimate: LayerEstimate | None, ready: Mapping[str, Any] | None = None
) -> str:
    """Why a GPU plan offloaded nothing, from the figures that decided it, and the one
    setting that changes it. `estimate` must be of this launch's reading (a respawn's is
    cleared of figures: the engine's own, in `ready`, speak for it)."""
    if plan is not None and plan.n_gpu_layers == 0:
        return "n_gpu_layers = 0 in the config: nothing is offloaded by request"
    if plan is not None and plan.n_gpu_layers != "auto":
        return f"-ngl {plan.n_gpu_layers} was asked and the engine offloaded none; see the server log"
    margin = estimate.margin_mib if estimate else fit_margin(plan.extra_args if plan else ())
    seen = engine_free(ready or {})
    if seen:
        figures = f"the engine saw {seen} free as it loaded (its runtime's share already taken); "
    elif estimate is not None and estimate.free_by_device:
        listed = ", ".join(f"{label} {mib_text(mib)}" for label, mib in estimate.free_by_device.items())
        runtime = (
            f", about {estimate.context_mib} MiB of it taken by the runtime on each GPU,"
            if estimate.context_mib
            else ""
        )
        figures = (
            f"free VRAM ({estimate.source}) {listed}{runtime} vs model {estimate.model_mib:.0f} MiB"
            f" + KV {estimate.kv_mib or 0:.0f} MiB; "
        )
    else:
        figures = ""
    if plan is not None and any(a in ("-fitt", "--fit-target") for a in plan.extra_args):
        return (
            f"{figures}the engine's fit found no room for a layer within the -fitt margin ({margin} MiB) in extra_args"
        )
    return (
        f"{figures}the engine keeps {margin} MiB free on each device (-fitt) and offloads nothing where less "
        f'is left; free VRAM, or lower the margin: [server] extra_args = ["-fitt", "256"]'
    )


async def process_vram(backends: Mapping[str, Backend], backend: str, pid: Any) -> int | None:
    """The server's own VRAM (MiB) where the platform reports it; None where it cannot."""
    plugin = backends.get(backend)
    if plugin is None or not isinstance(pid, int):
        return None
    try:
        telemetry = await trio.to_thread.run_sync(plugin.read_telemetry, TelemetryRequest(pid=pid))
    except Exception:
        return None
    return None if telemetry is None else telemetry.process_memory_mib
