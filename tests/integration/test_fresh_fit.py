"""A daemon started in a fresh home (no kept fitter answer) whose GPU plan clearly fits runs the
bundle's llama-fit-params zero times before it spawns its engine: Stoker's upper bound from the
GGUF header places it (states/fallback/memory_bound.py), and the plan's history says so. With
free VRAM near what the bound needs, the fitter runs as before.

The GPU is the FakeGPU plugin's (tests/integration/fakegpu_plugin: its free VRAM is whatever
FAKEGPU_DEVICES says, its bundle Stoker's CPU build relabelled); its fitter is a wrapper that
logs each run and execs the CPU build's real llama-fit-params. The FakeGPU server offloads
nothing, so the plan then falls back to the CPU (whose own bundle's fitter is not the wrapper)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import attrs
import pytest

from stoker.daemon.bundles.metadata import BUNDLE_JSON, BundleMeta, FileEntry
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config
from tests.integration.test_third_party_backend import daemons  # noqa: F401 (the fixture, used below)
from tests.integration.test_third_party_backend import relabel_cpu_bundle, settled, stoker, with_plugin

FIT_WRAPPER = """#!/bin/sh
echo "$@" >> "{log}"
exec "$(dirname "$0")/{real}" "$@"
"""


def with_logged_fitter(bundle_dir: Path, meta: BundleMeta, log: Path) -> None:
    """The bundle's llama-fit-params as a wrapper that logs each run (bundle.json names it)."""
    real = Path(meta.tools["fit_params"])
    wrapper = real.with_name("fakegpu-fit-params")
    (bundle_dir / wrapper).write_text(FIT_WRAPPER.format(log=log, real=real.name))
    os.chmod(bundle_dir / wrapper, 0o755)
    data = (bundle_dir / wrapper).read_bytes()
    entry = FileEntry(wrapper.as_posix(), len(data), 0o755, hashlib.sha256(data).hexdigest())
    tools = {**meta.tools, "fit_params": wrapper.as_posix()}
    meta = attrs.evolve(meta, tools=tools, files=(*meta.files, entry))
    (bundle_dir / BUNDLE_JSON).write_text(meta.to_json())


def fakegpu_plan_memory(d: DaemonProcess) -> dict[str, Any]:
    """The memory the first FakeGPU plan recorded in the launch history."""
    rows = d.history(machine="launch", limit=500)
    for row in sorted(rows, key=lambda r: r["id"]):
        plan = (row.get("event_data") or {}).get("plan") or {}
        if row["event"] == "PlanReady" and plan.get("backend") == "fakegpu":
            return plan["memory"]
    raise AssertionError("no fakegpu plan in the launch history")


@pytest.fixture
def fresh_fakegpu(stoker_home, installed_cpu_bundle, model, plugin_site, tmp_path, daemons):  # noqa: F811
    """A fresh home with the FakeGPU bundle (logging fitter) installed; start(free MiB) runs it."""
    log = tmp_path / "fit-runs.log"

    def start(free_mib: int) -> DaemonProcess:
        d = DaemonProcess(stoker_home, env=with_plugin(plugin_site, f"FakeGPU 9000:{free_mib}"))
        write_config(d.paths, tiny_config(model) + '[backend]\nprefer = "fakegpu"\n')
        bundle_dir = tmp_path / "fakegpu-bundle"
        meta = relabel_cpu_bundle(installed_cpu_bundle.root, bundle_dir, tmp_path / "never")
        with_logged_fitter(bundle_dir, meta, log)
        installed = stoker(d.env, "bundle", "install", str(bundle_dir), "--json")
        assert installed.returncode == 0, installed.stdout + installed.stderr
        assert not (d.paths.data_dir / "fit-cache.json").exists()  # fresh: nothing kept
        daemons.append(d.start())
        d.wait_for(settled, timeout=180, what="the plan to settle")
        return d

    return start, log


@pytest.mark.engine
def test_a_fresh_daemon_whose_gpu_plan_clearly_fits_runs_no_fitter(fresh_fakegpu):
    start, log = fresh_fakegpu
    d = start(80_000)
    assert not log.exists(), log.read_text()  # llama-fit-params ran zero times for the GPU plan
    memory = fakegpu_plan_memory(d)
    assert memory["source"] == "stoker-bound" and not memory["partial"]
    assert "upper bound, not llama-fit-params (not run)" in memory["detail"]
    assert "the least free GPU had 80000 MiB" in memory["detail"]


@pytest.mark.engine
def test_near_the_boundary_the_fresh_daemon_asks_the_fitter(fresh_fakegpu):
    start, log = fresh_fakegpu
    # More than the margin (the FakeGPU gets the plan), less than the bound with its clearance.
    d = start(1_200)
    assert log.exists() and "--fit-print on" in log.read_text().splitlines()[0]
    memory = fakegpu_plan_memory(d)
    assert "upper bound" not in json.dumps(memory)
