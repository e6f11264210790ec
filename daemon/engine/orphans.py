"""Servers whose identity was never recorded: found by their launch directory, and stopped.

A daemon killed with -9 between spawning llama-server and writing its identity file (or
whose record a later launch overwrote) leaves a server that no identity file names. Its
launch directory is still there: `serve_server` creates it (mkdtemp, 0700, in the runtime
dir) before the spawn and removes it only after the server is gone, and the server's own
command line names the key file inside it (`--api-key-file <launch dir>/api-key`). That path
is a token only Stoker made, so a process whose argv carries it is ours: the chaos test
found one such server living beside the one `status` reported.

`stop_unrecorded` runs once at daemon start, after the identity file has been proven and
before anything is spawned: every launch directory but the adopted server's is stale, and
whatever runs from it is stopped (TERM to its process group, grace, KILL) and the directory
removed.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import trio

from stoker.daemon.core.launch_records import launched_from
from stoker.daemon.core.process_group import GroupLeader, stop_group

log = logging.getLogger(__name__)


async def stop_unrecorded(launch_root: Path, keep: Path | None, grace: float) -> list[int]:
    """Stop every server launched from a directory under `launch_root` other than `keep`,
    remove those directories, and return the pids that were stopped."""
    try:
        stale = [d for d in launch_root.iterdir() if d.is_dir() and d.name.startswith("server-")]
    except OSError:
        return []
    keep_path = keep.resolve() if keep is not None else None
    stopped: list[int] = []
    for launch_dir in stale:
        if keep_path is not None and launch_dir.resolve() == keep_path:
            continue
        procs = await trio.to_thread.run_sync(launched_from, launch_dir)
        for proc in procs:
            log.warning("stopping server pid %d: launched from %s, recorded nowhere", proc.pid, launch_dir)
            await stop_group(GroupLeader.of_process(proc), grace)
            stopped.append(proc.pid)
        if not await trio.to_thread.run_sync(launched_from, launch_dir):
            shutil.rmtree(launch_dir, ignore_errors=True)
    return stopped
