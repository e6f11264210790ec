"""The daemon's open-files limit: raised at start so that many clients fit.

Each front door connection holds a file descriptor, and so does every control client; a soft
RLIMIT_NOFILE of 1024 (a shell's usual default) would leave a daemon with 1000 idle clients
unable to accept `stoker status`. The soft limit is raised to the hard one, which any process
may do without privileges (systemd's own advice for services that use epoll, as trio does).
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("stoker.daemon")

# Where the hard limit is unlimited (macOS), a soft limit the kernel is sure to accept
# (macOS refuses RLIM_INFINITY and anything past OPEN_MAX, 10240).
UNLIMITED_TARGET = 10240


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE towards the hard one; the (before, after) soft limits."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft == resource.RLIM_INFINITY or soft >= target:
        log.info("open files limit %s (hard %s): kept", soft, hard)
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("open files limit %d kept: raising it to %d failed (%s)", soft, target, exc)
        return soft, soft
    log.info("open files limit raised from %d to %d (the hard limit %s)", soft, target, hard)
    return soft, target
