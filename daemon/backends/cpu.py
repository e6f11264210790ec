"""The CPU: always present; which instruction sets it advertises and which really execute."""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

from stoker.daemon.backends.base import BUNDLE_FITS, Backend, BundleCheck, Detection, Device, ReasonKind
from stoker.daemon.backends.cpu_features import USABLE, X86_TESTS, InstructionTester, run_feature_tests
from stoker.daemon.backends.tools import ToolRunner, run_tool
from stoker.states.reasons import ReasonCode

R = ReasonCode
K = ReasonKind

# The flags that decide a llama.cpp CPU variant (the rest of /proc/cpuinfo is noise here).
RELEVANT = re.compile(r"^(sse3|ssse3|sse4_1|sse4_2|avx|avx2|fma|f16c|bmi1|bmi2|avx_vnni|avx512.*|amx.*)$")
AVX2_VARIANT_NEEDS = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
# Variant preference, best first. "native" (built with -march=native on this host) and
# "all" (GGML_CPU_ALL_VARIANTS: ggml picks by cpuid at run time, AMX included) both trust
# cpuid, so they are chosen only when every advertised feature was proven to execute.
TRUSTS_CPUID = ("native", "all")

# macOS sysctl names -> the Linux flag names used everywhere else.
_MAC_FLAGS = {
    "avx1.0": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "bmi2": "bmi2",
    "bmi1": "bmi1",
    "sse4.1": "sse4_1",
    "sse4.2": "sse4_2",
    "ssse3": "ssse3",
    "sse3": "sse3",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512dq": "avx512dq",
    "avx512cd": "avx512cd",
    "avx512vnni": "avx512_vnni",
}


