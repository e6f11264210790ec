"""Fault: the daemon stops while it builds its engine (docs/reliability.md, "Where the engine
comes from"). The build is a child process in its own group (daemon/install/sources.py): a
cancelled install must kill it with cmake and whatever cmake started, and free the builder's
lock for the next build. Checked to fail with trio's default deliver_cancel (the child alone
killed: cmake's own child kept running).
"""

from __future__ import annotations

import fcntl
import os

import psutil
import trio

from stoker.daemon.install.sources import run_build
from tests.integration.test_engine_sources import FAKE_CMAKE, FAKE_MAIN
from tests.waits import until


async def test_a_build_cancelled_with_the_daemon_leaves_no_process_and_no_lock(tmp_path, monkeypatch):
    marker = f"{os.getpid() % 1000 + 3000}"  # a sleep no one else runs
    tree = tmp_path / "slow"
    tree.mkdir()
    (tree / "main.c").write_text(FAKE_MAIN)
    (tree / "CMakeLists.txt").write_text(f"execute_process(COMMAND sleep {marker})\n" + FAKE_CMAKE)
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("STOKER_BUILD_SOURCE", f"dir:{tree}#build=7&commit=slow")

    def sleepers() -> list[psutil.Process]:
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]

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
    with open(tmp_path / "cache" / "builds" / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: the next build is not blocked
