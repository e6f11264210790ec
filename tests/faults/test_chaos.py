"""Chaos over the real daemon: random commands from several clients, engine updates (to a second
release, back, and rollbacks by hand), kill -9 of the daemon and of the server at random points,
restarts. Whatever happened, once the daemon settles (the launch machine steady, the update
machine resting) the processes Stoker started for this home are exactly the server `status`
reports (no smoke-run llama-server, no verification or staging process left), none carries a key
in its argv, and after a shutdown none is left. A second run does the same over three models
under `[placement] max_loaded = 2` with an RPC worker that dies and comes back, and the models'
own files cataloged and removed from the catalog: after every action, at a quiet point, each
model's servers are exactly the one status names, no more than max_loaded are loaded, and the
catalog matches the files (none of the user's own files deleted).

One daemon home for the whole run (its store carries over from example to example, so later
examples start from whatever the earlier ones left in it); the tiny model; a small
max_examples and no shrinking, so that it fits in about a minute of CI (each CI run draws new
examples). A failure prints the sequence of actions that led to it.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from stoker.daemon.bundles.installed import bundle_meta_of
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.launch_records import ENV_TOKEN
from stoker.states.engine_update.table import RESTING
from tests.faults.test_placement_evictions import assert_fleet_matches_status, fleet_config, model_copies
from tests.faults.test_servers import assert_exactly_what_status_reports, server_pids
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.integration.engine_repack import repack
from tests.integration.rpc_workers import WorkerProcess
from tests.waits import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CALL_TIMEOUT = 45.0  # a request not answered in this long is a wedged daemon
UPDATE_TIMEOUT = 120.0  # an engine update stages, smoke-runs two engines and restarts the server (~4 s here)
UPDATE_RESTING = {s.value for s in RESTING}

commands = st.lists(st.sampled_from(["up", "down", "restart"]), min_size=1, max_size=5)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("clients"), commands),  # one client per command, all at once
        st.tuples(st.just("kill_daemon"), st.floats(0, 0.3)),  # kill -9 after a delay, start again
        # a command, then kill -9 while it is carried out (a stop saving snapshots, a spawn)
        st.tuples(st.just("command_then_kill"), st.tuples(st.sampled_from(["down", "restart"]), st.floats(0, 0.1))),
        st.tuples(st.just("lose_store"), st.sampled_from(["database", "wal"])),  # kill -9, store moved aside
        st.tuples(st.just("kill_server"), st.floats(0, 0.3)),  # kill -9 every server of the model
        st.tuples(st.just("wait"), st.floats(0, 1.0)),
        # `stoker engine update --bundle` to the second release or back to the first, or `stoker
        # engine rollback`; then, or not, kill -9 of the daemon somewhere in the update's steps
        st.tuples(
            st.just("update"),
            st.tuples(st.sampled_from(["next", "back", "rollback"]), st.one_of(st.none(), st.floats(0, 4.0))),
        ),
    ),
    min_size=2,
    max_size=6,
)


class Chaos:
    """Runs one example's actions against a daemon; collects what no request may do."""

    def __init__(self, d: DaemonProcess, model, releases: dict[str, Path] | None = None) -> None:
        self.d = d
        self.model = model
        self.releases = releases or {}
        self.threads: list[threading.Thread] = []
        self.wedged: list[str] = []
        self.updates: list[str] = []  # what each update call answered (the reason, or its state)

    def clients(self, methods: list[str]) -> None:
        for method in methods:
            thread = threading.Thread(target=self._call, args=(method, random.random() * 0.05))
            thread.start()
            self.threads.append(thread)

    def _call(self, method: str, delay: float) -> None:
        time.sleep(delay)
        started = time.monotonic()
        try:
            with self.d.client(timeout=CALL_TIMEOUT) as c:
                c.call(method)
        except StokerError:
            pass  # refused, or the daemon was killed under it: an answer either way
        except OSError:
            pass
        if time.monotonic() - started >= CALL_TIMEOUT - 1:
            self.wedged.append(method)

    def update(self, arg: tuple[str, float | None]) -> None:
        """An engine update (or a rollback) from a client of its own; `kill_after`: kill -9 of the
        daemon that long after the request (mid-stage, mid-comparison, mid-restart...)."""
        target, kill_after = arg
        self.d.wait_socket(60)  # a daemon just started again: the update is asked of it, not refused unsent
        thread = threading.Thread(target=self._update, args=(target,))
        thread.start()
        self.threads.append(thread)
        if kill_after is not None:
            self.kill_daemon(kill_after)

    def _update(self, target: str) -> None:
        started = time.monotonic()
        try:
            with self.d.client(timeout=UPDATE_TIMEOUT) as c:
                if target == "rollback":
                    answer = c.call("engine.rollback")
                else:
                    answer = c.call("engine.update", bundle=str(self.releases[target]))
            self.updates.append(f"{target}: {answer.get('state')}")
        except StokerError as err:
            self.updates.append(f"{target}: {err.reason}")
        except OSError as err:
            self.updates.append(f"{target}: {type(err).__name__}")
        if time.monotonic() - started >= UPDATE_TIMEOUT - 1:
            self.wedged.append(f"engine {target}")

    def kill_daemon(self, delay: float) -> None:
        time.sleep(delay)
        if self.d.proc is not None and self.d.proc.poll() is None:
            self.d.kill9()
        self.d.start(wait=False)

    def command_then_kill(self, arg: tuple[str, float]) -> None:
        method, delay = arg
        self.clients([method])
        self.kill_daemon(delay)

    def lose_store(self, what: str) -> None:
        """What `store_corrupt` tells the user to do (move the database aside), or a lost -wal."""
        if self.d.proc is not None and self.d.proc.poll() is None:
            self.d.kill9()
        db = self.d.paths.db_file
        for suffix in ("-wal", "-shm") if what == "wal" else ("", "-wal", "-shm"):
            path = db.with_name(db.name + suffix)
            if path.exists():
                path.replace(path.with_name(path.name + ".aside"))
        self.d.start(wait=False)

    def wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def kill_server(self, delay: float) -> None:
        time.sleep(delay)
        for proc in servers_for(self.model):
            try:
                proc.kill()
            except Exception:
                pass

    def settle(self) -> dict:
        for thread in self.threads:
            thread.join(UPDATE_TIMEOUT + 15)  # an update is given longer than a command
        assert not any(t.is_alive() for t in self.threads), "a request never got its answer"
        assert not self.wedged, f"requests that hung: {self.wedged}"
        if self.d.proc is None or self.d.proc.poll() is not None:
            self.d.start(wait=False)
        self.d.wait_socket(60)
        deadline = time.monotonic() + 240
        while True:
            update = wait_update_resting(self.d)
            st_ = assert_exactly_what_status_reports(self.d, self.model, quiet=1.5)
            if wait_update_resting(self.d) == update:  # no update began while the server settled
                break
            assert time.monotonic() < deadline, "the update and launch machines never rested together"
        assert_only_what_status_reports_runs(self.d, st_)
        return st_


