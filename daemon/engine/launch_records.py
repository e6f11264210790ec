"""The record an engine run leaves before it can outlive whoever started it, and the sweep that
ends what a dead starter left.

A smoke run (the install's and `bundle verify`'s smoke gate, an engine update's comparison of the
old engine) starts llama-server in a session of its own, from a worker thread of the daemon or
from a CLI command. A daemon killed with -9 mid-run leaves that server running, holding a port,
with nothing to stop it. So before the spawn a launch directory is made for it (mkdtemp, 0700,
under the runtime dir's `smoke/`), holding:

    owner.json  the pid and start time of the process that started it (the daemon, or a CLI)
    api-key     the run's key (0600): the server reads it with `--api-key-file`, so the key
                never appears in an argv, and the path, a token only Stoker made, does
    cwd/        the server's empty working directory
    process.json  the server's pid and start time, written right after the spawn

Whatever runs from a directory is found by its recorded identity (pid and start time, while its
command line still names the directory's key file) or, killed between the spawn and that write,
by the key file's path in its command line. `stop_abandoned` runs at daemon start (directories
whose owner is gone) and at its shutdown (its own): each server is stopped with its group
(daemon/core/process_group.py) and its directory removed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import psutil
import trio

from stoker.daemon.core.process_group import GroupLeader, live_process, stop_group
from stoker.daemon.engine.orphans import KEY_FILE, launched_from

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
PROCESS_FILE = "process.json"
SMOKE_PREFIX = "smoke-"


def smoke_root(runtime_dir: Path) -> Path:
    """Where smoke runs' launch directories are made."""
    return Path(runtime_dir) / "smoke"


def _identity(pid: int) -> dict[str, Any]:
    return {"pid": pid, "create_time": psutil.Process(pid).create_time()}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def _read_identity(path: Path) -> tuple[int, float] | None:
    try:
        data = json.loads(path.read_text())
        return int(data["pid"]), float(data["create_time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@attrs.frozen
class LaunchRecord:
    """One run's launch directory (see the module's docstring)."""

    directory: Path

    @classmethod
    def create(cls, root: Path) -> LaunchRecord:
        """A fresh directory under `root`, its owner (this process) recorded, before any spawn."""
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        directory = Path(tempfile.mkdtemp(prefix=SMOKE_PREFIX, dir=root))
        _write_json(directory / OWNER_FILE, _identity(os.getpid()))
        (directory / "cwd").mkdir(mode=0o700)
        return cls(directory)

    @property
    def key_file(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def cwd(self) -> Path:
        return self.directory / "cwd"

    def write_key(self) -> str:
        """A new key in the 0600 key file the server is pointed at; the key itself."""
        key = secrets.token_hex(16)
        fd = os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return key

    def record_process(self, pid: int) -> None:
        """The spawned server's identity, for the sweep to prove it by (best effort: without it
        the key file's path in its command line still finds it)."""
        try:
            _write_json(self.directory / PROCESS_FILE, _identity(pid))
        except (OSError, psutil.Error):
            pass

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def _owner_state(directory: Path) -> str:
    """`mine`, `alive` (another live process) or `gone` (dead, or never recorded: nothing spawned)."""
    owner = _read_identity(directory / OWNER_FILE)
    if owner is None:
        return "gone"
    pid, create_time = owner
    if live_process(pid, create_time) is None:
        return "gone"
    return "mine" if pid == os.getpid() else "alive"


def launched(directory: Path) -> list[psutil.Process]:
    """The live processes run from `directory`: its recorded server, and any whose command line
    names its key file."""
    token = str(directory / KEY_FILE)
    found = {p.pid: p for p in launched_from(directory)}
    recorded = _read_identity(directory / PROCESS_FILE)
    if recorded is not None:
        proc = live_process(*recorded)
        try:
            if proc is not None and token in proc.cmdline():
                found.setdefault(proc.pid, proc)
        except (psutil.Error, OSError):
            pass
    return list(found.values())


async def stop_abandoned(root: Path, grace: float, *, mine: bool = False) -> list[int]:
    """Stop what runs from the launch directories under `root` whose owner is gone (`mine`: this
    process's own, at its shutdown), remove those directories; the pids stopped."""
    try:
        dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith(SMOKE_PREFIX)]
    except OSError:
        return []
    stopped: list[int] = []
    for directory in dirs:
        owner = await trio.to_thread.run_sync(_owner_state, directory)
        if owner != ("mine" if mine else "gone"):
            continue
        token = str(directory / KEY_FILE)
        for proc in await trio.to_thread.run_sync(launched, directory):
            try:
                leader = GroupLeader.of_process(proc, proof=functools.partial(_names, proc, token))
            except (psutil.Error, OSError):
                continue  # gone meanwhile
            log.warning("stopping engine pid %d: a smoke run from %s that its starter left", proc.pid, directory)
            await stop_group(leader, grace)
            stopped.append(proc.pid)
        if not await trio.to_thread.run_sync(launched, directory):
            shutil.rmtree(directory, ignore_errors=True)
    return stopped


def _names(proc: psutil.Process, token: str) -> bool:
    try:
        return token in proc.cmdline()
    except (psutil.Error, OSError):
        return False
