"""Build plans: the pinned cmake flags for each backend and CPU variant, and the toolchain.

Pure decisions live here (flags, the CPU features a variant needs, the CUDA driver floor) so
they are unit-tested without a compiler; `build.py` runs them. docs/cpu-variants.md says why
the CPU ships as explicit variants rather than ggml's GGML_CPU_ALL_VARIANTS.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Mapping

import attrs

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

BACKENDS = ("cpu", "cuda", "vulkan")

# Everything that makes the build hermetic and relocatable, for every backend.
COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # ON downloads the web UI at build time
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_LLGUIDANCE=OFF",
    "-DGGML_BACKEND_DL=OFF",  # DL backends also load from the cwd and fail silently
    "-DGGML_CCACHE=OFF",  # a shared compiler cache is an input the cache key cannot see
    "-DGGML_OPENMP_FETCH=OFF",
    "-DGGML_RPC=ON",  # ggml-rpc-server for `stoker worker`, and `--rpc` on the head
    # ggml-rpc links libibverbs whenever the build host has it (the H200 image does): every
    # bundle would then need rdma-core on the user's machine. RPC runs over TCP.
    "-DGGML_RPC_RDMA=OFF",
    "-DFETCHCONTENT_FULLY_DISCONNECTED=ON",  # nothing is downloaded while building
    "-DCMAKE_INSTALL_RPATH=$ORIGIN",
    "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    "-DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF",
)

X86_SIMD = (
    "SSE42",
    "AVX",
    "AVX_VNNI",
    "AVX2",
    "BMI2",
    "FMA",
    "F16C",
    "AVX512",
    "AVX512_VBMI",
    "AVX512_VNNI",
    "AVX512_BF16",
    "AMX_TILE",
    "AMX_INT8",
    "AMX_BF16",
)

# variant -> (GGML_NATIVE, the SIMD options turned ON, the /proc/cpuinfo flags they need)
CPU_VARIANTS: Mapping[str, tuple[bool, tuple[str, ...], tuple[str, ...]]] = {
    "avx2": (False, ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2"), ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2")),
    "compat": (False, (), ()),
    "native": (True, (), ("native",)),  # opt-in; runs only where cpuid tells the truth
}
SAFE_CPU_VARIANTS = ("avx2", "compat")  # in fallback order: fastest first

# The Linux driver each CUDA major needs (NVIDIA's CUDA compatibility table, minor-version
# compatibility floor): recorded so a too-old driver is named before launch.
CUDA_MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# CUDA code in families, each a bundle the manifest offers by compute capability (one bundle
# with all of them would be ~7x the CUDA library of one architecture: docs/bundles.md). Real
# code (SASS) for the cards users have; PTX (virtual) at the end for GPUs newer than the list.
# CUDA 13 builds for Turing (7.5) and newer only.
CUDA_FAMILIES: Mapping[str, tuple[str, ...]] = {
    "turing-ampere": ("75-real", "80-real", "86-real"),  # T4, RTX 20xx, A100, RTX 30xx, A10/A40
    "ada-hopper": ("89-real", "90-real"),  # RTX 40xx, L4, L40S, H100, H200
    "blackwell": ("100-real", "120-real", "120-virtual"),  # B200, RTX 50xx; PTX for what comes next
}
CUDA_FAMILIES_ALL = tuple(a for family in CUDA_FAMILIES.values() for a in family)
DEFAULT_CUDA_ARCHS = CUDA_FAMILIES_ALL
# The CUDA runtime libraries a CUDA bundle carries (NVIDIA's redistributable set), so that the
# host needs only the driver's libcuda.so.1.
CUDA_BUNDLED_LIBS = ("libcudart.so", "libcublas.so", "libcublasLt.so")
# A Vulkan bundle needs the Khronos loader from the host; the driver behind it is the host's.
VULKAN_SYSTEM_LIBS = ("libvulkan.so.1",)
# Vulkan headers other than the system's: an include directory holding vulkan/vulkan_core.h.
VULKAN_HEADERS_ENV = "STOKER_VULKAN_HEADERS"
# What the pinned engine's ggml-vulkan.cpp uses without a guard (b11434: the validation layer's
# settings in ggml_vk_instance_init); headers without it fail to compile 20 minutes in.
VULKAN_NEEDS = ("VK_EXT_layer_settings",)
_ARCH = re.compile(r"^\d{2,3}[af]?(-real|-virtual)?$")


def host_platform() -> str:
    """`linux-x86_64`, `darwin-arm64`, ...: the platform a bundle is built for."""
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "aarch64": "arm64"}.get(machine, machine)
    return f"{platform.system().lower()}-{machine}"


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The `flags` line of /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def default_cpu_variant(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """The safe variant this CPU can run: avx2 where its features are all present, else compat."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return "compat"
    flags = cpu_flags() if flags is None else flags
    needs = CPU_VARIANTS["avx2"][2]
    return "avx2" if all(f in flags for f in needs) else "compat"


