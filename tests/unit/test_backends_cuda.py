"""CUDA detection from recorded NVML / nvidia-smi answers, and bundle compatibility."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import backend_recordings as rec
from stoker.daemon.backends import Detection, TelemetryRequest
from stoker.daemon.backends.base import LaunchRequest
from stoker.daemon.backends.cuda import SMI_QUERY, SMI_QUERY_NO_CC, CudaBackend, parse_smi_csv
from stoker.daemon.backends.cuda_arch import CudaArch, archs_for, cc_supported, parse_cc, split_archs
from stoker.daemon.backends.tools import ToolResult, recorded_runner
from stoker.states.reasons import ReasonCode as R


def cuda(nvml=None, answers=None, sysfs=None, tmp_path=None):
    root = sysfs if sysfs is not None else (tmp_path / "no-sys" if tmp_path else "/nonexistent-sys")
    return CudaBackend(nvml=nvml, run=recorded_runner(answers or {}), sysfs_root=root)


def roundtrip(d: Detection) -> Detection:
    return Detection.from_dict(json.loads(json.dumps(d.to_dict())))


def test_h200_through_nvml():
    nvml = rec.FakeNvml()
    d = cuda(nvml).detect()
    assert d.present and d.usable and d.reason is None
    (dev,) = d.devices
    assert dev.name == "NVIDIA H200"
    assert (dev.memory_total_mib, dev.memory_free_mib) == (143771, 143150)
    assert dev.compute_capability == "9.0"
    assert dev.driver_version == "580.95.05" and dev.runtime_version == "13.0"
    assert d.evidence["source"] == "nvml"
    assert d.evidence["cuda_driver_version"] == "13.0"
    assert nvml.shutdown_calls == 1
    assert roundtrip(d) == d


def test_nvml_missing_falls_back_to_nvidia_smi():
    nvml = rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound)
    d = cuda(nvml, {"nvidia-smi": rec.H200_SMI}).detect()
    assert d.usable and d.evidence["source"] == "nvidia-smi"
    assert "NVMLError_LibraryNotFound" in d.evidence["nvml"]
    assert d.evidence["failing_library"] == "libnvidia-ml.so.1"
    (dev,) = d.devices
    assert (dev.name, dev.memory_total_mib, dev.memory_free_mib, dev.driver_version, dev.compute_capability) == (
        "NVIDIA H200",
        143771,
        143150,
        "580.95.05",
        "9.0",
    )
    assert d.evidence["driver"] == "580.95.05"


def test_pynvml_not_importable_falls_back_too(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pynvml(name, *args, **kwargs):
        if name == "pynvml":
            raise ImportError("No module named 'pynvml'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_pynvml)
    d = cuda(None, {"nvidia-smi": rec.TWO_GPU_SMI}).detect()
    assert d.usable and [x.compute_capability for x in d.devices] == ["9.0", "8.6"]
    assert d.evidence["nvml"].startswith("ImportError")


def test_old_driver_without_compute_cap_field_is_retried():
    calls = []

    def run(argv):
        calls.append(tuple(argv))
        if tuple(argv) == SMI_QUERY:
            return ToolResult(tuple(argv), 2, rec.SMI_OLD_DRIVER_NO_CC)
        return ToolResult(tuple(argv), 0, rec.H200_SMI_NO_CC)

    nvml = rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound)
    d = CudaBackend(nvml=nvml, run=run, sysfs_root="/nonexistent").detect()
    assert calls == [SMI_QUERY, SMI_QUERY_NO_CC]
    assert d.usable and d.devices[0].compute_capability is None


def test_neither_nvml_nor_smi_is_gpu_missing(tmp_path):
    rec.write_pci_device(tmp_path, "0000:00:02.0", "0x1234", "0x030000")  # some other VGA
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound), {}, sysfs=tmp_path).detect()
    assert (d.present, d.usable, d.reason) == (False, False, R.GPU_MISSING)
    assert d.evidence["pci_nvidia_display"] is False
    assert roundtrip(d) == d


def test_nvidia_on_pci_but_no_driver_stack_is_cuda_unavailable(tmp_path):
    rec.write_pci_device(tmp_path, "0000:65:00.0", "0x10de", "0x030200")
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound), {}, sysfs=tmp_path).detect()
    assert (d.present, d.usable, d.reason) == (True, False, R.CUDA_UNAVAILABLE)


def test_smi_reports_no_devices():
    answers = {"nvidia-smi": ToolResult(("nvidia-smi",), 6, rec.SMI_NO_DEVICES)}
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound), answers).detect()
    assert d.reason == R.GPU_MISSING and not d.present


def test_smi_cannot_reach_driver_is_cuda_unavailable():
    answers = {"nvidia-smi": ToolResult(("nvidia-smi",), 9, rec.SMI_NO_DRIVER)}
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound), answers).detect()
    assert (d.present, d.reason) == (True, R.CUDA_UNAVAILABLE)
    assert "couldn't communicate" in d.evidence["raw"]


def test_driver_not_loaded_and_no_nvidia_device_is_gpu_missing(tmp_path):
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_DriverNotLoaded), sysfs=tmp_path).detect()
    assert (d.present, d.reason) == (False, R.GPU_MISSING)
    assert "DriverNotLoaded" in d.evidence["nvml"]


def test_driver_not_loaded_with_nvidia_device_is_cuda_unavailable(tmp_path):
    rec.write_pci_device(tmp_path, "0000:65:00.0", "0x10de", "0x030200")
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_DriverNotLoaded), sysfs=tmp_path).detect()
    assert (d.present, d.reason) == (True, R.CUDA_UNAVAILABLE)


def test_library_driver_mismatch_is_cuda_unavailable():
    d = cuda(rec.FakeNvml(init_error=rec.NVMLError_LibRmVersionMismatch)).detect()
    assert (d.present, d.usable, d.reason) == (True, False, R.CUDA_UNAVAILABLE)
    assert "LibRmVersionMismatch" in d.evidence["nvml"]


def test_nvml_with_zero_devices_is_gpu_missing():
    nvml = rec.FakeNvml(gpus=[])
    d = cuda(nvml).detect()
    assert (d.present, d.reason) == (False, R.GPU_MISSING)
    assert d.evidence["device_count"] == 0 and nvml.shutdown_calls == 1


def test_every_device_lost_is_cuda_unavailable():
    d = cuda(rec.FakeNvml(gpus=[rec.NVMLError_GpuIsLost])).detect()
    assert (d.present, d.reason) == (True, R.CUDA_UNAVAILABLE)
    assert "GpuIsLost" in d.evidence["device_errors"]["0"]


def test_one_lost_device_of_two_keeps_the_other():
    d = cuda(rec.FakeNvml(gpus=[rec.NVMLError_GpuIsLost, rec.a6000()])).detect()
    assert d.usable and [x.index for x in d.devices] == [1]
    assert "0" in d.evidence["device_errors"]


# -- bundles ---------------------------------------------------------------------------

H200 = CudaBackend(nvml=rec.FakeNvml()).detect()
A6000 = CudaBackend(nvml=rec.FakeNvml(gpus=[rec.a6000()])).detect()


def meta(**kw):
    base = {
        "backend": "cuda",
        "variant": "cuda13",
        "cuda_archs": ["90-real"],
        "min_driver": "580.00",
        "build": {"toolkit": "13.0"},
    }
    base.update(kw)
    return base


def test_h200_runs_a_90_real_bundle():
    assert CudaBackend().check_bundle(H200, meta()) is None


def test_driver_older_than_bundle_minimum_is_cuda_unavailable():
    check = CudaBackend().explain_bundle(H200, meta(min_driver="590.10"))
    assert check.reason == R.CUDA_UNAVAILABLE
    assert check.evidence == {"driver": "580.95.05", "min_driver": "590.10"}
    assert "580.95.05" in check.message and "590.10" in check.message
    assert CudaBackend().check_bundle(H200, meta(min_driver="580.95.05")) is None


def test_toolkit_major_newer_than_driver_cuda_is_refused():
    assert CudaBackend().check_bundle(H200, meta(build={"toolkit": "14.0"})) == R.CUDA_UNAVAILABLE
    # Minor-version compatibility: a 13.1 build runs on a CUDA 13.0 driver.
    assert CudaBackend().check_bundle(H200, meta(build={"toolkit": "nvcc 13.1.80"})) is None


def test_cc_86_cannot_run_a_90_real_only_build():
    check = CudaBackend().explain_bundle(A6000, meta())
    assert check.reason == R.CUDA_UNAVAILABLE
    assert check.evidence["compute_capability"] == ["8.6"] and check.evidence["cuda_archs"] == ["90-real"]


def test_cc_86_runs_a_fat_build():
    fat = meta(cuda_archs="75-virtual;80-virtual;86-real;89-real;90-real")
    assert CudaBackend().check_bundle(A6000, fat) is None


def test_mixed_gpus_fit_when_one_of_them_can_run_it():
    both = CudaBackend(nvml=rec.FakeNvml(gpus=[rec.h200(), rec.a6000()])).detect()
    assert CudaBackend().check_bundle(both, meta()) is None


def test_absent_gpu_reports_its_own_reason():
    missing = CudaBackend(nvml=rec.FakeNvml(gpus=[])).detect()
    assert CudaBackend().check_bundle(missing, meta()) == R.GPU_MISSING


@pytest.mark.parametrize(
    ("cc", "archs", "ok"),
    [
        ((9, 0), "90-real", True),
        ((8, 6), "90-real", False),
        ((9, 0), "80-virtual", True),  # PTX JIT upward
        ((8, 6), "89-virtual", False),  # PTX never runs downward
        ((8, 9), "86-real", True),  # SASS within a major, upward minor
        ((8, 0), "86-real", False),
        ((9, 0), "86-real", False),  # SASS never crosses a major
        ((9, 0), "90a-real", True),
        ((10, 0), "90a-real", False),  # arch-specific: exactly 9.0
        ((10, 0), "90a-virtual", False),
        ((12, 0), "86", True),  # bare = real + virtual
        ((9, 0), "120a-real;100-real", False),
        ((9, 0), "all-major", None),
        ((9, 0), "", None),
    ],
)
def test_cuda_architecture_rules(cc, archs, ok):
    assert cc_supported(cc, archs) is ok


def test_arch_parsing():
    assert CudaArch.parse("120a-real") == CudaArch(12, 0, True, True, False, "120a-real")
    assert split_archs("75-virtual;86-real") == ("75-virtual", "86-real")
    assert parse_cc("9.0") == (9, 0) and parse_cc("gfx90a") is None
    with pytest.raises(ValueError):
        CudaArch.parse("sm_90")


# -- variant, launch, list-devices, telemetry -------------------------------------------


def test_choose_variant_by_driver_cuda_version():
    b = CudaBackend()
    assert b.choose_variant(H200, ["cuda12", "cuda13", "cuda14"]) == "cuda13"
    assert b.choose_variant(H200, ["cuda14"]) is None
    assert b.choose_variant(H200, ["default"]) == "default"
    assert b.choose_variant(CudaBackend(nvml=rec.FakeNvml(gpus=[])).detect(), ["cuda13"]) is None


def test_list_devices_signature_matches_the_engine_line():
    (listed,) = CudaBackend().parse_list_devices(rec.LIST_DEVICES_H200)
    assert (listed.name, listed.description, listed.memory_total_mib, listed.memory_free_mib) == (
        "CUDA0",
        "NVIDIA H200",
        143155,
        142629,
    )
    assert CudaBackend().parse_list_devices(rec.LIST_DEVICES_CPU) == ()


def test_launch_args():
    b = CudaBackend()
    assert b.launch_args(LaunchRequest("auto")) == ["-ngl", "auto"]
    assert b.launch_args(LaunchRequest(0)) == ["-ngl", "0"]
    assert b.launch_args(SimpleNamespace(gpu_layers=99, devices=(0, 1))) == ["-ngl", "99"]


def test_the_plans_devices_are_the_only_ones_cuda_sees():
    """The GPUs a plan gives the server, by NVML index: CUDA_VISIBLE_DEVICES with the runtime
    numbering GPUs by PCI bus as NVML does, so index 1 is NVML's GPU 1 whatever the order CUDA
    would pick by itself. No devices named: the environment is left alone."""
    b = CudaBackend()
    assert b.launch_env(LaunchRequest("auto")) == {}
    assert b.launch_env(LaunchRequest("auto", devices=(1,))) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "1",
    }
    assert b.launch_env(LaunchRequest(8, devices=(0, 2)))["CUDA_VISIBLE_DEVICES"] == "0,2"


def test_telemetry_reports_free_vram_as_nvml_says_it():
    """Free VRAM is NVML's own figure, not total - used (drivers that reserve memory count it in neither)."""
    t = CudaBackend(nvml=rec.FakeNvml([rec.h200(free=699 * rec.MIB)])).read_telemetry(TelemetryRequest())
    assert t.devices[0].memory_free_mib == 699


