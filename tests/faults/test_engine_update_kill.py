"""An engine update survives a daemon killed at any step: the slot or its
`.previous` always holds a launchable engine, a server keeps serving, and the restarted daemon
takes the update to its end from where history says it was.

Killed with SIGKILL while the update machine is in `staging`, `comparing` or `restarting` (each
lasts long enough to be seen); and at every step with the engines counted after: a smoke run's
llama-server (the staged engine's smoke gate, the old engine's comparison run) is ended by the
next daemon, exactly the servers status reports are left, none after `stoker shutdown`, and no
engine carries its key in its argv. A kill in the middle of the switch (between promote's two renames,
a window of milliseconds) is made exactly: the machine row at `switching` and the bundles dir as
that instant leaves it (the slot renamed to `.previous`, the staged tree not yet moved in).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

import pytest

from stoker.daemon.bundles.archive import unpack_bundle
from stoker.daemon.bundles.installed import PREVIOUS, find_installed
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.machines import MachineRunner
from stoker.daemon.install.update_steps import bundle_digest
from stoker.states.engine_update import table as U
from stoker.states.engine_update import records as R
from stoker.store import open_store
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.integration.engine_repack import repack
from tests.waits import wait_until

pytestmark = pytest.mark.engine

RESTING = {s.value for s in U.RESTING}


def wait_update(daemon: DaemonProcess, slot: str, states: set[str], timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    last: dict = {}
    while time.monotonic() < deadline:
        try:
            last = daemon.call("engine.status")
        except StokerError:
            last = {}
        if last.get("update_state") in states:
            return last
        time.sleep(0.05)
    raise AssertionError(f"the update never reached {states}: {last}\n{daemon.log_text()[-3000:]}")


def start(daemon: DaemonProcess, model: Path) -> dict:
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    daemon.start()
    return daemon.wait_state("ready")


@contextlib.contextmanager
def update_at_switching(daemon: DaemonProcess, cpu_bundle: Path, tmp_path: Path, variant: str, old: str):
    """The update machine as a daemon killed at the switch leaves it: the candidate (`old`.1)
    staged, its tokens compared, the Switch under way. Yields the machine's runner (the store
    closed after), the staged tree and the old and new engines' digests."""
    slot = f"cpu-{variant}"
    bundles = daemon.paths.bundles_dir
    good = repack(cpu_bundle, tmp_path / "good.zip", version=f"{old}.1")
    staging = bundles / f".update-{slot}" / "bundle"
    unpack_bundle(good, staging)
    old_digest, new_digest = bundle_digest(bundles / slot), bundle_digest(staging)
    assert old_digest and new_digest
    store = open_store(daemon.paths.db_file)
    try:
        runner = MachineRunner(U.ENGINE_UPDATE, U.ENGINE_UPDATE.machine_id("cpu", variant), store)
        tokens = (1, 2, 3)
        for event in (
            R.UpdateRequested("cpu", variant, bundle=str(good)),
            R.Resolved(R.BundleFacts(old, old_digest), R.Candidate(f"{old}.1", new_digest, good.as_uri())),
            R.Staged(R.BundleFacts(f"{old}.1", new_digest), str(staging), tokens),
            R.TokensCompared(tokens),
        ):
            runner.fire(event)
        assert runner.state is R.UpdateState.SWITCHING
        yield runner, staging, old_digest, new_digest
    finally:
        store.close()


@pytest.mark.parametrize("killed_in", ["staging", "comparing", "restarting"])
def test_a_daemon_killed_mid_update_finishes_it_after_restart(daemon, model, cpu_bundle, tmp_path, killed_in):
    st = start(daemon, model)
    slot, old = f"cpu-{st['variant']}", st["engine"]["version"]
    good = repack(cpu_bundle, tmp_path / "good.zip", version=f"{old}.1")
    machine = f"engine_update:{slot}"

    def ask() -> None:
        try:
            with daemon.client(timeout=300) as client:
                client.call("engine.update", bundle=str(good))
        except StokerError:
            pass  # the daemon dies under it

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    wait_until(
        lambda: any(r["to_state"] == killed_in for r in daemon.history(machine=machine, limit=20)),
        timeout=120,
        what=f"{machine} in {killed_in}",
        tick=0.01,
        detail=lambda: f"{daemon.history(machine=machine, limit=20)}",
    )
    daemon.kill9()
    asker.join(10)

    # Killed: the slot (or, mid-promote, its .previous) holds an engine, old or new, never neither.
    left = find_installed(daemon.paths, "cpu", st["variant"])
    assert left is not None and left.meta.version in (old, f"{old}.1")

    daemon.start()
    done = wait_update(daemon, slot, RESTING)
    assert done["update_state"] == "updated", done
    assert done["version"] == f"{old}.1" and done["previous"] == old
    history = daemon.history(machine=machine, limit=40)
    (resumed,) = [r for r in history if r["event"] == "Resumed"]
    assert resumed["evidence"]["resumed_from"] == killed_in
    st = daemon.wait_state("ready", timeout=120)
    assert st["engine"]["version"] == f"{old}.1"
    assert len(servers_for(model)) == 1
    assert not (daemon.paths.bundles_dir / f".update-{slot}").exists()


