"""What the identity file proves at daemon start (the launch machine's Reattach, carried out).

A server outlives a daemon killed with -9, and the store may not know it (a request recorded
but not acted on, a store moved aside, a lost -wal). The identity file in the runtime dir is
evidence on its own: `prove_identity` reads it and answers what it proves, as an event for
the launch machine, with the server to hold when there is one. It signals nothing: the
machine decides what to keep and what to stop (states/launch/adoption.py).
"""

from __future__ import annotations

from pathlib import Path

from stoker.daemon.engine.identity import AdoptedServer, adopt, matching_process, read_identity
from stoker.daemon.engine.orphans import stop_unrecorded
from stoker.states.launch import records as LR

Proof = LR.Adopted | LR.OrphanFound | LR.NothingToAdopt


async def prove_identity(identity_file: Path, recorded_pid: int | None) -> tuple[Proof, AdoptedServer | None]:
    """(the event, the server to hold): Adopted when every proof passes (pid, start time,
    executable, command line, health, API key); OrphanFound when only the process is ours
    (pid, start time, executable), held so that a Terminate can stop it (each signal re-proves
    it); NothingToAdopt when no process of ours is there (the stale file is removed)."""
    ident = read_identity(identity_file)
    if ident is None:
        why = "identity file unreadable" if identity_file.exists() else "no identity file"
        return LR.NothingToAdopt({"adoption": why}), None
    facts = {"port": ident.port, "recorded_pid": recorded_pid}
    adopted = await adopt(ident)
    if adopted is not None:
        return LR.Adopted(ident.pid, ident.create_time, {"adopted": True, **facts}), adopted
    if matching_process(ident) is not None:
        why = "identity not proven (command line, health or API key)"
        return LR.OrphanFound(ident.pid, ident.create_time, {"adoption": why, **facts}), AdoptedServer(ident)
    identity_file.unlink(missing_ok=True)
    return LR.NothingToAdopt({"adoption": f"the recorded process {ident.pid} is gone", **facts}), None


async def sweep_unrecorded(launch_root: Path, held: AdoptedServer | None, grace: float) -> list[int]:
    """At daemon start, before any spawn: stop the servers no identity file names (a daemon
    killed between a spawn and its record), found by their launch directory; the held
    server's own directory is kept. The pids stopped."""
    kept = held.identity.launch_dir if held is not None else None
    return await stop_unrecorded(launch_root, Path(kept) if kept else None, grace)
