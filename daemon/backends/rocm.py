"""AMD ROCm (HIP): amd-smi, then rocm-smi, then the amdgpu driver's sysfs files."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from stoker.daemon.backends.base import (
    BUNDLE_FITS,
    BundleCheck,
    Detection,
    Device,
    GpuBackend,
    excerpt,
    portable_variant,
)
from stoker.daemon.backends.tools import ToolRunner, run_tool
from stoker.states.reasons import ReasonCode

R = ReasonCode

AMD_SMI = ("amd-smi", "static", "--json")
ROCM_SMI = ("rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json")
AMD_PCI_VENDOR = "0x1002"
_MIB = 1024 * 1024


def _lower_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).lower(): v for k, v in data.items()}


def _mib(value: Any) -> int | None:
    """amd-smi sizes: {"value": 196592, "unit": "MB"}, "196592 MB", or a bare number (MB)."""
    if isinstance(value, Mapping):
        number, unit = value.get("value"), str(value.get("unit", "MB"))
    else:
        m = re.match(r"^\s*(\d+)\s*([A-Za-z]*)", str(value or ""))
        if m is None:
            return None
        number, unit = m.group(1), m.group(2) or "MB"
    if number is None:
        return None
    try:
        n = int(number)
    except (TypeError, ValueError):
        return None
    unit = unit.upper()
    if unit in ("B", "BYTES"):
        return n // _MIB
    if unit in ("KB", "KIB"):
        return n // 1024
    if unit in ("GB", "GIB"):
        return n * 1024
    return n


def parse_amd_smi_static(text: str) -> list[Device]:
    """`amd-smi static --json`: a list of GPUs (or {"gpu_data": [...]}, by version)."""
    data = json.loads(text)
    if isinstance(data, Mapping):
        data = data.get("gpu_data") or data.get("gpus") or [data]
    devices: list[Device] = []
    for entry in data:
        if not isinstance(entry, Mapping):
            continue
        asic = entry.get("asic") or {}
        vram = entry.get("vram") or {}
        driver = entry.get("driver") or {}
        name = asic.get("market_name") or asic.get("device_name") or "AMD GPU"
        devices.append(
            Device(
                index=int(entry.get("gpu", len(devices))),
                name=str(name),
                memory_total_mib=_mib(vram.get("size")),
                compute_capability=asic.get("target_graphics_version") or None,
                driver_version=(driver.get("version") if isinstance(driver, Mapping) else None) or None,
                device_type="discrete",
            )
        )
    return devices


def parse_rocm_smi(text: str) -> list[Device]:
    """`rocm-smi --showproductname --showmeminfo vram --json`: {"card0": {...}, ...}."""
    data = json.loads(text)
    devices = []
    for card, raw in sorted(data.items()):
        m = re.match(r"^card(\d+)$", card)
        if m is None or not isinstance(raw, Mapping):
            continue
        info = _lower_keys(raw)
        total = info.get("vram total memory (b)")
        used = info.get("vram total used memory (b)")
        total_mib = int(str(total)) // _MIB if str(total or "").isdigit() else None
        used_mib = int(str(used)) // _MIB if str(used or "").isdigit() else None
        devices.append(
            Device(
                index=int(m.group(1)),
                name=str(info.get("card series") or info.get("card model") or "AMD GPU"),
                memory_total_mib=total_mib,
                memory_free_mib=None if total_mib is None or used_mib is None else total_mib - used_mib,
                compute_capability=info.get("gfx version") or None,
                device_type="discrete",
            )
        )
    return devices


def read_sysfs_amdgpu(sysfs_root: Path) -> list[Device]:
    """Cards bound to amdgpu: /sys/class/drm/cardN/device/{vendor,mem_info_vram_total,...}."""
    devices: list[Device] = []
    drm = sysfs_root / "class" / "drm"
    if not drm.is_dir():
        return devices
    for card in sorted(drm.iterdir()):
        m = re.match(r"^card(\d+)$", card.name)
        if m is None:
            continue
        dev = card / "device"
        try:
            if (dev / "vendor").read_text().strip().lower() != AMD_PCI_VENDOR:
                continue
            total = int((dev / "mem_info_vram_total").read_text().strip())
        except (OSError, ValueError):
            continue  # not AMD, or not bound to amdgpu (no VRAM accounting)
        used = None
        try:
            used = int((dev / "mem_info_vram_used").read_text().strip())
        except (OSError, ValueError):
            pass
        name = "AMD GPU"
        try:
            name = (dev / "product_name").read_text().strip() or name
        except OSError:
            pass
        devices.append(
            Device(
                index=int(m.group(1)),
                name=name,
                memory_total_mib=total // _MIB,
                memory_free_mib=None if used is None else (total - used) // _MIB,
            )
        )
    return devices


class RocmBackend(GpuBackend, device="ROCm", codes="rocm", vendor="amd"):
    name = "rocm"
    auto_rank = 20

    def __init__(self, *, run: ToolRunner = run_tool, sysfs_root: Path | str = "/sys") -> None:
        self._run = run
        self._sysfs_root = Path(sysfs_root)

    def quick_detect(self) -> Detection | None:
        # Neither ROCm tool on PATH: detect() only reads sysfs attributes (no driver call).
        if self._run is run_tool and not any(shutil.which(argv[0]) for argv in (AMD_SMI, ROCM_SMI)):
            return self.detect()
        return None

    def detect(self) -> Detection:
        """amd-smi, rocm-smi, sysfs: the first that names a GPU decides; all are recorded."""
        evidence: dict[str, Any] = {}
        for argv, parse in ((AMD_SMI, parse_amd_smi_static), (ROCM_SMI, parse_rocm_smi)):
            result = self._run(argv)
            tool = argv[0]
            if result.missing:
                evidence[tool] = "not installed"
                continue
            if result.returncode != 0:
                evidence[tool] = f"exit {result.returncode}: {excerpt(result.stdout + result.stderr, 300)}"
                continue
            try:
                devices = parse(result.stdout)
            except (ValueError, TypeError, AttributeError) as e:
                evidence[tool] = f"unparsable output ({type(e).__name__}): {excerpt(result.stdout, 300)}"
                continue
            if devices:
                evidence.update(source=tool, raw=excerpt(result.stdout, 1000))
                return Detection.available(self.name, devices, _summary(devices, tool), **evidence)
            evidence[tool] = "no GPU listed"
        devices = read_sysfs_amdgpu(self._sysfs_root)
        if devices:
            # The amdgpu kernel driver sees the card; whether the HIP runtime works is only
            # proven by the bundle's own smoke test.
            evidence.update(source="sysfs", runtime="unverified: no ROCm tools installed")
            return Detection.available(self.name, devices, _summary(devices, "sysfs"), **evidence)
        tools_failed = any(str(v).startswith(("exit", "unparsable")) for v in evidence.values())
        if tools_failed:
            return Detection.unavailable(
                self.name,
                R.ROCM_UNAVAILABLE,
                present=True,
                message="ROCm tools are installed but failed; check the amdgpu driver and ROCm installation.",
                **evidence,
            )
        return Detection.unavailable(
            self.name, R.GPU_MISSING, present=False, message="No AMD GPU with the amdgpu driver was found.", **evidence
        )

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        """A variant named after the GPU's gfx target, else 'default', else the only one."""
        targets = {d.compute_capability for d in detection.devices if d.compute_capability}
        return portable_variant(detection, available_variants, preferred=targets)

    def explain_bundle(self, detection: Detection, bundle_meta: Mapping[str, Any]) -> BundleCheck:
        """A HIP build carries code for its listed gfx targets only (`gpu_targets`)."""
        if not detection.usable:
            return BundleCheck(detection.reason or R.ROCM_UNAVAILABLE, detection.message, dict(detection.evidence))
        targets = bundle_meta.get("gpu_targets") or bundle_meta.get("amdgpu_targets")
        if isinstance(targets, str):
            targets = [t for t in re.split(r"[;,]", targets) if t]
        gfx = sorted({d.compute_capability for d in detection.devices if d.compute_capability})
        if targets and gfx and not set(gfx) & set(targets):
            return BundleCheck(
                R.ROCM_UNAVAILABLE,
                f"This bundle was built for {';'.join(targets)}, not for {', '.join(gfx)}.",
                {"gpu_targets": list(targets), "gfx": gfx},
            )
        return BUNDLE_FITS


def _summary(devices: list[Device], source: str) -> str:
    names = ", ".join(
        f"{d.name} ({d.memory_total_mib} MiB{', ' + d.compute_capability if d.compute_capability else ''})"
        for d in devices
    )
    return f"{len(devices)} AMD GPU(s) via {source}: {names}"
