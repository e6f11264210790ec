"""How a CLI command that changes Stoker's state runs: through the running daemon when there
is one, else in this process while holding the daemon's lock (so that none starts meanwhile
and works on the same rows)."""

from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

T = TypeVar("T")

# A daemon that holds the lock may not have opened its socket yet: how long to keep asking.
SOCKET_WAIT_S = 30.0


def through_daemon_or_here(paths: StokerPaths, *, here: Callable[[], T], through_daemon: Callable[[], T]) -> T:
    """`here()` under the daemon's lock when no daemon runs, else `through_daemon()`; a daemon
    that is starting (lock held, socket not open yet) or gone meanwhile is asked again."""
    from stoker.daemon.core.pidlock import acquire_lock

    deadline = time.monotonic() + SOCKET_WAIT_S
    while True:
        try:
            lock = acquire_lock(paths.lock_file)
        except StokerError as err:
            if err.reason != ReasonCode.DAEMON_ALREADY_RUNNING:
                raise
        else:
            try:
                return here()
            finally:
                os.close(lock)
        try:
            return through_daemon()
        except StokerError as unanswered:
            if unanswered.reason != ReasonCode.DAEMON_NOT_RUNNING or time.monotonic() > deadline:
                raise
        time.sleep(0.2)
