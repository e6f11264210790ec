"""The daemon's start: its backends probed while the rest of its code loads.

    private dirs -> lock -> store -> config -> plugins -> what a killed daemon left ends
         -> probes (the default model's candidates asked ahead) -> the daemon's code loaded
         -> `Daemon.serve` (daemon/runtime.py: every other service, in its order)

A daemon's first plan waits on a verdict from each backend it may use: a subprocess each (a
Python process that loads its plugin, cuda's NVML, the CPU's instruction tests), ~0.4 s on a
2-core machine before anything else of the plan could go on. The daemon's own code takes about
as long to load (the control socket, the front door, every subsystem and its records). Neither
needs the other, so the probe service starts first, on only what it needs (the store, the
plugins), asks for the candidates of the default model's plan (`candidates_for`, the same
question the fallback machine's ProbeCandidates asks) when the daemon is to load it at start,
and the rest of the daemon's code loads in a thread meanwhile; the plan then joins the probes
in flight, or reads their verdicts from the cache, through the same probe machine, generation
and TTL as any other. A daemon that loads nothing at start probes nothing ahead.

Only where the probes get cores of their own (`AHEAD_MIN_CORES`): the probes take ~0.75 s of
CPU in three processes, and on a 2-core machine they took the import's core instead (measured,
10 pairs: the engine spawned 0.15 s later, the socket answered 0.4 s later), so there the
probes run when the plan asks for them, as before.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import trio

from stoker.daemon.backends.registry import candidates_for, load_backends, try_order
from stoker.daemon.config.model import Config, ConfigError, load_config
from stoker.daemon.core.events import EventBus
from stoker.daemon.core.launch_records import runs_root, stop_abandoned
from stoker.daemon.core.loading import keep_loaded, loading
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.pidlock import acquire_lock, data_dir_unwritable
from stoker.daemon.engine.fit import CACHE_FILE as FIT_CACHE_FILE
from stoker.daemon.engine.fit import keep_answers_in
from stoker.daemon.models.facts import keep_layouts_in
from stoker.daemon.probes.verdicts import ProbeService
from stoker.store import open_store

if TYPE_CHECKING:
    from stoker.daemon.runtime import Daemon

log = logging.getLogger("stoker")

AHEAD_MIN_CORES = 4


def usable_cores() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def load_initial_config(paths: StokerPaths) -> tuple[Config, list[str]]:
    try:
        return load_config(paths.config_file), []
    except ConfigError as err:
        return Config(), list(err.problems)


def _daemon_class() -> type[Daemon]:
    """The daemon's code, loaded (in a thread: the probes go on meanwhile) and kept to its end
    (daemon/core/loading.py)."""
    with loading():
        from stoker.daemon.runtime import Daemon
    keep_loaded()
    return Daemon


async def run_daemon(
    paths: StokerPaths,
    *,
    autostart: bool = True,
    load_default: bool = True,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the daemon until shutdown; raises StokerError if it cannot start. `load_default`
    False: the default model loads at its first request, not with the daemon."""
    try:
        paths.make_private()
    except OSError as exc:
        raise data_dir_unwritable(paths.data_dir, exc) from None
    lock_fd = acquire_lock(paths.lock_file)
    try:
        # The engine fitter's answers, kept across daemons (daemon/engine/fit.py FitCache).
        keep_answers_in(paths.data_dir / FIT_CACHE_FILE)
        keep_layouts_in(paths.data_dir / "gguf-headers.json")  # the GGUF headers parsed, likewise
        store = open_store(paths.db_file)
        try:
            config, problems = load_initial_config(paths)
            # Plugins first: loading one registers the reason codes it brings, which the machine
            # rows restored from the store may hold (a fallback that recorded fakegpu_startup_failed).
            backends = load_backends()
            bus = EventBus()

            def publish(event: dict[str, Any]) -> None:
                bus.publish(event)  # until the daemon takes over (Daemon.publish: the change signal too)

            probes = ProbeService(
                store,
                try_order(backends),
                publish=publish,
                quick={name: b.quick_detect for name, b in backends.items()},
            )
            async with trio.open_nursery() as nursery:
                await nursery.start(probes.serve)
                # What a killed daemon (or CLI) left running (a smoke run, a build, a probe) ends first.
                await stop_abandoned(runs_root(paths.runtime_dir), config.supervisor.stop_grace_s)
                if autostart and load_default and not problems and usable_cores() >= AHEAD_MIN_CORES:
                    probes.start_probes(candidates_for(config.backend.prefer, backends)[0])
                daemon_class = await trio.to_thread.run_sync(_daemon_class)
                daemon = daemon_class(paths, store, bus, config, backends, probes)
                if problems:
                    daemon.refuse_initial_config(problems)
                await daemon.serve(autostart=autostart, load_default=load_default, task_status=task_status)
                nursery.cancel_scope.cancel()
        finally:
            store.close()
    finally:
        os.close(lock_fd)
