"""A third-party backend, installed the way a user installs one, is a backend like the built-ins.

The test builds a small distribution (tests/integration/fakegpu_plugin: one module, one
`stoker.backends` entry point), installs it with pip into a temporary directory and puts that
directory on PYTHONPATH for the CLI, a real daemon and its probe children. Nothing in Stoker's
tree names "fakegpu"; yet it is accepted by config validation (and refused without the
plugin), its bundle (Stoker's CPU build relabelled, with a real llama-server underneath) is
verified against the plugin's --list-devices signature, it is probed out of process, listed by
`stoker probe`, planned and launched, shown by `status` and the TUI (backend card and backend
choice), and it falls back to the CPU with its own reason codes and sentences:
fakegpu_gpu_layers_zero (its CPU engine offloads nothing), fakegpu_startup_failed (its device
is lost while loading) and fakegpu_unavailable (its runtime does not answer). Once the plugin is
uninstalled, a daemon on the same STOKER_HOME still starts and reads those codes back.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import psutil
import pytest

from stoker.daemon.bundles.metadata import BUNDLE_JSON, BundleMeta, FileEntry
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from stoker.tui.app import StokerApp
from stoker.tui.link import SocketLink
from stoker.tui.screens.backend_choice import BackendChoiceScreen
from stoker.tui.widgets.backend_card import BackendCard

DEVICE = "FakeGPU 9000:8192"
# The plugin's sentences (tests/integration/fakegpu_plugin/stoker_fakegpu.py), as a user reads them.
ZERO_LAYERS = "The FakeGPU server offloaded no layer (its engine is the CPU build), so it is reported as the CPU."
DEVICE_LOST_LINE = "fakegpu: device lost while loading the model"  # what its engine says as it dies
NO_ANSWER = "The FakeGPU runtime does not answer; set FAKEGPU_DEVICES to NAME:MiB and probe again."

# FakeGPU's engine: the CPU llama-server, or a device lost while loading when the flag file exists.
WRAPPER = """#!/bin/sh
case "$1" in
  --version|--list-devices) ;;
  *) if [ -e "{flag}" ]; then echo "fakegpu: device lost while loading the model" >&2; kill -SEGV $$; fi ;;
