"""ROCm, Vulkan and Metal detection from recorded tool answers and fake sysfs trees."""

from __future__ import annotations

import json

import backend_recordings as rec
from stoker.daemon.backends import Detection
from stoker.daemon.backends.metal import MetalBackend
from stoker.daemon.backends.rocm import RocmBackend
from stoker.daemon.backends.tools import ToolResult, recorded_runner
from stoker.daemon.backends.vulkan import VulkanBackend
from stoker.states.reasons import ReasonCode as R


def roundtrip(d: Detection) -> Detection:
    return Detection.from_dict(json.loads(json.dumps(d.to_dict())))


# -- ROCm ------------------------------------------------------------------------------


def rocm(answers, sysfs):
    return RocmBackend(run=recorded_runner(answers), sysfs_root=sysfs)


def test_rocm_from_amd_smi(tmp_path):
    d = rocm({"amd-smi": rec.AMD_SMI_STATIC_MI300X}, tmp_path).detect()
    assert d.usable and d.evidence["source"] == "amd-smi"
    (dev,) = d.devices
    assert (dev.name, dev.memory_total_mib, dev.compute_capability, dev.driver_version) == (
        "AMD Instinct MI300X",
        196592,
        "gfx942",
        "6.8.5",
    )
    assert roundtrip(d) == d


def test_rocm_from_rocm_smi_when_amd_smi_is_missing(tmp_path):
    d = rocm({"rocm-smi": rec.ROCM_SMI_MI210}, tmp_path).detect()
    assert d.evidence["source"] == "rocm-smi" and d.evidence["amd-smi"] == "not installed"
    (dev,) = d.devices
    assert (dev.name, dev.memory_total_mib, dev.memory_free_mib, dev.compute_capability) == (
        "AMD Instinct MI210",
        65520,
        65510,
        "gfx90a",
    )


def test_rocm_from_sysfs_when_no_tools(tmp_path):
    rec.write_amdgpu_card(tmp_path, 1, 16 * 1024**3, 1024**3, "Radeon RX 7800 XT")
    d = rocm({}, tmp_path).detect()
    assert d.usable and d.evidence["source"] == "sysfs"
    assert d.evidence["runtime"].startswith("unverified")
    (dev,) = d.devices
    assert (dev.index, dev.name, dev.memory_total_mib, dev.memory_free_mib) == (1, "Radeon RX 7800 XT", 16384, 15360)


def test_rocm_sysfs_ignores_other_vendors(tmp_path):
    card = tmp_path / "class" / "drm" / "card0" / "device"
    card.mkdir(parents=True)
    (card / "vendor").write_text("0x8086\n")
    d = rocm({}, tmp_path).detect()
    assert (d.present, d.reason) == (False, R.GPU_MISSING)


def test_rocm_broken_tools_and_no_sysfs_is_rocm_unavailable(tmp_path):
    answers = {
        "amd-smi": ToolResult(("amd-smi",), 1, "", "ERROR: amdgpu driver not initialized"),
        "rocm-smi": "not json",
    }
    d = rocm(answers, tmp_path).detect()
    assert (d.present, d.usable, d.reason) == (True, False, R.ROCM_UNAVAILABLE)
    assert d.evidence["amd-smi"].startswith("exit 1") and d.evidence["rocm-smi"].startswith("unparsable")


def test_rocm_nothing_is_gpu_missing(tmp_path):
    d = rocm({}, tmp_path).detect()
    assert (d.present, d.usable, d.reason) == (False, False, R.GPU_MISSING)


def test_rocm_bundle_targets(tmp_path):
    d = rocm({"amd-smi": rec.AMD_SMI_STATIC_MI300X}, tmp_path).detect()
    b = RocmBackend()
    assert b.check_bundle(d, {"gpu_targets": "gfx90a;gfx942"}) is None
    assert b.check_bundle(d, {"gpu_targets": ["gfx1100"]}) == R.ROCM_UNAVAILABLE
    assert b.choose_variant(d, ["gfx942", "gfx1100"]) == "gfx942"
    listed = b.parse_list_devices("Available devices:\n  ROCm0: AMD Instinct MI300X (196592 MiB, 196000 MiB free)\n")
    assert listed[0].name == "ROCm0"


# -- Vulkan ----------------------------------------------------------------------------


def test_vulkan_counts_the_gpu_and_ignores_llvmpipe():
    d = VulkanBackend(run=recorded_runner({"vulkaninfo": rec.VULKAN_SUMMARY_RTX_AND_LLVMPIPE})).detect()
    assert d.usable
    (dev,) = d.devices
    assert (dev.index, dev.name, dev.device_type, dev.runtime_version, dev.driver_version) == (
        0,
        "NVIDIA GeForce RTX 4090",
        "discrete",
        "1.3.277",
        "550.54.14",
    )
    assert d.evidence["software_devices"] == ["llvmpipe (LLVM 15.0.7, 256 bits)"]
    assert roundtrip(d) == d


def test_vulkan_llvmpipe_only_is_absent():
    d = VulkanBackend(run=recorded_runner({"vulkaninfo": rec.VULKAN_SUMMARY_LLVMPIPE_ONLY})).detect()
    assert (d.present, d.usable, d.reason) == (False, False, R.GPU_MISSING)
    assert d.devices == ()
    assert "llvmpipe" in d.message


def test_vulkan_without_a_driver():
    answers = {"vulkaninfo": ToolResult(("vulkaninfo",), 1, "", rec.VULKAN_NO_DRIVER)}
    d = VulkanBackend(run=recorded_runner(answers)).detect()
    assert (d.present, d.reason) == (False, R.GPU_MISSING)
    assert "ERROR_INCOMPATIBLE_DRIVER" in d.evidence["raw"]


def test_vulkan_tool_missing():
    d = VulkanBackend(run=recorded_runner({})).detect()
    assert (d.present, d.reason) == (False, R.GPU_MISSING)
    assert d.evidence == {"vulkaninfo": "not installed"}


# -- Metal -----------------------------------------------------------------------------


def test_metal_on_apple_silicon():
    def run(argv):
        table = {"machdep.cpu.brand_string": "Apple M2 Pro", "hw.memsize": str(32 * 1024**3), "-productVersion": "14.5"}
        return recorded_runner({argv[0]: table[argv[-1]]})(argv)

    d = MetalBackend(system="Darwin", machine="arm64", run=run).detect()
    assert d.usable
    (dev,) = d.devices
    assert (dev.name, dev.memory_total_mib, dev.runtime_version) == ("Apple M2 Pro", 32768, "14.5")
    assert MetalBackend().choose_variant(d, ["default"]) == "default"


def test_metal_elsewhere_is_absent():
    for system, machine in (("Linux", "x86_64"), ("Darwin", "x86_64"), ("Linux", "aarch64")):
        d = MetalBackend(system=system, machine=machine, run=recorded_runner({})).detect()
        assert (d.present, d.usable, d.reason) == (False, False, R.GPU_MISSING)
