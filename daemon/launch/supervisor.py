"""The launch supervisor: executes one server instance's launch machine effects, feeds back events.

The machine (states/launch/table.py) decides; this module does. Every effect goes through one
`EffectDriver` (a handler per effect type) and becomes a task in the supervisor's nursery;
every outcome becomes an event carrying facts (an exit's status and classified reason, a
spawn that failed) through `MachineRunner.fire`, which persists the transition before
anything else happens. Nothing here judges what an exit means. Timers belong to the state
that armed them and are cancelled when the machine leaves it; an event that arrives too
late for the state it was meant for is an illegal transition, logged and dropped.

One server task at a time: a spawn never overlaps the end of the previous server's task, a server
task that ends (or is cancelled) always forgets its handle, and a stop with no server reports at
once (the machine never asks for one while a spawn is under way). At start, the identity file is
proven before `run` reports started, so no request, plan or autostart runs before the server
that outlived the last daemon is accounted for.

The plan is complete when it arrives (daemon/fallback/launch_plan.py): `server_spec` maps it onto
the engine's spawn spec field by field, reading neither the config, the models nor the snapshot
settings, so the command line is what history recorded.
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

from stoker.daemon.core import sdnotify
from stoker.daemon.config.model import Config
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.machines import EffectDriver, MachineRunner, Publish
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.engine.api import EngineClient
from stoker.daemon.engine.identity import AdoptedServer
from stoker.daemon.engine.process import ServerHandle, ServerSpec, serve_server, stop_server
from stoker.daemon.engine.ready import wait_ready
from stoker.daemon.launch.adoption import prove_identity, sweep_unrecorded
from stoker.daemon.launch.instance import ServerInstance
from stoker.daemon.launch.liveness import watch_liveness
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.backoff import Backoff
from stoker.states.launch.steps import stop_cause
from stoker.states.machine import IllegalTransition, Step
from stoker.states.snapshots.policy import save_before_stop
from stoker.states.reasons import ReasonCode
from stoker.store.database import Store

log = logging.getLogger(__name__)

# Async: planning may probe hardware out of process, install a bundle or assemble a model.
Planner = Callable[[Config, LR.MakePlan], Awaitable[LR.LaunchPlan]]
# A hook run once a server is ready, before the machine says so (snapshot restore goes here).
ReadyHook = Callable[["Supervisor", Any], Any]
# A hook run before a planned stop while the server still serves (snapshot save goes here);
# its second argument is the cause (states/launch/steps.py stop_cause): "stop", "restart",
# "evicted" (for another model), "idle" (past its TTL) or "shutdown".
StopHook = Callable[["Supervisor", str], Any]


def launch_settings(config: Config) -> LR.LaunchSettings:
    """The launch machine's knobs from the config."""
    sup = config.supervisor
    return LR.LaunchSettings(
        max_restarts=sup.max_restarts,
        stall_timeout=config.server.stall_timeout_s,
        stop_grace=sup.stop_grace_s,
        stable_after=sup.stable_after_s,
        hung_after=sup.hung_after_s,
        drain_timeout=config.frontdoor.drain_timeout_s,
    )


def server_spec(plan: LR.LaunchPlan) -> ServerSpec:
    """The engine's spawn spec for a plan: the plan's fields, nothing else (0 threads or
    context means the engine's default, so no flag)."""
    return ServerSpec(
        server_path=plan.server_path,
        model_path=plan.model_path,
        host=plan.host,
        port=plan.port,
        ctx_size=plan.ctx_size or None,
        parallel=plan.parallel,
        threads=plan.threads or None,
        backend_args=plan.backend_args,
        flash_attn=plan.flash_attn,
        extra_args=plan.extra_args,
        slot_save_path=plan.slot_save_path,
        env=plan.backend_env,
    )