esac
exec "$(dirname "$0")/{real}" "$@"
"""


def with_plugin(site: Path, devices: str | None) -> dict[str, str]:
    """The environment of a machine where the plugin is installed (and FakeGPU reports `devices`)."""
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path}
    if devices is not None:
        env["FAKEGPU_DEVICES"] = devices
    return env


def relabel_cpu_bundle(cpu_root: Path, dest: Path, lost_flag: Path) -> BundleMeta:
    """Stoker's CPU build as the FakeGPU bundle: bundle.json says backend "fakegpu", and its
    server is a wrapper that execs the CPU llama-server (or dies while `lost_flag` exists)."""
    shutil.copytree(cpu_root, dest)
    meta = BundleMeta.read(dest)
    real = Path(meta.server)
    wrapper = real.with_name("fakegpu-server")
    (dest / wrapper).write_text(WRAPPER.format(flag=lost_flag, real=real.name))
    os.chmod(dest / wrapper, 0o755)
    data = (dest / wrapper).read_bytes()
    entry = FileEntry(wrapper.as_posix(), len(data), 0o755, hashlib.sha256(data).hexdigest())
    meta = attrs.evolve(meta, backend="fakegpu", server=wrapper.as_posix(), files=(*meta.files, entry))
    (dest / BUNDLE_JSON).write_text(meta.to_json())
    return meta


def stoker(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def settled(st: dict[str, Any]) -> bool:
    return st["state"] == "ready" and st["fallback_state"] == "settled"


def the_server(model: Path) -> psutil.Process:
    found = servers_for(model)
    assert len(found) == 1, found
    return found[0]


def fallback_of(st: dict[str, Any], backend: str) -> dict[str, Any]:
    return next(f for f in st["fallbacks"] if f["backend"] == backend)


# --- the TUI against the real daemon ------------------------------------------------------


async def until(pilot, predicate: Callable[[], Any], timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await pilot.pause(0.05)


def card_text(app: StokerApp) -> str:
    card = app.query_one(BackendCard)
    return "".join(segment.text for segment in app.console.render(card.render(), app.console.options))


async def tui_shows_fakegpu(socket: Path) -> None:
    app = StokerApp(SocketLink(socket))
    async with app.run_test(size=(120, 32)) as pilot:
        await until(pilot, lambda: (app.status or {}).get("state") == "ready", what="ready")
        text = card_text(app)
        assert "fell back" in text and "fakegpu: fakegpu_gpu_layers_zero" in text, text
        assert "forced" in text  # prefer = "fakegpu": forced, as any backend's name is
        await pilot.press("b")
        await until(pilot, lambda: isinstance(app.screen, BackendChoiceScreen), what="the backend choice")
        offered = [name for name, _ in app.screen.choices]
        assert offered[0] == "auto" and "fakegpu" in offered and offered[-1] == "cpu"
        await pilot.press("escape")
        await pilot.press("q")


# --- the scenario ----------------------------------------------------------------------------


@pytest.fixture
def daemons(stoker_home, model):
    """Daemons started by the test; none, and no server, may outlive it."""
    started: list[DaemonProcess] = []
    yield started
    for d in started:
        d.stop()
    leftovers = servers_for(model)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


@pytest.mark.engine
@pytest.mark.slow
def test_a_plugin_backend_is_probed_planned_launched_shown_and_falls_back_with_its_own_codes(
    stoker_home, installed_cpu_bundle, model, plugin_site, daemons, tmp_path
):
    plain = {**os.environ, "STOKER_HOME": str(stoker_home)}
    d = DaemonProcess(stoker_home, env=with_plugin(plugin_site, DEVICE))
    env = d.env

    # Config validation knows the name only where the plugin is installed.
    write_config(d.paths, tiny_config(model) + '[backend]\nprefer = "fakegpu"\n')
    assert stoker(env, "config", "check").returncode == 0
    refused = stoker(plain, "config", "check")
    assert refused.returncode != 0 and "backend.prefer" in refused.stderr and "fakegpu" in refused.stderr

    # Its bundle: verified by asking the plugin (the CPU build's "(none)" is its signature).
    lost = tmp_path / "fakegpu-device-lost"
    bundle_dir = tmp_path / "fakegpu-bundle"
    meta = relabel_cpu_bundle(installed_cpu_bundle.root, bundle_dir, lost)
    unjudged = stoker(plain, "bundle", "verify", str(bundle_dir), "--json")
    assert unjudged.returncode != 0 and "fakegpu" in unjudged.stdout + unjudged.stderr
    installed = stoker(env, "bundle", "install", str(bundle_dir), "--json")
    assert installed.returncode == 0, installed.stdout + installed.stderr
    slot = d.paths.bundles_dir / f"fakegpu-{meta.variant}"
    assert json.loads(installed.stdout)["backend"] == "fakegpu" and slot.is_dir()

    # Forced: planned and launched on its own bundle, the real CPU llama-server underneath.
    daemons.append(d.start())
    st = d.wait_for(settled, timeout=180, what="the fakegpu plan to settle")
    assert st["planned_backend"] == "fakegpu" and st["variant"] == meta.variant
    assert st["preference"] == {"prefer": "fakegpu", "forced": True, "candidates": ["fakegpu"]}
    assert "fakegpu" in st["backends"]
    cmd = the_server(model).cmdline()
    assert Path(cmd[0]).is_relative_to(slot) and cmd[0].endswith("llama-server")
    assert cmd[cmd.index("-ngl") + 1] == "auto"  # planned as an accelerator: the engine fits
    # Its CPU engine offloads nothing: its own code and sentence say so, and it counts as the CPU.
    zero = fallback_of(st, "fakegpu")
    assert zero["reason"] == "fakegpu_gpu_layers_zero" and zero["message"] == ZERO_LAYERS
    assert st["backend"] == "cpu" and st["fallback_reason"] == "fakegpu_gpu_layers_zero"
    rows = d.history(machine="fallback")
    assert any(r["event"] == "LaunchSucceeded" and r["reason"] == "fakegpu_gpu_layers_zero" for r in rows)

    # Probed out of process like any backend; `stoker probe` lists it with its verdict.
    probe = json.loads(stoker(env, "probe", "--fresh", "--json").stdout)
    fake = {b["backend"]: b for b in probe["backends"]}["fakegpu"]
    assert fake["usable"] and fake["devices"][0]["name"] == "FakeGPU 9000" and fake["generation"] >= 2
    assert "probed" not in fake["evidence"]  # no quick_detect: a probe child loaded the plugin
    human = stoker(env, "probe").stdout
    assert "fakegpu: available" in human and "device 0: FakeGPU 9000, 8192 MiB (8192 MiB free)" in human
    shown = stoker(env, "status").stdout
    assert f"fallback  fakegpu: fakegpu_gpu_layers_zero - {ZERO_LAYERS}" in shown

    # The TUI: the card names its fallback, the backend choice offers it.
    asyncio.run(tui_shows_fakegpu(d.paths.socket_path))

    # Auto mode tries it where it says (after the built-in GPUs, before the CPU).
    out = stoker(env, "use", "auto", "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    st = d.wait_for(lambda s: settled(s) and s["preference"]["prefer"] == "auto", timeout=180, what="auto")
    candidates = st["preference"]["candidates"]
    assert candidates[-2:] == ["fakegpu", "cpu"] and set(candidates) == set(st["backends"])
    assert st["planned_backend"] == "fakegpu" and fallback_of(st, "fakegpu")["reason"] == "fakegpu_gpu_layers_zero"

    # Its device is lost while loading: its own startup code, and the CPU bundle serves.
    lost.touch()
    first = st["pid"]
    assert stoker(env, "restart", "--json").returncode == 0
    st = d.wait_for(
        lambda s: settled(s) and s["pid"] not in (None, first) and s["planned_backend"] == "cpu",
        timeout=180,
        what="the CPU after fakegpu's startup failure",
    )
    died = fallback_of(st, "fakegpu")
    assert died["reason"] == "fakegpu_startup_failed"
    # The sentence is this failure's evidence (its signal, its last line), not the code's generic one.
    assert "killed by signal SIGSEGV" in died["message"] and DEVICE_LOST_LINE in died["message"]
    assert died["evidence"]["exit_reason"] == "server_crashed" and died["evidence"].get("signal") == "SIGSEGV"
    cpu_cmd = the_server(model).cmdline()
    assert Path(cpu_cmd[0]).is_relative_to(installed_cpu_bundle.root)
    assert st["backend"] == "cpu"
    d.stop()

    # A new daemon reads those rows back (the plugin's codes are registered before any row is
    # restored); FakeGPU's runtime does not answer this time: its own unavailable code.
    d2 = DaemonProcess(stoker_home, env=with_plugin(plugin_site, "offline"))
    daemons.append(d2.start())
    st = d2.wait_for(settled, timeout=180, what="the CPU with fakegpu unavailable")
    off = fallback_of(st, "fakegpu")
    assert off["reason"] == "fakegpu_unavailable" and off["message"] == NO_ANSWER
    assert st["planned_backend"] == "cpu" and st["probes"]["fakegpu"]["reason"] == "fakegpu_unavailable"
    assert "fakegpu: unusable [fakegpu_unavailable]" in stoker(d2.env, "probe").stdout
    old = [r["reason"] for r in d2.history(machine="fallback")]
    assert "fakegpu_startup_failed" in old and "fakegpu_unavailable" in old
    d2.stop()

    # The plugin uninstalled: a daemon without it still starts on the same STOKER_HOME. Its
    # codes in the restored rows read back as a plugin's that is gone; it serves on the CPU,
    # and `stoker status` and `stoker history` show the old rows.
    d3 = DaemonProcess(stoker_home)
    daemons.append(d3.start())
    st = d3.wait_for(settled, timeout=180, what="the CPU without the plugin")
    assert "fakegpu" not in st["backends"] and st["planned_backend"] == "cpu" and st["backend"] == "cpu"
    shown = stoker(plain, "status")
    assert shown.returncode == 0 and "ready" in shown.stdout, shown.stdout + shown.stderr
    rows = json.loads(stoker(plain, "history", "--machine", "fallback", "--json").stdout)
    assert {"fakegpu_startup_failed", "fakegpu_unavailable"} <= {r["reason"] for r in rows}
    human = stoker(plain, "history", "--machine", "fallback")
    assert human.returncode == 0 and "[fakegpu_startup_failed]" in human.stdout, human.stdout + human.stderr
