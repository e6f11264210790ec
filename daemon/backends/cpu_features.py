"""Does this CPU really execute what it advertises? Execute the instruction and see.

cpuid (and so /proc/cpuinfo) can advertise AVX-512 or AMX that a hypervisor or the kernel
does not actually let a process run; `-march=native` code then dies with SIGILL. For each
advertised feature we execute one instruction of it in a throwaway child Python process
(a few bytes of machine code in an executable mmap page, called through ctypes). Exit 0
means usable, death by SIGILL means advertised-but-unusable, anything else means the test
itself could not run (untested).

AMX needs more than the instruction: Linux (>= 5.16) gives a process the large AMX state
only after `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, and the tile registers
must be configured (`ldtilecfg`) before `tilezero`/`tdp*` - either missing is also SIGILL.
The test does both, the way ggml's AMX path does, so it answers "can a correct program use
AMX here", and the evidence says whether the kernel granted the permission.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Callable, Iterable, Mapping

# x86-64 machine code per /proc/cpuinfo flag: one instruction of the feature, then
# vzeroupper (so no dirty upper state leaks) and ret. Assembled with GNU as, checked with objdump.
_VZU_RET = "c5f877c3"
_AMX_PRELUDE = (
    "c4e2784907"  # ldtilecfg (%rdi)
    "c4e27b49c0"  # tilezero %tmm0
    "c4e27b49c8"  # tilezero %tmm1
    "c4e27b49d0"  # tilezero %tmm2
)
_AMX_EPILOGUE = "c4e27849c0c3"  # tilerelease; ret

X86_TESTS: dict[str, tuple[str, bool]] = {
    # feature: (hex machine code, needs AMX permission + tile config)
    "avx": ("c5fc58c0" + _VZU_RET, False),  # vaddps %ymm0,%ymm0,%ymm0
    "avx2": ("c5fdfec0" + _VZU_RET, False),  # vpaddd %ymm0,%ymm0,%ymm0
    "fma": ("c4e27db8c0" + _VZU_RET, False),  # vfmadd231ps %ymm0,%ymm0,%ymm0
    "f16c": ("c4e27d13c0" + _VZU_RET, False),  # vcvtph2ps %xmm0,%ymm0
    "bmi2": ("c4e2f9f7c0c3", False),  # shlx %rax,%rax,%rax
    "avx_vnni": ("c4e27d50c0" + _VZU_RET, False),  # {vex} vpdpbusd %ymm0,%ymm0,%ymm0
    "avx512f": ("62f17d48efc0" + _VZU_RET, False),  # vpxord %zmm0,%zmm0,%zmm0
    "avx512bw": ("62f17d48fcc0" + _VZU_RET, False),  # vpaddb %zmm0,%zmm0,%zmm0
    "avx512_vnni": ("62f27d4850c0" + _VZU_RET, False),  # vpdpbusd %zmm0,%zmm0,%zmm0
    "avx512_bf16": ("62f27e4852c0" + _VZU_RET, False),  # vdpbf16ps %zmm0,%zmm0,%zmm0
    "avx512_fp16": ("62f57c4858c0" + _VZU_RET, False),  # vaddph %zmm0,%zmm0,%zmm0
    "amx_tile": (_AMX_PRELUDE + _AMX_EPILOGUE, True),
    "amx_int8": (_AMX_PRELUDE + "c4e26b5ec1" + _AMX_EPILOGUE, True),  # tdpbssd %tmm2,%tmm1,%tmm0
    "amx_bf16": (_AMX_PRELUDE + "c4e26a5cc1" + _AMX_EPILOGUE, True),  # tdpbf16ps %tmm2,%tmm1,%tmm0
}

# Run as `python -I -S -c CHILD HEX MODE`; MODE is plain, amx (permission + tile config) or
# amx-noperm (tile config only: the negative control). Exit 3: the kernel refused permission.
CHILD = r"""
import ctypes, mmap, sys
code, mode = bytes.fromhex(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
arg = None
if mode.startswith("amx"):
    # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 158 is SYS_arch_prctl on x86-64
    if mode == "amx" and libc.syscall(158, 0x1023, 18) != 0:
        print("arch_prctl errno", ctypes.get_errno()); sys.exit(3)
    cfg = (ctypes.c_uint8 * 64)()
    cfg[0] = 1  # palette 1; tiles 0-2: 16 rows x 64 bytes
    for t in range(3):
        cfg[16 + 2 * t] = 64
        cfg[48 + t] = 16
    arg = ctypes.addressof(cfg)
page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
page.write(code)
fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(ctypes.addressof(ctypes.c_char.from_buffer(page)))
fn(arg)
print("ok")
"""

USABLE = "usable"
SIGILL = "sigill"  # advertised, but the CPU/hypervisor/kernel faults on it
KERNEL_REFUSED = "kernel_refused"  # AMX: arch_prctl denied the tile-data permission
# Anything else is "error: ..." (the test itself could not run: untested).

InstructionTester = Callable[[Iterable[str]], Mapping[str, str]]

TEST_TIMEOUT_S = 10.0


def _verdict(proc: subprocess.Popen[str], out: str, err: str) -> str:
    rc = proc.returncode
    if rc == 0 and out.strip().endswith("ok"):
        return USABLE
    if rc == -signal.SIGILL:
        return SIGILL
    if rc == 3:
        return f"{KERNEL_REFUSED}: {out.strip()}"
    if rc is not None and rc < 0:
        return f"error: killed by {signal.Signals(-rc).name}"
    tail = (err or out).strip().splitlines()[-1:] or [""]
    return f"error: exit {rc} {tail[0][:200]}"


def run_feature_tests(features: Iterable[str], python: str = sys.executable) -> dict[str, str]:
    """Execute one instruction per feature, each in its own child process, all in parallel."""
    wanted = [f for f in features if f in X86_TESTS]
    procs = {}
    for feature in wanted:
        code, amx = X86_TESTS[feature]
        procs[feature] = subprocess.Popen(
            [python, "-I", "-S", "-c", CHILD, code, "amx" if amx else "plain"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            # No core dumps from the expected SIGILLs.
            preexec_fn=_no_core if os.name == "posix" else None,
        )
    results = {}
    for feature, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=TEST_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            results[feature] = f"error: timed out after {TEST_TIMEOUT_S:g}s"
            continue
        results[feature] = _verdict(proc, out, err)
    return results


def _no_core() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
