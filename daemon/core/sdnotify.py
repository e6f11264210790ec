"""sd_notify: tell systemd (or anything listening on $NOTIFY_SOCKET) how the daemon is doing.

Every function is a no-op returning False when NOTIFY_SOCKET is unset, and never raises: a
notification that cannot be delivered is logged, the daemon carries on.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Mapping

import trio

log = logging.getLogger(__name__)


def _address(environ: Mapping[str, str]) -> str | None:
    value = environ.get("NOTIFY_SOCKET")
    if not value:
        return None
    if value.startswith("@"):
        return "\0" + value[1:]  # an abstract socket
    return value


def notify(state: str, *, environ: Mapping[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1", newline-separated assignments) to $NOTIFY_SOCKET."""
    address = _address(os.environ if environ is None else environ)
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(1.0)
            sock.sendto(state.encode("utf-8"), address)
    except OSError as err:
        log.warning("sd_notify %r to %r failed: %s", state, address.replace("\0", "@"), err)
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    """READY=1: start-up is complete (the server answers)."""
    return notify("READY=1" + (f"\nSTATUS={_one_line(status_text)}" if status_text else ""))


def stopping(status_text: str | None = None) -> bool:
    """STOPPING=1: the daemon is shutting down."""
    return notify("STOPPING=1" + (f"\nSTATUS={_one_line(status_text)}" if status_text else ""))


def watchdog() -> bool:
    """WATCHDOG=1: the daemon's loop is alive."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """STATUS=...: one line for `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between pings systemd expects (WATCHDOG_USEC), or None if not for this process."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC")
    if not usec:
        return None
    pid = env.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 if value > 0 else None


async def serve_watchdog(*, task_status: trio.TaskStatus[float | None] = trio.TASK_STATUS_IGNORED) -> None:
    """Ping WATCHDOG=1 at half the interval systemd asks for; returns at once if it asks none.

    The pings come from the trio loop, so a wedged loop stops them and systemd notices.
    """
    interval = watchdog_interval()
    task_status.started(interval)
    if interval is None:
        return
    while True:
        watchdog()
        await trio.sleep(interval / 2)
