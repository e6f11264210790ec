"""Vulkan: `vulkaninfo --summary`; a software rasteriser (llvmpipe, SwiftShader) is no GPU."""

from __future__ import annotations

import re
import shutil
from typing import Any, Iterable

from daemon.backends.base import Backend, Detection, Device, ReasonKind, excerpt, gpu_device_signature, gpu_reason_codes
from daemon.backends.tools import ToolRunner, run_tool
from states.reasons import ReasonCode

R = ReasonCode
K = ReasonKind

VULKANINFO = ("vulkaninfo", "--summary")
_TYPES = {
    "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU": "discrete",
    "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU": "integrated",
    "PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU": "virtual",
    "PHYSICAL_DEVICE_TYPE_CPU": "cpu",
    "PHYSICAL_DEVICE_TYPE_OTHER": "other",
}
_SOFTWARE = re.compile(r"llvmpipe|lavapipe|swiftshader|softpipe", re.IGNORECASE)


def _version(value: str) -> str:
    """'4206847 (1.3.255)' -> '1.3.255'; '1.3.255' stays."""
    m = re.search(r"\(([\d.]+)\)", value)
    return m.group(1) if m else value.strip()


def parse_vulkaninfo_summary(text: str) -> list[dict[str, str]]:
    """The `GPUn:` blocks of `vulkaninfo --summary` as dicts of their `key = value` lines."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        header = re.match(r"^GPU(\d+):\s*$", line.strip())
        if header:
            current = {"index": header.group(1)}
            blocks.append(current)
            continue
        if current is None:
            continue
        m = re.match(r"^\s+(\w+)\s*=\s*(.*?)\s*$", line)
        if m:
            current[m.group(1)] = m.group(2)
        elif line.strip() and not line.startswith((" ", "\t")):
            current = None  # the next top-level section
    return blocks


def is_software(block: dict[str, str]) -> bool:
    """A CPU-type device or a known software rasteriser: Vulkan on the CPU does not count."""
    return block.get("deviceType") == "PHYSICAL_DEVICE_TYPE_CPU" or bool(
        _SOFTWARE.search(block.get("deviceName", "") + " " + block.get("driverName", ""))
    )


class VulkanBackend(Backend):
    name = "vulkan"
    device_signature = gpu_device_signature("Vulkan")
    auto_rank = 40
    reason_family = {
        K.UNAVAILABLE: R.VULKAN_UNAVAILABLE,
        K.BINARY_MISSING: R.BINARY_MISSING_VULKAN_DETECTED,
        K.STARTUP_FAILED: R.VULKAN_STARTUP_FAILED,
        K.GPU_LAYERS_ZERO: R.VULKAN_GPU_LAYERS_ZERO,
        K.BUNDLE_INSTALL_FAILED: R.VULKAN_BUNDLE_INSTALL_FAILED,
        K.VRAM_FULL: R.VULKAN_VRAM_FULL,
    }
    reason_codes = gpu_reason_codes(reason_family)

    def __init__(self, *, run: ToolRunner = run_tool) -> None:
        self._run = run

    def quick_detect(self) -> Detection | None:
        # No vulkaninfo on PATH: detect() says so without running anything.
        if self._run is run_tool and shutil.which(VULKANINFO[0]) is None:
            return self.detect()
        return None

    def detect(self) -> Detection:
        """Hardware Vulkan devices from vulkaninfo; software ones are recorded and ignored."""
        result = self._run(VULKANINFO)
        if result.missing:
            return Detection.unavailable(
                self.name,
                R.GPU_MISSING,
                present=False,
                message="vulkaninfo is not installed, so no Vulkan GPU could be confirmed (install vulkan-tools).",
                vulkaninfo="not installed",
            )
        output = result.stdout + ("\n" + result.stderr if result.stderr else "")
        blocks = parse_vulkaninfo_summary(result.stdout)
        evidence: dict[str, Any] = {"source": "vulkaninfo", "raw": excerpt(output, 1500)}
        if result.returncode != 0 and not blocks:
            # No ICD for any GPU: ERROR_INCOMPATIBLE_DRIVER / ERROR_INITIALIZATION_FAILED.
            return Detection.unavailable(
                self.name,
                R.GPU_MISSING,
                present=False,
                message=f"vulkaninfo found no Vulkan driver (exit {result.returncode}).",
                **evidence,
            )
        software = [b.get("deviceName", "?") for b in blocks if is_software(b)]
        devices = [
            Device(
                index=int(b["index"]),
                name=b.get("deviceName", "Vulkan device"),
                driver_version=_version(b["driverVersion"]) if "driverVersion" in b else None,
                runtime_version=_version(b["apiVersion"]) if "apiVersion" in b else None,
                device_type=_TYPES.get(b.get("deviceType", ""), b.get("deviceType")),
            )
            for b in blocks
            if not is_software(b)
        ]
        evidence.update(
            software_devices=software,
            drivers=sorted({b.get("driverName", "") for b in blocks if not is_software(b)} - {""}),
        )
        if not devices:
            return Detection.unavailable(
                self.name,
                R.GPU_MISSING,
                present=False,
                message="Vulkan only offers a software (CPU) device"
                + (f": {', '.join(software)}" if software else "")
                + "; that is no GPU.",
                **evidence,
            )
        names = ", ".join(f"{d.name} ({d.device_type}, Vulkan {d.runtime_version})" for d in devices)
        return Detection.available(self.name, devices, f"{len(devices)} Vulkan GPU(s): {names}", **evidence)

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        """Vulkan builds are portable (SPIR-V): 'default', else the only variant."""
        variants = sorted(set(available_variants))
        if not detection.usable or not variants:
            return None
        if "default" in variants:
            return "default"
        return variants[0] if len(variants) == 1 else None
