"""NVIDIA telemetry through NVML: Stoker's one NVML reader, behind the cuda plugin's
`read_telemetry`.

The telemetry sampler (every 5 s while somebody watches) and the fallback orchestrator (free
VRAM before a launch, the server's own VRAM once it is ready) both read through here, so the
figures a person sees and the ones a fallback decision rests on come from the same code.

NVML is initialised on the first reading (~110 ms) and kept: every later reading is
sub-millisecond. `release()` shuts it down again (the sampler does when no server runs, so a
stopped daemon holds no driver library open); the next reading initialises it anew. NVML
counts its own inits, so a detection in the same process (tests) does not disturb it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import attrs

from stoker.daemon.backends.base import DeviceTelemetry, Telemetry, TelemetryRequest

_MIB = 1024 * 1024


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _attempt(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception:  # NVMLError_NotSupported and friends: that one figure is unknown
        return None


@attrs.define(eq=False)
class NvmlTelemetry:
    """Readings of every (or the requested) NVIDIA GPU; `load` returns the pynvml module."""

    backend: str
    load: Callable[[], Any]
    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _initialised: bool = False

    def read(self, request: TelemetryRequest) -> Telemetry:
        """Utilisation, memory, temperature, power and compute processes per device, and the
        requested pid's own VRAM; raises (NVMLError_LibraryNotFound, ...) when NVML cannot be
        initialised or cannot count its devices."""
        with self._lock:
            nvml = self.load()
            if not self._initialised:
                nvml.nvmlInit()
                self._initialised = True
            indices = request.devices or tuple(range(int(nvml.nvmlDeviceGetCount())))
            readings = []
            process_bytes: int | None = None if request.pid is None else 0
            for index in indices:
                handle = _attempt(lambda: nvml.nvmlDeviceGetHandleByIndex(index))
                if handle is None:
                    continue  # fallen off the bus: the others are still worth reading
                reading, mine = _read_device(nvml, index, handle, request.pid)
                readings.append(reading)
                # The pid's total is summed in bytes, then rounded down once (as nvidia-smi does).
                process_bytes = None if process_bytes is None or mine is None else process_bytes + mine
            return Telemetry(
                self.backend, tuple(readings), None if process_bytes is None else process_bytes // _MIB, source="nvml"
            )

    def release(self) -> None:
        """Shut NVML down if a reading initialised it (the next reading starts it again)."""
        with self._lock:
            if self._initialised:
                _attempt(self.load().nvmlShutdown)
            self._initialised = False


def _read_device(nvml: Any, index: int, handle: Any, pid: int | None) -> tuple[DeviceTelemetry, int | None]:
    """One device's reading, and the bytes `pid` holds on it (None: unknown, or no pid)."""
    mem = _attempt(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
    util = _attempt(lambda: nvml.nvmlDeviceGetUtilizationRates(handle))
    temp = _attempt(lambda: nvml.nvmlDeviceGetTemperature(handle, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)))
    power = _attempt(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
    name = _attempt(lambda: nvml.nvmlDeviceGetName(handle))
    procs = _attempt(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
    mine = None
    if pid is not None and procs is not None:
        mine = sum(int(p.usedGpuMemory or 0) for p in procs if int(p.pid) == pid)
    reading = DeviceTelemetry(
        index=index,
        name=None if name is None else _text(name),
        memory_used_mib=None if mem is None else int(mem.used) // _MIB,
        memory_total_mib=None if mem is None else int(mem.total) // _MIB,
        memory_free_mib=None if mem is None else int(mem.free) // _MIB,
        utilization_percent=None if util is None else int(util.gpu),
        memory_utilization_percent=None if util is None else int(util.memory),
        temperature_c=None if temp is None else int(temp),
        power_w=None if power is None else power / 1000.0,
        process_memory_mib=None if mine is None else mine // _MIB,
        compute_processes=None if procs is None else len(procs),
    )
    return reading, mine
