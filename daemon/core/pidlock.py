"""One process per data directory: an exclusive flock on a lock file, held for the process's life.

The daemon (`acquire_lock`) and `stoker worker` each take one; the kernel drops it with the
process, so a killed holder never leaves a stale lock. The holder writes its pid in the file, and
the next process refused reads it back to say who holds it; each caller words that refusal.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

log = logging.getLogger("stoker")


class LockHeld(Exception):
    """Another process holds the lock; `holder` is the pid it wrote there ('' where none)."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


def take_pid_lock(path: Path) -> int:
    """An exclusive flock on `path` (made 0600, its folder 0700), taken without waiting: the
    descriptor to keep open. LockHeld where another process holds it; OSError where the file
    cannot be made."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 64).decode(errors="replace").strip()
        os.close(fd)
        raise LockHeld(holder) from None
    return fd


def write_pid(fd: int) -> None:
    """Record this process's pid in the lock file it holds (what the next one refused reads)."""
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())


def data_dir_unwritable(path: Path, exc: OSError) -> StokerError:
    """data_dir_unwritable, in the words of the error that refused it."""
    why = exc.strerror or str(exc)
    return StokerError(
        ReasonCode.DATA_DIR_UNWRITABLE,
        f"The daemon cannot write {path} ({why}); free space on that disk or fix its permissions, then start "
        f"the daemon again.",
        {"path": str(path), "error": f"{type(exc).__name__}: {why}"},
    )


def acquire_lock(path: Path) -> int:
    """Hold an exclusive flock on `path` for the daemon's life; refuse if another holds it."""
    try:
        fd = take_pid_lock(path)
    except LockHeld as held:
        raise StokerError(
            ReasonCode.DAEMON_ALREADY_RUNNING,
            f"Another Stoker daemon (pid {held.holder or '?'}) already runs for {path.parent}; "
            f"use `stoker status`, or `stoker shutdown` to stop it.",
            {"pid": held.holder, "lock": str(path)},
        ) from None
    except OSError as exc:
        raise data_dir_unwritable(path, exc) from None
    try:
        write_pid(fd)
    except OSError as exc:  # a full disk: the lock holds without the pid written in it
        log.warning("cannot record the daemon's pid in %s: %s", path, exc)
    return fd
