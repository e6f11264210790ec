"""The launch supervisor: executes the launch machine's effects and feeds the results back.

The machine (states/launch.py) decides; this module does. Every effect becomes a task in
the supervisor's nursery, and every outcome becomes an event through `MachineRunner.fire`,
which persists the transition before anything else happens. Timers belong to the state that
armed them and are cancelled when the machine leaves it; an event that arrives too late for
the state it was meant for is an illegal transition, logged and dropped.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import attrs
import trio

from daemon.core import sdnotify
from daemon.config.model import Config
from daemon.core.errors import StokerError
from daemon.core.machines import MachineRunner
from daemon.models.resolve import model_launch_args
from daemon.core.paths import StokerPaths
from daemon.engine.api import EngineClient
from daemon.engine.identity import (
    AdoptedServer,
    adopt,
    read_identity,
    stop_orphan,
)
from daemon.snapshots.service import snapshot_server_args
from daemon.engine.process import ServerHandle, ServerSpec, serve_server, stop_server
from daemon.engine.ready import wait_ready
from states import launch as L
from states.machine import IllegalTransition, Step
from states.reasons import ReasonCode

log = logging.getLogger(__name__)

# Async: planning may probe hardware out of process, install a bundle or assemble a model.
Planner = Callable[[Config, L.MakePlan], Awaitable[L.LaunchPlan]]
# A hook run once a server is ready, before the machine says so (snapshot restore goes here).
ReadyHook = Callable[["Supervisor", Any], Any]
# A hook run before a planned stop while the server still serves (snapshot save goes here);
# its second argument is the cause: "stop", "restart" or "shutdown".
StopHook = Callable[["Supervisor", str], Any]


def launch_settings(config: Config) -> L.LaunchSettings:
    """The launch machine's knobs from the config."""
    sup = config.supervisor
    return L.LaunchSettings(
        max_restarts=sup.max_restarts,
        stall_timeout=config.server.stall_timeout_s,
        stop_grace=sup.stop_grace_s,
        stable_after=sup.stable_after_s,
    )


def backoff_delay(attempt: int, initial: float, cap: float, rng: random.Random) -> float:
    """Capped exponential backoff with jitter in [50%, 100%] of the step (never zero)."""
    step = min(cap, initial * (2 ** max(attempt - 1, 0)))
    return round(step * (0.5 + rng.random() / 2), 4)


