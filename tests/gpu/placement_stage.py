"""Placement for a whole offload on a real GPU, a stage of verify_gpu.py.

Two multi-GB models, `a` (the default, loaded at start) and `b` (loaded when a request names
it), on a GPU that another process fills but for room for one of them and a half: with `a`
loaded and idle, the engine's fitter would place only part of `b`'s layers. The case:
- `unload_for_full_offload = true` (the default): `a` is unloaded first (`placement_evicted`,
  why `full_offload`, in its history), `b`'s memory is estimated again, and `b` runs with every
  layer on CUDA;
- `false`, the control: `b` runs partly off the GPU beside `a`, still loaded. This shows the
  first case was really short.
Each case is judged on status, the engine's own offload line (through status's `layers`) and
NVML (VRAM held by `b`'s server).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from tests.gpu.frontdoor_stage import free_port

MODEL_GIB = 2.0
CTX = 4096


def whole_vram_mib(homes: Any, model: Path) -> float:
    """What every layer of `model` takes on the GPU at CTX, by the CUDA bundle's fitter."""
    from stoker.daemon.engine.fit import project
    from stoker.daemon.engine.process import ServerSpec, server_env
    from stoker.daemon.fallback.memory import fitter_of

    tool = fitter_of(homes.cuda)
    assert tool is not None, "the CUDA bundle has no llama-fit-params"
    env = server_env(ServerSpec(homes.cuda.server, model))
    return sum(project(tool, model, ["-c", str(CTX), "-ngl", "999"], env).devices.values())


def config(a: Path, b: Path, port: int, unload: bool) -> str:
    from tests.integration.daemon_harness import tiny_config

    return tiny_config(a, ctx_size=CTX, ready_timeout_s=300.0) + (
        f"[frontdoor]\nport = {port}\n"
        f"[placement]\nmax_loaded = 2\nunload_for_full_offload = {'true' if unload else 'false'}\n"
        f'[models.a]\nmodel = "{a}"\ndefault = true\n'
        f'[models.b]\nmodel = "{b}"\n'
    )


def st_offload(
    homes: Any,
    work: Path,
    scenario: Callable[..., Any],
    nvml: Callable[[int | None], dict[str, Any]],
    hold: Callable[[int], tuple[Any, str]],
) -> dict[str, Any]:
    from tests.bench.bigmodel import write_big_model

    count = len(nvml(None).get("per_device") or [])  # NVML's devices (what a pid holds: none here)
    if count > 1:
        return {"status": "SKIP", "why": f"{count} GPUs: the holder fills GPU 0 only"}
    a = write_big_model(work / "offload-a.gguf", MODEL_GIB, seed=1)
    b = write_big_model(work / "offload-b.gguf", MODEL_GIB, seed=2)
    whole = whole_vram_mib(homes, b)
    # Room for one model whole and half of another, beside the fit margin (1024 MiB) and each
    # server's CUDA runtime (~524 MiB, docs/gpu-verification.md).
    keep = int(1.5 * whole) + 1024 + 2 * 600
    holder, line = hold(keep)
    try:
        if not line.startswith("held"):
            return {"status": "SKIP", "why": f"could not hold VRAM: {line or holder.wait(30)}"}
        cases = {
            "unload": one_case(homes, a, b, True, scenario, nvml),
            "control": one_case(homes, a, b, False, scenario, nvml),
        }
    finally:
        holder.kill()
        holder.wait(30)
    on, off = cases["unload"], cases["control"]
    checks = {
        "control: b runs partly off the GPU beside a (the case is really short)": off.get("b_partial") is True
        and off.get("a_state") == "ready",
        "unload: a unloaded for b's full offload (placement_evicted, why full_offload)": on.get("a_evicted_for_offload")
        is True,
        "unload: b on cuda with every layer offloaded": on.get("b_whole") is True,
        # Planned again after the unload: the fitter's figures, or (with room to spare for it)
        # Stoker's upper bound; either way not the figures it was fitted short with.
        "unload: b's plan estimated again after the unload, whole": on.get("b_memory_source")
        in ("llama-fit-params", "stoker-bound")
        and on.get("b_whole_vram_mib") == 0,
        "unload: NVML sees b's server hold more VRAM than in the control": (on.get("b_vram_mib") or 0)
        > (off.get("b_vram_mib") or 0),
        "both answered": on.get("answer") == 200 and off.get("answer") == 200,
    }
    return {
        "status": "PASS" if all(checks.values()) else "FAIL",
        "checks": checks,
        "holder": line,
        "whole_vram_mib": whole,
        "kept_free_mib": keep,
        **cases,
    }


def one_case(
    homes: Any,
    a: Path,
    b: Path,
    unload: bool,
    scenario: Callable[..., Any],
    nvml: Callable[[int | None], dict[str, Any]],
) -> dict[str, Any]:
    import httpx

    home = homes.fresh(f"offload-{'unload' if unload else 'control'}", cpu=True, cuda=True)
    port = free_port()
    sc = scenario(f"offload-{'unload' if unload else 'control'}", home)
    sc.write_config(config(a, b, port, unload))
    ev: dict[str, Any] = {}
    try:
        sc.daemon.start()
        status = sc.daemon.wait_for(
            lambda s: any(m["name"] == "a" and m["state"] == "ready" for m in s.get("models") or []),
            timeout=300,
            what="a ready",
        )
        ev["a_before"] = pick(status, "a")
        time.sleep(1.0)  # a is idle: no request in flight, none held
        began = time.monotonic()
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "b", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
            timeout=300,
            trust_env=False,
        )
        ev["answer"] = reply.status_code
        ev["answer_s"] = round(time.monotonic() - began, 2)
        status = sc.daemon.call("status")
        a_now, b_now = pick(status, "a"), pick(status, "b")
        ev["a_after"], ev["b_after"] = a_now, b_now
        layers = b_now.get("layers") or {}
        ev["a_state"] = a_now.get("state")
        ev["b_whole"] = (
            b_now.get("backend") == "cuda"
            and bool(layers.get("total"))
            and layers.get("offloaded") == layers.get("total")
        )
        ev["b_partial"] = (
            b_now.get("backend") == "cuda"
            and bool(layers.get("total"))
            and 0 <= (layers.get("offloaded") or 0) < layers["total"]
        )
        estimate = (b_now.get("memory") or {}).get("estimate") or {}
        ev["b_memory_source"], ev["b_whole_vram_mib"] = estimate.get("source"), estimate.get("whole_vram_mib")
        history = sc.daemon.history(machine="launch:a", limit=50)
        evicted = [r for r in history if r.get("reason") == "placement_evicted"]
        ev["a_evictions"] = [r.get("evidence") for r in evicted]
        ev["a_evicted_for_offload"] = any((r.get("evidence") or {}).get("why") == "full_offload" for r in evicted)
        ev["b_nvml"] = nvml(b_now.get("pid"))
        ev["b_vram_mib"] = ev["b_nvml"].get("process_vram_mib")
    except Exception as err:
        ev["error"] = f"{type(err).__name__}: {err}"
    finally:
        sc.finish()
    return ev


def pick(status: dict[str, Any], name: str) -> dict[str, Any]:
    found = next((m for m in status.get("models") or [] if m["name"] == name), {})
    return {k: found.get(k) for k in ("state", "backend", "planned_backend", "layers", "pid", "reason", "memory")}
