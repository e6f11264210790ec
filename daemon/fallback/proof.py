"""The proof of acceleration: is a ready GPU server really using its GPU, and if not, why.

A GPU plan that reaches ready proves nothing by itself: the engine may have fitted no layer
(`offloaded 0/M layers to GPU`) or the server may hold no VRAM at all. After the launch the
orchestrator asks `judge_acceleration` for a verdict from the engine's own load lines and,
where the platform reports it (NVML per-process memory), the server's VRAM; a failed proof
carries a hint that names the one setting that changes it. The readings of the backend's
telemetry live here too: the server's own VRAM after the launch, and the free VRAM read now
that confirms a probe's "no room" before a launch is skipped.
"""

from __future__ import annotations

from typing import Any, Mapping

import trio

from daemon.backends.base import Backend, ReasonKind, TelemetryRequest
from daemon.backends.registry import family_reason
from daemon.fallback.layers import FIT_MARGIN_MIB, LayerEstimate
from states import launch_records as LR
from states.reasons import ReasonCode


async def judge_acceleration(
    backends: Mapping[str, Backend],
    backend: str,
    evidence: Mapping[str, Any],
    plan: LR.LaunchPlan | None = None,
    estimate: LayerEstimate | None = None,
) -> tuple[ReasonCode | None, dict[str, Any]]:
    """None if the GPU is really in use, else why not; and the proof either way."""
    offloaded = evidence.get("offloaded_layers")
    proof: dict[str, Any] = {
        "offloaded_layers": offloaded,
        "total_layers": evidence.get("total_layers"),
        "offload_line": (evidence.get("evidence_lines") or {}).get("offloaded"),
    }
    if not offloaded:
        proof["hint"] = zero_layers_hint(plan, estimate)
        return family_reason(backends, backend, ReasonKind.GPU_LAYERS_ZERO, ReasonCode.GPU_CLAIMED_BUT_UNUSED), proof
    vram = await process_vram(backends, backend, evidence.get("pid"))
    proof["process_vram_mib"] = vram
    if vram == 0:
        return ReasonCode.GPU_CLAIMED_BUT_UNUSED, proof
    return None, proof


def zero_layers_hint(plan: LR.LaunchPlan | None, estimate: LayerEstimate | None) -> str:
    """Why a GPU plan offloaded nothing, and the one setting that changes it."""
    if plan is not None and plan.n_gpu_layers == 0:
        return "n_gpu_layers = 0 in the config: nothing is offloaded by request"
    if plan is not None and any(a in ("-fitt", "--fit-target") for a in plan.extra_args):
        return "the engine's fit found no room for a layer within the -fitt margin in extra_args"
    runtime = (
        f", about {estimate.context_mib * estimate.n_devices} MiB of it taken by the runtime,"
        if estimate and estimate.context_mib
        else ""
    )
    room = (
        ""
        if estimate is None or estimate.free_vram_mib is None
        else (
            f"{estimate.free_vram_mib} MiB free VRAM{runtime} vs model {estimate.model_mib:.0f} MiB + KV {estimate.kv_mib or 0:.0f} MiB; "
        )
    )
    return (
        f"{room}the engine keeps {FIT_MARGIN_MIB} MiB free (-fitt) and offloads nothing when less is left; "
        f'free VRAM, or lower the margin: [server] extra_args = ["-fitt", "256"]'
    )


async def free_vram_now(backends: Mapping[str, Backend], backend: str, indices: tuple[int, ...]) -> dict[int, int]:
    """Free VRAM per device read now (NVML in-process, as telemetry does); {} if unreadable."""
    try:
        now = await trio.to_thread.run_sync(backends[backend].read_telemetry, TelemetryRequest(devices=indices))
    except Exception:
        return {}
    return {
        d.index: d.memory_total_mib - d.memory_used_mib
        for d in (now.devices if now else ())
        if d.memory_total_mib is not None and d.memory_used_mib is not None
    }


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
