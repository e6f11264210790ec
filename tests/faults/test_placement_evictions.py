"""Several models under `[placement] max_loaded`, real daemon and real servers: each cold load
unloads exactly one idle model (a model already stopping gives its place back; nothing else is
unloaded meanwhile), and at every quiet point the servers that exist are exactly those status
reports, model by model.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config

pytestmark = [pytest.mark.engine]

STEADY = ("ready", "stopped", "failed")


def model_copies(model: Path, names: list[str]) -> dict[str, Path]:
    """A private copy of the tiny model per name, so that each model's servers are found by its path."""
    copies = {}
    for name in names:
        path = model.parent / "fleet" / f"{name}.gguf"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(model, path)
        copies[name] = path
    return copies


def fleet_config(model: Path, copies: dict[str, Path], *, max_loaded: int, extra: str = "") -> str:
    """The tiny config serving each copy as [models.NAME] (the first the default), `max_loaded` at once."""
    text = tiny_config(model) + f"[placement]\nmax_loaded = {max_loaded}\n"
    for i, (name, path) in enumerate(copies.items()):
        text += f'[models.{name}]\nmodel = "{path}"\n' + ("default = true\n" if i == 0 else "")
    return text + extra


def models_of(d: DaemonProcess) -> dict[str, dict]:
    return {m["name"]: m for m in d.call("status")["models"]}


def quiet_models(d: DaemonProcess, quiet: float = 1.0, timeout: float = 120.0) -> dict[str, dict]:
    """Every model in a steady state, unchanged over `quiet` seconds."""
    deadline = time.monotonic() + timeout
    last: dict[str, tuple] = {}
    while True:
        models = models_of(d)
        seen = {n: (m["state"], m["pid"]) for n, m in models.items()}
        if seen == last and all(s in STEADY for s, _ in seen.values()):
            return models
        assert time.monotonic() < deadline, f"no quiet point: {seen}\n{d.log_text()[-4000:]}"
        last = seen
        time.sleep(quiet)


def assert_fleet_matches_status(d: DaemonProcess, copies: dict[str, Path], quiet: float = 1.0) -> dict[str, dict]:
    """At a quiet point, for every model: the servers of its file that exist are exactly the one
    status names (none unless it is ready); no more are loaded than max_loaded allows."""
    models = quiet_models(d, quiet)
    for name, path in copies.items():
        pids = sorted(p.pid for p in servers_for(path))
        want = [models[name]["pid"]] if models[name]["state"] == "ready" else []
        assert pids == want, f"{name}: status says {models[name]['state']} pid {models[name]['pid']}, found {pids}"
    return models


def evictions(d: DaemonProcess, names: list[str]) -> list[tuple[str, str]]:
    """(evicted model, the model it made room for), oldest first."""
    found = []
    for name in names:
        for row in d.history(machine=f"launch:{name}", limit=200):
            if row["reason"] == "placement_evicted":
                found.append((row["id"] or 0, name, row["evidence"]["for"]))
    return [(name, made_room_for) for _, name, made_room_for in sorted(found)]


def test_each_cold_load_under_max_loaded_unloads_exactly_one_idle_model(daemon, model):
    names = ["m0", "m1", "m2", "m3"]
    copies = model_copies(model, names)
    write_config(daemon.paths, fleet_config(model, copies, max_loaded=2))
    try:
        daemon.start()
        daemon.wait_for(lambda s: models_of_status(s)["m0"] == "ready", 90, "the default model ready")
        daemon.call("up", model="m1")
        assert_fleet_matches_status(daemon, copies)
        loads = ["m2", "m3", "m0"]  # each a cold load with both places taken by idle models
        for name in loads:
            daemon.call("up", model=name)
            models = assert_fleet_matches_status(daemon, copies)
            ready = sorted(n for n, m in models.items() if m["state"] == "ready")
            assert name in ready and len(ready) == 2, models
        got = evictions(daemon, names)
        assert len(got) == len(loads), f"{len(loads)} cold loads took {len(got)} evictions: {got}"
        assert [made_room_for for _, made_room_for in got] == loads
        print(f"{len(loads)} cold loads under max_loaded = 2: {len(got)} evictions {got}")
    finally:
        daemon.stop()
        leftovers = [p for path in copies.values() for p in servers_for(path)]
        for proc in leftovers:
            proc.kill()
        assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


def models_of_status(status: dict) -> dict[str, str]:
    return {m["name"]: m["state"] for m in status["models"]}
