"""Proving that a running llama-server is ours, adopting it, and stopping an orphan safely.

A server outlives a daemon killed with -9. The next daemon reads the identity record it left
and adopts the server only if every check passes: same pid, same start time and executable
(psutil), `/health` answers on the recorded port, and an authenticated request succeeds with
the recorded API key and fails without it. An orphan is signalled only when pid, start time
and executable match: a reused pid is never signalled.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Sequence

import attrs
import httpx
import psutil
import trio

from stoker.daemon.core.process_group import GroupLeader, live_process, stop_group
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.exits import classify_exit
from stoker.states.convert import structure
from stoker.states.reasons import ReasonCode


@attrs.frozen
class ServerIdentity:
    """What the daemon records about a server it started (runtime file, mode 0600)."""

    pid: int
    pgid: int
    create_time: float
    exe: str
    cmdline_sha256: str
    host: str
    port: int | None
    api_key: str
    log_path: str
    started_at: float
    launch_dir: str | None = None
    # The executable's file identity (`dev:ino`, `exe_file`): it proves the binary after its
    # bundle's directory was renamed under it (an engine update moves the slot to `.previous`
    # while the server runs), where the path no longer does. None: recorded before, or no /proc.
    exe_file: str | None = None

    def to_json(self) -> str:
        """The record as JSON (what `write_identity` stores)."""
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "ServerIdentity":
        """Parse a stored record; unknown keys are ignored, a missing one raises MissingFields."""
        return structure(json.loads(text), cls)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def cmdline_digest(argv: Sequence[str]) -> str:
    """sha256 of the argv joined by NULs, as /proc/PID/cmdline holds it."""
    return hashlib.sha256("\0".join(argv).encode()).hexdigest()


def live_exe(proc: psutil.Process) -> str | None:
    """The executable's path; a binary replaced on disk reads as 'PATH (deleted)'."""
    try:
        exe = proc.exe()
    except (psutil.Error, OSError):
        return None
    return exe.removesuffix(" (deleted)") if exe else None


def exe_file(pid: int) -> str | None:
    """The running executable's file identity, `dev:ino` (through /proc/PID/exe, which names
    the file the process runs whatever became of its path); None where /proc cannot say."""
    try:
        st = os.stat(f"/proc/{pid}/exe")
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def write_identity(path: Path, ident: ServerIdentity) -> None:
    """Write the record atomically, mode 0600 (it holds the API key)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=".identity-", dir=path.parent)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(ident.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_identity(path: Path) -> ServerIdentity | None:
    """The recorded identity, or None when the file is missing or unreadable (nothing proven)."""
    try:
        return ServerIdentity.from_json(Path(path).read_text())
    except (OSError, ValueError, TypeError):
        return None


def matching_process(ident: ServerIdentity) -> psutil.Process | None:
    """The live process that has the record's pid, start time and executable, else None."""
    proc = live_process(ident.pid, ident.create_time)
    if proc is None:
        return None
    if live_exe(proc) != ident.exe and (ident.exe_file is None or exe_file(ident.pid) != ident.exe_file):
        return None  # another executable (the same file moved with its bundle's directory still proves it)
    return proc


async def verify_identity(ident: ServerIdentity) -> bool:
    """True only if the process is ours and its HTTP server proves it holds our API key."""
    await trio.lowlevel.checkpoint()
    proc = matching_process(ident)
    if proc is None or ident.port is None:
        return False
    try:
        if cmdline_digest(proc.cmdline()) != ident.cmdline_sha256:
            return False
    except (psutil.Error, OSError):
        return False
    return await _http_proof(ident)


async def _http_proof(ident: ServerIdentity) -> bool:
    try:
        async with EngineClient.open(ident.base_url, ident.api_key, timeout=3.0) as engine:
            if (await engine.health()).status_code != 200:
                return False
            if (await engine.props(with_key=False)).status_code != 401:
                return False
            return (await engine.props()).status_code == 200
    except httpx.HTTPError:
        return False


@attrs.define(eq=False)
class AdoptedServer:
    """A proven server from a previous daemon: not our child, so its exit is polled."""

    identity: ServerIdentity

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def base_url(self) -> str:
        return self.identity.base_url

    @property
    def api_key(self) -> str:
        return self.identity.api_key

    def is_running(self) -> bool:
        """True while the recorded process (pid, start time, exe) is alive and not a zombie."""
        return matching_process(self.identity) is not None

    async def wait_exit(self, poll: float = 0.5) -> tuple[ReasonCode, dict[str, Any]]:
        """Block until it is gone; classified from its log alone (the exit status is not ours)."""
        while self.is_running():
            await trio.sleep(poll)
        reason, evidence = classify_exit(None, _log_tail(Path(self.identity.log_path)))
        evidence["log_path"] = self.identity.log_path
        return reason, evidence

    async def stop(self, grace: float) -> bool:
        """`stop_orphan` for this server; False if it could no longer be proven ours."""
        return await stop_orphan(self.identity, grace)


async def adopt(ident: ServerIdentity) -> AdoptedServer | None:
    """An `AdoptedServer` if the identity is proven, else None (the caller stops or ignores it)."""
    return AdoptedServer(ident) if await verify_identity(ident) else None


async def stop_orphan(ident: ServerIdentity, grace: float) -> bool:
    """TERM, grace, KILL a proven process (pid + start time + exe); False if nothing was proven."""
    if matching_process(ident) is None:
        await trio.lowlevel.checkpoint()
        return False
    await stop_group(
        GroupLeader(ident.pid, ident.create_time, proof=lambda: matching_process(ident) is not None), grace
    )
    if ident.launch_dir and matching_process(ident) is None:
        shutil.rmtree(ident.launch_dir, ignore_errors=True)
    return True


def _log_tail(path: Path, max_bytes: int = 64 * 1024) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
            return f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []
