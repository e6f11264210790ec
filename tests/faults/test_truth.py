"""Truth in every figure: what Stoker shows comes from the reading
that decided, and names what really runs.

A real daemon and a real llama-server serve under FakeGPU, the third-party backend of
tests/integration/fakegpu_plugin (Stoker's CPU build relabelled): a non-CPU backend whose
devices, free memory read now, and device selection the test controls, with no GPU on the
machine. Its CPU engine offloads nothing, so every FakeGPU server is demoted to the CPU by
the proof after ready: the case `stoker telemetry` named wrongly. The CUDA-specific figures
(NVML read now, CUDA_VISIBLE_DEVICES, the engine's own free-VRAM lines) are tested with the
recorded H200 answers in tests/unit/test_fallback_orchestrator.py and test_layer_plan.py.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from stoker.daemon.control.status_text import format_status
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config
from tests.integration.test_launch_plan import recorded_plans
from tests.integration.test_third_party_backend import (  # noqa: F401  (daemons: a fixture)
    daemons,
    fallback_of,
    relabel_cpu_bundle,
    settled,
    stoker,
    the_server,
    with_plugin,
)
from stoker.tui.widgets.backend_card import BackendCard

DEVICE = "FakeGPU 9000:8192"


def fakegpu_daemon(home: Path, site: Path, cpu_bundle, tmp_path: Path, devices: str, **env: str) -> DaemonProcess:
    """A daemon on a machine where FakeGPU is installed with `devices`, its bundle installed."""
    d = DaemonProcess(home, env={**with_plugin(site, devices), **env})
    bundle = tmp_path / "fakegpu-bundle"
    relabel_cpu_bundle(cpu_bundle.root, bundle, tmp_path / "never-lost")
    done = stoker(d.env, "bundle", "install", str(bundle), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return d


def demoted(st: dict) -> bool:
    return settled(st) and st["planned_backend"] == "fakegpu" and st["backend"] == "cpu"


@pytest.mark.engine
def test_telemetry_names_the_backend_in_use_and_a_demoted_respawn_is_recorded(
    stoker_home,
    installed_cpu_bundle,
    model,
    plugin_site,
    daemons,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    """`stoker telemetry` once said cuda while status said cpu (cuda_gpu_layers_zero); and a
    respawn demoted to the CPU is a transition in history, with fallback_reason."""
    d = fakegpu_daemon(stoker_home, plugin_site, installed_cpu_bundle, tmp_path, DEVICE)
    write_config(d.paths, tiny_config(model))
    daemons.append(d.start())
    st = d.wait_for(demoted, timeout=180, what="the FakeGPU server, demoted to the CPU")
    sample = json.loads(stoker(d.env, "telemetry", "--json").stdout)["sample"]
    assert sample["backend"] == "cpu" and sample["pid"] == st["pid"]  # as status says
    assert sample["planned_backend"] == "fakegpu"
    assert st["fallback_reason"] == "fakegpu_gpu_layers_zero" and st["offload"] is None
    assert sample["gpu_error"] is None  # no error about a GPU the server does not compute on
    human = stoker(d.env, "telemetry").stdout
    assert "cpu (planned fakegpu: not accelerated)" in human, human

    # The server crashes; the same plan is respawned and proven again: a new transition.
    before = len(d.history(machine="fallback", limit=500))
    os.kill(st["pid"], signal.SIGKILL)
    again = d.wait_for(lambda s: demoted(s) and s["pid"] not in (None, st["pid"]), timeout=120, what="the respawn")
    rows = d.history(machine="fallback", limit=500)
    assert len(rows) == before + 1
    newest = rows[0]
    assert (newest["event"], newest["to_state"], newest["reason"]) == (
        "LaunchSucceeded",
        "settled",
        "fakegpu_gpu_layers_zero",
    )
    assert newest["evidence"]["after"] == "respawn" and newest["evidence"]["effective_backend"] == "cpu"
    assert again["fallback_reason"] == "fakegpu_gpu_layers_zero" and again["backend"] == "cpu"
    assert json.loads(stoker(d.env, "telemetry", "--json").stdout)["sample"]["backend"] == "cpu"


@pytest.mark.engine
def test_free_memory_is_read_when_the_plan_is_made_and_a_forced_backend_says_one_thing(
    stoker_home,
    installed_cpu_bundle,
    model,
    plugin_site,
    daemons,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    """The probe's figures (cached up to 30 s) said there was room; another tenant
    filled the device since. The reading made at planning decides, and is what is shown.
    Forced with no room, it once said both "serving on the CPU" and "nothing is served"."""
    now = tmp_path / "fakegpu-now"
    d = fakegpu_daemon(stoker_home, plugin_site, installed_cpu_bundle, tmp_path, DEVICE, FAKEGPU_NOW=str(now))
    write_config(d.paths, tiny_config(model))
    daemons.append(d.start())
    first = d.wait_for(demoted, timeout=180, what="the FakeGPU server")
    now.write_text("100")  # another tenant took the device; the probe still says 8192 MiB free
    assert stoker(d.env, "restart", "--json").returncode == 0
    st = d.wait_for(
        lambda s: settled(s) and s["pid"] not in (None, first["pid"]) and s["planned_backend"] == "cpu",
        timeout=180,
        what="the CPU, without a FakeGPU launch",
    )
    full = fallback_of(st, "fakegpu")
    assert full["reason"] == "fakegpu_vram_full"
    passed = [
        r
        for r in d.history(machine="fallback", limit=500)
        if r["event"] == "CheckPassed" and r["event_data"]["backend"] == "fakegpu"
    ][-1]  # the first launch's check (history is newest first): no reading yet, the probe's figures stood
    assert passed["evidence"]["free_vram_mib"] == {"0": 8192} and passed["evidence"]["free_vram_source"] == "probe"
    assert full["evidence"]["free_vram_mib"] == {"0": 100} and full["evidence"]["free_vram_source"] == "read now"
    assert "0: FakeGPU 9000 100 MiB" in full["message"] and "8192" not in full["message"]
    probe = json.loads(stoker(d.env, "probe", "--json").stdout)
    fake = {b["backend"]: b for b in probe["backends"]}["fakegpu"]
    assert fake["devices"][0]["memory_free_mib"] == 8192  # what the probe said; the reading overrode it

    out = stoker(d.env, "use", "fakegpu", "--json")
    assert out.returncode in (0, 1), out.stdout + out.stderr
    failed = d.wait_state("failed", timeout=60)
    assert failed["reason"] == "fakegpu_vram_full"
    assert "nothing is served" in failed["message"] and "serving on the CPU" not in failed["message"]
    assert "0: FakeGPU 9000 100 MiB" in failed["message"]


@pytest.mark.engine
def test_a_device_without_room_is_kept_from_the_server_and_history_says_so(
    stoker_home,
    installed_cpu_bundle,
    model,
    plugin_site,
    daemons,  # noqa: F811  (the imported fixture)
    tmp_path,
):
    """A device that can take no layer once still received the server's runtime (520 MiB
    of CUDA context on an H200). The plan names the devices the server may use, as the plugin
    spells it (its environment), and the plan in history is exactly what the server ran with."""
    d = fakegpu_daemon(stoker_home, plugin_site, installed_cpu_bundle, tmp_path, "Big:8192,Full:100")
    write_config(d.paths, tiny_config(model))
    daemons.append(d.start())
    st = d.wait_for(demoted, timeout=180, what="the FakeGPU server")
    plan = recorded_plans(d)[-1]
    assert plan.backend == "fakegpu" and plan.backend_env == (("FAKEGPU_VISIBLE_DEVICES", "0"),)
    environ = the_server(model).environ()
    assert environ.get("FAKEGPU_VISIBLE_DEVICES") == "0"
    assert psutil.Process(st["pid"]).environ().get("FAKEGPU_VISIBLE_DEVICES") == "0"
    why = st["layers"]["why"]
    assert "free VRAM (probe) 0: Big 8192 MiB vs" in why and "left out: 1: Full 100 MiB" in why


# --- the partial offload, as each client says it -------------------------------------------


PARTIAL = {
    "state": "ready",
    "backend": "cuda",
    "variant": "avx2",
    "offload": "partial",
    "layers": {"planned": "auto", "offloaded": 15, "total": 33, "why": "-ngl auto: ..."},
    "preference": {"prefer": "auto", "forced": False, "candidates": ["cuda", "cpu"]},
    "fallbacks": [],
}


def test_a_partial_offload_is_called_partial_by_the_cli_and_the_tui():
    """`backend cuda` for 15 of 33 layers once said nothing of "partial"."""
    assert "backend   cuda (avx2; partial: 15/33 layers)" in format_status(PARTIAL)
    full = {**PARTIAL, "offload": "full", "layers": {**PARTIAL["layers"], "offloaded": 33}}
    assert "backend   cuda (avx2)\n" in format_status(full)
    card = BackendCard()
    card.status = PARTIAL
    console = Console(width=100, record=True)
    console.print(card.render())
    assert "cuda (avx2; partial: 15/33 layers)" in console.export_text()
