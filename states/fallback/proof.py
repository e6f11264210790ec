"""The proof of acceleration (pure): is a ready GPU server really using its GPU, and if not, why.

A GPU plan that reaches ready proves nothing by itself: the engine may have fitted no layer
(`offloaded 0/M layers to GPU`), run its layers on a software rasteriser (a Vulkan device that
is the CPU), or the server may hold no VRAM at all. The fallback orchestrator gathers what the
engine's load lines and, where the platform reports it (NVML per-process memory), the server's
own VRAM say, as an `AccelerationProof` carried by `LaunchSucceeded`; the fallback table asks
`acceleration_verdict` and, for a server not really accelerated, reports it as the CPU with
the backend's own code (`<backend>_gpu_layers_zero`, its software-device code) or
`gpu_claimed_but_unused`.
"""

from __future__ import annotations

from typing import Any

import attrs

from stoker.states.machine import str_tuple
from stoker.states.reasons import ReasonCode


@attrs.frozen
class AccelerationProof:
    """What a ready GPU server's load lines and the platform said, with the backend's own codes
    for each way of not being accelerated (a plugin's facts) and the hint the plan's figures
    give for a server that offloaded nothing."""

    offloaded_layers: int | None
    total_layers: int | None = None
    offload_line: str | None = None
    software_devices: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    process_vram_mib: int | None = None  # None: the platform does not say
    layers_zero: ReasonCode = ReasonCode.GPU_CLAIMED_BUT_UNUSED
    software_device: ReasonCode = ReasonCode.GPU_CLAIMED_BUT_UNUSED
    hint: str = ""


def acceleration_verdict(proof: AccelerationProof) -> ReasonCode | None:
    """None if the GPU is really in use, else why not: no layer offloaded, layers on a
    software rasteriser, or a server that holds no VRAM (where the platform reports it)."""
    if not proof.offloaded_layers:
        return proof.layers_zero
    if proof.software_devices:
        return proof.software_device
    if proof.process_vram_mib == 0:
        return ReasonCode.GPU_CLAIMED_BUT_UNUSED
    return None


def proof_evidence(backend: str, proof: AccelerationProof) -> dict[str, Any]:
    """The proof as evidence: the engine's figures, and what decided the verdict."""
    evidence: dict[str, Any] = {
        "offloaded_layers": proof.offloaded_layers,
        "total_layers": proof.total_layers,
        "offload_line": proof.offload_line,
    }
    if not proof.offloaded_layers:
        evidence["hint"] = proof.hint
    elif proof.software_devices:
        evidence["software_devices"] = list(proof.software_devices)
        evidence["message"] = (
            f"The {backend} server offloaded {proof.offloaded_layers}/{proof.total_layers} layers to "
            f"{', '.join(proof.software_devices)}, a software rasteriser running on the CPU: nothing is "
            "accelerated, so it is reported as the CPU."
        )
    else:
        evidence["process_vram_mib"] = proof.process_vram_mib
    return evidence