def variant_fits(cpu_requires: tuple[str, ...], flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` can run a bundle that requires `cpu_requires`."""
    return "native" not in cpu_requires and all(f in flags for f in cpu_requires)


def parse_cuda_archs(text: str | None) -> tuple[str, ...]:
    """`90-real`, a list (`75-virtual;80-virtual,90-real`), a family name or `all` -> a validated tuple."""
    if not text:
        return DEFAULT_CUDA_ARCHS
    if text.strip() == "all":
        return CUDA_FAMILIES_ALL
    if text.strip() in CUDA_FAMILIES:
        return CUDA_FAMILIES[text.strip()]
    archs = tuple(a.strip() for a in re.split(r"[;,\s]+", text) if a.strip())
    bad = [a for a in archs if not _ARCH.match(a)]
    if not archs or bad:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            "Bad --cuda-archs: use compute capabilities such as 90-real or 75-virtual;86-real, or a family.",
            {"cuda_archs": text, "invalid": bad, "families": sorted(CUDA_FAMILIES)},
        )
    return archs


def cuda_system_libs(toolkit_major: int) -> tuple[str, ...]:
    """The libraries a CUDA bundle needs from the host: the driver's alone (the runtime is bundled)."""
    return ("libcuda.so.1",)


def cuda_lib_dirs(nvcc: str | None) -> tuple[str, ...]:
    """Where the toolkit next to `nvcc` keeps its runtime libraries."""
    if not nvcc:
        return ()
    root = Path(nvcc).resolve().parent.parent
    dirs = [root / "lib64", root / "targets" / f"{platform.machine()}-linux" / "lib", root / "lib"]
    return tuple(str(d) for d in dirs if d.is_dir())


def _cpu_flags_for(variant: str) -> tuple[str, ...]:
    if variant not in CPU_VARIANTS:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            f"Unknown CPU variant {variant!r}; choose one of {', '.join(CPU_VARIANTS)}.",
            {"variant": variant},
        )
    native, enabled, _ = CPU_VARIANTS[variant]
    flags = [f"-DGGML_NATIVE={'ON' if native else 'OFF'}"]
    if not native:
        # Every option is stated, ON or OFF, so a changed upstream default cannot change us.
        flags += [f"-DGGML_{opt}={'ON' if opt in enabled else 'OFF'}" for opt in X86_SIMD]
    return tuple(flags)


@attrs.frozen
class Toolchain:
    compiler: str  # first line of `c++ --version`
    cmake: str
    generator: str
    toolkit: str | None = None  # "cuda 13.0" for CUDA builds
    toolkit_major: int | None = None
    nvcc: str | None = None
    vulkan_include: str | None = None  # Vulkan headers other than the system's ($STOKER_VULKAN_HEADERS)

    def to_dict(self) -> dict[str, Any]:
        return {"compiler": self.compiler, "cmake": self.cmake, "generator": self.generator, "toolkit": self.toolkit}


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as err:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED, f"The build tool {cmd[0]!r} is missing or broken.", {"error": str(err)}
        ) from None
    return out.strip().splitlines()[0] if out.strip() else ""


def find_nvcc(environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    for candidate in (env.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def parse_nvcc_version(text: str) -> tuple[str, int]:
    """`... release 13.0, V13.0.88` -> ("cuda 13.0", 13)."""
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            "Could not read the CUDA toolkit version from nvcc.",
            {"nvcc_version": text[-500:]},
        )
    return f"cuda {m.group(1)}.{m.group(2)}", int(m.group(1))


def _vulkan_include_dirs(environ: Mapping[str, str]) -> tuple[Path, ...]:
    sdk = environ.get("VULKAN_SDK")
    dirs = (environ.get(VULKAN_HEADERS_ENV), f"{sdk}/include" if sdk else None, "/usr/include", "/usr/local/include")
    return tuple(Path(d) for d in dirs if d)


def find_glslc(environ: Mapping[str, str] | None = None) -> str | None:
    """glslc where cmake's FindVulkan looks for it: $VULKAN_SDK/bin, then PATH."""
    env = os.environ if environ is None else environ
    sdk = env.get("VULKAN_SDK")
    for candidate in (f"{sdk}/bin/glslc" if sdk else None, shutil.which("glslc")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def vulkan_toolkit(environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """(`vulkan 1.4.309, shaderc 2023.2-1`, the include dir to give cmake or None for the
    system's): the Vulkan headers' version and glslc's are cache-key inputs (the headers decide
    which device features ggml-vulkan compiles in, glslc the SPIR-V). The first headers found
    are used: $STOKER_VULKAN_HEADERS, $VULKAN_SDK/include, /usr/include, /usr/local/include.
    bundle_build_failed naming the packages when the headers, glslc or the SPIR-V headers are
    missing, or when the headers lack what the pinned engine uses (VULKAN_NEEDS)."""
    env = os.environ if environ is None else environ
    includes = _vulkan_include_dirs(env)
    core = next((d / "vulkan" / "vulkan_core.h" for d in includes if (d / "vulkan" / "vulkan_core.h").is_file()), None)
    spirv = any((d / "spirv" / "unified1" / "spirv.hpp").is_file() for d in includes)
    glslc = find_glslc(env)
    missing = [
        what
        for what, ok in (("libvulkan-dev (vulkan/vulkan_core.h)", core), ("glslc", glslc), ("spirv-headers", spirv))
        if not ok
    ]
    if missing or core is None or glslc is None:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            f"The Vulkan build needs {', '.join(missing)}: on Debian/Ubuntu `apt-get install libvulkan-dev glslc "
            "spirv-headers` (or set VULKAN_SDK to a LunarG SDK).",
            {"missing": missing, "searched": [str(d) for d in includes]},
        )
    text = core.read_text(errors="replace")
    header = re.search(r"VK_HEADER_VERSION_COMPLETE\s+VK_MAKE_API_VERSION\(\s*0,\s*(\d+),\s*(\d+),", text)
    patch = re.search(r"#define\s+VK_HEADER_VERSION\s+(\d+)", text)
    headers = f"{header.group(1)}.{header.group(2)}.{patch.group(1)}" if header and patch else "unknown"
    lacking = [name for name in VULKAN_NEEDS if f"#define {name} 1" not in text]
    if lacking:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            f"The Vulkan headers in {core.parent.parent} ({headers}) lack {', '.join(lacking)}, which the engine's "
            f"Vulkan backend uses: newer headers are needed (Debian 12's libvulkan-dev is 1.3.239; Debian 13's "
            f"1.4.309 works). Point {VULKAN_HEADERS_ENV} at an include directory that has them (`./dev test` "
            "unpacks Debian 13's libvulkan-dev there on Debian 12) or set VULKAN_SDK to a LunarG SDK.",
            {"headers": str(core), "version": headers, "lacking": lacking},
        )
    shaderc = _first_line([glslc, "--version"]).replace("shaderc ", "").strip()
    system = str(core.parent.parent) in ("/usr/include", "/usr/local/include")
    return f"vulkan {headers}, shaderc {shaderc}", None if system else str(core.parent.parent)


