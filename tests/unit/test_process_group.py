"""The one process-group stop (daemon/core/process_group.py), against real processes."""

from __future__ import annotations

import os
import signal
import subprocess

import psutil
import trio

from stoker.daemon.core.process_group import GroupLeader, signal_group, stop_group

# The leader ends on TERM; the member it started ignores TERM (an ignored signal survives exec).
LEAVES_A_MEMBER = "(trap '' TERM; echo armed; exec sleep 60) & echo $!; wait"


async def spawn(script: str, lines: int = 1) -> tuple[trio.Process, list[str]]:
    """`sh -c script` in a session of its own, once it has printed `lines` lines; those lines."""
    process = await trio.lowlevel.open_process(
        ["sh", "-c", script], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True
    )
    assert process.stdout is not None
    line = b""
    with trio.fail_after(10):  # waiting for the script's lines (its traps are set by then)
        while line.count(b"\n") < lines:
            line += await process.stdout.receive_some(64)
    return process, line.decode().split()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_gone(pid: int) -> None:
    with trio.fail_after(10):  # waiting for the member to end
        while not gone(pid):
            await trio.sleep(0.01)


async def test_a_child_that_ends_on_term_leaves_no_member_of_its_group_behind():
    process, said = await spawn(LEAVES_A_MEMBER, lines=2)
    member = int(next(word for word in said if word.isdigit()))
    assert not gone(member)
    with trio.fail_after(20):
        assert await stop_group(GroupLeader.of_child(process), grace=5.0)
    assert process.returncode == -signal.SIGTERM
    await wait_gone(member)


async def test_a_child_that_ignores_term_is_killed_after_the_grace():
    process, _ = await spawn("trap '' TERM; echo ready; while :; do sleep 0.05; done")
    with trio.fail_after(20):
        assert await stop_group(GroupLeader.of_child(process), grace=0.3)
    assert process.returncode == -signal.SIGKILL


async def test_a_process_that_is_not_our_child_is_stopped_with_its_group_while_proven():
    process, said = await spawn(LEAVES_A_MEMBER, lines=2)
    member = int(next(word for word in said if word.isdigit()))
    leader = GroupLeader.of_process(psutil.Process(process.pid))
    with trio.fail_after(20):
        assert await stop_group(leader, grace=5.0)
    await wait_gone(member)
    await process.wait()


async def test_a_pid_that_names_another_process_now_is_never_signalled():
    # This test's own pid with another start time: a reused pid. A signal would end the test run.
    reused = GroupLeader(os.getpid(), psutil.Process().create_time() - 60.0)
    assert not signal_group(reused, signal.SIGTERM)
    assert not GroupLeader(os.getpid(), psutil.Process().create_time(), proof=lambda: False).alive()
    with trio.fail_after(5):
        assert await stop_group(reused, grace=1.0)  # nothing of it is left to stop


async def test_a_reaped_child_is_never_signalled_again():
    process, _ = await spawn("echo ready; exit 3")
    await process.wait()
    assert not signal_group(GroupLeader.of_child(process), signal.SIGKILL)