def test_telemetry_reads_memory_and_the_servers_share():
    gpu = rec.h200(
        util=37, memory_util=12, temp=41, power_mw=123456, processes=[(4242, 2048 * rec.MIB), (7, 10 * rec.MIB)]
    )
    nvml = rec.FakeNvml(gpus=[gpu])
    b = CudaBackend(nvml=nvml)
    t = b.read_telemetry(TelemetryRequest(pid=4242))
    assert t.process_memory_mib == 2048 and t.source == "nvml" and t.backend == "cuda"
    (dev,) = t.devices
    assert (dev.name, dev.memory_used_mib, dev.memory_total_mib) == ("NVIDIA H200", 621, 143771)
    assert (dev.utilization_percent, dev.memory_utilization_percent, dev.temperature_c) == (37, 12, 41)
    assert dev.power_w == pytest.approx(123.456)
    assert dev.process_memory_mib == 2048 and dev.compute_processes == 2  # the other tenant is counted, not ours
    b.read_telemetry(TelemetryRequest())
    assert nvml.init_calls == 1  # NVML initialised once for telemetry, then reused


def test_telemetry_of_the_recorded_h200_holding_an_idle_context():
    nvml = rec.FakeNvml(gpus=[rec.h200(**rec.H200_HOLDING)], driver="580.159.04")
    t = CudaBackend(nvml=nvml).read_telemetry(TelemetryRequest(pid=456))
    (dev,) = t.devices
    assert (dev.memory_used_mib, dev.memory_total_mib, dev.utilization_percent) == (3189, 143771, 0)
    assert t.process_memory_mib == 2566 and dev.compute_processes == 1
    assert (dev.temperature_c, dev.power_w) == (33, pytest.approx(104.2))