@attrs.define(eq=False)
class Supervisor:
    """One server instance: its launch machine (store id keyed by the instance), the live
    server, and the tasks that carry out the machine's effects."""

    paths: StokerPaths
    store: Store
    config: Config
    planner: Planner
    instance: ServerInstance = ServerInstance()
    publish: Publish | None = None
    ready_hook: ReadyHook | None = None
    before_stop: StopHook | None = None
    # A planned stop's drain of its requests in flight, within the bound given (Usage.drain_within).
    drain: Callable[[float], Awaitable[None]] | None = None
    shutting_down: bool = False  # set by the daemon: the stop cause is "shutdown"
    rng: random.Random = attrs.field(factory=random.Random)
    server: ServerHandle | AdoptedServer | None = None
    ready_evidence: dict[str, Any] | None = None
    ready_at: float | None = None
    runner: MachineRunner = attrs.field(init=False)
    loaded_state: LR.LaunchState = attrs.field(init=False)  # as the store had it, before any proof
    _effects: EffectDriver[None] = attrs.field(init=False)
    _nursery: trio.Nursery | None = None
    _server_nursery: trio.Nursery | None = None  # the spawned server's own tasks
    _server_done: trio.Event | None = None  # set when the last server task has ended
    _reattached: trio.Event = attrs.field(factory=trio.Event)  # the identity file is accounted for
    _stops_done: int = 0  # how many times the machine has left `stopping` (the process gone)
    _stop_done: trio.Event = attrs.field(factory=trio.Event)
    # Timers and watchers by name, each with the state that owns it (cancelled when it is left).
    _timers: dict[str, tuple[LR.LaunchState, trio.CancelScope]] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.runner = MachineRunner(L.LAUNCH, self.instance.machine_id(L.LAUNCH.name), self.store, self.publish)
        self.loaded_state = LR.LaunchState(self.runner.state)
        self._effects = EffectDriver(
            L.LAUNCH,
            {
                LR.MakePlan: self._make_plan,
                LR.Spawn: self._spawn,
                LR.WatchReadiness: self._watch_readiness,
                LR.Terminate: self._stop,
                LR.StartBackoff: self._start_backoff,
                LR.ArmStableTimer: self._arm_stable,
                LR.WatchLiveness: self._watch_liveness,
                LR.Reattach: self._reattach_later,
                LR.Notify: self._notify,
            },
        )

    @property
    def identity_file(self) -> Path:
        return self.instance.identity_file(self.paths)

    @property
    def log_path(self) -> Path:
        return self.instance.log_path(self.paths)

    @property
    def state(self) -> LR.LaunchState:
        return self.runner.state  # type: ignore[return-value]

    @property
    def data(self) -> LR.LaunchData:
        return self.runner.data

    @property
    def plan(self) -> LR.LaunchPlan | None:
        """The plan the server runs (or last ran)."""
        return self.data.plan

    @property
    def pid(self) -> int | None:
        """The live server's pid (spawned or adopted), if any."""
        return None if self.server is None else self.server.pid

    @property
    def restarts(self) -> int:
        """Restarts after a crash since the user last started the server (machine data)."""
        return self.data.restarts

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Prove what the identity file names and resume the machine from it, then execute
        effects until cancelled. Started only once the proof has answered."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            resume = L.resume_effects(self.state, self.data)
            log.info("launch machine in %s%s: %s", self.state, " (resumed)" if self.runner.resumed else "", resume)
            self._execute(resume)
            await self._reattached.wait()
            task_status.started()
            await trio.sleep_forever()

    # --- events in -----------------------------------------------------------------------

    def fire(self, event: object) -> Step:
        """Fire an event (raises IllegalTransition) and start its effects."""
        before = self.state
        result = self.runner.fire(event)
        if result.state != before:
            self._cancel_timers_not_owned_by(LR.LaunchState(result.state))
            if before is LR.LaunchState.STOPPING:
                self._stops_done += 1
                self._stop_done.set()
                self._stop_done = trio.Event()
        self._execute(result.effects)
        return result

    def offer(self, event: object) -> Step | None:
        """Fire an event that may have arrived too late for its state; drop it if so."""
        try:
            return self.fire(event)
        except IllegalTransition as err:
            log.info("dropped late event: %s", err)
            return None

    async def wait_stopped(self) -> None:
        """Return once the stop under way now (if any) has completed: its process is gone. The
        machine may be on its way up again already, if a later request asked for that."""
        if self.state is not LR.LaunchState.STOPPING:
            await trio.lowlevel.checkpoint()
            return
        target = self._stops_done + 1
        while self._stops_done < target:
            await self._stop_done.wait()

    # --- effects out ---------------------------------------------------------------------

    def _execute(self, effects: tuple[Any, ...]) -> None:
        assert self._nursery is not None, "supervisor is not running"
        self._effects.run_all(effects)

    @property
    def _tasks(self) -> trio.Nursery:
        assert self._nursery is not None, "supervisor is not running"
        return self._nursery

    def _make_plan(self, effect: LR.MakePlan) -> None:
        self._tasks.start_soon(self._plan, effect)

    async def _plan(self, effect: LR.MakePlan) -> None:
        try:
            plan = await self.planner(self.config, effect)
        except StokerError as err:
            self.offer(LR.PlanFailed(err.reason, {"message": err.message, **err.evidence}, request=effect.request))
            return
        self.offer(LR.PlanReady(plan, request=effect.request))

    def _spawn(self, effect: LR.Spawn) -> None:
        previous, done = self._server_done, trio.Event()
        self._server_done = done
        self._tasks.start_soon(self._run_server, effect.plan, previous, done)

    def _watch_readiness(self, effect: LR.WatchReadiness) -> None:
        server = self.server
        if isinstance(server, ServerHandle) and self._server_nursery is not None:
            # In the spawned server's own nursery: its exit ends the watch.
            self._server_nursery.start_soon(self._watch_ready, server, effect.stall_timeout)
        elif isinstance(server, AdoptedServer):
            self._tasks.start_soon(self._watch_adopted_ready, server, effect.stall_timeout)
        else:
            log.error("WatchReadiness with no live server (state %s)", self.state)

    def _stop(self, effect: LR.Terminate) -> None:
        # The machine decides whether the stop drains; how long, as the config in force says now
        # (a reload of [frontdoor] drain_timeout_s alone reaches the machine at its next start).
        drain = effect.drain and self.config.frontdoor.drain_timeout_s
        self._tasks.start_soon(self._terminate, effect.grace, drain)

    def _start_backoff(self, effect: LR.StartBackoff) -> None:
        sup = self.config.supervisor
        delay = Backoff(sup.backoff_initial_s, sup.backoff_max_s).delay(effect.attempt, self.rng.random())
        if self.offer(LR.BackoffStarted(delay)) is not None:
            self._start_timer("backoff", LR.LaunchState.BACKOFF, delay, LR.BackoffElapsed())

    def _arm_stable(self, effect: LR.ArmStableTimer) -> None:
        self._start_timer("stable", LR.LaunchState.READY, effect.after, LR.Stable())

    def _watch_liveness(self, effect: LR.WatchLiveness) -> None:
        server = self.server
        base_url, api_key = self.endpoint()
        if server is None or base_url is None:
            log.error("WatchLiveness with no live server (state %s)", self.state)
            return
        watch = functools.partial(
            watch_liveness, base_url, api_key, server.pid, effect.every, effect.answer_within, self.offer
        )
        self._start_watch("liveness", LR.LaunchState.READY, watch)

    def _reattach_later(self, effect: LR.Reattach) -> None:
        self._tasks.start_soon(self._reattach, effect)

    def _notify(self, effect: LR.Notify) -> None:
        if effect.kind == "ready":
            sdnotify.ready(effect.text or None)
        else:
            sdnotify.status(effect.text)

    # --- timers --------------------------------------------------------------------------

    def _start_timer(self, name: str, owner: LR.LaunchState, delay: float, event: object) -> None:
        async def fire_later() -> None:
            await trio.sleep(delay)
            self.offer(event)

        self._start_watch(name, owner, fire_later)

    def _start_watch(self, name: str, owner: LR.LaunchState, work: Callable[[], Awaitable[object]]) -> None:
        """Run `work` as `name` (replacing one of that name) until done or `owner` is left."""
        old = self._timers.pop(name, None)
        if old is not None:
            old[1].cancel()
        scope = trio.CancelScope()
        self._timers[name] = (owner, scope)

        async def watch() -> None:
            with scope:
                await work()
            if name in self._timers and self._timers[name][1] is scope:
                del self._timers[name]

        self._tasks.start_soon(watch)

    def _cancel_timers_not_owned_by(self, state: LR.LaunchState) -> None:
        for name, (owner, scope) in list(self._timers.items()):
            if owner != state:
                del self._timers[name]
                scope.cancel()

    # --- one server's life ---------------------------------------------------------------

    async def _run_server(self, plan: LR.LaunchPlan, previous: trio.Event | None, done: trio.Event) -> None:
        try:
            if previous is not None and not previous.is_set():
                # The machine spawns only once the last server is gone; never two at once.
                log.error("spawn asked while the previous server task is still running: ending it first")
                if isinstance(self.server, ServerHandle):
                    await stop_server(self.server, self.data.settings.stop_grace)
                await previous.wait()
            await self._serve(plan)
        finally:
            done.set()

    async def _serve(self, plan: LR.LaunchPlan) -> None:
        log_path = self.log_path
        handle: ServerHandle | None = None
        try:
            async with trio.open_nursery() as nursery:
                try:
                    handle = await nursery.start(
                        functools.partial(
                            serve_server,
                            server_spec(plan),
                            log_path=log_path,
                            grace=self.data.settings.stop_grace,
                            launch_root=self.instance.launch_root(self.paths),
                            # Written at spawn, rewritten once the real port is known (port 0),
                            # removed at exit: what a restarted daemon proves before adopting.
                            identity_path=self.identity_file,
                            log_rotation=self.config.logs.rotation,
                        )
                    )
                except StokerError as err:
                    self.offer(LR.SpawnFailed(err.reason, {"message": err.message, **err.evidence}))
                    return
                assert handle is not None
                self.server = handle
                self._server_nursery = nursery
                if self.offer(LR.Spawned(handle.pid, handle.identity.create_time, str(log_path))) is None:
                    # The table accounts for every spawn (a stop while spawning stops it); else it must not run.
                    nursery.start_soon(stop_server, handle, self.data.settings.stop_grace)
                report = await handle.wait_exit()
                nursery.cancel_scope.cancel()
        finally:
            # Also when cancelled: a server task that ended leaves no handle to wait on.
            if handle is not None:
                if self.server is handle:
                    self._server_nursery = None
                self._forget_server(handle)
        if report.expected:
            self.offer(LR.StopCompleted(report.returncode, {"signal": report.signal}))
        else:
            self.offer(LR.ServerExited(report.returncode, report.reason, report.evidence))

    async def _watch_ready(self, handle: ServerHandle, stall_timeout: float) -> None:
        announced = False

        def announce() -> None:
            nonlocal announced
            if not announced and handle.log.model_path is not None and handle.exit is None:
                announced = True
                self.offer(LR.LoadStarted({"model_path": handle.log.model_path}))

        async def announce_load() -> None:
            # The engine's first "loaded meta data" line: the model is being read.
            while handle.log.model_path is None and handle.exit is None:
                await handle.wait_changed()
            announce()

        # The stall and start bounds run from the spawn: an engine silent before it reads the
        # model (held by an RPC worker busy with another head) is stalled, never waited on forever.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(announce_load)
            try:
                report = await wait_ready(
                    handle, stall_timeout=stall_timeout, ready_timeout=self.config.server.ready_timeout_s
                )
            except StokerError as err:
                nursery.cancel_scope.cancel()
                if err.reason in (ReasonCode.SERVER_STALLED, ReasonCode.SERVER_START_TIMEOUT):
                    self.offer(LR.StallTimeout())
                return  # an exit is reported by _run_server
            nursery.cancel_scope.cancel()
        announce()  # loaded implies the metadata line: LoadStarted always comes before Ready
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
        self.offer(LR.Ready(evidence))

    def _forget_server(self, server: ServerHandle | AdoptedServer) -> None:
        if self.server is server:
            self.server = None
            self.ready_evidence = None
            self.ready_at = None
            if isinstance(server, AdoptedServer):  # a spawned server's record goes with it
                self.identity_file.unlink(missing_ok=True)

    async def _terminate(self, grace: float, drain: float = 0.0) -> None:
        server = self.server
        after = self.data.after_stop
        if self.drain is not None:  # a planned stop: the front door's requests in flight finish first
            await self.drain(drain)
        # Whether to save, and within what, is states/snapshots/policy.py's (a hang: the grace, no more).
        budget = save_before_stop(after, grace)
        if server is not None and self.before_stop is not None and budget is not None:
            cause = stop_cause(self.data, self.shutting_down)
            with trio.move_on_after(budget) as attempt:
                try:
                    await self.before_stop(self, cause)
                except Exception:  # saving state must never keep a server from stopping
                    log.exception("before-stop hook failed")
            if attempt.cancelled_caught:
                log.warning("no snapshot before %s: the server did not answer within %.1f s", cause, budget)
        if isinstance(server, ServerHandle):
            await stop_server(server, grace)  # _run_server reports StopCompleted
            return
        if isinstance(server, AdoptedServer):
            await server.stop(grace)
            if self.server is server:  # else its exit watcher already reported it
                self._forget_server(server)
                self.offer(LR.StopCompleted(None, {"adopted": True}))
            return
        # No server: the machine asks for a stop only once a spawn has answered, so nothing runs.
        self.offer(LR.StopCompleted(None, {"server": None}))

    # --- after a daemon restart ----------------------------------------------------------

    async def _reattach(self, effect: LR.Reattach) -> None:
        try:
            event, server = await prove_identity(self.identity_file, effect.pid)
            await sweep_unrecorded(self.instance.launch_root(self.paths), server, self.data.settings.stop_grace)
            if server is not None:
                self.server = server
                self._tasks.start_soon(self._watch_adopted_exit, server)
            if self.runner.accepts(event):
                self.fire(event)
            else:  # stopped or failed, and no server of ours: nothing to resume
                log.info("no server to adopt: %s", event)
        finally:
            self._reattached.set()

    async def _watch_adopted_ready(self, server: AdoptedServer, stall_timeout: float) -> None:
        with trio.move_on_after(self.config.server.ready_timeout_s):
            async with EngineClient.open(server.base_url, server.api_key) as engine:
                while self.server is server:
                    if await engine.healthy():
                        await self._ready({"adopted": True, "base_url": server.base_url, "pid": server.pid})
                        return
                    await trio.sleep(0.2)
            return
        self.offer(LR.StallTimeout())

    async def _watch_adopted_exit(self, server: AdoptedServer) -> None:
        reason, evidence = await server.wait_exit()
        if self.server is not server:
            return
        self._forget_server(server)
        self.offer(LR.ServerExited(None, reason, evidence))

    # --- for status ----------------------------------------------------------------------

    def endpoint(self) -> tuple[str | None, str | None]:
        """(base URL, API key) of the live server, if any."""
        server = self.server
        if server is None:
            return None, None
        if isinstance(server, ServerHandle):
            return server.base_url, server.api_key
        return server.base_url, server.identity.api_key
