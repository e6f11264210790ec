"""Does this CPU really execute what it advertises? Execute the instruction and see.

cpuid (and so /proc/cpuinfo) can advertise AVX-512 or AMX that a hypervisor or the kernel
does not actually let a process run; `-march=native` code then dies with SIGILL. For each
advertised feature we execute one instruction of it in a throwaway process of its own (a few
bytes of machine code in an executable mmap page, called through ctypes). Exit 0 means
usable, death by SIGILL means advertised-but-unusable, anything else means the test itself
could not run (untested).

One `python -I -S` tester sets ctypes up once and forks a process per feature, which runs the
instruction and exits; the tester only waits and reports each one's exit. A process per
feature is what isolates a fault; an interpreter per feature (the tests before) cost ~25 ms
of CPU each, which on a CPU with AVX-512 and AMX (14 tests) was most of the CPU probe.

AMX needs more than the instruction: Linux (>= 5.16) gives a process the large AMX state
only after `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, and the tile registers
must be configured (`ldtilecfg`) before `tilezero`/`tdp*` - either missing is also SIGILL.
The test does both, the way ggml's AMX path does, so it answers "can a correct program use
AMX here", and the evidence says whether the kernel granted the permission. The permission
is asked in each forked process, never in the tester, so the negative control (`amx-noperm`)
really runs without it.
"""

from __future__ import annotations

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

# Run as `python -I -S -c TESTER TIMEOUT NAME:HEX:MODE...`; MODE is plain, amx (permission + tile
# config) or amx-noperm (tile config only: the negative control). Each test is a forked process
# whose exit the tester prints as one line, `NAME STATUS [MESSAGE]` (STATUS: its exit code,
# negative for a signal, or `timeout`). Exit 3: the kernel refused permission.
TESTER = r"""
import ctypes, mmap, os, resource, signal, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core dumps from the expected SIGILLs
libc = ctypes.CDLL(None, use_errno=True)

def execute(code, mode, said):
    arg = None
    if mode.startswith("amx"):
        # arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 158 is SYS_arch_prctl on x86-64
        if mode == "amx" and libc.syscall(158, 0x1023, 18) != 0:
            os.write(said, b"arch_prctl errno %d" % ctypes.get_errno())
            os._exit(3)
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
    os._exit(0)

waiting = {}
for item in sys.argv[2:]:
    name, code, mode = item.split(":")
    read, said = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            execute(bytes.fromhex(code), mode, said)
        except BaseException as e:
            os.write(said, f"{type(e).__name__}: {e}".encode())
        os._exit(4)
    os.close(said)
    waiting[pid] = (name, read)

killed = set()
def expire(signum, frame):
    for pid in waiting:
        killed.add(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # reaped just now, between the wait and its line
signal.signal(signal.SIGALRM, expire)
signal.alarm(int(sys.argv[1]))
while waiting:
    pid, status = os.wait()
    if pid not in waiting:
        continue
    name, read = waiting.pop(pid)
    said = os.read(read, 4096).decode(errors="replace").replace("\n", " ")
    os.close(read)
    code = "timeout" if pid in killed else os.waitstatus_to_exitcode(status)
    print(name, code, said, flush=True)
"""

USABLE = "usable"
SIGILL = "sigill"  # advertised, but the CPU/hypervisor/kernel faults on it
KERNEL_REFUSED = "kernel_refused"  # AMX: arch_prctl denied the tile-data permission
# Anything else is "error: ..." (the test itself could not run: untested).

InstructionTester = Callable[[Iterable[str]], Mapping[str, str]]

TEST_TIMEOUT_S = 10.0


def _verdict(status: str, said: str) -> str:
    if status == "timeout":
        return f"error: timed out after {TEST_TIMEOUT_S:g}s"
    rc = int(status)
    if rc == 0:
        return USABLE
    if rc == -signal.SIGILL:
        return SIGILL
    if rc == 3:
        return f"{KERNEL_REFUSED}: {said}"
    if rc < 0:
        return f"error: killed by {signal.Signals(-rc).name}"
    return f"error: exit {rc} {said[:200]}"


def run_feature_tests(features: Iterable[str], python: str = sys.executable) -> dict[str, str]:
    """Execute one instruction per feature, each in its own process (forked by one tester), all at once."""
    wanted = [f for f in features if f in X86_TESTS]
    if not wanted:
        return {}
    tests = [f"{f}:{X86_TESTS[f][0]}:{'amx' if X86_TESTS[f][1] else 'plain'}" for f in wanted]
    argv = [python, "-I", "-S", "-c", TESTER, str(int(TEST_TIMEOUT_S)), *tests]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=TEST_TIMEOUT_S + 5
        )
    except subprocess.TimeoutExpired:
        return dict.fromkeys(wanted, f"error: timed out after {TEST_TIMEOUT_S:g}s")
    except OSError as e:
        return dict.fromkeys(wanted, f"error: {type(e).__name__}: {e}")
    results = {}
    for line in done.stdout.splitlines():
        name, _, rest = line.partition(" ")
        status, _, said = rest.partition(" ")
        if name in wanted and status:
            results[name] = _verdict(status, said.strip())
    # A test the tester never reported (it died itself): untested, with what it said.
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
    missing = f"error: the tester exited {done.returncode} {tail[0][:200]}".rstrip()
    return {f: results.get(f, missing) for f in wanted}