def test_a_kill_between_the_switch_renames_serves_the_old_engine_then_completes(
    daemon, model, installed_cpu_bundle, cpu_bundle, tmp_path
):
    variant = installed_cpu_bundle.meta.variant
    slot, old = f"cpu-{variant}", installed_cpu_bundle.meta.version
    bundles = daemon.paths.bundles_dir
    # The update machine as the killed daemon left it: tokens compared, the Switch under way.
    with update_at_switching(daemon, cpu_bundle, tmp_path, variant, old) as (_, _, old_digest, new_digest):
        # ...and promote's first rename done, its second not: no slot, the old engine as `.previous`.
        (bundles / slot).rename(bundles / (slot + PREVIOUS))
    serving = find_installed(daemon.paths, "cpu", variant)
    assert serving is not None and serving.meta.version == old  # never neither

    write_config(daemon.paths, tiny_config(model, snapshots=True))
    daemon.start()
    done = wait_update(daemon, slot, RESTING)
    assert done["update_state"] == "updated" and done["version"] == f"{old}.1" and done["previous"] == old, done
    assert bundle_digest(bundles / slot) == new_digest and bundle_digest(bundles / (slot + PREVIOUS)) == old_digest
    st = daemon.wait_for(
        lambda s: s["state"] == "ready" and (s.get("engine") or {}).get("version") == f"{old}.1",
        timeout=120,
        what="the new engine serving",
    )
    assert st["pid"] and len(servers_for(model)) == 1


def test_a_daemon_restarted_in_the_restart_step_leaves_a_model_the_user_stopped_stopped(
    daemon, model, installed_cpu_bundle, cpu_bundle, tmp_path
):
    """The update switched the slot and was restarting alpha and beta when the daemon died; meanwhile
    the user had stopped beta (`stoker down beta`). The resumed update restarts alpha on the new
    engine and leaves beta stopped (verdict `stopped`): it loads on the new engine when asked."""
    from stoker.daemon.bundles.installed import promote
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    beta_model = write_tiny_model(tmp_path / "beta" / "beta.gguf", seed=7)
    variant = installed_cpu_bundle.meta.variant
    slot, old = f"cpu-{variant}", installed_cpu_bundle.meta.version
    bundles = daemon.paths.bundles_dir
    sections = f'[models.alpha]\nmodel = "{model}"\ndefault = true\n[models.beta]\nmodel = "{beta_model}"\n'
    write_config(daemon.paths, tiny_config(model) + sections)
    daemon.start()
    daemon.wait_state("ready")
    daemon.call("up", model="beta")
    daemon.wait_for(lambda s: _model(s, "beta")["state"] == "ready", what="beta ready")
    daemon.call("down", model="beta")
    assert _model(daemon.call("status"), "beta")["down_cause"] == "user"
    daemon.kill9()

    # The update as the killed daemon left it: switched to the new engine, restarting both.
    with update_at_switching(daemon, cpu_bundle, tmp_path, variant, old) as (runner, staging, _, _):
        promote(staging, bundles, slot=slot)
        runner.fire(R.Switched((R.ServerBaseline("alpha", None, None), R.ServerBaseline("beta", None, None))))
        assert runner.state is R.UpdateState.RESTARTING

    daemon.start()
    done = wait_update(daemon, slot, RESTING)
    assert done["update_state"] == "updated" and done["version"] == f"{old}.1", done
    rows = daemon.history(machine=f"engine_update:{slot}", limit=5)
    (restarted,) = [r for r in rows if r["event"] == "ServersRestarted"]
    assert {v["name"]: v["outcome"] for v in restarted["event_data"]["verdicts"]} == {
        "alpha": "ready",
        "beta": "stopped",
    }
    time.sleep(2.0)  # a start of beta would have begun by now
    beta = _model(daemon.call("status"), "beta")
    assert beta["state"] == "stopped" and beta["down_cause"] == "user", beta
    assert servers_for(beta_model) == [] and len(servers_for(model)) == 1
    assert "RestartRequested" not in [r["event"] for r in daemon.history(machine="launch:beta", limit=5)]


