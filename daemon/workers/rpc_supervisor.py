"""`stoker worker`'s service: the worker machine (states/worker/table.py) and the effects it asks for.

One task reads the machine's events from a channel and fires them (one writer: transitions are
persisted in order, `stoker history --machine worker` shows them); each effect starts a small
task that reports back as an event: the spawned server's exit, its first RPC answer, a backoff
or stable timer. The server is proven ready through the engine's own RPC handshake
(daemon/workers/rpc_wire.py), never by a log line: a worker that prints its devices but does
not answer HELLO is not serving. While it serves nothing probes it (the rpc-server serves one
client at a time: a probe would wait behind the head's llama-server).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import psutil
import trio

from stoker.daemon.bundles.installed import InstalledBundle
from stoker.daemon.config.workers import WorkerConfig
from stoker.daemon.core.machines import EffectDriver, MachineRunner, Publish
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.workers import server as W
from stoker.daemon.workers.rpc_wire import read_worker
from stoker.states.worker import table as M
from stoker.states.backoff import Backoff
from stoker.states.machine import IllegalTransition
from stoker.states.reasons import ReasonCode
from stoker.store.database import Store

log = logging.getLogger(__name__)

MACHINE_ID = "worker"
ANSWER_POLL_S = 0.1
ADOPTED_POLL_S = 0.5


@attrs.define(eq=False)
class WorkerService:
    """Supervises this host's ggml-rpc-server through the worker machine."""

    paths: StokerPaths
    store: Store
    worker: WorkerConfig
    bundle: InstalledBundle
    settings: M.WorkerSettings = M.WorkerSettings()
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    publish: Publish | None = None
    on_step: Callable[[MachineRunner], None] | None = None  # the CLI's one line per transition
    runner: MachineRunner = attrs.field(init=False)
    _effects: EffectDriver[Awaitable[None]] = attrs.field(init=False)
    _send: trio.MemorySendChannel[object] = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel[object] = attrs.field(init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    _running: W.RunningWorker | None = attrs.field(default=None, init=False)
    _adopted: psutil.Process | None = attrs.field(default=None, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _rng: random.Random = attrs.field(factory=random.Random, init=False)

    def __attrs_post_init__(self) -> None:
        self.runner = MachineRunner(M.WORKER, MACHINE_ID, self.store, self.publish)
        self._send, self._receive = trio.open_memory_channel(64)
        self._effects = EffectDriver(
            M.WORKER,
            {
                M.SpawnServer: self._spawn,
                M.WatchServer: self._watch_adopted,
                M.StartBackoff: self._backoff,
                M.ArmStableTimer: self._arm_stable,
                M.TerminateServer: self._terminate,
            },
        )

    @property
    def log_path(self) -> Path:
        return self.paths.logs_dir / "rpc-server.log"

    @property
    def identity_path(self) -> Path:
        return self.paths.runtime_dir / "rpc-worker.json"

    @property
    def state(self) -> M.WorkerState:
        return M.WorkerState(self.runner.state)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Adopt a proven server or start one, then run the machine until stopped."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._fire(self._first_event())
            task_status.started()
            async for event in self._receive:
                self._fire(event)
                done = self.state is M.WorkerState.FAILED or (self._stopping and self.state is M.WorkerState.STOPPED)
                if done and not self._alive():
                    break
            nursery.cancel_scope.cancel()

    async def stop(self) -> None:
        """Stop the server (TERM, grace, KILL) and end `serve`."""
        self._stopping = True
        await self._send.send(M.StopRequested())

    async def wait_state(self, *states: M.WorkerState) -> None:
        """Until the machine is in one of `states`."""
        while self.state not in states:
            changed = self._changed
            await changed.wait()

    # --- the machine ------------------------------------------------------------------------

    def _first_event(self) -> object:
        argv = W.worker_argv(self.bundle, self.worker)
        ident = W.WorkerIdentity.read(self.identity_path)
        proc = W.proven_process(ident, argv) if ident is not None else None
        protocol = self.bundle.meta.rpc_protocol
        if ident is not None and proc is not None and ident.address == self.worker.address:
            self._adopted = proc
            evidence = {"pid": ident.pid, "exe": ident.exe, "identity": str(self.identity_path)}
            return M.Adopted(self.worker.address, protocol, ident.pid, ident.create_time, evidence, self.settings)
        return M.StartRequested(self.worker.address, protocol, self.settings)

    def _fire(self, event: object) -> None:
        try:
            step = self.runner.fire(event)
        except IllegalTransition as err:  # a timer or watcher of an earlier server
            log.info("worker: %s", err)
            return
        self._changed.set()
        self._changed = trio.Event()
        if self.on_step is not None:
            self.on_step(self.runner)
        assert self._nursery is not None
        self._effects.start_all(self._nursery, step.effects)

    def _alive(self) -> bool:
        if self._running is not None and self._running.process.returncode is None:
            return True
        return self._adopted is not None and self._adopted.is_running()

    # --- effects ----------------------------------------------------------------------------

    async def _spawn(self, effect: M.SpawnServer) -> None:
        try:
            running = await W.spawn(self.paths, self.bundle, self.worker, self.log_path, self.identity_path)
        except OSError as err:
            await self._send.send(M.SpawnFailed(ReasonCode.SERVER_SPAWN_FAILED, {"error": str(err)}))
            return
        self._running, self._adopted = running, None
        await self._send.send(M.Spawned(running.process.pid, running.identity.create_time))
        assert self._nursery is not None
        self._nursery.start_soon(self._wait_answer, running)
        returncode = await running.process.wait()
        self.identity_path.unlink(missing_ok=True)
        if running.stop_requested:
            await self._send.send(M.StopCompleted(returncode))
            return
        reason, evidence = W.classify(returncode, self.log_path, running.log_offset)
        await self._send.send(M.Exited(returncode, reason, evidence))

    async def _wait_answer(self, running: W.RunningWorker) -> None:
        """Until the server answers HELLO (then Answered) or ends."""
        protocol = self.bundle.meta.rpc_protocol
        while running.process.returncode is None:
            reading = await read_worker(self.worker.address, protocol, timeout_s=2.0)
            if reading.reachable and reading.version is not None:
                _version, named = W.device_lines(self.log_path, running.log_offset)
                devices = []
                for device in reading.devices:
                    entry: dict[str, Any] = {
                        "index": device.index,
                        "free_mib": device.free_bytes // 2**20,
                        "total_mib": device.total_bytes // 2**20,
                    }
                    if device.index < len(named):
                        entry["name"] = named[device.index]["name"]
                        entry["description"] = named[device.index]["description"]
                    devices.append(entry)
                evidence = {"address": self.worker.address, "answered_in_ms": reading.elapsed_ms}
                await self._send.send(M.Answered(reading.version, tuple(devices), evidence))
                return
            await trio.sleep(ANSWER_POLL_S)

    async def _watch_adopted(self, effect: M.WatchServer) -> None:
        proc = self._adopted
        while proc is not None and proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            await trio.sleep(ADOPTED_POLL_S)
        self.identity_path.unlink(missing_ok=True)
        if self._stopping:
            await self._send.send(M.StopCompleted(None))
            return
        reason, evidence = W.classify(None, self.log_path, 0)
        await self._send.send(M.Exited(None, reason, {**evidence, "adopted": True}))

    async def _backoff(self, effect: M.StartBackoff) -> None:
        delay = Backoff(self.backoff_initial_s, self.backoff_max_s).delay(effect.attempt, self._rng.random())
        await trio.sleep(delay)
        await self._send.send(M.BackoffElapsed())

    async def _arm_stable(self, effect: M.ArmStableTimer) -> None:
        pid = self.runner.data.pid
        await trio.sleep(effect.after)
        if self.state is M.WorkerState.SERVING and self.runner.data.pid == pid:
            await self._send.send(M.Stable())

    async def _terminate(self, effect: M.TerminateServer) -> None:
        if self._running is not None and self._running.process.returncode is None:
            await W.terminate(self._running, effect.grace)  # its watcher reports StopCompleted
        elif self._adopted is not None and self._adopted.is_running():
            self._stopping = True
            await W.terminate_adopted(self._adopted, effect.grace)  # its watcher reports it
        else:
            await self._send.send(M.StopCompleted(None))
