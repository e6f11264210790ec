"""CPU detection: advertised vs usable features, variant choice, bundle requirements."""

from __future__ import annotations

import pytest

import backend_recordings as rec
from stoker.daemon.backends.base import LaunchRequest
from stoker.daemon.backends.cpu import CpuBackend, parse_cpuinfo, parse_meminfo
from stoker.daemon.backends.cpu_features import SIGILL, USABLE, X86_TESTS
from stoker.daemon.backends.tools import recorded_runner
from stoker.states.reasons import ReasonCode as R

VARIANTS = ["native", "avx2", "compat"]


def recorded_tester(faulting=(), errors=()):
    """A recorded instruction tester: everything executes except `faulting` (SIGILL)."""
    seen = []

    def run_tests(features):
        features = list(features)
        seen.append(features)
        out = {}
        for f in features:
            out[f] = SIGILL if f in faulting else ("error: exit 1 PermissionError" if f in errors else USABLE)
        return out

    run_tests.seen = seen
    return run_tests


def cpu(tmp_path, cpuinfo, **kw):
    proc = rec.write_proc(tmp_path / "proc", cpuinfo)
    kw.setdefault("system", "Linux")
    kw.setdefault("machine", "x86_64")
    return CpuBackend(proc=proc, **kw)


def test_amx_advertised_but_faulting_is_not_usable(tmp_path):
    t = recorded_tester(faulting={"amx_tile", "amx_int8", "amx_bf16"})
    d = cpu(tmp_path, rec.CPUINFO_SPR_VM, tester=t).detect()
    assert d.present and d.usable and d.reason is None
    ev = d.evidence
    assert {"amx_tile", "amx_int8", "amx_bf16", "avx512f"} <= set(ev["advertised"])
    assert ev["unusable"] == ["amx_bf16", "amx_int8", "amx_tile"]
    assert "avx512f" in ev["usable"] and "amx_tile" not in ev["usable"]
    assert "advertised but faulting: amx_bf16, amx_int8, amx_tile" in d.message
    # Only advertised features with a known test are executed, each exactly once.
    assert sorted(t.seen[0]) == sorted(f for f in ev["advertised"] if f in X86_TESTS)
    assert CpuBackend().choose_variant(d, VARIANTS) == "avx2"  # never native
    assert CpuBackend().choose_variant(d, ["all", "avx2", "compat"]) == "avx2"


def test_everything_usable_allows_native(tmp_path):
    d = cpu(tmp_path, rec.CPUINFO_SPR_VM, tester=recorded_tester()).detect()
    assert d.evidence["unusable"] == [] and d.evidence["untested"] == []
    assert CpuBackend().choose_variant(d, VARIANTS) == "native"
    assert CpuBackend().choose_variant(d, ["avx2", "compat"]) == "avx2"


def test_untested_features_do_not_count_as_proven(tmp_path):
    d = cpu(tmp_path, rec.CPUINFO_SPR_VM, tester=recorded_tester(errors={"avx512f"})).detect()
    assert d.evidence["untested"] == ["avx512f"]
    assert CpuBackend().choose_variant(d, VARIANTS) == "avx2"


def test_avx512_faulting_too(tmp_path):
    d = cpu(tmp_path, rec.CPUINFO_SPR_VM, tester=recorded_tester(faulting={"avx512f", "avx512bw"})).detect()
    assert {"avx512f", "avx512bw"} <= set(d.evidence["unusable"])
    assert CpuBackend().choose_variant(d, VARIANTS) == "avx2"


def test_haswell_gets_avx2_and_sandy_bridge_gets_compat(tmp_path):
    haswell = cpu(tmp_path / "h", rec.CPUINFO_HASWELL, tester=recorded_tester()).detect()
    assert haswell.devices[0].name.startswith("Intel(R) Core(TM) i7-4770")
    # Everything Haswell advertises works, so native is allowed there.
    assert CpuBackend().choose_variant(haswell, ["avx2", "compat"]) == "avx2"
    sandy = cpu(tmp_path / "s", rec.CPUINFO_SANDY, tester=recorded_tester()).detect()
    assert CpuBackend().choose_variant(sandy, ["avx2", "compat"]) == "compat"
    broken_fma = cpu(tmp_path / "f", rec.CPUINFO_HASWELL, tester=recorded_tester(faulting={"fma"})).detect()
    assert CpuBackend().choose_variant(broken_fma, ["native", "avx2", "compat"]) == "compat"


def test_arm_runs_no_x86_tests(tmp_path):
    t = recorded_tester()
    d = cpu(tmp_path, rec.CPUINFO_ARM, machine="aarch64", tester=t).detect()
    assert t.seen == [] and d.evidence["tests"] == {}
    assert CpuBackend().choose_variant(d, ["compat"]) == "compat"


def test_memory_and_device(tmp_path):
    d = cpu(tmp_path, rec.CPUINFO_SPR_VM, tester=recorded_tester()).detect()
    (dev,) = d.devices
    assert (dev.name, dev.memory_total_mib, dev.memory_free_mib, dev.device_type) == (
        "Intel(R) Xeon(R) Processor",
        24106,
        22588,
        "cpu",
    )