def parse_cpuinfo(text: str) -> tuple[str | None, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo text (x86 'flags', Arm 'Features')."""
    model = None
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and model is None:
            model = value.strip() or None
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, frozenset(flags)


def parse_meminfo(text: str) -> tuple[int | None, int | None]:
    """(MemTotal, MemAvailable) in MiB from /proc/meminfo text."""
    values = {}
    for line in text.splitlines():
        m = re.match(r"^(MemTotal|MemAvailable):\s+(\d+) kB", line)
        if m:
            values[m.group(1)] = int(m.group(2)) // 1024
    return values.get("MemTotal"), values.get("MemAvailable")


class CpuBackend(Backend):
    name = "cpu"
    device_signature = re.compile(r"^\s+\(none\)\s*$")  # a CPU-only build lists no device
    offloads = False
    auto_rank = 1000  # the floor: tried last, after every accelerator
    reason_family = {K.UNAVAILABLE: R.PROBE_FAILED, K.BUNDLE_INSTALL_FAILED: R.CPU_BUNDLE_INSTALL_FAILED}
    reason_codes = frozenset({R.CPU_ILLEGAL_INSTRUCTION, R.CPU_BUNDLE_INSTALL_FAILED, R.OUT_OF_MEMORY, R.PROBE_FAILED})

    def __init__(
        self,
        *,
        system: str | None = None,
        machine: str | None = None,
        proc: Path | str = "/proc",
        run: ToolRunner = run_tool,
        tester: InstructionTester = run_feature_tests,
    ) -> None:
        self._system = system or platform.system()
        self._machine = (machine or platform.machine()).lower()
        self._proc = Path(proc)
        self._run = run
        self._tester = tester

    @property
    def _x86(self) -> bool:
        return self._machine in ("x86_64", "amd64", "i686", "i386")

    def _read(self, name: str) -> str:
        try:
            return (self._proc / name).read_text(errors="replace")
        except OSError:
            return ""

    def _features_darwin(self) -> tuple[str | None, frozenset[str], int | None]:
        brand = self._run(("sysctl", "-n", "machdep.cpu.brand_string"))
        mem = self._run(("sysctl", "-n", "hw.memsize"))
        flags: set[str] = set()
        for key in ("machdep.cpu.features", "machdep.cpu.leaf7_features"):
            answer = self._run(("sysctl", "-n", key))
            if answer.ok:
                flags |= {_MAC_FLAGS.get(f.lower(), f.lower()) for f in answer.stdout.split()}
        total = int(mem.stdout.strip()) // (1024 * 1024) if mem.ok and mem.stdout.strip().isdigit() else None
        return (brand.stdout.strip() or None) if brand.ok else None, frozenset(flags), total

    def detect(self) -> Detection:
        """Advertised features, then the x86 ones executed for real in child processes."""
        free = None
        if self._system == "Darwin":
            model, flags, total = self._features_darwin()
        else:
            model, flags = parse_cpuinfo(self._read("cpuinfo"))
            total, free = parse_meminfo(self._read("meminfo"))
        advertised = sorted(f for f in flags if RELEVANT.match(f))
        tests: dict[str, str] = {}
        if self._x86:
            to_test = [f for f in advertised if f in X86_TESTS]
            try:
                tests = dict(self._tester(to_test))
            except Exception as e:  # the tester itself failed: nothing proven
                tests = {f: f"error: {type(e).__name__}: {e}" for f in to_test}
        faulting = sorted(f for f, v in tests.items() if v != USABLE and not v.startswith("error"))
        untested = sorted(f for f, v in tests.items() if v.startswith("error"))
        usable = sorted(f for f in advertised if f not in faulting and f not in untested)
        evidence: dict[str, Any] = {
            "arch": self._machine,
            "system": self._system,
            "advertised": advertised,
            "usable": usable,
            "unusable": faulting,
            "untested": untested,
            "tests": tests,
            "logical_cpus": os.cpu_count(),
        }
        device = Device(
            index=0, name=model or self._machine, memory_total_mib=total, memory_free_mib=free, device_type="cpu"
        )
        message = f"{device.name}, {os.cpu_count()} logical CPUs"
        if faulting:
            message += f"; advertised but faulting: {', '.join(faulting)}"
        return Detection.available(self.name, [device], message, **evidence)

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        """native/all only if everything advertised executes; avx2 if its set executes; else compat."""
        variants = set(available_variants)
        ev = detection.evidence
        usable = set(ev.get("usable", ()))
        advertised = set(ev.get("advertised", ()))
        proven = advertised <= usable and not ev.get("untested") and not ev.get("unusable")
        if proven:
            for v in TRUSTS_CPUID:
                if v in variants:
                    return v
        if AVX2_VARIANT_NEEDS <= usable and "avx2" in variants:
            return "avx2"
        for v in ("compat", "default"):
            if v in variants:
                return v
        safe = variants - set(TRUSTS_CPUID) - {"avx2"}
        return sorted(safe)[0] if len(safe) == 1 else None

    def explain_bundle(self, detection: Detection, bundle_meta: Mapping[str, Any]) -> BundleCheck:
        """A bundle compiled for features this CPU cannot execute would die with SIGILL.

        `cpu_requires` lists /proc/cpuinfo flags, or "native" for a -march=native build of
        this host: that one needs every advertised feature proven, and is refused on an AMX
        CPU when GCC <= 12 built it (its `_tile_loadconfig` miscompiles ggml's tile config,
        so the engine dies at `tilezero` on any AMX machine; docs/backends.md).
        """
        required = set(bundle_meta.get("cpu_requires") or ())
        ev = detection.evidence
        usable = set(ev.get("usable", ()))
        advertised = set(ev.get("advertised", ()))
        if "native" in required:
            required.discard("native")
            unproven = sorted((advertised - usable) | set(ev.get("untested", ())))
            if unproven:
                return BundleCheck(
                    R.CPU_ILLEGAL_INSTRUCTION,
                    f"A -march=native bundle needs every advertised feature; not proven here: "
                    f"{', '.join(unproven)}. Use the avx2 or compat variant.",
                    {"cpu_requires": ["native"], "unproven": unproven},
                )
            compiler = str((bundle_meta.get("build") or {}).get("compiler") or "")
            gcc = gcc_major(compiler)
            amx = sorted(f for f in advertised if f.startswith("amx"))
            if amx and gcc is not None and gcc <= 12:
                return BundleCheck(
                    R.CPU_ILLEGAL_INSTRUCTION,
                    f"This native bundle was built by GCC {gcc}, whose _tile_loadconfig drops ggml's AMX tile "
                    "configuration: it dies with SIGILL at tilezero on any AMX CPU. Use the avx2 variant, or "
                    "rebuild with a newer compiler or with AMX off.",
                    {"compiler": compiler, "amx": amx},
                )
        if not required:
            return BUNDLE_FITS
        missing = sorted(required - usable)
        if not missing:
            return BUNDLE_FITS
        faulting = sorted(set(missing) & set(ev.get("unusable", ())))
        detail = (
            f"advertised but faulting here: {', '.join(faulting)}"
            if faulting
            else f"not available: {', '.join(missing)}"
        )
        return BundleCheck(
            R.CPU_ILLEGAL_INSTRUCTION,
            f"This CPU bundle needs {', '.join(missing)} ({detail}); use a safer CPU variant.",
            {"cpu_requires": sorted(required), "missing": missing, "faulting": faulting},
        )


def gcc_major(compiler_version_line: str) -> int | None:
    """GCC's major version from `c++ --version`'s first line; None for clang or unknown."""
    line = compiler_version_line.strip()
    if not line or "clang" in line.lower():
        return None
    m = re.search(r"\)\s+(\d+)\.\d+", line) or re.search(r"(\d+)\.\d+(?:\.\d+)?\s*$", line)
    return int(m.group(1)) if m else None