def wait_update_resting(d: DaemonProcess, timeout: float = 180.0) -> str | None:
    """The engine update machine's state once it rests (None: no update ever asked)."""
    last: dict = {}

    def resting() -> bool:
        nonlocal last
        last = d.call("engine.status")
        return last.get("update_state") is None or last["update_state"] in UPDATE_RESTING

    wait_until(resting, timeout=timeout, what="the engine update to rest", detail=lambda: f"{last}")
    return last.get("update_state")


def stoker_processes(d: DaemonProcess) -> list[psutil.Process]:
    """Every live process Stoker started for this daemon's home, however deep: one whose command
    line names a path in the home (the served engines, a smoke run's key file, a staged engine's
    `--version`) or that carries one of its launch records in its environment (smoke runs,
    verification, builds, probes, fits, and what they started). The daemon itself excluded."""
    home = str(d.home)
    daemon = d.proc.pid if d.proc is not None else None
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid in (daemon, os.getpid()) or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = proc.info["cmdline"] or []
            if any(home in arg for arg in cmd) or proc.environ().get(ENV_TOKEN, "").startswith(home):
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def assert_only_what_status_reports_runs(d: DaemonProcess, st_: dict) -> None:
    """The processes Stoker started for this home are exactly the server status names (none when
    it names none), and none shows a key in its command line (/proc/PID/cmdline, any user reads it)."""
    procs = stoker_processes(d)
    shown = {p.pid: p.info["cmdline"] for p in procs}
    expected = [st_["pid"]] if st_["state"] == "ready" else []
    assert sorted(shown) == expected, f"status says {st_['state']} pid {st_['pid']}; running: {shown}"
    keys = [k for k in (st_.get("api_key"),) if k]
    carrying = {pid: cmd for pid, cmd in shown.items() if "--api-key" in cmd or any(k in a for k in keys for a in cmd)}
    assert not carrying, f"a key in an argv: {carrying}"


