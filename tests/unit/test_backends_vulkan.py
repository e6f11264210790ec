"""The Vulkan plugin beyond detection: the software opt-in, the launch's device env, the proof
that a software rasteriser is not acceleration, and the build plan (no CUDA coupling)."""

from __future__ import annotations

import pytest

from stoker.daemon.backends.base import LaunchRequest
from stoker.daemon.backends.tools import ToolResult, recorded_runner
from stoker.daemon.backends.vulkan import ALLOW_SOFTWARE, VISIBLE_DEVICES, VulkanBackend
from stoker.daemon.bundles import variants
from stoker.daemon.bundles.variants import BuildPlan, Toolchain
from stoker.daemon.core.errors import StokerError
from stoker.daemon.fallback.proof import read_proof
from stoker.states.fallback.proof import acceleration_verdict, proof_evidence
from stoker.states.reasons import ReasonCode as R
from tests.unit import backend_recordings as rec

OPT_IN = {ALLOW_SOFTWARE: "1"}
# What this machine's vulkaninfo 1.3.239 printed with Debian 12's mesa-vulkan-drivers.
LAVAPIPE = """Devices:
========
GPU0:
\tapiVersion         = 1.3.230
\tdriverVersion      = 0.0.1
\tvendorID           = 0x10005
\tdeviceID           = 0x0000
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
\tdriverID           = DRIVER_ID_MESA_LLVMPIPE
\tdriverName         = llvmpipe
\tdriverInfo         = Mesa 22.3.6 (LLVM 15.0.6)
"""
# The engine's `using device` line on it, as engine/ready.py keeps it (ServerLog.devices).
ENGINE_LLVMPIPE = "Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)"


def vulkan(summary: str, environ: dict[str, str] | None = None) -> VulkanBackend:
    return VulkanBackend(run=recorded_runner({"vulkaninfo": summary}), environ=environ or {})


def test_lavapipe_is_no_gpu_without_the_opt_in():
    d = vulkan(LAVAPIPE).detect()
    assert (d.present, d.usable, d.reason) == (False, False, R.GPU_MISSING)
    assert ALLOW_SOFTWARE in d.message and vulkan(LAVAPIPE).launch_env(LaunchRequest("auto")) == {}


def test_the_opt_in_makes_lavapipe_usable_and_says_it_is_not_a_gpu():
    plugin = vulkan(LAVAPIPE, OPT_IN)
    d = plugin.detect()
    assert d.usable and d.present
    (dev,) = d.devices
    assert (dev.index, dev.device_type, dev.name) == (0, "cpu", "llvmpipe (LLVM 15.0.6, 256 bits)")
    assert d.evidence["software"] is True and d.evidence["accelerated"] is False
    assert "not a GPU" in d.message and "nothing is accelerated" in d.message
    # The engine uses a CPU-type device only when named: the plan names it.
    assert plugin.launch_env(LaunchRequest("auto")) == {VISIBLE_DEVICES: "0"}
    assert plugin.choose_variant(d, ["avx2"]) == "avx2"


def test_the_opt_in_never_hides_a_real_gpu():
    plugin = vulkan(rec.VULKAN_SUMMARY_RTX_AND_LLVMPIPE, OPT_IN)
    d = plugin.detect()
    assert [x.name for x in d.devices] == ["NVIDIA GeForce RTX 4090"] and "software" not in d.evidence
    assert plugin.launch_env(LaunchRequest("auto")) == {}  # the engine takes every GPU itself
    assert plugin.launch_env(LaunchRequest("auto", (0,))) == {VISIBLE_DEVICES: "0"}


def test_ggml_vk_visible_devices_is_honoured_like_the_engine_does():
    hidden = vulkan(rec.VULKAN_SUMMARY_RTX_AND_LLVMPIPE, {VISIBLE_DEVICES: "1"}).detect()
    assert hidden.reason == R.GPU_MISSING  # only llvmpipe left visible
    bad = vulkan(rec.VULKAN_SUMMARY_RTX_AND_LLVMPIPE, {VISIBLE_DEVICES: "7"}).detect()
    assert bad.reason == R.VULKAN_UNAVAILABLE and "refuse" in bad.message
    shown = vulkan(rec.VULKAN_SUMMARY_RTX_AND_LLVMPIPE, {VISIBLE_DEVICES: "0"}).detect()
    assert shown.usable and shown.evidence[VISIBLE_DEVICES] == "0"


def test_no_driver_with_the_opt_in_is_still_absent():
    answers = {"vulkaninfo": ToolResult(("vulkaninfo",), 1, "", rec.VULKAN_NO_DRIVER)}
    d = VulkanBackend(run=recorded_runner(answers), environ=OPT_IN).detect()
    assert (d.present, d.reason) == (False, R.GPU_MISSING)
    assert VulkanBackend(run=recorded_runner(answers), environ=OPT_IN).launch_env(LaunchRequest("auto")) == {}