def test_telemetry_of_the_recorded_idle_h200_without_the_process():
    t = CudaBackend(nvml=rec.FakeNvml(gpus=[rec.h200(**rec.H200_IDLE)])).read_telemetry(TelemetryRequest(pid=456))
    (dev,) = t.devices
    assert dev.memory_used_mib == 615 and dev.compute_processes == 0
    assert t.process_memory_mib == 0 and dev.process_memory_mib == 0  # read, and none of it is ours


def test_telemetry_sums_the_servers_share_over_two_gpus():
    gpus = [rec.h200(processes=[(4242, 2048 * rec.MIB)]), rec.a6000(processes=[(4242, 512 * rec.MIB + 1)])]
    t = CudaBackend(nvml=rec.FakeNvml(gpus=gpus)).read_telemetry(TelemetryRequest(pid=4242))
    assert [d.process_memory_mib for d in t.devices] == [2048, 512]
    assert t.process_memory_mib == 2560
    assert t.devices[1].power_w is None  # the A6000 recording has no power reading: unknown, not 0 W


def test_telemetry_without_a_process_list_leaves_the_share_unknown():
    gpus = [rec.h200(processes=rec.NVMLError_NotSupported)]
    t = CudaBackend(nvml=rec.FakeNvml(gpus=gpus)).read_telemetry(TelemetryRequest(pid=4242))
    assert t.process_memory_mib is None and t.devices[0].compute_processes is None
    assert t.devices[0].memory_used_mib == 621  # the other figures are still read


