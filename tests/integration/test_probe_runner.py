"""The out-of-process probe on this machine: the real CPU probe, and probes that crash or hang.

The CPU assertions record what was verified on the development VM (docs/backends.md): it
advertises AVX-512 and AMX, and both execute for a process that requests the AMX tile-data
permission and configures the tiles; without those two steps the same AMX code is SIGILL.
"""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import trio

from stoker.daemon.backends.cpu_features import SIGILL, TESTER, USABLE, X86_TESTS
from stoker.daemon.probes.runner import run_probe, run_probes
from stoker.states.reasons import ReasonCode as R
from tests.waits import until

HERE = Path(__file__).parent
x86_linux = pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() != "x86_64", reason="x86-64 Linux instruction tests"
)


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def process_gone(pid: int) -> bool:
    """Dead or a zombie waiting for a reaper that is not ours."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"


@x86_linux
async def test_real_cpu_probe_out_of_process():
    with trio.fail_after(60):
        d = await run_probe("cpu", timeout=45)
    assert (d.backend, d.present, d.usable, d.reason) == ("cpu", True, True, None)
    ev = d.evidence
    advertised = set(ev["advertised"])
    assert set(ev["tests"]) == advertised & set(X86_TESTS)
    assert advertised == set(ev["usable"]) | set(ev["unusable"]) | set(ev["untested"])
    for feature in ("avx512f", "amx_tile", "amx_int8", "amx_bf16"):
        if feature in cpu_flags():
            # Verified here: advertised AND executable (see docs/backends.md, "This machine").
            assert ev["tests"][feature] == USABLE, ev["tests"]
    if {"amx_tile", "avx512f"} <= cpu_flags():
        assert ev["unusable"] == []
        from stoker.daemon.backends.cpu import CpuBackend

        assert CpuBackend().choose_variant(d, ["native", "avx2", "compat"]) == "native"


def _run_child(code_hex: str, mode: str) -> int:
    """The exit status of one instruction test, as the tester reports its forked process's."""
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", TESTER, "10", f"t:{code_hex}:{mode}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(done.stdout.split()[1])


@x86_linux
def test_each_instruction_test_is_its_own_process_a_fault_or_a_hang_costs_only_it():
    """`ud2` always faults, `jmp $` never returns: the tester reports SIGILL for one and a
    timeout for the other, and the plain `ret` beside them still exits 0."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", TESTER, "1", "ud2:0f0b:plain", "hang:ebfe:plain", "ret:c3:plain"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    said = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines()}
    assert said == {"ud2": "-4", "hang": "timeout", "ret": "0"}, done
    assert done.returncode == 0 and time.monotonic() - started < 10


@x86_linux
@pytest.mark.skipif("amx_tile" not in cpu_flags(), reason="the CPU does not advertise AMX")
def test_amx_without_permission_or_tile_config_is_sigill():
    """The negative control: the instruction test does see a fault when there is one.

    The AMX test code run without arch_prctl(ARCH_REQ_XCOMP_PERM) dies with SIGILL, and so does
    `tilezero` without `ldtilecfg` even with the permission - exactly how a program that
    skips either step (the llama.cpp SIGILL at `tilezero`) fails on this CPU.
    """
    code, _ = X86_TESTS["amx_tile"]
    assert _run_child(code, "amx-noperm") == -4  # SIGILL: no arch_prctl permission
    assert _run_child("c4e27b49c0c3", "amx") == -4  # tilezero, no ldtilecfg
    assert _run_child(code, "amx") == 0
    assert SIGILL == "sigill"


async def test_segfaulting_probe_becomes_unavailable_with_evidence():
    with trio.fail_after(30):
        d = await run_probe("segv", timeout=20, target="probe_backends:SegfaultBackend", env=child_env())
    assert (d.present, d.usable, d.reason) == (False, False, R.PROBE_FAILED)
    assert d.evidence["probe"] == "probe crashed with SIGSEGV"
    assert "about to touch the driver" in d.evidence["stderr"]
    assert "SIGSEGV" in d.message


async def test_segfault_under_a_gpu_name_is_that_backends_unavailable():
    with trio.fail_after(30):
        d = await run_probe("cuda", timeout=20, target="probe_backends:SegfaultingCuda", env=child_env())
    assert d.reason == R.CUDA_UNAVAILABLE
    assert d.evidence["probe"] == "probe crashed with SIGSEGV" and d.evidence["signal"] == "SIGSEGV"


async def test_hanging_probe_is_killed_with_its_children(tmp_path):
    pidfile = tmp_path / "pids"
    with trio.fail_after(30):
        d = await run_probe(
            "hang", timeout=3, target="probe_backends:HangingBackend", env=child_env(STOKER_TEST_PIDFILE=str(pidfile))
        )
    assert (d.usable, d.reason) == (False, R.PROBE_FAILED)
    assert d.evidence["probe"] == "probe timed out after 3s"
    assert d.evidence["timeout_s"] == 3
    assert "waiting for the driver" in d.evidence["stderr"]  # kept although the probe was killed
    child, grandchild = (int(p) for p in pidfile.read_text().split())
    await until(
        lambda: process_gone(child) and process_gone(grandchild),
        timeout=10,
        what=f"the timed-out probe {child} and its child {grandchild} to be killed",
    )


async def test_a_daemon_left_holding_stdout_does_not_stall_the_probe(tmp_path):
    pidfile = tmp_path / "pid"
    try:
        with trio.fail_after(15):
            d = await run_probe(
                "daemonizing",
                timeout=10,
                target="probe_backends:DaemonizingBackend",
                env=child_env(STOKER_TEST_PIDFILE=str(pidfile)),
            )
        assert d.usable and d.message == "answered; a helper daemon lives on"
        assert d.evidence == {}
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


async def test_raising_and_garbage_probes():
    with trio.fail_after(30):
        raising = await run_probe("raising", timeout=20, target="probe_backends:RaisingBackend", env=child_env())
        garbage = await run_probe("garbage", timeout=20, target="probe_backends:GarbageBackend", env=child_env())
    assert raising.reason == R.PROBE_FAILED and "libfoo.so.1" in raising.evidence["error"]
    assert garbage.reason == R.PROBE_FAILED
    assert garbage.evidence["probe"] == "probe exited with status 3"
    assert "not json at all" in garbage.evidence["stdout"]


async def test_the_daemon_side_survives_bad_probes_and_keeps_probing():
    """Crash, hang and a real probe side by side in one nursery: only the bad ones fail."""
    results = {}

    async def probe(name, **kw):
        results[name] = await run_probe(name, **kw)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: probe("segv", timeout=20, target="probe_backends:SegfaultBackend", env=child_env())
            )
            nursery.start_soon(
                lambda: probe("raising", timeout=2, target="probe_backends:RaisingBackend", env=child_env())
            )
            nursery.start_soon(lambda: probe("cuda", timeout=30))
        after = await run_probes(["cpu", "metal"], timeout=45)
    assert results["segv"].reason == R.PROBE_FAILED and results["raising"].reason == R.PROBE_FAILED
    assert results["cuda"].backend == "cuda" and "probe_failed" not in results["cuda"].evidence
    assert after["cpu"].usable and after["metal"].reason == R.GPU_MISSING


async def test_outer_cancellation_still_cancels():
    """Shutdown is not a probe failure: cancelling the caller propagates and kills the child."""
    with trio.move_on_after(1) as scope:
        await run_probe(
            "hang", timeout=60, target="probe_backends:HangingBackend", env=child_env(STOKER_TEST_PIDFILE=os.devnull)
        )
    assert scope.cancelled_caught
