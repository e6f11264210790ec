"""The decision tables beside the machines, drawn as Markdown by running them (never by hand).

Pure text; `docs/states/generate.py` writes it to docs/states/policies.md. Each section calls
the policy it documents on its inputs, so the page is what the code decides, row for row.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable

from stoker.states.backoff import Backoff
from stoker.states.fallback.table import CPU_VARIANTS_BY_SAFETY, BundleMissing, cpu_variant_order, missing_reason
from stoker.states.fallback.proof import AccelerationProof, acceleration_verdict
from stoker.states.fallback.vram import FreeVram, VramCheck, devices_of, no_room
from stoker.states.frontdoor.policy import RETRY_AFTER_S, HoldMove, admit, hold_move, refusal
from stoker.states.launch.exits import FATAL_EXITS, REPLAN_EXITS, judge_exit
from stoker.states.launch.records import AfterStop, ExitPhase, GpuLayers, LaunchPlan, LaunchState
from stoker.states.reasons import ReasonCode
from stoker.states.snapshots.policy import SAVE_BEFORE_STOP

R = ReasonCode


def _table(header: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None or value == ():
        return "-"
    if isinstance(value, tuple):
        return ", ".join(f"`{v}`" for v in value)
    if isinstance(value, enum.Enum):
        return f"`{value.value}`"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _codes(codes: Iterable[str]) -> str:
    return ", ".join(f"`{c}`" for c in sorted(codes))


def exit_policy() -> str:
    """The launch machine's verdict on an unasked exit (states/launch/exits.py)."""
    gpu = LaunchPlan("cuda", "cuda12", "/b", "/b/llama-server", "/m.gguf", n_gpu_layers="auto")
    cpu = LaunchPlan("cpu", "avx2", "/b", "/b/llama-server", "/m.gguf")
    rows = [
        (reason, phase, plan.backend, judge_exit(reason, phase, plan))
        for reason in (R.MODEL_MISSING, R.CPU_ILLEGAL_INSTRUCTION, R.RPC_WORKER_LOST, R.SERVER_CRASHED)
        for phase in ExitPhase
        for plan in (gpu, cpu)
    ]
    return (
        "## Exits (states/launch/exits.py)\n\n"
        f"Fatal, whatever the phase or plan: {_codes(FATAL_EXITS)}. A new plan: {_codes(REPLAN_EXITS)}, and any "
        "non-CPU plan that dies before it was ever ready. Anything else is respawned with the same plan after "
        "the restart backoff, until `max_restarts` makes it a `crash_loop`.\n\n"
        + _table(("reason", "phase", "plan", "verdict"), rows)
    )


def restart_backoff() -> str:
    """The delay before each restart (states/backoff.py), at the config's defaults."""
    policy = Backoff()
    rows = [(attempt, f"{policy.step(attempt):g}", f"{policy.delay(attempt, 0.0):g}") for attempt in range(1, 9)]
    return (
        "## Restart backoff (states/backoff.py)\n\n"
        f"The launch and worker machines back off before respawning a crashed process: from "
        f"`[supervisor] backoff_initial_s` ({policy.initial_s:g} s) doubling per attempt, at most "
        f"`backoff_max_s` ({policy.cap_s:g} s), jittered into [50 %, 100 %] of the step.\n\n"
        + _table(("attempt", "step (s)", "shortest delay (s)"), rows)
    )


def cpu_builds() -> str:
    """Which CPU builds a plan may use (states/fallback/table.py)."""
    cases = [
        ("auto", "x86_64", None),
        ("auto", "aarch64", None),
        ("native", "x86_64", None),
        ("auto", "x86_64", "avx2"),
        ("auto", "x86_64", "compat"),
        ("native", "x86_64", "native"),
    ]
    rows = [
        (setting, arch, faulted, cpu_variant_order(setting, arch, R.CPU_ILLEGAL_INSTRUCTION, faulted))
        for setting, arch, faulted in cases
    ]
    return (
        "## CPU builds (states/fallback/table.py, `cpu_variant_order`)\n\n"
        f"Fastest to safest: {_codes(CPU_VARIANTS_BY_SAFETY)}. After a SIGILL (`cpu_illegal_instruction`) every "
        "build at or above the one that faulted is out of the next plan.\n\n"
        + _table(("`[backend] cpu_variant`", "architecture", "faulted (SIGILL)", "builds tried, in order"), rows)
    )


def missing_bundles() -> str:
    """A missing bundle's code (states/fallback/table.py, `missing_reason`)."""
    cases: list[tuple[str, bool, ReasonCode | None]] = [
        ("cuda", True, R.BINARY_MISSING_NVIDIA_DETECTED),
        ("cuda", False, R.BINARY_MISSING_NVIDIA_DETECTED),
        ("cpu", True, None),
    ]
    rows = [(b, present, code, missing_reason(BundleMissing(b, present, code))) for b, present, code in cases]
    return (
        "## Missing bundles (states/fallback/table.py, `BundleMissing`)\n\n"
        "The one check failure an install repairs: installed once per request, then checked again; missing "
        "again, the next candidate.\n\n" + _table(("backend", "hardware present", "backend's code", "reason"), rows)
    )