def test_telemetry_skips_a_device_that_fell_off_the_bus():
    nvml = rec.FakeNvml(gpus=[rec.NVMLError_GpuIsLost, rec.h200()])
    t = CudaBackend(nvml=nvml).read_telemetry(TelemetryRequest())
    assert [d.index for d in t.devices] == [1]


def test_telemetry_reads_only_the_requested_devices():
    nvml = rec.FakeNvml(gpus=[rec.h200(), rec.a6000()])
    t = CudaBackend(nvml=nvml).read_telemetry(TelemetryRequest(devices=(1,)))
    assert [(d.index, d.name) for d in t.devices] == [(1, "NVIDIA RTX A6000")]


def test_telemetry_release_shuts_nvml_down_until_the_next_reading():
    nvml = rec.FakeNvml()
    b = CudaBackend(nvml=nvml)
    b.release_telemetry()
    assert nvml.shutdown_calls == 0  # nothing was open
    b.read_telemetry(TelemetryRequest())
    b.release_telemetry()
    assert (nvml.init_calls, nvml.shutdown_calls) == (1, 1)
    b.read_telemetry(TelemetryRequest())
    assert nvml.init_calls == 2


def test_telemetry_without_nvml_raises_the_reason():
    b = CudaBackend(nvml=rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound))
    with pytest.raises(rec.NVMLError_LibraryNotFound):
        b.read_telemetry(TelemetryRequest())


def test_smi_csv_parser_skips_junk():
    assert [d.name for d in parse_smi_csv("\n" + rec.TWO_GPU_SMI + "garbage\n")] == ["NVIDIA H200", "NVIDIA RTX A6000"]


# -- CUDA_VISIBLE_DEVICES: NVML ignores it, the engine's CUDA runtime does not -----------------


class UuidNvml(rec.FakeNvml):
    def nvmlDeviceGetUUID(self, handle):
        return handle["uuid"]


def two_gpus() -> UuidNvml:
    return UuidNvml([rec.h200(uuid="GPU-aaaa1111-0000"), rec.a6000(uuid="GPU-bbbb2222-0000")])