@pytest.fixture
def chaos_daemon(daemon, model):
    """The suite's daemon with snapshots on (the default): stops save slots first, so a kill
    lands in the middle of one as it would in real use."""
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    return daemon


@pytest.fixture
def releases(cpu_bundle, tmp_path) -> dict[str, Path]:
    """The two releases an update moves between: the installed CPU bundle, and the same engine
    repacked as the next version (tests/integration/engine_repack.py)."""
    version = bundle_meta_of(cpu_bundle).version
    return {"next": repack(cpu_bundle, tmp_path / "next.zip", version=f"{version}.1"), "back": cpu_bundle}


# STOKER_CHAOS_EXAMPLES draws more examples (a longer local run); CI's default keeps the suite fast.
CHAOS_EXAMPLES = int(os.environ.get("STOKER_CHAOS_EXAMPLES") or 10)


@settings(
    # ~5-9 s each: the suite must stay under 15 minutes on CI's 2 cores (new examples every run)
    max_examples=CHAOS_EXAMPLES,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example runs real processes
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=actions)
def test_chaos_leaves_exactly_the_servers_status_reports(chaos_daemon, model, releases, actions):
    chaos = Chaos(chaos_daemon, model, releases)
    started = time.monotonic()
    chaos_daemon.start()
    try:
        for name, arg in actions:
            getattr(chaos, name)(arg)
        st_ = chaos.settle()
        assert st_["state"] in ("ready", "stopped", "failed")
        # None outlives a daemon that knows it: a shutdown leaves nothing behind.
        chaos_daemon.call("shutdown")
        assert chaos_daemon.proc.wait(30) == 0
        assert server_pids(model) == [], "servers left after shutdown"
        left = {p.pid: p.info["cmdline"] for p in stoker_processes(chaos_daemon)}
        assert not left, f"processes left after shutdown: {left}"
    finally:
        chaos_daemon.stop()  # the next example starts from a stopped daemon (its store kept)
        print(f"{len(actions)} actions in {time.monotonic() - started:.1f} s; updates: {chaos.updates}")


# --- several models under max_loaded, an RPC worker coming and going -----------------------------

FLEET = ["m0", "m1", "m2"]  # three models, two places
FLEET_MAX_LOADED = 2

fleet_commands = st.lists(
    st.tuples(st.sampled_from(["up", "down", "restart"]), st.sampled_from(FLEET)), min_size=1, max_size=4
)
fleet_actions = st.lists(
    st.one_of(
        st.tuples(st.just("clients"), fleet_commands),  # one client per command, all at once
        st.tuples(st.just("kill_daemon"), st.floats(0, 0.3)),  # kill -9 after a delay, start again
        st.tuples(st.just("kill_server"), st.sampled_from(FLEET)),  # kill -9 that model's server
        st.tuples(st.just("worker_goes"), st.none()),  # the worker's host dies (supervisor and server)
        st.tuples(st.just("worker_comes"), st.none()),  # and comes back, on the same address
        st.tuples(st.just("pull_local"), st.sampled_from(FLEET)),  # catalog a model's own file
        st.tuples(st.just("rm"), st.sampled_from(FLEET)),  # and remove it from the catalog
        st.tuples(st.just("wait"), st.floats(0, 1.0)),
    ),
    min_size=2,
    max_size=5,
)


