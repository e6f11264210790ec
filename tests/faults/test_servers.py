"""No leaked or duplicated servers: a daemon killed mid-command, many clients at once, a lost store.

Every test ends with the suite's own check (tests/integration/conftest.py `daemon`): no
llama-server of this test's model outlives it. Each also checks, while the daemon runs, that
exactly the server `status` reports exists.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import threading
import time

import psutil
import trio
import pytest

from stoker.daemon.core.errors import StokerError
from tests.integration.daemon_harness import DaemonProcess, servers_for

pytestmark = [pytest.mark.engine]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def server_pids(model) -> list[int]:
    return sorted(p.pid for p in servers_for(model))


def assert_exactly_what_status_reports(d: DaemonProcess, model, quiet: float = 1.0) -> dict:
    """Settle (a steady state, unchanged for `quiet` seconds), then: the servers that exist are
    exactly the one status names (none when it names none)."""
    st = d.wait_for(lambda s: s["state"] in ("ready", "stopped", "failed"), 90, "a steady state")
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        time.sleep(quiet)
        again = d.call("status")
        if (again["state"], again["pid"]) == (st["state"], st["pid"]) and again["state"] in (
            "ready",
            "stopped",
            "failed",
        ):
            break
        st = again
    expected = [st["pid"]] if st["state"] == "ready" else []
    assert server_pids(model) == expected, f"status says {st['state']} pid {st['pid']}"
    return st


def write_launch_row(d: DaemonProcess, state: str, **data: object) -> None:
    """Put the launch machine's row where a daemon killed at that moment would have left it."""
    with sqlite3.connect(d.paths.db_file) as db:
        (raw,) = db.execute("select data from machines where id = 'launch'").fetchone()
        db.execute(
            "update machines set state = ?, data = ? where id = 'launch'",
            (state, json.dumps({**json.loads(raw), **data})),
        )
    db.close()


# --- killed while stopping, started again: no leaked server -------------------------------


def test_daemon_killed_while_restarting_leaves_one_server(daemon, model):
    """Killed with -9 right after `restart` was recorded (stopping, the old server not yet
    signalled): the next daemon stops the old server before it plans a new one."""
    daemon.start()
    first = daemon.wait_state("ready")
    daemon.kill9()
    write_launch_row(daemon, "stopping", after_stop="restart")
    daemon.start()
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 60, "a new server")
    time.sleep(1.0)  # a late adoption of the old server would show now
    assert not alive(first["pid"])
    assert server_pids(model) == [st["pid"]]
    rows = [(r["from_state"], r["event"], r["to_state"]) for r in daemon.history(machine="launch", limit=50)]
    assert ("stopping", "Adopted", "stopping") in rows  # proven first, then stopped
    daemon.call("shutdown")
    daemon.proc.wait(30)
    assert server_pids(model) == []


def test_daemon_killed_while_stopping_after_down_stays_stopped(daemon, model):
    daemon.start()
    first = daemon.wait_state("ready")
    daemon.kill9()
    write_launch_row(daemon, "stopping", after_stop="stop")
    daemon.start()
    st = daemon.wait_state("stopped", 60)
    assert st["pid"] is None and not alive(first["pid"])
    assert_exactly_what_status_reports(daemon, model)


# --- many clients at once: commands composed by the machine, not raced -------------------


@pytest.mark.parametrize("delay", [0.0, 0.005, 0.015, 0.05])
def test_restart_then_down_ends_stopped_with_no_server(daemon, model, delay):
    daemon.start()
    daemon.wait_state("ready")
    for _ in range(3):
        daemon.call("up")
        daemon.wait_state("ready")
        daemon.call("restart")
        time.sleep(delay)
        st = daemon.call("down")
        assert st["state"] == "stopped" and st["pid"] is None
        assert server_pids(model) == []  # when `down` answers, the server is gone
    time.sleep(1.0)
    assert daemon.call("status")["state"] == "stopped"
    assert server_pids(model) == []


def test_fifteen_clients_never_wedge_the_supervisor(daemon, model):
    """15 clients, 150 up/down/restart requests in random order: every request is answered,
    and the server that runs afterwards is exactly the one status reports; up and down still work."""
    daemon.start()
    daemon.wait_state("ready")
    seed = int(os.environ.get("STOKER_FAULT_SEED") or random.randrange(1 << 30))
    failures: list[str] = []

    def client(k: int) -> None:
        rng = random.Random(seed + k)
        for _ in range(10):
            method = rng.choice(["up", "down", "restart"])
            try:
                with daemon.client(timeout=60) as c:
                    c.call(method)
            except StokerError as err:
                if err.reason != "illegal_transition":  # refused while stopping is an answer
                    failures.append(f"client {k} {method}: {err.reason} {err.message}")
            time.sleep(rng.random() * 0.03)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(15)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), f"a request never got its answer (seed {seed})"
    assert failures == [], f"seed {seed}\n{daemon.log_text()[-8000:]}"
    assert_exactly_what_status_reports(daemon, model)
    assert daemon.call("up")
    st = daemon.wait_state("ready", 60)
    assert server_pids(model) == [st["pid"]]
    assert daemon.call("down")["state"] == "stopped"
    assert server_pids(model) == []


# --- the identity file is evidence on its own, even without the store ---------------------


