"""`stoker daemon` in the foreground: its logs, its umask, and how a refusal to run is said.

A refusal prints one line, `error [reason]: sentence`, with the reason that stopped it, whether
it came straight from start-up or wrapped in trio's exception groups by the service that raised
it (a 70-line ExceptionGroup traceback before); only a bug (no reason code) logs a traceback.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sys
from pathlib import Path

import setproctitle
import trio

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.logfiles import DaemonLogHandler
from stoker.daemon.core.openfiles import raise_open_files_limit
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.pidlock import data_dir_unwritable
from stoker.daemon.start import load_initial_config, log, run_daemon
from stoker.states.reasons import ReasonCode, ReasonedError


def _setup_logging(paths: StokerPaths, log_level: str) -> None:
    """logs/daemon.log, rotated as `[logs]` says, and stderr: everything on a terminal, in the
    journal or at debug level; elsewhere (a file that `stoker run` points it to, which nothing
    rotates) only warnings and errors, the file having the rest."""
    logging.basicConfig(
        level=getattr(logging, log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # Per-request lines from the HTTP client would drown the daemon's own story.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config, _problems = load_initial_config(paths)
    try:
        handler = DaemonLogHandler(paths.logs_dir / "daemon.log", config.logs.rotation)
    except OSError as exc:
        log.warning("no daemon log file: %s", exc)
        return
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    console_is_read = sys.stderr.isatty() or "JOURNAL_STREAM" in os.environ or log_level == "debug"
    if not console_is_read:
        for existing in root.handlers:
            existing.setLevel(logging.WARNING)
    root.addHandler(handler)


# OSErrors that mean the disk or the directory refuses the daemon's files, not a bug.
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EIO}


def refusal_of(exc: BaseException, paths: StokerPaths) -> ReasonedError | None:
    """The reason-coded error that stopped the daemon, found inside trio's exception groups
    (a service that failed at start-up arrives wrapped in one per nursery); None for a bug."""
    if isinstance(exc, ReasonedError):
        return exc
    if isinstance(exc, OSError) and exc.errno in _DISK_ERRNOS:
        return data_dir_unwritable(Path(exc.filename) if exc.filename else paths.data_dir, exc)
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = refusal_of(inner, paths)
            if found is not None:
                return found
    return None


def run_foreground(paths: StokerPaths, *, log_level: str = "info", load_default: bool = True) -> int:
    """`stoker daemon`: run in the foreground; the exit code says why it stopped.

    What it creates is its user's alone (umask 077: the server's snapshots and logs included).
    A refusal prints one line, `error [reason]: sentence`, and logs it without a traceback; only
    a bug (no reason code) logs its traceback, and prints one line saying so.
    """
    # `ps` and `pgrep stoker` show the daemon by its name rather than `python -m ...`.
    setproctitle.setproctitle("stoker daemon")
    os.umask(0o077)
    try:
        paths.make_private()
    except OSError:
        pass  # run_daemon says why, with its reason
    _setup_logging(paths, log_level)
    raise_open_files_limit()  # many front door clients, and `stoker status` still answered
    try:
        trio.run(functools.partial(run_daemon, paths, load_default=load_default))
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        err = refusal_of(exc, paths)
        if err is None:
            log.error("the daemon stopped on an internal error", exc_info=exc)
            err = StokerError(ReasonCode.INTERNAL_ERROR, evidence={"error": f"{type(exc).__name__}: {exc}"})
        else:
            log.error("%s: %s", err.reason, err.message)
        print(f"error [{err.reason}]: {err.message}", file=sys.stdout, flush=True)
        return 1
    return 0