@pytest.mark.parametrize("value", ["", "-1", "7", "GPU-cccc", "nonsense"])
def test_cuda_visible_devices_hiding_every_gpu_is_gpu_missing(value):
    d = CudaBackend(
        nvml=two_gpus(), run=recorded_runner({}), sysfs_root="/nonexistent", environ={"CUDA_VISIBLE_DEVICES": value}
    ).detect()
    assert not d.usable and not d.present and d.reason == R.GPU_MISSING
    assert d.evidence["cuda_visible_devices"] == value and d.evidence["visible_indices"] == []
    assert d.evidence["device_count"] == 2 and "CUDA_VISIBLE_DEVICES" in d.message


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("1", ["NVIDIA RTX A6000"]),
        ("1,0", ["NVIDIA RTX A6000", "NVIDIA H200"]),
        ("GPU-aaaa", ["NVIDIA H200"]),
        ("0,7,1", ["NVIDIA H200"]),  # the runtime stops at the first entry that names no device
        (" 0 , 0", ["NVIDIA H200"]),
    ],
)
def test_cuda_visible_devices_selects_like_the_runtime(value, names):
    d = CudaBackend(
        nvml=two_gpus(), run=recorded_runner({}), sysfs_root="/nonexistent", environ={"CUDA_VISIBLE_DEVICES": value}
    ).detect()
    assert d.usable and [dev.name for dev in d.devices] == names


def test_unset_cuda_visible_devices_sees_every_gpu():
    d = CudaBackend(nvml=two_gpus(), run=recorded_runner({}), sysfs_root="/nonexistent", environ={}).detect()
    assert d.usable and len(d.devices) == 2 and "cuda_visible_devices" not in d.evidence


def test_cuda_visible_devices_applies_to_nvidia_smi_too():
    nvml = rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound)
    d = CudaBackend(
        nvml=nvml,
        run=recorded_runner({"nvidia-smi": rec.H200_SMI}),
        sysfs_root="/nonexistent",
        environ={"CUDA_VISIBLE_DEVICES": ""},
    ).detect()
    assert d.reason == R.GPU_MISSING and d.evidence["source"] == "nvidia-smi"


# -- a local build for the detected GPUs only ----------------------------------------------


@pytest.mark.parametrize(
    ("ccs", "archs"),
    [
        (["9.0"], ("90-real",)),
        (["9.0", "9.0", "8.6"], ("86-real", "90-real")),  # every detected GPU's, once, lowest first
        (["12.0", "7.5"], ("75-real", "120-real")),
        (["9.0", None, "junk"], ("90-real",)),
        ([None], ()),
    ],
)
def test_the_build_architectures_are_the_detected_compute_capabilities(ccs, archs):
    assert archs_for(ccs) == archs


def test_the_cuda_plugin_builds_for_the_gpus_it_detected():
    both = CudaBackend(nvml=rec.FakeNvml(gpus=[rec.h200(), rec.a6000()])).detect()
    assert CudaBackend().build_archs(H200) == ("90-real",)
    assert CudaBackend().build_archs(both) == ("86-real", "90-real")
    assert CudaBackend().build_archs(CudaBackend(nvml=rec.FakeNvml(gpus=[])).detect()) == ()
    assert CudaBackend().build_archs(None) == ()


def test_a_bundle_built_for_the_h200_is_refused_on_another_gpu():
    built_here = meta(cuda_archs=list(CudaBackend().build_archs(H200)))
    assert CudaBackend().check_bundle(H200, built_here) is None
    check = CudaBackend().explain_bundle(A6000, built_here)
    assert check.reason == R.CUDA_UNAVAILABLE and "90-real" in check.message and "8.6" in check.message


def test_the_daemons_build_passes_the_detected_architectures_to_cmake():
    from stoker.daemon.bundles.variants import BuildPlan, Toolchain, parse_cuda_archs
    from stoker.daemon.install.sources import build_command

    archs = CudaBackend().build_archs(H200)
    argv = build_command("cuda", "cuda13", environ={}, archs=archs)
    assert argv[argv.index("--cuda-archs") + 1] == "90-real"
    assert "--cuda-archs" not in build_command("cpu", "avx2", environ={})  # nothing detected: the default
    toolchain = Toolchain("c++ 13", "cmake 3.28", "Ninja", "cuda 13.0", 13, "/usr/local/cuda/bin/nvcc")
    plan = BuildPlan.for_backend("cuda", "avx2", parse_cuda_archs(argv[argv.index("--cuda-archs") + 1]), toolchain)
    assert "-DCMAKE_CUDA_ARCHITECTURES=90-real" in plan.flags and plan.cuda_archs == ("90-real",)