@pytest.mark.parametrize("lost", ["database", "wal"])
def test_a_lost_store_does_not_duplicate_the_server(daemon, model, lost):
    """The store moved aside (what store_corrupt tells the user to do) or its -wal lost while
    the server ran: the next daemon proves the server from its identity file and stops it
    before starting its own, so one server runs, the one status reports."""
    daemon.start()
    first = daemon.wait_state("ready")
    daemon.kill9()
    db = daemon.paths.db_file
    for suffix in ("-wal", "-shm") if lost == "wal" else ("", "-wal", "-shm"):
        path = db.with_name(db.name + suffix)
        if path.exists():
            path.rename(path.with_name(path.name + ".aside"))
    daemon.start()
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["endpoint"], 60, "ready")
    time.sleep(1.0)
    assert server_pids(model) == [st["pid"]]
    assert st["pid"] == first["pid"] or not alive(first["pid"])
    assert_exactly_what_status_reports(daemon, model)


def test_a_server_whose_identity_was_never_written_is_stopped(daemon, model):
    """A daemon killed between spawning llama-server and writing its identity file (the chaos
    test caught a second server living beside the one status reported) leaves a server no
    identity file names. Its launch directory names it: the next daemon stops it before its
    own spawn, so one server runs, the one status reports."""
    daemon.start()
    daemon.wait_state("ready")
    daemon.kill9()
    ident = json.loads((daemon.paths.runtime_dir / "server.json").read_text())
    # What the window leaves: the server and its launch dir, no record of it.
    (daemon.paths.runtime_dir / "server.json").unlink()
    assert os.path.isdir(ident["launch_dir"]) and alive(ident["pid"])
    daemon.start()
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["endpoint"], 60, "ready")
    assert not alive(ident["pid"]), "the unrecorded server still runs"
    assert not os.path.exists(ident["launch_dir"])
    assert server_pids(model) == [st["pid"]]
    assert_exactly_what_status_reports(daemon, model)


# --- a request at the exact moment a spawn is being prepared --------------------------------
# The daemon's own supervisor and the real engine, in-process, so that a request can be made
# exactly between PlanReady and Spawned (from a socket client it lands there only sometimes).


def _launches(log_path) -> int:
    try:
        return log_path.read_text(errors="replace").count("==== stoker: launch")
    except FileNotFoundError:
        return 0


async def _supervisor_with_requests_while_spawning(installed_cpu_bundle, model, requests):
    """Run a Supervisor on the real engine; each time a spawn starts (PlanReady), make the
    next of `requests`; return (history, launches at the first `stopped`, launches at the end)."""
    from stoker.daemon.config.model import load_config
    from stoker.daemon.core.paths import StokerPaths
    from stoker.states.launch import records as LR
    from stoker.store import open_store
    from tests.integration.daemon_harness import tiny_config, write_config

    paths = StokerPaths.from_env()
    write_config(paths, tiny_config(model))
    config = load_config(paths.config_file)
    plan = LR.LaunchPlan(
        "cpu", installed_cpu_bundle.meta.variant, str(installed_cpu_bundle.root), str(installed_cpu_bundle.server),
        str(model), port=0, ctx_size=256,
    )  # fmt: skip

    async def planner(config, effect):
        await trio.sleep(0)
        return plan

    store = open_store(paths.db_file)
    pending = list(requests)
    stopped_at: list[int] = []
    with trio.fail_after(120):
        history = await _run_requests(paths, store, config, planner, pending, stopped_at)
    store.close()
    log_path = paths.logs_dir / "llama-server.log"
    return history, stopped_at[0], _launches(log_path)


async def _run_requests(paths, store, config, planner, pending, stopped_at):
    from stoker.daemon.launch.supervisor import Supervisor
    from stoker.states.launch import records as LR

    async with trio.open_nursery() as nursery:

        def publish(message):
            if message["event"] == "PlanReady" and pending:
                nursery.start_soon(_fire, sup, pending.pop(0))
            if message["to"] == "stopped" and not stopped_at:
                stopped_at.append(_launches(sup.log_path))

        sup = Supervisor(paths, store, config, planner, publish=publish)
        await nursery.start(sup.run)
        sup.fire(LR.UpRequested(LR.LaunchSettings(stop_grace=3.0)))
        with trio.fail_after(60):
            while not (sup.state is LR.LaunchState.STOPPED and not pending):
                await trio.sleep(0.01)
        await trio.sleep(1.0)  # anything spawned after `stopped` shows now
        assert sup.state is LR.LaunchState.STOPPED and sup.server is None
        nursery.cancel_scope.cancel()
    return [(r.from_state, r.event, r.to_state) for r in reversed(store.history(machine="launch", limit=100))]


async def _fire(sup, event) -> None:
    sup.fire(event)


async def test_a_down_while_spawning_stops_what_was_spawned_before_it_says_stopped(installed_cpu_bundle, model):
    from stoker.states.launch import records as LR

    history, at_stopped, at_end = await _supervisor_with_requests_while_spawning(
        installed_cpu_bundle, model, [LR.DownRequested()]
    )
    assert at_stopped == at_end == 1  # nothing was launched after the machine said stopped
    assert ("stopping", "Spawned", "stopping") in history  # the stop waited for the spawn
    assert history[-1] == ("stopping", "StopCompleted", "stopped")
    assert server_pids(model) == []


async def test_restarts_and_a_down_while_spawning_leave_no_server_and_no_wedge(installed_cpu_bundle, model):
    from stoker.states.launch import records as LR

    requests = [LR.RestartRequested(), LR.RestartRequested(), LR.DownRequested()]
    history, at_stopped, at_end = await _supervisor_with_requests_while_spawning(installed_cpu_bundle, model, requests)
    assert at_stopped == at_end == 3  # three spawns, each stopped before the next began
    assert [h for h in history if h[1] == "Spawned"] == [("stopping", "Spawned", "stopping")] * 3
    assert server_pids(model) == []