def gpu_room() -> str:
    """Room for a layer (states/fallback/vram.py), on an H200-like CUDA backend."""
    cases: list[tuple[tuple[int, ...], int, GpuLayers]] = [
        ((699,), 1024, "auto"),
        ((699,), 87, "auto"),
        ((300, 143150), 1024, "auto"),
        ((9000, 143150), 1024, "auto"),
        ((699,), 1024, 8),
    ]
    rows: list[tuple[Any, ...]] = []
    for free, margin, layers in cases:
        check = VramCheck(FreeVram(dict(enumerate(free))), margin, 524, layers, R.CUDA_VRAM_FULL)
        full = no_room("cuda", check)
        given = ", ".join(str(i) for i in devices_of(check)) or "all"
        rows.append(
            (", ".join(str(f) for f in free), margin, layers, full[0] if full else None, given if not full else None)
        )
    return (
        "## Room on the GPUs (states/fallback/vram.py)\n\n"
        "A GPU takes a layer when its free VRAM (read at the check) is at least the runtime's share "
        "(`runtime_reserve_mib`, 524 MiB for CUDA) plus the margin the engine keeps (-fitt). None with room "
        "under `-ngl auto`: the backend is skipped with its vram_full code; only some: the plan gets those.\n\n"
        + _table(("free MiB per GPU", "margin (MiB)", "n_gpu_layers", "skipped with", "GPUs given"), rows)
    )


def acceleration() -> str:
    """The proof of acceleration (states/fallback/proof.py)."""
    cases = [
        ("25/25 layers, 900 MiB held", AccelerationProof(25, 25, process_vram_mib=900)),
        ("25/25 layers, no per-process reading", AccelerationProof(25, 25)),
        ("0/25 layers", AccelerationProof(0, 25, layers_zero=R.CUDA_GPU_LAYERS_ZERO)),
        ("25/25 layers, 0 MiB held", AccelerationProof(25, 25, process_vram_mib=0)),
        (
            "3/3 layers on llvmpipe",
            AccelerationProof(3, 3, software_devices=("llvmpipe",), software_device=R.VULKAN_SOFTWARE_DEVICE),
        ),
    ]
    rows = [(what, acceleration_verdict(proof) or "accelerated: served as planned") for what, proof in cases]
    return (
        "## Really accelerated? (states/fallback/proof.py)\n\n"
        "A ready GPU server that is not really accelerated serves on, reported as the CPU with the reason.\n\n"
        + _table(("what the server proved", "verdict"), rows)
    )


def front_door() -> str:
    """Holding a request and its 503 (states/frontdoor/policy.py)."""
    moves = [
        (state, hold_move(state, False), hold_move(state, True), admit(state, False, 0, 1))
        for state in LaunchState
        if state is not LaunchState.READY  # sent at once
    ]
    ends = [
        ("ready", False, None),
        ("loading", True, None),
        ("failed", False, R.PLACEMENT_NO_ROOM),
        ("failed", False, R.CRASH_LOOP),
        ("stopped", False, None),
        ("backoff", False, None),
    ]
    refusals = []
    for state, placing, failed in ends:
        reason = refusal(LaunchState(state), placing, failed)
        refusals.append((LaunchState(state), placing, failed, reason, RETRY_AFTER_S[reason] if reason else None))
    return (
        "## The front door's hold (states/frontdoor/policy.py)\n\n"
        f"A request that finds its model not ready (a ready one is sent at once): refused at once, held "
        f"(`{HoldMove.WAIT.value}`), or its model loaded first (`{HoldMove.LOAD.value}`); with "
        "`[frontdoor] max_queue` requests held already it is refused with `frontdoor_queue_full`.\n\n"
        + _table(("launch state", "next move", "next move (loads on demand)", "refused at once with"), moves)
        + "\n\nOnce the hold is over, the 503 and its Retry-After:\n\n"
        + _table(("ended in", "making room", "failed with", "503 reason", "Retry-After (s)"), refusals)
    )


def stop_saves() -> str:
    """Whether a stop saves the slots first (states/snapshots/policy.py)."""
    rows = [(after, SAVE_BEFORE_STOP[after]) for after in AfterStop]
    return (
        "## Snapshots before a stop (states/snapshots/policy.py)\n\n"
        "By where the stop leads (the launch machine's `after_stop`): `save` within the stop budget, "
        "`within_grace` (a hung engine: the stop's grace, no more), or `skip`.\n\n"
        + _table(("after_stop", "save"), rows)
    )


def document() -> str:
    """The whole docs/states/policies.md page."""
    sections = (exit_policy, restart_backoff, cpu_builds, missing_bundles, gpu_room, acceleration, front_door)
    body = "\n\n".join(section() for section in (*sections, stop_saves))
    return (
        "# Decision tables\n\n"
        "<!-- Generated by docs/states/generate.py from the policies in states/; do not edit. -->\n\n"
        "The decisions the machines take from the facts their events carry, and the pure policies beside "
        "them (STYLE.md, Rule 1): each table below is the policy run on the inputs shown.\n\n"
        f"{body}\n"
    )
