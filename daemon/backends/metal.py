"""Apple Metal: Apple silicon Macs only (llama.cpp disables Metal on Intel Macs by default)."""

from __future__ import annotations

import platform
from typing import Any

from stoker.daemon.backends.base import Detection, Device, GpuBackend
from stoker.daemon.backends.tools import ToolRunner, run_tool
from stoker.states.reasons import ReasonCode

R = ReasonCode


# ggml-metal names its device MTL0; memory is the recommended working set. Metal reports no
# per-process VRAM.
class MetalBackend(GpuBackend, device="MTL", codes="metal", vendor="metal", process_vram=False):
    name = "metal"
    auto_rank = 30

    def __init__(self, *, system: str | None = None, machine: str | None = None, run: ToolRunner = run_tool) -> None:
        self._system = system or platform.system()
        self._machine = (machine or platform.machine()).lower()
        self._run = run

    def detect(self) -> Detection:
        """Darwin on arm64 has a Metal GPU sharing unified memory; anything else has none."""
        evidence: dict[str, Any] = {"system": self._system, "arch": self._machine}
        if self._system != "Darwin" or self._machine not in ("arm64", "aarch64"):
            return Detection.unavailable(
                self.name,
                R.GPU_MISSING,
                present=False,
                message=f"Metal needs an Apple silicon Mac; this is {self._system} on {self._machine}.",
                **evidence,
            )
        chip = self._run(("sysctl", "-n", "machdep.cpu.brand_string"))
        mem = self._run(("sysctl", "-n", "hw.memsize"))
        os_version = self._run(("sw_vers", "-productVersion"))
        name = chip.stdout.strip() if chip.ok and chip.stdout.strip() else "Apple silicon"
        total = int(mem.stdout.strip()) // (1024 * 1024) if mem.ok and mem.stdout.strip().isdigit() else None
        macos = os_version.stdout.strip() if os_version.ok else None
        evidence.update(chip=name, macos=macos, unified_memory_mib=total)
        device = Device(index=0, name=name, memory_total_mib=total, runtime_version=macos, device_type="integrated")
        return Detection.available(self.name, [device], f"{name}, {total} MiB unified memory", **evidence)

    def quick_detect(self) -> Detection | None:
        # Not an Apple silicon Mac: detect() answers from the platform alone.
        if self._system != "Darwin" or self._machine not in ("arm64", "aarch64"):
            return self.detect()
        return None
