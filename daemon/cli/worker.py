"""`stoker worker [run] | check ADDRESS... | status`: this host as an RPC worker, and checking workers.

`stoker worker` runs in the foreground (a systemd unit or a terminal), supervising the
ggml-rpc-server of an installed bundle on `[worker] host:port` (127.0.0.1:50052 by default)
through the worker machine: restarted with backoff, adopted across a `stoker worker` restart
when its identity is proven, stopped on Ctrl-C or TERM. One line per transition on stdout.
`check` reads workers through the engine's RPC protocol exactly as the head's planner does
(version, devices, free memory); `status` prints the worker machine's row. See
docs/scale-out.md.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import attrs
import click
import trio

from stoker.daemon.backends.registry import load_backends, try_order
from stoker.daemon.bundles.installed import list_installed
from stoker.daemon.cli.output import emit, fail, json_option
from stoker.daemon.config.model import ConfigError, load_config
from stoker.daemon.config.workers import worker_bind_problems
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.machines import MachineRunner
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.pidlock import LockHeld, take_pid_lock, write_pid
from stoker.daemon.workers.rpc_wire import read_workers
from stoker.daemon.workers.server import choose_bundle
from stoker.daemon.workers.rpc_supervisor import MACHINE_ID, WorkerService
from stoker.states.worker import table as M
from stoker.states.machine import to_json
from stoker.states.reasons import ReasonCode
from stoker.store import open_store


def register(group: click.Group) -> None:
    group.add_command(worker)


@click.group(invoke_without_command=True)
@click.pass_context
def worker(ctx: click.Context) -> None:
    """This host as an RPC worker (ggml-rpc-server), and checking workers."""
    if ctx.invoked_subcommand is None:
        ctx.invoke(run)


def hold_worker_lock(path: Path) -> int:
    """One `stoker worker` per data directory: an flock held for its life (the kernel drops it
    with the process)."""
    try:
        fd = take_pid_lock(path)
    except LockHeld as held:
        raise StokerError(
            ReasonCode.DAEMON_ALREADY_RUNNING,
            f"Another `stoker worker` (pid {held.holder or '?'}) already runs for {path.parent}.",
            {"pid": held.holder, "lock": str(path)},
        ) from None
    write_pid(fd)
    return fd


def _line(runner: MachineRunner) -> None:
    data: M.WorkerData = runner.data
    parts = [f"worker {runner.state.value}"]
    if data.address:
        parts.append(data.address)
    if data.pid:
        parts.append(f"pid {data.pid}")
    if runner.state is M.WorkerState.SERVING and data.version:
        devices = ", ".join(
            f"{d.get('name', d['index'])} {d['free_mib']}/{d['total_mib']} MiB free" for d in data.devices
        )
        parts.append(f"rpc {data.version}" + (f" [{devices}]" if devices else ""))
    if data.reason:
        parts.append(f"[{data.reason}]")
    click.echo("  ".join(parts))
    sys.stdout.flush()


@worker.command()
@click.option(
    "--host", default=None, help="Override [worker] host (a non-loopback one needs allow_unauthenticated_rpc)."
)
@click.option("--port", type=int, default=None, help="Override [worker] port.")
def run(host: str | None, port: int | None) -> None:
    """Supervise ggml-rpc-server in the foreground (Ctrl-C stops it)."""
    paths = StokerPaths.from_env()
    try:
        config = load_config(paths.config_file)
    except ConfigError as err:
        fail(False, err)
    settings = config.worker
    if host is not None or port is not None:
        settings = attrs.evolve(settings, host=host or settings.host, port=port or settings.port)
        problems = worker_bind_problems(settings)
        if problems:
            fail(False, ConfigError(problems))
    paths.make_private()
    try:
        lock_fd = hold_worker_lock(paths.runtime_dir / "worker.lock")
    except StokerError as err:
        fail(False, err)
    try:
        bundle = choose_bundle(paths, settings, try_order(load_backends()))
        store = open_store(paths.db_file)
        sup = config.supervisor
        service = WorkerService(
            paths,
            store,
            settings,
            bundle,
            M.WorkerSettings(sup.max_restarts, sup.stable_after_s, min(sup.stop_grace_s, 10.0)),
            sup.backoff_initial_s,
            sup.backoff_max_s,
            on_step=_line,
        )
        click.echo(
            f"worker: {bundle.meta.backend}/{bundle.meta.variant} bundle, rpc protocol {bundle.meta.rpc_protocol}"
        )
        trio.run(_serve, service)
        store.close()
    except StokerError as err:
        fail(False, err)
    finally:
        os.close(lock_fd)
    if service.state is M.WorkerState.FAILED:
        data = service.runner.data
        fail(False, StokerError(data.reason or ReasonCode.SERVER_CRASHED, None, data.evidence))


async def _serve(service: WorkerService) -> None:
    """The service until it is stopped (Ctrl-C, TERM) or has failed with nothing left running."""
    async with trio.open_nursery() as nursery:

        async def on_signal() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    await service.stop()

        nursery.start_soon(on_signal)
        await service.serve()
        nursery.cancel_scope.cancel()


@worker.command()
@click.argument("addresses", nargs=-1, required=False)
@json_option
def check(addresses: tuple[str, ...], as_json: bool) -> None:
    """Read workers as the planner does (default: every [[workers]] address)."""
    paths = StokerPaths.from_env()
    try:
        config = load_config(paths.config_file)
    except ConfigError as err:
        fail(as_json, err)
    addresses = addresses or tuple(w.address for w in config.workers)
    if not addresses:
        fail(as_json, StokerError(ReasonCode.BAD_REQUEST, "No address given and no [[workers]] in the config."))
    protocols = sorted({b.meta.rpc_protocol for b in list_installed(paths) if b.meta.rpc_protocol})
    protocol = protocols[0] if protocols else None
    readings = trio.run(read_workers, addresses, protocol)
    data: list[dict[str, Any]] = []
    for reading in readings:
        entry = reading.to_evidence()
        entry["matches_bundle"] = reading.reachable and reading.version == protocol
        data.append(entry)

    def human(rows: list[dict[str, Any]]) -> str:
        lines = [f"bundle rpc protocol: {protocol or 'none installed'}"]
        for row in rows:
            if not row["reachable"]:
                lines.append(f"{row['address']}: unreachable ({row.get('error')})")
                continue
            devices = ", ".join(
                f"#{d['index']} {d['free_mib']}/{d['total_mib']} MiB free" for d in row.get("devices", [])
            )
            match = "" if row["matches_bundle"] else f"  [differs from {protocol}]"
            lines.append(f"{row['address']}: rpc {row.get('version')}{match}  {devices}")
        return "\n".join(lines)

    emit(as_json, {"protocol": protocol, "workers": data} if as_json else data, None if as_json else human)
    if not all(row["matches_bundle"] for row in data):
        sys.exit(1)


@worker.command()
@json_option
def status(as_json: bool) -> None:
    """The worker machine's state, as the last `stoker worker` left it."""
    paths = StokerPaths.from_env()
    store = open_store(paths.db_file)
    record = store.machine(MACHINE_ID)
    store.close()
    if record is None:
        emit(as_json, {"state": None}, lambda _d: "no `stoker worker` has run with this data directory")
        return
    data = {"state": record.state, **to_json(record.data)}
    emit(as_json, data, lambda d: "\n".join(f"{k}: {v}" for k, v in d.items() if k != "settings"))
