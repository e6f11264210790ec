"""What Stoker keeps is its user's alone: KV snapshots hold whole conversations (token ids that
another user could decode back to text), the database and the logs hold their traces.

Data, log, snapshot and runtime directories are 0700 and their files 0600: created so from the
start (the daemon runs with umask 077, which llama-server inherits for the slot files it
writes), and tightened at start-up when an older Stoker left them open.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from stoker.daemon.core.paths import StokerPaths
from tests.integration.daemon_harness import tiny_config, write_config

PRIVATE_TREES = ("logs", "snapshots")  # under the data dir, checked all the way down


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def open_to_others(paths: StokerPaths) -> list[str]:
    """Every private directory or file that group or others can read: what must not exist."""
    found = []
    candidates = [paths.data_dir, *paths.data_dir.iterdir()]  # the data dir's own files
    for tree in (*(paths.data_dir / t for t in PRIVATE_TREES), paths.runtime_dir):
        candidates += [tree, *tree.rglob("*")]
    for path in candidates:
        if path.is_symlink() or (path.is_dir() and path.parent == paths.data_dir and path.name not in PRIVATE_TREES):
            continue  # bundles/ and models/ hold no conversation; the 0700 data dir covers them
        if mode(path) & 0o077:
            found.append(f"{path} {oct(mode(path))}")
    return found


@pytest.fixture
def loose_umask():
    """A common desktop umask (022): what is private must not depend on the caller's."""
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.engine
def test_snapshots_database_and_logs_are_private_from_the_start(daemon, model, loose_umask):
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    d = daemon.start()
    st = d.wait_state("ready")
    from tests.integration.test_snapshots import PROMPT, Engine

    eng = Engine(st)
    eng.complete(eng.tokenize(PROMPT), 8)
    saved = d.call("snapshot.save")["saved"]
    snapshot = d.paths.snapshots_dir / saved[0]["filename"]
    assert snapshot.stat().st_size > 0 and mode(snapshot) == 0o600
    for path in (d.paths.data_dir, d.paths.logs_dir, d.paths.snapshots_dir, d.paths.runtime_dir):
        assert mode(path) == 0o700, path
    for path in (d.paths.db_file, Path(f"{d.paths.db_file}-wal"), d.paths.logs_dir / "llama-server.log"):
        assert mode(path) == 0o600, path
    assert open_to_others(d.paths) == []


@pytest.mark.engine
def test_what_an_older_stoker_left_open_is_tightened_at_start_up(daemon, model, loose_umask):
    paths = daemon.paths
    for directory in (paths.data_dir, paths.logs_dir, paths.snapshots_dir, paths.runtime_dir):
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o755)
    old_snapshot = paths.snapshots_dir / "slot-0-old.bin"
    old_snapshot.write_bytes(b"qsgg" + b"\0" * 64)
    old_log = paths.logs_dir / "llama-server.log.1"
    old_log.write_text("a conversation's trace\n")
    for path in (old_snapshot, old_log):
        os.chmod(path, 0o644)
    d = daemon.start()
    d.wait_state("ready")
    assert mode(paths.snapshots_dir) == mode(paths.data_dir) == 0o700
    assert mode(old_snapshot) == mode(old_log) == 0o600
    assert open_to_others(paths) == []


def test_the_default_data_dir_is_private(tmp_path, monkeypatch, loose_umask):
    """Without STOKER_HOME: the platform's user dirs (XDG here), created 0700 by the daemon."""
    monkeypatch.delenv("STOKER_HOME")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "share"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    (tmp_path / "run").mkdir(mode=0o700)
    paths = StokerPaths.from_env()
    assert paths.data_dir == tmp_path / "share" / "stoker"
    paths.make_private()
    for path in paths.private_dirs:
        assert mode(path) == 0o700, path


def test_the_state_database_is_created_private_and_an_open_one_tightened(tmp_path, loose_umask):
    from stoker.store import open_store

    path = tmp_path / "data" / "stoker.db"
    store = open_store(path)
    store.db.execute("create table t(x)")  # something in the WAL
    assert mode(path.parent) == 0o700
    assert mode(path) == mode(Path(f"{path}-wal")) == mode(Path(f"{path}-shm")) == 0o600
    store.close()
    os.chmod(path, 0o644)
    open_store(path).close()
    assert mode(path) == 0o600