class FleetChaos(Chaos):
    """Chaos over several models and a worker; every action ends at a quiet point, where the
    invariant is checked."""

    def __init__(self, d: DaemonProcess, copies: dict[str, Path], worker: WorkerProcess) -> None:
        super().__init__(d, None)
        self.copies = copies
        self.worker = worker
        self.quiet_points = 0

    def clients(self, commands: list[tuple[str, str]]) -> None:  # type: ignore[override]
        for method, name in commands:
            thread = threading.Thread(target=self._call_model, args=(method, name, random.random() * 0.05))
            thread.start()
            self.threads.append(thread)

    def _call_model(self, method: str, name: str, delay: float) -> None:
        time.sleep(delay)
        started = time.monotonic()
        try:
            with self.d.client(timeout=CALL_TIMEOUT) as c:
                c.call(method, model=name)
        except (StokerError, OSError):
            pass  # refused (placement_no_room, a model failed), or the daemon was killed under it
        if time.monotonic() - started >= CALL_TIMEOUT - 1:
            self.wedged.append(f"{method} {name}")

    def kill_server(self, name: str) -> None:  # type: ignore[override]
        for proc in servers_for(self.copies[name]):
            try:
                proc.kill()
            except Exception:
                pass

    def worker_goes(self, _: None) -> None:
        if self.worker.proc is not None and self.worker.proc.poll() is None:
            self.worker.proc.send_signal(signal.SIGKILL)  # first the supervisor: else it restarts the server
            self.worker.proc.wait(10)
        pid = self.worker.rpc_server_pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def worker_comes(self, _: None) -> None:
        if self.worker.proc is None or self.worker.proc.poll() is not None:
            mark = len(self.worker.text())
            self.worker.start()
            self.worker.wait_serving(60, mark)

    def pull_local(self, name: str) -> None:
        try:
            self.d.call("pull", spec=str(self.copies[name]), name=f"c-{name}")
        except StokerError:
            pass  # already cataloged, or refused with its reason

    def rm(self, name: str) -> None:
        try:
            self.d.call("model.rm", name=f"c-{name}")
        except StokerError:
            pass  # not cataloged

    def settle(self) -> dict:
        for thread in self.threads:
            thread.join(CALL_TIMEOUT + 15)
        assert not any(t.is_alive() for t in self.threads), "a request never got its answer"
        assert not self.wedged, f"requests that hung: {self.wedged}"
        self.threads = []
        gone = [str(path) for path in self.copies.values() if not path.is_file()]
        assert not gone, f"the user's own model files were deleted: {gone}"
        if self.d.proc is None or self.d.proc.poll() is not None:
            self.d.start(wait=False)
        self.d.wait_socket(60)
        models = assert_fleet_matches_status(self.d, self.copies, quiet=1.0)
        ready = [n for n, m in models.items() if m["state"] == "ready"]
        assert len(ready) <= FLEET_MAX_LOADED, f"{len(ready)} loaded over max_loaded {FLEET_MAX_LOADED}: {ready}"
        assert_catalog_matches_files(self.d)
        self.quiet_points += 1
        return models


def assert_catalog_matches_files(d: DaemonProcess) -> None:
    """Every cataloged model's file exists, and every model file in the models directory is cataloged."""
    listed = d.call("model.list")["models"]
    missing = [m["path"] for m in listed if not Path(m["path"]).is_file()]
    assert not missing, f"cataloged models without their file: {missing}"
    cataloged = {os.path.realpath(m["path"]) for m in listed}
    models_dir = d.paths.models_dir
    files = {os.path.realpath(p) for p in models_dir.rglob("*.gguf")} if models_dir.is_dir() else set()
    assert files <= cataloged, f"model files the catalog does not know: {sorted(files - cataloged)}"


@pytest.fixture
def fleet_worker(tmp_path, cpu_bundle):
    """One real RPC worker (`stoker worker`) that the chaos kills and starts again."""
    worker = WorkerProcess(tmp_path / "worker", cpu_bundle).start()
    try:
        worker.wait_serving()
        yield worker
    finally:
        worker.stop()


@pytest.fixture
def fleet_daemon(daemon, model, fleet_worker):
    """The suite's daemon serving three copies of the tiny model, two at a time, over the worker."""
    copies = model_copies(model, FLEET)
    text = (
        fleet_config(model, copies, max_loaded=FLEET_MAX_LOADED) + f'[[workers]]\naddress = "{fleet_worker.address}"\n'
    )
    write_config(daemon.paths, text)
    yield daemon, copies
    daemon.stop()
    leftovers = [p for path in copies.values() for p in servers_for(path)]
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


@settings(
    max_examples=4,  # each action ends at a checked quiet point: about a minute an example on 2 cores
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example runs real processes
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=fleet_actions)
def test_chaos_over_several_models_and_a_worker_leaves_exactly_what_status_reports(fleet_daemon, fleet_worker, actions):
    d, copies = fleet_daemon
    chaos = FleetChaos(d, copies, fleet_worker)
    chaos.worker_comes(None)  # each example starts with the worker up (the last may have ended without it)
    d.start()
    try:
        chaos.settle()
        for name, arg in actions:
            getattr(chaos, name)(arg)
            chaos.settle()
        # None outlives a daemon that knows it: a shutdown leaves nothing behind.
        d.call("shutdown")
        assert d.proc.wait(60) == 0
        left = {name: [p.pid for p in servers_for(path)] for name, path in copies.items()}
        assert not any(left.values()), f"servers left after shutdown: {left}"
        assert chaos.quiet_points == len(actions) + 1
    finally:
        d.stop()  # the next example starts from a stopped daemon (its store kept)
