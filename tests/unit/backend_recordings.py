"""Recorded hardware answers for backend detection tests: no GPU needed to test GPU logic.

The H200 figures are from a real H200 machine (driver 580.95.05, CUDA 13.0): nvidia-smi
printed `NVIDIA H200, 143771, 143150, 580.95.05, 9.0`; NVML reports the same in bytes.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

MIB = 1024 * 1024

H200_SMI = "NVIDIA H200, 143771, 143150, 580.95.05, 9.0\n"
TWO_GPU_SMI = "NVIDIA H200, 143771, 143150, 580.95.05, 9.0\nNVIDIA RTX A6000, 49140, 48600, 580.95.05, 8.6\n"
SMI_NO_DEVICES = "No devices were found\n"
SMI_NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)
SMI_OLD_DRIVER_NO_CC = 'Field "compute_cap" is not a valid field to query.\n'
H200_SMI_NO_CC = "NVIDIA H200, 143771, 143150, 470.256.02\n"
LIST_DEVICES_H200 = "Available devices:\n  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)\n"
LIST_DEVICES_CPU = "Available devices:\n  (none)\n"


class NVMLError(Exception):
    pass


def _error(name: str) -> type[NVMLError]:
    return type(name, (NVMLError,), {})


NVMLError_LibraryNotFound = _error("NVMLError_LibraryNotFound")
NVMLError_DriverNotLoaded = _error("NVMLError_DriverNotLoaded")
NVMLError_LibRmVersionMismatch = _error("NVMLError_LibRmVersionMismatch")
NVMLError_GpuIsLost = _error("NVMLError_GpuIsLost")
NVMLError_NotSupported = _error("NVMLError_NotSupported")


class FakeNvml:
    """Stands in for the pynvml module: the same function names, recorded answers.

    `init_error`: an exception class nvmlInit raises. `gpus`: dicts with name, total, free,
    used, cc, util, memory_util, temp, power_mw, processes [(pid, bytes)] (or an exception
    class to raise when they are listed), or an exception class to raise when the device is
    queried.
    """

    NVML_TEMPERATURE_GPU = 0

    def __init__(
        self,
        gpus: list[dict[str, Any] | type[Exception]] | None = None,
        *,
        init_error: type[Exception] | None = None,
        driver: str = "580.95.05",
        cuda_driver: int = 13000,
    ) -> None:
        self.gpus = [h200()] if gpus is None else gpus
        self.init_error = init_error
        self.driver = driver
        self.cuda_driver = cuda_driver
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.init_error is not None:
            raise self.init_error("recorded failure")

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda_driver

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        gpu = self.gpus[index]
        if isinstance(gpu, type):
            raise gpu("recorded device failure")
        return gpu

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> str:
        return handle["name"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(total=handle["total"], free=handle["free"], used=handle["total"] - handle["free"])

    def nvmlDeviceGetCudaComputeCapability(self, handle: dict[str, Any]) -> tuple[int, int]:
        return handle["cc"]

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        return SimpleNamespace(gpu=handle.get("util", 0), memory=handle.get("memory_util", 0))

    def nvmlDeviceGetTemperature(self, handle: dict[str, Any], sensor: int) -> int:
        return handle.get("temp", 30)

    def nvmlDeviceGetPowerUsage(self, handle: dict[str, Any]) -> int:
        if "power_mw" not in handle:
            raise NVMLError_NotSupported("no power reading")
        return handle["power_mw"]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        if isinstance(handle.get("processes"), type):
            raise handle["processes"]("recorded failure")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle.get("processes", [])]


def h200(**overrides: Any) -> dict[str, Any]:
    gpu = {"name": "NVIDIA H200", "total": 143771 * MIB, "free": 143150 * MIB, "cc": (9, 0)}
    gpu.update(overrides)
    return gpu


# Telemetry recorded on a real H200 (driver 580.159.04, CUDA 13.0) with pynvml: the idle GPU,
# then a process (pid 456) holding a CUDA context and a 2 GiB allocation but computing nothing.
H200_TOTAL = 150754820096
H200_IDLE = {"total": H200_TOTAL, "free": 150109880320, "util": 0, "temp": 32, "power_mw": 85105, "processes": []}
H200_HOLDING = {
    "total": H200_TOTAL,
    "free": 147409993728,
    "util": 0,
    "temp": 33,
    "power_mw": 104200,
    "processes": [(456, 2690646016)],
}


def a6000(**overrides: Any) -> dict[str, Any]:
    gpu = {"name": "NVIDIA RTX A6000", "total": 49140 * MIB, "free": 48600 * MIB, "cc": (8, 6)}
    gpu.update(overrides)
    return gpu


# amd-smi static --json (ROCm 6.x shape: a list, sizes as value/unit).
AMD_SMI_STATIC_MI300X = """[
  {
    "gpu": 0,
    "asic": {
      "market_name": "AMD Instinct MI300X",
      "vendor_id": "0x1002",
      "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
      "device_id": "0x74a1",
      "rev_id": "0x00",
      "target_graphics_version": "gfx942"
    },
    "driver": {"name": "amdgpu", "version": "6.8.5"},
    "vram": {"type": "HBM", "vendor": "N/A", "size": {"value": 196592, "unit": "MB"}, "bit_width": 8192}
  }
]
"""

# rocm-smi --showproductname --showmeminfo vram --json
ROCM_SMI_MI210 = """{"card0": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "10960896",
"Card Series": "AMD Instinct MI210", "Card Model": "0x740f", "Card Vendor": "Advanced Micro Devices, Inc. [AMD/ATI]",
"Card SKU": "D67301", "GFX Version": "gfx90a"}}
"""

VULKAN_SUMMARY_RTX_AND_LLVMPIPE = """==========
VULKANINFO
==========

