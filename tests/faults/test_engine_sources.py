"""Fault: the daemon stops, or is killed, while it builds its engine (docs/reliability.md, "Where
the engine comes from"). The build is a child process in its own group (daemon/install/sources.py): a
cancelled install must kill it with cmake and whatever cmake started, and free the builder's
lock for the next build. Checked to fail with trio's default deliver_cancel (the child alone
killed: cmake's own child kept running).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from typing import Callable

import psutil
import trio

from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.launch_records import runs_root, stop_abandoned
from stoker.daemon.install.sources import run_build
from tests.integration.test_engine_sources import FAKE_CMAKE, FAKE_MAIN
from tests.waits import until


def slow_source(tmp_path, monkeypatch, marker: str) -> Callable[[], list[psutil.Process]]:
    """An engine source whose cmake configure runs `sleep MARKER`, as the daemon's build source;
    the sleeping processes it leaves, found by their command line."""
    tree = tmp_path / "slow"
    tree.mkdir()
    (tree / "main.c").write_text(FAKE_MAIN)
    (tree / "CMakeLists.txt").write_text(f"execute_process(COMMAND sleep {marker})\n" + FAKE_CMAKE)
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("STOKER_BUILD_SOURCE", f"dir:{tree}#build=7&commit=slow")

    def sleepers() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]

    return sleepers


async def test_a_build_cancelled_with_the_daemon_leaves_no_process_and_no_lock(tmp_path, monkeypatch):
    marker = f"{os.getpid() % 1000 + 3000}"  # a sleep no one else runs
    sleepers = slow_source(tmp_path, monkeypatch, marker)

    building = trio.Event()

    def progress(fig: dict) -> None:
        if fig["line"].startswith("building cpu-compat"):
            building.set()

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_build, "cpu", "compat", progress)
            await building.wait()
            await until(sleepers, timeout=60, what="cmake configuring (its child sleeps)")
            nursery.cancel_scope.cancel()  # what a daemon's shutdown does to its installs
    await until(
        lambda: sleepers() == [],
        timeout=10,
        what="the build's process group to be killed",
        detail=lambda: f"{sleepers()}",
    )
    locks = sorted((tmp_path / "cache" / "builds").glob(".*.lock"))
    assert locks, "the build took no lock"
    for path in locks:
        with open(path, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the next build is not blocked


async def test_two_engines_build_side_by_side_and_one_recipe_once(tmp_path, monkeypatch):
    """The CPU engine a first run serves with is not queued behind a GPU engine built beside
    it: builds of two recipes run at once; a second build of the same recipe waits for the
    first and finds it built."""
    marker = f"{os.getpid() % 1000 + 5000}"  # a sleep no one else runs
    sleepers = slow_source(tmp_path, monkeypatch, marker)

    said: list[str] = []
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for variant in ("compat", "avx2", "compat"):
                nursery.start_soon(run_build, "cpu", variant, lambda fig: said.append(fig["line"]))
            await until(lambda: len(sleepers()) == 2, timeout=60, what="both recipes configuring at once")
            await until(
                lambda: "the same engine build is running; waiting for it" in said,
                timeout=30,
                what="the second compat build to wait",
                detail=lambda: f"{said}",
            )
            assert len(sleepers()) == 2  # not three: one recipe builds once
            nursery.cancel_scope.cancel()
    await until(lambda: sleepers() == [], timeout=10, what="the builds' process groups to be killed")


async def test_a_build_whose_starter_was_killed_is_ended_by_the_next_daemon(tmp_path, monkeypatch):
    """The process that started a build (a daemon's install) is killed with -9 while cmake runs:
    the build goes on in its own session. What the next daemon runs first at its start,
    `stop_abandoned` over its runtime dir's launch records, ends it, cmake's child included."""
    marker = f"{os.getpid() % 1000 + 4000}"  # a sleep no one else runs
    monkeypatch.setenv("STOKER_HOME", str(tmp_path / "home"))
    sleepers = slow_source(tmp_path, monkeypatch, marker)

    code = (
        "import trio; from stoker.daemon.install.sources import run_build; trio.run(run_build, 'cpu', 'compat', print)"
    )
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        with trio.fail_after(120):
            await until(sleepers, timeout=90, what="cmake configuring (its child sleeps)")
    finally:
        starter.kill()
        starter.wait()
    assert sleepers(), "the build outlives its starter"
    with trio.fail_after(60):
        stopped = await stop_abandoned(runs_root(StokerPaths.from_env().runtime_dir), grace=2.0)
    assert stopped
    await until(lambda: sleepers() == [], timeout=10, what="the build ended", detail=lambda: f"{sleepers()}")
    assert not list(runs_root(StokerPaths.from_env().runtime_dir).iterdir())