def detect_toolchain(backend: str) -> Toolchain:
    """Probe the compiler, cmake and (for CUDA) nvcc or (for Vulkan) its headers and glslc on this host."""
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    compiler = _first_line([os.environ.get("CXX", "c++"), "--version"])
    cmake = _first_line(["cmake", "--version"])
    if backend == "vulkan":
        toolkit, include = vulkan_toolkit()
        return Toolchain(compiler, cmake, generator, toolkit, vulkan_include=include)
    if backend != "cuda":
        return Toolchain(compiler, cmake, generator)
    nvcc = find_nvcc()
    if nvcc is None:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            "nvcc (the CUDA toolkit) was not found; install it or set CUDACXX.",
            {"searched": ["$CUDACXX", "PATH", "/usr/local/cuda/bin/nvcc"]},
        )
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    toolkit, major = parse_nvcc_version(out)
    return Toolchain(compiler, cmake, generator, toolkit, major, nvcc)


@attrs.frozen
class BuildPlan:
    """Everything that decides a build's output, except the source."""

    backend: str
    variant: str
    platform: str
    flags: tuple[str, ...]
    cpu_requires: tuple[str, ...]
    cuda_archs: tuple[str, ...]
    min_driver: str | None
    declared_system_libs: tuple[str, ...]
    toolchain: Toolchain
    host_cpu: str | None = None  # digest of the build host's cpu flags, for native only
    # Libraries (soname prefixes) copied into the bundle from `bundled_lib_dirs` rather than
    # left to the host: the CUDA runtime.
    bundled_libs: tuple[str, ...] = ()
    bundled_lib_dirs: tuple[str, ...] = ()

    @classmethod
    def for_backend(
        cls,
        backend: str,
        variant: str | None = None,
        cuda_archs: tuple[str, ...] | None = None,
        toolchain: Toolchain | None = None,
    ) -> "BuildPlan":
        """The pinned plan for a backend and CPU variant (the variant also sets a CUDA build's CPU part)."""
        if backend not in BACKENDS:
            raise StokerError(
                ReasonCode.BUNDLE_BUILD_FAILED,
                f"Stoker can build the {', '.join(BACKENDS)} backends, not {backend!r}.",
                {"backend": backend},
            )
        variant = variant or default_cpu_variant()
        toolchain = toolchain or detect_toolchain(backend)
        flags = COMMON_FLAGS + _cpu_flags_for(variant)
        archs: tuple[str, ...] = ()
        bundled: tuple[str, ...] = ()
        bundled_dirs: tuple[str, ...] = ()
        min_driver = None
        libs: tuple[str, ...] = ()
        if backend == "cuda":
            archs = cuda_archs or DEFAULT_CUDA_ARCHS
            major = toolchain.toolkit_major or 0
            # NCCL only serves several GPUs, and cmake links it whenever the build host happens
            # to have it (the H200 image does): the bundle then needs libnccl.so.2 on every host.
            flags += ("-DGGML_CUDA=ON", "-DGGML_CUDA_NCCL=OFF", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}")
            if toolchain.nvcc:
                flags += (f"-DCMAKE_CUDA_COMPILER={toolchain.nvcc}",)
            min_driver = CUDA_MIN_DRIVER.get(major)
            libs = cuda_system_libs(major)
            bundled, bundled_dirs = CUDA_BUNDLED_LIBS, cuda_lib_dirs(toolchain.nvcc)
        elif backend == "vulkan":
            # Only the Vulkan loader comes from the host; it finds the host's driver (ICD) itself.
            # GGML_CUDA stays off whatever the build host has: no CUDA coupling.
            flags += ("-DGGML_VULKAN=ON",)
            if toolchain.vulkan_include:
                flags += (f"-DVulkan_INCLUDE_DIR={toolchain.vulkan_include}",)
            libs = VULKAN_SYSTEM_LIBS
        host_cpu = None
        if variant == "native":
            host_cpu = hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
        return cls(
            backend,
            variant,
            host_platform(),
            flags,
            CPU_VARIANTS[variant][2],
            archs,
            min_driver,
            libs,
            toolchain,
            host_cpu,
            bundled,
            bundled_dirs,
        )

    def cache_inputs(self, source_digest: str, extra: Mapping[str, Any]) -> dict[str, Any]:
        """The document whose digest is the build cache key."""
        return {
            "source": source_digest,
            "backend": self.backend,
            "variant": self.variant,
            "platform": self.platform,
            "flags": list(self.flags),
            "cuda_archs": list(self.cuda_archs),
            "toolchain": self.toolchain.to_dict(),
            "host_cpu": self.host_cpu,
            **({"bundled_libs": list(self.bundled_libs)} if self.bundled_libs else {}),
            **extra,
        }