def test_tester_crash_leaves_everything_untested(tmp_path):
    def boom(features):
        raise OSError("fork failed")

    d = cpu(tmp_path, rec.CPUINFO_HASWELL, tester=boom).detect()
    assert d.usable and set(d.evidence["untested"]) == {"avx", "avx2", "fma", "f16c", "bmi2"}
    assert CpuBackend().choose_variant(d, VARIANTS) == "compat"


def test_bundle_needing_a_faulting_feature_is_refused(tmp_path):
    d = cpu(tmp_path, rec.CPUINFO_SPR_VM, tester=recorded_tester(faulting={"amx_tile", "amx_int8"})).detect()
    b = CpuBackend()
    check = b.explain_bundle(d, {"cpu_requires": ["avx2", "amx_int8", "amx_tile"]})
    assert check.reason == R.CPU_ILLEGAL_INSTRUCTION
    assert check.evidence["faulting"] == ["amx_int8", "amx_tile"]
    assert b.check_bundle(d, {"cpu_requires": ["avx2", "fma"]}) is None
    assert b.check_bundle(d, {"cpu_requires": []}) is None


def test_macos_intel_features_from_sysctl():
    def run(argv):
        key = argv[-1]
        table = {
            "machdep.cpu.brand_string": "Intel(R) Core(TM) i9-9880H CPU @ 2.30GHz",
            "hw.memsize": str(32 * 1024**3),
            "machdep.cpu.features": "FPU SSE SSE2 SSE3 SSSE3 FMA SSE4.1 SSE4.2 AVX1.0 F16C",
            "machdep.cpu.leaf7_features": "BMI1 AVX2 BMI2",
        }
        return recorded_runner({"sysctl": table[key]})(argv)

    d = CpuBackend(system="Darwin", machine="x86_64", run=run, tester=recorded_tester()).detect()
    assert {"avx", "avx2", "fma", "f16c", "bmi2"} <= set(d.evidence["usable"])
    assert d.devices[0].memory_total_mib == 32 * 1024
    assert CpuBackend().choose_variant(d, ["avx2", "compat"]) == "avx2"


def test_cpu_offloads_nothing_and_has_the_none_signature():
    from types import SimpleNamespace

    b = CpuBackend()
    # -ngl 0 whatever the plan asks: the CPU build has no device to offload to, and says so.
    assert b.launch_args(SimpleNamespace(gpu_layers=99, devices=("CUDA0",))) == ["-ngl", "0"]
    assert b.launch_args(LaunchRequest("auto")) == ["-ngl", "0"]
    assert b.device_signature.match("  (none)")
    (listed,) = b.parse_list_devices(rec.LIST_DEVICES_CPU)
    assert (listed.backend, listed.name) == ("cpu", "(none)")
    assert b.parse_list_devices(rec.LIST_DEVICES_H200) == ()


@pytest.mark.parametrize("text", ["", "junk"])
def test_parsers_tolerate_junk(text):
    assert parse_cpuinfo(text) == (None, frozenset())
    assert parse_meminfo(text) == (None, None)


def test_native_bundle_needs_every_advertised_feature_proven(tmp_path):
    b = CpuBackend()
    native = {"cpu_requires": ["native"], "build": {"compiler": "c++ (GCC) 14.2.0"}}
    faulty = cpu(tmp_path / "a", rec.CPUINFO_SPR_VM, tester=recorded_tester(faulting={"amx_tile"})).detect()
    check = b.explain_bundle(faulty, native)
    assert check.reason == R.CPU_ILLEGAL_INSTRUCTION and check.evidence["unproven"] == ["amx_tile"]
    proven = cpu(tmp_path / "b", rec.CPUINFO_SPR_VM, tester=recorded_tester()).detect()
    assert b.check_bundle(proven, native) is None


def test_native_amx_bundle_built_by_gcc_12_is_refused(tmp_path):
    """GCC 12.2's _tile_loadconfig drops the tile config stores: SIGILL at tilezero (verified here)."""
    b = CpuBackend()
    proven = cpu(tmp_path / "a", rec.CPUINFO_SPR_VM, tester=recorded_tester()).detect()
    gcc12 = {"cpu_requires": ["native"], "build": {"compiler": "c++ (Debian 12.2.0-14+deb12u1) 12.2.0"}}
    check = b.explain_bundle(proven, gcc12)
    assert check.reason == R.CPU_ILLEGAL_INSTRUCTION
    assert check.evidence["amx"] == ["amx_bf16", "amx_int8", "amx_tile"]
    clang = {"cpu_requires": ["native"], "build": {"compiler": "Debian clang version 16.0.6 (15)"}}
    assert b.check_bundle(proven, clang) is None
    haswell = cpu(tmp_path / "b", rec.CPUINFO_HASWELL, tester=recorded_tester()).detect()
    assert b.check_bundle(haswell, gcc12) is None  # no AMX, no miscompiled path


def test_gcc_major():
    from stoker.daemon.backends.cpu import gcc_major

    assert gcc_major("c++ (Debian 12.2.0-14+deb12u1) 12.2.0") == 12
    assert gcc_major("g++ (GCC) 14.2.1 20240912 (Red Hat 14.2.1-3)") == 14
    assert gcc_major("gcc 11.4.0") == 11
    assert gcc_major("Ubuntu clang version 18.1.3 (1ubuntu1)") is None
    assert gcc_major("") is None