Vulkan Instance Version: 1.3.275


Instance Extensions: count = 24
-------------------------------
VK_EXT_debug_report                    : extension revision 10

Devices:
========
GPU0:
\tapiVersion         = 1.3.277
\tdriverVersion      = 550.54.14
\tvendorID           = 0x10de
\tdeviceID           = 0x2684
\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName         = NVIDIA GeForce RTX 4090
\tdriverID           = DRIVER_ID_NVIDIA_PROPRIETARY
\tdriverName         = NVIDIA
\tdriverInfo         = 550.54.14
\tconformanceVersion = 1.3.7.2
GPU1:
\tapiVersion         = 1.3.255
\tdriverVersion      = 0.0.1
\tvendorID           = 0x10005
\tdeviceID           = 0x0000
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.7, 256 bits)
\tdriverID           = DRIVER_ID_MESA_LLVMPIPE
\tdriverName         = llvmpipe
\tdriverInfo         = Mesa 23.2.1-1ubuntu3.1~22.04.2 (LLVM 15.0.7)
\tconformanceVersion = 1.3.1.1
"""

VULKAN_SUMMARY_LLVMPIPE_ONLY = """Devices:
========
GPU0:
\tapiVersion         = 4206847 (1.3.255)
\tdriverVersion      = 0.0.1
\tvendorID           = 0x10005
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.7, 256 bits)
\tdriverName         = llvmpipe
"""

VULKAN_NO_DRIVER = (
    "ERROR: [Loader Message] Code 0 : vkCreateInstance: Found no drivers!\n"
    "Cannot create Vulkan instance.\nThis problem is often caused by a faulty installation of the Vulkan driver "
    "or attempting to use a GPU that does not support Vulkan.\nERROR at ./vulkaninfo/vulkaninfo.h:456:"
    "vkCreateInstance failed with ERROR_INCOMPATIBLE_DRIVER\n"
)

# /proc/cpuinfo of this development VM (abridged to one processor).
CPUINFO_SPR_VM = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Processor
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt tsc_deadline_timer aes xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec xgetbv1 xsaves avx_vnni avx512_bf16 avx512vbmi umip pku ospke waitpkg avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg avx512_vpopcntdq rdpid cldemote movdiri movdir64b md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile amx_int8 arch_capabilities

processor\t: 1
flags\t\t: fpu sse sse2
"""

CPUINFO_HASWELL = """processor\t: 0
model name\t: Intel(R) Core(TM) i7-4770 CPU @ 3.40GHz
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 popcnt avx f16c bmi1 avx2 bmi2
"""

CPUINFO_SANDY = """processor\t: 0
model name\t: Intel(R) Core(TM) i7-2600 CPU @ 3.40GHz
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 popcnt avx
"""

CPUINFO_ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
"""

MEMINFO = "MemTotal:       24684544 kB\nMemFree:        20000000 kB\nMemAvailable:   23130112 kB\n"


def write_proc(root: Path, cpuinfo: str, meminfo: str = MEMINFO) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "cpuinfo").write_text(cpuinfo)
    (root / "meminfo").write_text(meminfo)
    return root


def write_pci_device(sysfs: Path, slot: str, vendor: str, pci_class: str) -> None:
    dev = sysfs / "bus" / "pci" / "devices" / slot
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "vendor").write_text(vendor + "\n")
    (dev / "class").write_text(pci_class + "\n")


def write_amdgpu_card(sysfs: Path, card: int, total: int, used: int, product: str | None = None) -> None:
    dev = sysfs / "class" / "drm" / f"card{card}" / "device"
    dev.mkdir(parents=True, exist_ok=True)
    (dev / "vendor").write_text("0x1002\n")
    (dev / "mem_info_vram_total").write_text(f"{total}\n")
    (dev / "mem_info_vram_used").write_text(f"{used}\n")
    if product:
        (dev / "product_name").write_text(product + "\n")
