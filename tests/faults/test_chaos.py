"""Chaos over the real daemon: random commands from several clients, kill -9 of the daemon and
of the server at random points, restarts. Whatever happened, once the daemon settles exactly
the servers `status` reports exist, and after a shutdown none is left without a daemon that
knows it.

One daemon home for the whole run (its store carries over from example to example, so later
examples start from whatever the earlier ones left in it); the tiny model; a small
max_examples and no shrinking, so that it fits in about a minute of CI (each CI run draws new
examples). A failure prints the sequence of actions that led to it.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from stoker.daemon.core.errors import StokerError
from tests.faults.test_servers import assert_exactly_what_status_reports, server_pids
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config

pytestmark = [pytest.mark.engine, pytest.mark.slow]

CALL_TIMEOUT = 45.0  # a request not answered in this long is a wedged daemon

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
    ),
    min_size=2,
    max_size=7,
)


class Chaos:
    """Runs one example's actions against a daemon; collects what no request may do."""

    def __init__(self, d: DaemonProcess, model) -> None:
        self.d = d
        self.model = model
        self.threads: list[threading.Thread] = []
        self.wedged: list[str] = []

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
            thread.join(CALL_TIMEOUT + 15)
        assert not any(t.is_alive() for t in self.threads), "a request never got its answer"
        assert not self.wedged, f"requests that hung: {self.wedged}"
        if self.d.proc is None or self.d.proc.poll() is not None:
            self.d.start(wait=False)
        self.d.wait_socket(60)
        return assert_exactly_what_status_reports(self.d, self.model, quiet=1.5)


@pytest.fixture
def chaos_daemon(daemon, model):
    """The suite's daemon with snapshots on (the default): stops save slots first, so a kill
    lands in the middle of one as it would in real use."""
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    return daemon


@settings(
    max_examples=10,  # ~5 s each: the suite must stay under 15 minutes on CI's 2 cores (new examples every run)
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: each example runs real processes
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(actions=actions)
def test_chaos_leaves_exactly_the_servers_status_reports(chaos_daemon, model, actions):
    chaos = Chaos(chaos_daemon, model)
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
    finally:
        chaos_daemon.stop()  # the next example starts from a stopped daemon (its store kept)
