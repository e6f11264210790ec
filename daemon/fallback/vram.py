"""Free VRAM read at the moment of a decision, for a GPU check.

A probe's verdict is cached for 30 s, so its free-VRAM figures can be that old: another
process may have filled (or freed) the GPU since. Every GPU check therefore reads free VRAM
again through the backend plugin (NVML for CUDA: ~0.03 ms once initialised), and that one
reading is what the fallback table decides from (states/fallback/vram.py: whether any GPU has
room for a layer, which GPUs the server gets), what the layer estimate quotes
(daemon/fallback/layers.py) and what the user is shown. When the reading fails (no reader,
the library cannot load) the probe's figures stand in, and the source says so.
"""

from __future__ import annotations

import trio

from stoker.daemon.backends.base import Backend, Detection, LaunchRequest, TelemetryRequest
from stoker.states.fallback.vram import PROBE, READ_NOW, FreeVram
from stoker.states.launch.records import GpuLayers


async def read_free_vram(plugin: Backend, detection: Detection) -> FreeVram | None:
    """Free VRAM on every detected GPU, read now through the plugin; the probe's figures where
    the reading fails or misses a device; None where neither knows."""
    names = {d.index: d.name for d in detection.devices}
    probed = {d.index: d.memory_free_mib for d in detection.devices if isinstance(d.memory_free_mib, int)}
    now = await free_vram_now(plugin, tuple(names))
    if now and set(now) == set(names):
        return FreeVram(now, names, READ_NOW)
    return FreeVram(probed, names, PROBE) if probed else None


async def free_vram_now(plugin: Backend, indices: tuple[int, ...]) -> dict[int, int]:
    """Free VRAM per device read now (NVML in-process, as telemetry reads it); {} if unreadable.
    The library is released again: a plan that ends on the CPU leaves none loaded."""

    def read() -> dict[int, int]:
        try:
            now = plugin.read_telemetry(TelemetryRequest(devices=indices))
        finally:
            plugin.release_telemetry()
        free: dict[int, int] = {}
        for d in now.devices if now else ():
            if d.memory_free_mib is not None:
                free[d.index] = d.memory_free_mib
            elif d.memory_total_mib is not None and d.memory_used_mib is not None:
                free[d.index] = d.memory_total_mib - d.memory_used_mib
        return free

    try:
        return await trio.to_thread.run_sync(read)
    except Exception:  # no reader, or it cannot load: the probe's figures stand
        return {}


def keeps_to(plugin: Backend, layers: GpuLayers, devices: tuple[int, ...]) -> tuple[int, ...]:
    """`devices` if the plugin can keep its server to them (its launch environment or
    arguments change for them), else (): a plugin that cannot leaves the engine every GPU, and
    the plan must not claim otherwise."""
    if not devices:
        return ()
    kept, every = LaunchRequest(layers, devices), LaunchRequest(layers)
    env_differs = plugin.launch_env(kept) != plugin.launch_env(every)
    return devices if env_differs or plugin.launch_args(kept) != plugin.launch_args(every) else ()