@attrs.define(eq=False)
class Supervisor:
    paths: StokerPaths
    runner: MachineRunner
    config: Config
    planner: Planner
    ready_hook: ReadyHook | None = None
    before_stop: StopHook | None = None
    shutting_down: bool = False  # set by the daemon: the stop cause is "shutdown"
    rng: random.Random = attrs.field(factory=random.Random)
    server: ServerHandle | AdoptedServer | None = None
    ready_evidence: dict[str, Any] | None = None
    ready_at: float | None = None
    restarts: int = 0
    _nursery: trio.Nursery | None = None
    _server_scope: trio.CancelScope | None = None
    _timers: dict[str, trio.CancelScope] = attrs.field(factory=dict)

    @property
    def identity_file(self) -> Path:
        return self.paths.runtime_dir / "server.json"

    @property
    def state(self) -> L.LaunchState:
        return self.runner.state  # type: ignore[return-value]

    @property
    def data(self) -> L.LaunchData:
        return self.runner.data

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Resume the machine where the store left it, then execute effects until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            resume = L.resume_effects(self.state, self.data) if self.runner.resumed else ()
            if resume:
                log.info("resuming launch machine in %s: %s", self.state, resume)
            self._execute(resume)
            task_status.started()
            await trio.sleep_forever()

    # --- events in -----------------------------------------------------------------------

    def fire(self, event: object) -> Step:
        """Fire an event (raises IllegalTransition) and start its effects."""
        before = self.state
        result = self.runner.fire(event)
        if result.state != before:
            self._cancel_timers_not_owned_by(result.state)
        self._execute(result.effects)
        return result

    def offer(self, event: object) -> Step | None:
        """Fire an event that may have arrived too late for its state; drop it if so."""
        try:
            return self.fire(event)
        except IllegalTransition as err:
            log.info("dropped late event: %s", err)
            return None

    # --- effects out ---------------------------------------------------------------------

    def _execute(self, effects: tuple[Any, ...]) -> None:
        assert self._nursery is not None, "supervisor is not running"
        for effect in effects:
            handler = getattr(self, f"_do_{type(effect).__name__}")
            handler(effect)

    def _do_MakePlan(self, effect: L.MakePlan) -> None:
        self._nursery.start_soon(self._make_plan, effect)

    async def _make_plan(self, effect: L.MakePlan) -> None:
        try:
            plan = await self.planner(self.config, effect)
        except StokerError as err:
            self.offer(L.PlanFailed(err.reason, {"message": err.message, **err.evidence}))
            return
        self.offer(L.PlanReady(plan))

    def _do_Spawn(self, effect: L.Spawn) -> None:
        if self._server_scope is not None:
            self._server_scope.cancel()
        scope = trio.CancelScope()
        self._server_scope = scope
        self._nursery.start_soon(self._run_server, effect.plan, scope)

    def _do_WatchReadiness(self, effect: L.WatchReadiness) -> None:
        # A spawned server is watched by its own task (_run_server); an adopted one here.
        if isinstance(self.server, AdoptedServer):
            self._nursery.start_soon(self._watch_adopted_ready, self.server, effect.stall_timeout)

    def _do_Terminate(self, effect: L.Terminate) -> None:
        self._nursery.start_soon(self._terminate, effect.grace)

    def _do_StartBackoff(self, effect: L.StartBackoff) -> None:
        sup = self.config.supervisor
        delay = backoff_delay(effect.attempt, sup.backoff_initial_s, sup.backoff_max_s, self.rng)
        if self.offer(L.BackoffStarted(delay)) is not None:
            self._start_timer(L.LaunchState.BACKOFF, delay, L.BackoffElapsed())

    def _do_ArmStableTimer(self, effect: L.ArmStableTimer) -> None:
        self._start_timer(L.LaunchState.READY, effect.after, L.Stable())

    def _do_Reattach(self, effect: L.Reattach) -> None:
        self._nursery.start_soon(self._reattach, effect)

    def _do_Notify(self, effect: L.Notify) -> None:
        if effect.kind == "ready":
            sdnotify.ready(effect.text or None)
        else:
            sdnotify.status(effect.text)

    # --- timers --------------------------------------------------------------------------

    def _start_timer(self, owner: L.LaunchState, delay: float, event: object) -> None:
        old = self._timers.pop(owner.value, None)
        if old is not None:
            old.cancel()
        scope = trio.CancelScope()
        self._timers[owner.value] = scope

        async def timer() -> None:
            with scope:
                await trio.sleep(delay)
                self._timers.pop(owner.value, None)
                self.offer(event)

        self._nursery.start_soon(timer)

    def _cancel_timers_not_owned_by(self, state: L.LaunchState) -> None:
        for owner in list(self._timers):
            if owner != state.value:
                self._timers.pop(owner).cancel()

    # --- one server's life ---------------------------------------------------------------

    def server_spec(self, plan: L.LaunchPlan) -> ServerSpec:
        server = self.config.server
        slot_save_path, snapshot_args = snapshot_server_args(self.paths, self.config, plan.model_path)
        return ServerSpec(
            server_path=plan.server_path,
            model_path=plan.model_path,
            host=plan.host,
            port=plan.port,
            ctx_size=plan.ctx_size or None,
            parallel=plan.parallel,
            threads=server.threads or None,
            n_gpu_layers=None if plan.backend == "cpu" else plan.n_gpu_layers,
            flash_attn=server.flash_attn,
            # --metrics: telemetry reads tokens/s from /metrics.
            extra_args=(*model_launch_args(server.model), *plan.extra_args, "--metrics", *snapshot_args),
            slot_save_path=slot_save_path,
        )

    async def _run_server(self, plan: L.LaunchPlan, scope: trio.CancelScope) -> None:
        log_path = self.paths.logs_dir / "llama-server.log"
        with scope:
            # The spec reads the model's GGUF header once per file (about a second for
            # Gemma): off the event loop, so status requests never wait on it.
            spec = await trio.to_thread.run_sync(self.server_spec, plan)
            async with trio.open_nursery() as nursery:
                try:
                    handle: ServerHandle = await nursery.start(
                        functools.partial(
                            serve_server,
                            spec,
                            log_path=log_path,
                            grace=self.data.settings.stop_grace,
                            launch_root=self.paths.runtime_dir / "launch",
                            # Written at spawn, rewritten once the real port is known (port 0),
                            # removed at exit: what a restarted daemon proves before adopting.
                            identity_path=self.identity_file,
                        )
                    )
                except StokerError as err:
                    self.offer(L.ServerExited(None, err.reason, err.evidence, fatal=True))
                    return
                self.server = handle
                self.offer(L.Spawned(handle.pid, handle.identity.create_time, str(log_path)))
                nursery.start_soon(self._watch_ready, handle)
                report = await handle.wait_exit()
                nursery.cancel_scope.cancel()
            self._forget_server(handle)
            if report.expected:
                self.offer(L.StopCompleted(report.returncode, {"signal": report.signal}))
            else:
                self.offer(self._exit_event(report.returncode, report.reason, report.evidence))

    def _exit_event(self, returncode: int | None, reason: ReasonCode, evidence: dict[str, Any]) -> L.ServerExited:
        # SIGILL: the CPU variant is wrong for this CPU, so the next attempt needs a new plan.
        replan = reason == ReasonCode.CPU_ILLEGAL_INSTRUCTION
        # A missing or unparseable model, or an option the engine rejects, cannot get better
        # by retrying: fail at once with the real reason instead of looping into crash_loop.
        fatal = reason in (ReasonCode.MODEL_MISSING, ReasonCode.MODEL_LOAD_FAILED, ReasonCode.SERVER_BAD_ARGUMENTS)
        self.restarts += 1
        return L.ServerExited(returncode, reason, evidence, replan=replan, fatal=fatal)

    async def _watch_ready(self, handle: ServerHandle) -> None:
        settings = self.data.settings
        # The engine's first "loaded meta data" line: the model is being read.
        while handle.log.model_path is None and handle.exit is None:
            await handle.wait_changed()
        if handle.exit is None:
            self.offer(L.LoadStarted({"model_path": handle.log.model_path}))
        try:
            report = await wait_ready(
                handle, stall_timeout=settings.stall_timeout, ready_timeout=self.config.server.ready_timeout_s
            )
        except StokerError as err:
            if err.reason in (ReasonCode.SERVER_STALLED, ReasonCode.SERVER_START_TIMEOUT):
                self.offer(L.StallTimeout())
            return  # an exit is reported by _run_server
        evidence = report.to_evidence()
        await self._ready(evidence)

    async def _ready(self, evidence: dict[str, Any]) -> None:
        if self.ready_hook is not None:
            try:
                extra = await self.ready_hook(self, evidence)
            except Exception:  # a hook must never keep a healthy server from serving
                log.exception("ready hook failed")
                extra = None
            if extra:
                evidence = {**evidence, **extra}
        self.ready_evidence = evidence
        self.ready_at = time.time()
        self.offer(L.Ready(evidence))

    def _forget_server(self, server: ServerHandle | AdoptedServer) -> None:
        if self.server is server:
            self.server = None
            self.ready_evidence = None
            self.ready_at = None
            if isinstance(server, AdoptedServer):  # a spawned server's record goes with it
                self.identity_file.unlink(missing_ok=True)

    async def _terminate(self, grace: float) -> None:
        server = self.server
        after = self.data.after_stop
        if server is not None and self.before_stop is not None and after is not L.AfterStop.CRASH:
            cause = "shutdown" if self.shutting_down else after.value
            try:
                await self.before_stop(self, cause)
            except Exception:  # saving state must never keep a server from stopping
                log.exception("before-stop hook failed")
        if isinstance(server, ServerHandle):
            await stop_server(server, grace)  # _run_server reports StopCompleted
            return
        if isinstance(server, AdoptedServer):
            await server.stop(grace)
            self._forget_server(server)
        self.offer(L.StopCompleted(None, {"adopted": server is not None}))

    # --- after a daemon restart ----------------------------------------------------------

    async def _reattach(self, effect: L.Reattach) -> None:
        ident = read_identity(self.identity_file)
        why = "no identity file"
        if ident is not None and effect.pid is not None and ident.pid != effect.pid:
            why = f"identity file names pid {ident.pid}, the machine {effect.pid}"
        elif ident is not None:
            adopted = await adopt(ident)
            if adopted is not None:
                self.server = adopted
                self.offer(L.Adopted(ident.pid, ident.create_time, {"adopted": True, "port": ident.port}))
                self._nursery.start_soon(self._watch_adopted_exit, adopted)
                return
            why = "identity not proven (pid, start time, executable, API key or health)"
            # Only a process proven to be ours (pid + start time + executable) is signalled.
            stopped = await stop_orphan(ident, self.data.settings.stop_grace)
            why += "; orphan stopped" if stopped else "; no process of ours to stop"
        self.identity_file.unlink(missing_ok=True)
        event = (
            L.StopCompleted(None, {"adoption": why})
            if self.state is L.LaunchState.STOPPING
            else L.ServerExited(None, ReasonCode.SERVER_CRASHED, {"adoption": why})
        )
        self.offer(event)

    async def _watch_adopted_ready(self, server: AdoptedServer, stall_timeout: float) -> None:
        with trio.move_on_after(self.config.server.ready_timeout_s):
            async with EngineClient.open(server.base_url, server.api_key) as engine:
                while self.server is server:
                    if await engine.healthy():
                        await self._ready({"adopted": True, "base_url": server.base_url, "pid": server.pid})
                        return
                    await trio.sleep(0.2)
            return
        self.offer(L.StallTimeout())

    async def _watch_adopted_exit(self, server: AdoptedServer) -> None:
        reason, evidence = await server.wait_exit()
        if self.server is not server:
            return
        self._forget_server(server)
        self.offer(self._exit_event(None, reason, evidence))

    # --- for status ----------------------------------------------------------------------

    def endpoint(self) -> tuple[str | None, str | None]:
        """(base URL, API key) of the live server, if any."""
        server = self.server
        if server is None:
            return None, None
        if isinstance(server, ServerHandle):
            return server.base_url, server.api_key
        return server.base_url, server.identity.api_key