async def test_a_server_on_llvmpipe_is_reported_as_the_cpu_with_its_reason():
    backends = {"vulkan": vulkan(LAVAPIPE, OPT_IN)}
    ready = {"offloaded_layers": 3, "total_layers": 3, "devices": [ENGINE_LLVMPIPE], "pid": 1}
    proof = await read_proof(backends, "vulkan", ready)
    assert acceleration_verdict(proof) == R.VULKAN_SOFTWARE_DEVICE
    evidence = proof_evidence("vulkan", proof)
    assert evidence["software_devices"] == [ENGINE_LLVMPIPE]
    assert "3/3 layers" in evidence["message"] and "nothing is accelerated" in evidence["message"]
    # A real GPU's line proves acceleration (Vulkan has no per-process VRAM reader to say otherwise).
    gpu = {**ready, "devices": ["Vulkan0 (NVIDIA H200)"]}
    assert acceleration_verdict(await read_proof(backends, "vulkan", gpu)) is None
    # Nothing offloaded is still gpu_layers_zero, whatever the device.
    zero = {**ready, "offloaded_layers": 0}
    assert acceleration_verdict(await read_proof(backends, "vulkan", zero)) == R.VULKAN_GPU_LAYERS_ZERO


def test_reason_codes_are_the_vulkan_family():
    codes = VulkanBackend.reason_codes
    assert {R.VULKAN_SOFTWARE_DEVICE, R.VULKAN_STARTUP_FAILED, R.VULKAN_BUNDLE_INSTALL_FAILED} <= codes
    assert R.GPU_CLAIMED_BUT_UNUSED not in codes  # no process-VRAM reader: it could never be proven


TOOLS = Toolchain("c++ (Debian 12.2.0) 12.2.0", "cmake version 3.25.1", "Ninja", "vulkan 1.3.239, shaderc 2023.2-1")


def test_vulkan_build_plan_has_no_cuda_in_it():
    plan = BuildPlan.for_backend("vulkan", "avx2", toolchain=TOOLS)
    assert "-DGGML_VULKAN=ON" in plan.flags
    assert not any("CUDA" in f for f in plan.flags)
    assert plan.declared_system_libs == ("libvulkan.so.1",) and plan.cuda_archs == () and plan.min_driver is None
    assert plan.cache_inputs("src", {})["toolchain"]["toolkit"] == "vulkan 1.3.239, shaderc 2023.2-1"
    # The CPU part is the variant's, as for CUDA.
    assert "-DGGML_AVX2=ON" in plan.flags and plan.cpu_requires == variants.CPU_VARIANTS["avx2"][2]


def test_missing_vulkan_build_tools_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(variants, "_vulkan_include_dirs", lambda environ: (tmp_path,))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(StokerError) as err:
        variants.vulkan_toolkit({})
    assert err.value.reason == R.BUNDLE_BUILD_FAILED
    assert "apt-get install libvulkan-dev glslc spirv-headers" in err.value.message
    assert len(err.value.evidence["missing"]) == 3


def _vulkan_tree(root, *, layer_settings: bool):
    (root / "vulkan").mkdir(parents=True)
    (root / "spirv" / "unified1").mkdir(parents=True)
    (root / "spirv" / "unified1" / "spirv.hpp").write_text("")
    define = "#define VK_EXT_layer_settings 1\n" if layer_settings else ""
    (root / "vulkan" / "vulkan_core.h").write_text(
        "#define VK_HEADER_VERSION 309\n"
        "#define VK_HEADER_VERSION_COMPLETE VK_MAKE_API_VERSION(0, 1, 4, VK_HEADER_VERSION)\n" + define
    )
    glslc = root / "bin" / "glslc"
    glslc.parent.mkdir()
    glslc.write_text("#!/bin/sh\necho 'shaderc 2023.2-1'\n")
    glslc.chmod(0o755)
    return root


def test_headers_too_old_for_the_engine_are_named_and_newer_ones_are_given_to_cmake(tmp_path, monkeypatch):
    old = _vulkan_tree(tmp_path / "old", layer_settings=False)
    monkeypatch.setattr(variants, "_vulkan_include_dirs", lambda environ: (old,))
    monkeypatch.setenv("PATH", str(old / "bin"))
    with pytest.raises(StokerError) as err:
        variants.vulkan_toolkit({})
    assert err.value.evidence["lacking"] == ["VK_EXT_layer_settings"]
    assert variants.VULKAN_HEADERS_ENV in err.value.message and "1.4.309" in err.value.message
    new = _vulkan_tree(tmp_path / "new", layer_settings=True)
    monkeypatch.setattr(variants, "_vulkan_include_dirs", lambda environ: (new, old))
    assert variants.vulkan_toolkit({}) == ("vulkan 1.4.309, shaderc 2023.2-1", str(new))
    tools = Toolchain(*TOOLS.to_dict().values(), vulkan_include=str(new))
    plan = BuildPlan.for_backend("vulkan", "avx2", toolchain=tools)
    assert plan.flags[-1] == f"-DVulkan_INCLUDE_DIR={new}"  # a cache-key input too


async def test_the_engines_device_line_keeps_a_description_with_parentheses(tmp_path):
    """llama-server prints `using device NAME (DESC) (ID) - N MiB free`; llvmpipe's DESC has its
    own parentheses, and the proof's message quotes what is kept."""
    from stoker.daemon.engine.ready import ServerLog

    path = tmp_path / "server.log"
    path.write_text(
        "0.00.135.387 I llama_prepare_model_devices: using device Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits)) "
        "(unknown id) - 2048 MiB free\n"
        "0.00.135.400 I llama_prepare_model_devices: using device CUDA0 (NVIDIA H200) (0000:00:00.0) - 142629 MiB free\n"
    )
    log = ServerLog(path, 0)
    log.poll()
    assert log.devices == ["Vulkan0 (llvmpipe (LLVM 15.0.6, 256 bits))", "CUDA0 (NVIDIA H200)"]
    assert log.device_free_mib == {"Vulkan0": 2048, "CUDA0": 142629}
