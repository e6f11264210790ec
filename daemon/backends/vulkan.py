"""Vulkan: `vulkaninfo --summary`; a software rasteriser (llvmpipe, SwiftShader) is no GPU.

The engine's Vulkan backend (ggml-vulkan) uses every discrete and integrated GPU by itself and
never a CPU-type device unless GGML_VK_VISIBLE_DEVICES names it. Stoker follows the same rule:
a machine whose only Vulkan device is a software rasteriser has no Vulkan GPU. The opt-in
STOKER_VULKAN_ALLOW_SOFTWARE=1 (tests, CI, a user who wants to see the engine run) makes that
device usable: the plan then names it in GGML_VK_VISIBLE_DEVICES, and once the server is ready
the proof of acceleration reports it as the CPU with `vulkan_software_device` (the engine's
`using device` line names the rasteriser), so status never calls it accelerated.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Any, Iterable, Mapping

from stoker.daemon.backends.base import Detection, Device, GpuBackend, LaunchPlanLike, ReasonKind, excerpt
from stoker.daemon.backends.tools import ToolRunner, run_tool
from stoker.states.reasons import ReasonCode

R = ReasonCode

VULKANINFO = ("vulkaninfo", "--summary")
# The opt-in that lets the engine run on a software Vulkan device (lavapipe/llvmpipe).
ALLOW_SOFTWARE = "STOKER_VULKAN_ALLOW_SOFTWARE"
# ggml-vulkan's device selection (its CUDA_VISIBLE_DEVICES): indices in the loader's order,
# which is vulkaninfo's `GPUn` numbering.
VISIBLE_DEVICES = "GGML_VK_VISIBLE_DEVICES"
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


def _opted_in(environ: Mapping[str, str]) -> bool:
    return environ.get(ALLOW_SOFTWARE, "").strip().lower() in ("1", "true", "yes", "on")


def visible_indices(value: str, count: int) -> list[int] | None:
    """The device indices GGML_VK_VISIBLE_DEVICES selects, or None where the engine would refuse
    it (an index past the last device, or not a number: it throws at start)."""
    chosen: list[int] = []
    for token in value.replace(",", " ").split():
        if not token.isdigit() or int(token) >= count:
            return None
        chosen.append(int(token))
    return chosen


def _device(block: dict[str, str]) -> Device:
    return Device(
        index=int(block["index"]),
        name=block.get("deviceName", "Vulkan device"),
        driver_version=_version(block["driverVersion"]) if "driverVersion" in block else None,
        runtime_version=_version(block["apiVersion"]) if "apiVersion" in block else None,
        device_type=_TYPES.get(block.get("deviceType", ""), block.get("deviceType")),
    )


# No process-VRAM reader: gpu_claimed_but_unused cannot be proven here.
class VulkanBackend(
    GpuBackend,
    device="Vulkan",
    codes="vulkan",
    vendor="vulkan",
    kinds=(ReasonKind.SOFTWARE_DEVICE,),
    process_vram=False,
):
    name = "vulkan"
    auto_rank = 40

    def __init__(self, *, run: ToolRunner = run_tool, environ: Mapping[str, str] | None = None) -> None:
        self._run = run
        self._environ = environ

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    def quick_detect(self) -> Detection | None:
        # No vulkaninfo on PATH: detect() says so without running anything.
        if self._run is run_tool and shutil.which(VULKANINFO[0]) is None:
            return self.detect()
        return None

    def detect(self) -> Detection:
        """Hardware Vulkan devices from vulkaninfo; software ones are recorded and, without the
        opt-in, ignored."""
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
        selected = self.environ.get(VISIBLE_DEVICES)
        if selected is not None:
            indices = visible_indices(selected, len(blocks))
            evidence[VISIBLE_DEVICES] = selected
            if indices is None:
                return Detection.unavailable(
                    self.name,
                    R.VULKAN_UNAVAILABLE,
                    present=bool(blocks),
                    message=f"{VISIBLE_DEVICES}={selected!r} names no device of the {len(blocks)} Vulkan "
                    "lists; the engine would refuse to start. Unset it or name a device by its vulkaninfo GPU number.",
                    **evidence,
                )
            blocks = [b for b in blocks if int(b["index"]) in indices]
        software = [b for b in blocks if is_software(b)]
        hardware = [_device(b) for b in blocks if not is_software(b)]
        evidence.update(
            software_devices=[b.get("deviceName", "?") for b in software],
            drivers=sorted({b.get("driverName", "") for b in blocks if not is_software(b)} - {""}),
        )
        if hardware:
            names = ", ".join(f"{d.name} ({d.device_type}, Vulkan {d.runtime_version})" for d in hardware)
            return Detection.available(self.name, hardware, f"{len(hardware)} Vulkan GPU(s): {names}", **evidence)
        listed = ", ".join(b.get("deviceName", "?") for b in software)
        if software and _opted_in(self.environ):
            devices = [_device(b) for b in software[:1]]  # one rasteriser is enough: more would only share the CPU
            evidence.update(software=True, accelerated=False, opt_in=f"{ALLOW_SOFTWARE}=1")
            return Detection.available(
                self.name,
                devices,
                f"Vulkan offers only a software rasteriser ({listed}): not a GPU, nothing is accelerated; "
                f"used because {ALLOW_SOFTWARE}=1 asks for it.",
                **evidence,
            )
        return Detection.unavailable(
            self.name,
            R.GPU_MISSING,
            present=False,
            message="Vulkan only offers a software (CPU) device"
            + (f": {listed}" if software else "")
            + f"; that is no GPU ({ALLOW_SOFTWARE}=1 runs the Vulkan engine on it anyway, unaccelerated).",
            **evidence,
        )

    def launch_env(self, plan: LaunchPlanLike) -> dict[str, str]:
        """GGML_VK_VISIBLE_DEVICES for the plan's devices (vulkaninfo's numbers are the engine's);
        with the software opt-in and no hardware GPU, the rasteriser's number, which the engine
        uses only when named. Nothing otherwise: the engine takes every GPU itself."""
        if plan.devices:
            return {VISIBLE_DEVICES: ",".join(str(i) for i in plan.devices)}
        if not _opted_in(self.environ):
            return {}
        detection = self.detect()  # ~0.1 s of vulkaninfo, only with the opt-in
        if detection.usable and detection.evidence.get("software"):
            return {VISIBLE_DEVICES: ",".join(str(d.index) for d in detection.devices)}
        return {}

    def software_devices(self, engine_devices: Iterable[str]) -> tuple[str, ...]:
        """The devices the engine said it used (`Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))`)
        that are a software rasteriser."""
        return tuple(d for d in engine_devices if _SOFTWARE.search(d))
