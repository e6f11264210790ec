"""Stopping a process group: TERM, a grace, KILL, then whatever the leader left behind.

The one way Stoker ends a process it runs (the engine, an rpc-server, a probe, a build) or one
it proved its own (an adopted server, an orphan). A pid is signalled only while it still names
the same process: our own child until it is reaped (the kernel keeps its pid and its group's id
until then), anything else while its pid and start time (and whatever else proves it) match,
pinned by a pidfd between the proof and the signal. Once the leader is gone, the members of its
group born between its start and its end are killed too: a group that reuses the id can only be
born after ours emptied, and its own leader has pid == pgid.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Awaitable, Callable

import attrs
import psutil
import trio

KILL_WAIT = 5.0  # after KILL: how long the kernel may take to end it (a process in D state lingers)
_POLL = 0.05  # how often a process that is not our child is looked at while it ends
# psutil's start time: float seconds since the epoch, from the boot time and start ticks.
_CREATE_TIME_TOLERANCE = 0.01


def live_process(pid: int, create_time: float) -> psutil.Process | None:
    """The process `pid` if it started at `create_time` (the pid not reused since) and has not
    ended (a zombie has); else None."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - create_time) > _CREATE_TIME_TOLERANCE:
            return None
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
    except (psutil.Error, OSError):
        return None
    return proc


@attrs.frozen
class GroupLeader:
    """A process to stop with its group, and what proves it is still the same process."""

    pid: int
    create_time: float | None  # psutil's; None: unknown, so nothing is swept after it ends
    child: trio.Process | None = None  # our own child: waited on, and safe to signal until reaped
    proof: Callable[[], bool] | None = None  # more than pid and start time (an engine's executable)

    @classmethod
    def of_child(cls, process: trio.Process, create_time: float | None = None) -> GroupLeader:
        """Our child, started in a session of its own (its pgid is its pid)."""
        if create_time is None and process.returncode is None:
            try:
                create_time = psutil.Process(process.pid).create_time()
            except (psutil.Error, OSError):
                pass
        return cls(process.pid, create_time, child=process)

    @classmethod
    def of_process(cls, proc: psutil.Process, proof: Callable[[], bool] | None = None) -> GroupLeader:
        """A process that is not our child, as psutil found it (its start time with it)."""
        return cls(proc.pid, proc.create_time(), proof=proof)

    def alive(self) -> bool:
        """Running, not a zombie, and still the process this leader names."""
        if self.child is not None:
            return self.child.returncode is None
        if self.create_time is None or live_process(self.pid, self.create_time) is None:
            return False
        return self.proof is None or self.proof()


def signal_group(leader: GroupLeader, sig: signal.Signals) -> bool:
    """Send `sig` to the leader's group (to the leader alone where it leads none) while it is
    proven the same process; False when it is not, or is gone."""
    if leader.child is not None:
        if leader.child.returncode is not None:  # reaped: its pid may name another process now
            return False
        return _killpg(leader.pid, sig)
    pidfd = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(leader.pid)
        except OSError:
            return False
    try:
        if not leader.alive():
            return False
        try:
            if os.getpgid(leader.pid) == leader.pid:
                return _killpg(leader.pid, sig)  # the proven leader is alive: the pgid is its own
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(leader.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


async def stop_group(leader: GroupLeader, grace: float, *, kill_wait: float = KILL_WAIT) -> bool:
    """TERM to the leader's group, up to `grace` seconds for it to end, KILL, up to `kill_wait`;
    then the members it left behind. Shielded and bounded, so a cancelled caller still stops
    what it started. True when the leader is gone (already gone counts)."""
    with trio.CancelScope(shield=True, deadline=trio.current_time() + grace + 2 * kill_wait):
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_wait)):
            if not signal_group(leader, sig):
                break
            with trio.move_on_after(wait):
                await _ended(leader)
            if not leader.alive():
                break
        gone = not leader.alive()
        if gone:
            kill_stragglers(leader, ended_by=time.time())
    return gone


def stop_on_cancel(grace: float) -> Callable[[trio.Process], Awaitable[None]]:
    """`trio.run_process`'s `deliver_cancel`: the child and its group stopped by `stop_group`."""

    async def deliver(process: trio.Process) -> None:
        await stop_group(GroupLeader.of_child(process), grace)

    return deliver


def kill_stragglers(leader: GroupLeader, ended_by: float) -> None:
    """KILL what is left of the leader's group once it has ended: members that have its pgid,
    are not a group leader themselves, and were born between its start and `ended_by`."""
    if leader.create_time is None:
        return
    for proc in psutil.process_iter(["create_time"]):
        try:
            if (
                proc.pid != leader.pid
                and os.getpgid(proc.pid) == leader.pid
                and leader.create_time <= proc.info["create_time"] <= ended_by
            ):
                proc.send_signal(signal.SIGKILL)  # psutil refuses a pid reused since it was listed
        except (ProcessLookupError, psutil.Error, OSError):
            continue


async def _ended(leader: GroupLeader) -> None:
    if leader.child is not None:
        await leader.child.wait()
        return
    while leader.alive():
        await trio.sleep(_POLL)


def _killpg(pgid: int, sig: signal.Signals) -> bool:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