def _model(status: dict, name: str) -> dict:
    return next(m for m in status["models"] if m["name"] == name)


def home_engines(daemon: DaemonProcess) -> list[psutil.Process]:
    """Every live llama-server started from this daemon's home (its slots, `.previous`, a staged
    update): the served ones and any smoke run, whoever started it."""
    root = str(daemon.home)
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmd = proc.info["cmdline"] or []
            if cmd and cmd[0].endswith("llama-server") and cmd[0].startswith(root):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except psutil.Error:
            continue
    return found


def keys_in_argv(procs: list[psutil.Process], *keys: str) -> list[tuple[int, list[str]]]:
    """The processes whose command line (as /proc/PID/cmdline shows any local user) carries a key."""
    shown = []
    for proc in procs:
        try:
            cmd = proc.cmdline()
        except psutil.Error:
            continue
        if "--api-key" in cmd or any(k and any(k in arg for arg in cmd) for k in keys):
            shown.append((proc.pid, cmd))
    return shown


@pytest.mark.parametrize("killed_in", ["resolving", "staging", "comparing", "switching", "restarting"])
def test_a_daemon_killed_at_each_update_step_leaves_exactly_the_servers_status_reports(
    daemon, model, cpu_bundle, tmp_path, killed_in
):
    """kill -9 at each step of `stoker engine update`; in staging and comparing the kill lands
    while the step's smoke-run llama-server runs. The next daemon ends that run, finishes the
    update, and then the engines running are exactly the one status reports; `stoker shutdown`
    leaves none; no engine ever shows a key in its argv."""
    st = start(daemon, model)
    slot, old = f"cpu-{st['variant']}", st["engine"]["version"]
    good = repack(cpu_bundle, tmp_path / "good.zip", version=f"{old}.1")
    machine = f"engine_update:{slot}"
    served = st["pid"]

    def ask() -> None:
        try:
            with daemon.client(timeout=300) as client:
                client.call("engine.update", bundle=str(good))
        except StokerError:
            pass  # the daemon dies under it

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()
    smoke: list[psutil.Process] = []

    def argv_of(proc: psutil.Process) -> list[str]:
        try:
            return proc.cmdline()
        except psutil.Error:  # it ended since it was listed (a verification's short run)
            return []

    def reached() -> bool:
        if not any(r["to_state"] == killed_in for r in daemon.history(machine=machine, limit=20)):
            return False
        if killed_in not in ("staging", "comparing"):
            return True
        smoke[:] = [p for p in home_engines(daemon) if p.pid != served and "-m" in argv_of(p)]
        return bool(smoke) and daemon.call("engine.status")["update_state"] == killed_in

    wait_until(reached, timeout=180, what=f"{machine} in {killed_in}", tick=0.01)
    daemon.kill9()
    asker.join(10)
    left_running = [p for p in smoke if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert keys_in_argv(home_engines(daemon), st["api_key"]) == []

    daemon.start()
    done = wait_update(daemon, slot, RESTING, timeout=300)
    assert done["update_state"] == "updated", done
    st = daemon.wait_for(
        lambda s: s["state"] == "ready" and (s.get("engine") or {}).get("version") == f"{old}.1",
        timeout=180,
        what="the new engine serving",
    )
    engines = wait_until(
        lambda: (found := home_engines(daemon)) and len(found) == 1 and found,
        timeout=30,
        what="one engine left: the served one",
        detail=lambda: f"{[(p.pid, p.cmdline()) for p in home_engines(daemon)]} status pid {st['pid']}",
    )
    assert [p.pid for p in engines] == [st["pid"]], (killed_in, [p.pid for p in left_running])
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in left_running)
    assert keys_in_argv(engines, st["api_key"]) == []
    assert not list((daemon.paths.runtime_dir / "runs").glob("smoke-*"))

    out = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "shutdown"], env=daemon.env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert daemon.proc is not None
    daemon.proc.wait(60)
    assert wait_until(lambda: not home_engines(daemon), timeout=30, what="no engine after shutdown")
