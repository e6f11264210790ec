"""The daemon: one root nursery in which every service starts, in this order.

    (daemon/start.py: private dirs -> lock -> store -> config -> plugins -> probes, while this
     module loads) -> store keeper -> installs (resumes interrupted installs)
         -> pulls -> snapshots -> the fleet (one supervisor per configured model, each resuming its
            launch machine; its planner is its own fallback orchestrator) -> engine updates (resumes
            one left mid-way; the opt-in automatic check) -> telemetry
         -> control socket -> front door -> config watcher -> sd_notify watchdog -> autostart
            (the pinned models and the default; the others load when a request names them)

The control socket's handlers reach the daemon only through `ControlledDaemon`
(daemon/control/controlled.py); the methods below under "what the socket methods use" are
that interface, and nothing in daemon.control imports this module.

A second daemon on the same state directory refuses to start (an flock that the kernel
releases even when the daemon is killed with -9). A planned shutdown stops every server first.
`Daemon.supervisor` is the default model's (what `status`'s top-level fields, telemetry and
/metrics describe); everything per model goes through `Daemon.fleet` (daemon/fleet/).

The disk never stops the daemon: a transition the state database cannot take waits in memory
(the store keeper writes it when space returns; `status` says `store_write_failed` meanwhile),
and a refusal to start is one line, `error [reason]: sentence`, with the reason that stopped it.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import attrs
import trio

from stoker.daemon.core import sdnotify
from stoker.states.convert import structure, unstructure
from stoker.daemon.config.model import Config, ConfigError, config_diff
from stoker.daemon.config.watch import watch_config
from stoker.daemon.control.controlled import HistoryQuery
from stoker.daemon.control.methods import dispatch
from stoker.daemon.control.replies import (
    ApiKey,
    CatalogModel,
    CreatedApiKey,
    ModelList,
    ModelRemoved,
    PullState,
    ServedBy,
    SnapshotListing,
    SnapshotRestored,
    TelemetryReading,
)
from stoker.daemon.control.server import serve_control
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.events import EventBus
from stoker.daemon.core.machines import EffectDriver, MachineRunner
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.store_keeper import serve_store_keeper
from stoker.daemon.core.launch_records import runs_root, stop_abandoned
from stoker.daemon.backends.base import Backend, Detection
from stoker.daemon.bundles.installed import InstalledBundle
from stoker.daemon.fallback.orchestrator import FallbackOrchestrator
from stoker.daemon.fleet.engine_servers import FleetEngineServers
from stoker.daemon.fleet.fleet import Fleet
from stoker.daemon.fleet.member import Member, Services
from stoker.daemon.fleet.usage import ChangeSignal
from stoker.daemon.frontdoor.hold import Hold
from stoker.daemon.frontdoor.server import serve_frontdoor
from stoker.daemon.frontdoor.daemon_view import Caller
from stoker.daemon.install.manifest import MANIFEST_ENV
from stoker.daemon.install.installer import InstallService
from stoker.daemon.install.update import EngineUpdateService
from stoker.daemon.probes.verdicts import ProbeResult, ProbeService
from stoker.daemon.snapshots.save_restore import SnapshotService
from stoker.daemon.launch.supervisor import Supervisor
from stoker.daemon.models.check import model_problem
from stoker.daemon.models.pull import PullOptions, PullService, pull_options
from stoker.daemon.telemetry.sampler import ServerTarget, TelemetrySampler
from stoker.daemon.telemetry.publisher import serve_telemetry
from stoker.states.config import table as C
from stoker.states.launch import records as LR
from stoker.store import TransitionRecord
from stoker.store.catalog import ModelRecord
from stoker.store.database import Store, StoreHealth
from stoker.store.errors import StoreError
from stoker.store.keys import KeyStore
from stoker.store.snapshots import SnapshotCatalog, SnapshotRecord

log = logging.getLogger("stoker")


@attrs.define(eq=False)
class Daemon:
    paths: StokerPaths
    store: Store
    bus: EventBus
    config: Config
    backends: dict[str, Backend]  # the plugins that loaded (daemon/start.py loads them first)
    probes: ProbeService  # serving already (daemon/start.py: the probes run while this module loads)
    fleet: Fleet = attrs.field(init=False)  # every configured model's supervisor and orchestrator
    installs: InstallService = attrs.field(init=False)
    engine_updates: EngineUpdateService = attrs.field(init=False)  # `stoker engine update|rollback`
    snapshots: SnapshotService = attrs.field(init=False)
    keys: KeyStore = attrs.field(init=False)  # the user's API keys; the front door checks with keys.check
    frontdoor_hold: Hold = attrs.field(init=False)  # requests held or in flight at the front door
    pulls: PullService = attrs.field(init=False)  # model pulls and the catalog (daemon/models/pull.py)
    config_runner: MachineRunner = attrs.field(init=False)
    _config_effects: EffectDriver[None] = attrs.field(init=False)
    telemetry_sampler: TelemetrySampler | None = attrs.field(init=False, default=None)  # set when served
    # The front door's bound URLs once it started ([] when off or its port was taken); None before.
    frontdoor_binds: list[str] | None = attrs.field(init=False, default=None)
    _config_applied: trio.Event = attrs.field(init=False, factory=trio.Event)
    # Ollama's API ([ollama], daemon/frontdoor/ollama.py): where it listens, or why it could not.
    ollama_url: str | None = attrs.field(init=False, default=None)
    ollama_error: str | None = attrs.field(init=False, default=None)
    config_problems: list[str] = attrs.field(factory=list)
    config_loaded_invalid: bool = False  # no valid file was ever read: refuse `up`
    started_at: float = attrs.field(factory=time.time)
    _shutdown: trio.Event = attrs.field(factory=trio.Event)
    change_signal: ChangeSignal = attrs.field(
        factory=ChangeSignal
    )  # fired at every transition (and every request's end)

    def __attrs_post_init__(self) -> None:
        backends = self.backends
        self.probes.publish = self.publish  # its events on the bus, and the change signal fired
        self.store.on_health = self._on_store_health
        self.config_runner = MachineRunner(C.CONFIG, "config", self.store, publish=self.publish)
        self._config_effects = EffectDriver(C.CONFIG, {C.ApplyConfig: self._apply_config})
        self.snapshots = SnapshotService(self.paths, SnapshotCatalog(self.store), lambda: self.config, self.bus.publish)
        self.keys = KeyStore(self.store)
        self.pulls = PullService(
            self.paths, self.store, self.publish, in_use=self.serves_model, launched_by=self.serves_by_name
        )
        self.installs = InstallService(
            self.paths,
            self.store,
            self.publish,
            manifest_source=self.manifest_source,
            trusted_keys=lambda: self.config.bundles.trusted_keys,
            backends=backends,
        )
        self.frontdoor_hold = Hold(self)  # the front door's waiting room (each model's requests in its member)
        services = Services(
            self.paths,
            self.store,
            self.probes,
            self.installs,
            backends,
            self.pulls,
            self.snapshots,
            self.publish,
            self.change_signal,
        )
        self.fleet = Fleet(services, self.config, may_start=lambda: not self.config_loaded_invalid)
        self.pulls.on_change = self.fleet.catalog_changed
        self.engine_updates = EngineUpdateService(
            self.paths,
            self.store,
            self.installs,
            self.publish,
            settings=lambda: self.config.engine,
            ready_timeout=lambda: self.config.server.ready_timeout_s,
            servers=FleetEngineServers(lambda: self.fleet, self.store),
        )

    @property
    def supervisor(self) -> Supervisor:
        """The default model's supervisor: what the top-level status, telemetry and /metrics describe."""
        return self.fleet.default.supervisor

    @property
    def orchestrator(self) -> FallbackOrchestrator:
        """The default model's fallback orchestrator."""
        return self.fleet.default.orchestrator

    def manifest_source(self) -> str:
        """Where bundles are resolved: `[bundles] manifest`, else $STOKER_MANIFEST_URL."""
        return self.config.bundles.manifest or os.environ.get(MANIFEST_ENV, "")

    def _on_store_health(self, health: StoreHealth) -> None:
        if health.writable:
            log.warning("the state database takes writes again: the held-back transitions are written")
        else:
            log.error(
                "the state database cannot be written (%s): the daemon keeps running and writes the held-back "
                "transitions once it can",
                health.error,
            )
        self.publish({"topic": "store.writable" if health.writable else "store.write_failed", **health.to_dict()})

    def store_health(self) -> StoreHealth:
        """Whether transitions reach the state database, and what waits for it."""
        return self.store.health()

    def publish(self, event: Mapping[str, Any]) -> None:
        self.bus.publish(event)
        self.change_signal.fire()

    def launch_settings(self) -> LR.LaunchSettings:
        return self.fleet.default.settings()

    async def wait_state(self, states: Iterable[LR.LaunchState]) -> None:
        """Until the default model's launch machine is in one of `states`."""
        await self.fleet.default.wait_state(states)

    def request_shutdown(self) -> None:
        self._shutdown.set()

    # --- what the socket methods use (daemon.control.controlled.ControlledDaemon) --------

    def fallback_status(self, member: Member | None = None) -> Mapping[str, Any]:
        member = member or self.fleet.default
        return member.orchestrator.status(member.supervisor, member.served.config.backend.prefer)

    def probe_verdicts(self) -> Mapping[str, Mapping[str, Any]]:
        return self.probes.verdicts()

    def history(self, query: HistoryQuery) -> Sequence[TransitionRecord]:
        return self.store.history(**attrs.asdict(query, recurse=False))  # its fields are the store's filters

    def transitions_after(self, after_id: int, kinds: Sequence[str], limit: int) -> Sequence[TransitionRecord]:
        """History rows past `after_id`, in write order: the front door's /metrics counters."""
        return self.store.transitions_after(after_id, kinds, limit)

    @property
    def backend_names(self) -> Sequence[str]:
        return tuple(self.probes.backends)

    async def probe(self, backend: str) -> ProbeResult:
        return await self.probes.probe(backend)

    async def probe_all(self, names: Sequence[str], *, fresh: bool) -> Mapping[str, ProbeResult]:
        return await self.probes.probe_all(list(names), fresh=fresh)

    async def install(self, backend: str, *, variant: str | None, detection: Detection) -> InstalledBundle:
        return await self.installs.install(backend, variant=variant, detection=detection)

    async def install_file(self, path: Path, *, smoke: bool, detection: Detection | None) -> InstalledBundle:
        return await self.installs.install_file(path, smoke=smoke, detection=detection)

    def install_statistics(self) -> Sequence[Mapping[str, Any]]:
        return self.installs.statistics()

    def snapshot_status(self, member: Member | None = None) -> dict[str, Any] | None:
        return self.snapshots.status((member or self.fleet.default).supervisor.ready_evidence)

    def snapshot_listing(self, instance: str) -> SnapshotListing:
        member = self.fleet.members.get(instance)
        ready = member is not None and member.state is LR.LaunchState.READY
        listing = self.snapshots.listing(instance, member.supervisor if member is not None and ready else None)
        return structure(listing, SnapshotListing)

    def snapshot(self, snapshot_id: int, instance: str) -> SnapshotRecord:
        return self.snapshots.get(snapshot_id, instance)

    async def save_snapshots(self, member: Member, slot: int | None) -> Sequence[SnapshotRecord]:
        return await self.snapshots.save(member.supervisor, "manual", slot=slot)

    async def restore_snapshot(
        self, member: Member, snapshot_id: int, slot: int | None, if_faster: bool = False
    ) -> SnapshotRestored:
        restored = await self.snapshots.restore(member.supervisor, snapshot_id, slot, if_faster=if_faster)
        return structure(restored, SnapshotRestored)

    def remove_snapshot(self, record: SnapshotRecord) -> None:
        self.snapshots.remove([record])

    def create_key(self, name: str | None) -> CreatedApiKey:
        return CreatedApiKey.made(self.keys.create(name))

    def authorize(self, presented_key: str | None, loopback: bool) -> Caller | None:
        """The front door's key check: a valid user key always passes (as its name, for the
        access log); without one, a loopback client passes unless [frontdoor] require_keys."""
        if presented_key is not None and (record := self.keys.check(presented_key)) is not None:
            return Caller(record.name or f"#{record.id}")
        return Caller() if loopback and not self.config.frontdoor.require_keys else None

    def list_keys(self) -> Sequence[ApiKey]:
        return [ApiKey.of(record) for record in self.keys.list()]

    def revoke_key(self, ident: str) -> ApiKey:
        try:
            return ApiKey.of(self.keys.revoke(ident))
        except StoreError as err:
            raise StokerError(err.reason, err.message, err.evidence) from None

    async def pull_model(
        self, spec: str, *, name: str | None, hf_endpoint: str | None, hf_token: str | None, index_url: str | None
    ) -> ModelRecord:
        options: PullOptions = pull_options(hf_endpoint=hf_endpoint, hf_token=hf_token, index_url=index_url)
        return await self.pulls.pull(spec, name=name, options=options)

    def list_models(self) -> ModelList:
        members = self.fleet.serving()
        models = tuple(
            structure(
                unstructure(record)
                | {"served_by": [unstructure(ServedBy(m.name, m.state.value)) for m in members if m.serves(record)]},
                CatalogModel,
            )
            for record in self.pulls.models()
        )
        return ModelList(models=models, pulls=structure(self.pulls.statistics(), tuple[PullState, ...]))

    def pulls_under_way(self) -> Sequence[Mapping[str, Any]]:
        return self.pulls.under_way()

    async def remove_model(self, name: str) -> ModelRemoved:
        return structure(await self.pulls.remove(name), ModelRemoved)

    def serves_model(self, path: str) -> bool:
        """Whether a server (starting, ready or restarting) runs on the model file `path`."""
        wanted = os.path.realpath(path)
        return any(
            m.data.plan is not None and m.occupies and os.path.realpath(m.data.plan.model_path) == wanted
            for m in self.fleet.members.values()
        )

    def serves_by_name(self, name: str) -> bool:
        """Whether a server runs that was launched by the catalog name `name` (its config names it)."""
        return any(
            m.data.plan is not None and m.occupies and m.served.spec == name for m in self.fleet.members.values()
        )

    async def telemetry(self) -> TelemetryReading:
        if self.telemetry_sampler is None:
            raise RuntimeError("the telemetry service is not running")
        return structure(await self.telemetry_sampler.reading(), TelemetryReading)

    def telemetry_target(self) -> ServerTarget | None:
        """The live server for the telemetry service to sample (the default model's), or None
        when none runs."""
        return self.fleet.default.server_target()

    # --- config reload -------------------------------------------------------------------

    def on_config_change(self, new: Config) -> bool:
        """A valid file was read: check the model a relaunch would load, and let the config
        machine decide; False when it refused (the server keeps serving on the config in force)."""
        old = self.config
        changed = sorted(config_diff(old, new))
        relaunching = self.fleet.relaunches(new)
        reason, problem, key = None, None, "server.model"
        for served in relaunching:  # the first model that cannot load refuses the whole file
            reason, problem = model_problem(served.spec, self.pulls.catalog)
            key = f"models.{served.name}.model" if new.models else "server.model"
            if reason is not None:
                break
        relaunch = bool(relaunching)
        step = self.config_runner.fire(C.ConfigAccepted(changed, relaunch, reason, problem, key))
        self._config_effects.run_all(step.effects, new)
        if self.config is not new:
            self.config_problems = list(self.config_runner.data.problems)
            log.warning("config refused, keeping the previous one: %s", "; ".join(self.config_problems))
            return False
        log.info("config reloaded: %s%s", ", ".join(changed) or "no change", " (relaunch)" if relaunch else "")
        return True

    def _apply_config(self, effect: C.ApplyConfig, new: Config) -> None:
        self.config = new
        self.config_problems = []
        self.config_loaded_invalid = False
        self.fleet.apply(new)  # each model relaunched where its own config changed (effect.relaunch: any)
        self._config_applied.set()
        self._config_applied = trio.Event()

    async def wait_config_applied(self) -> None:
        """Return once a reloaded config is in force (the front door rebinds where its address changed)."""
        await self._config_applied.wait()

    def _frontdoor_bound(self, binds: list[str]) -> None:
        self.frontdoor_binds = binds

    def refuse_initial_config(self, problems: list[str]) -> None:
        """The config file read at start is invalid: defaults in force, nothing started until it is fixed."""
        log.warning(
            "config refused at start, the server is not started (fix it, then `stoker up`): %s", "; ".join(problems)
        )
        self.config_problems = problems
        self.config_loaded_invalid = True
        self.config_runner.fire(C.ConfigRejected(problems))

    def on_config_invalid(self, err: ConfigError) -> None:
        self.config_problems = list(err.problems)
        self.config_runner.fire(C.ConfigRejected(err.problems))
        log.warning("config rejected, keeping the previous one: %s", "; ".join(err.problems))

    # --- the root nursery ----------------------------------------------------------------

    async def serve(
        self,
        *,
        autostart: bool = True,
        load_default: bool = True,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._handle_signals)
            await nursery.start(serve_store_keeper, self.store)
            # Installs and pulls a killed daemon left mid-way go on while the rest starts.
            nursery.start_soon(self.installs.resume_all)
            nursery.start_soon(self.pulls.resume_all)
            await nursery.start(self.snapshots.run)
            await nursery.start(self.fleet.serve)  # every model's supervisor, its identity file proven
            await nursery.start(self.engine_updates.serve)  # resumes an engine update left mid-way
            self.telemetry_sampler = await nursery.start(
                serve_telemetry, self.telemetry_target, self.bus, self.fleet.services.backends
            )
            await nursery.start(serve_control, self.paths.socket_path, partial(dispatch, self), self.bus)
            # The front door (docs/frontdoor.md), user API keys checked through `authorize`.
            self.frontdoor_binds = await nursery.start(
                functools.partial(
                    serve_frontdoor,
                    self,
                    authorize=self.authorize,
                    hold=self.frontdoor_hold,
                    config_applied=self.wait_config_applied,
                    on_bound=self._frontdoor_bound,
                )
            )
            await nursery.start(
                lambda task_status: watch_config(
                    self.paths.config_file,
                    self.on_config_change,
                    on_invalid=self.on_config_invalid,
                    current=self.config,
                    task_status=task_status,
                )
            )
            await nursery.start(sdnotify.serve_watchdog)
            if autostart and not self.config_loaded_invalid:
                # The pinned models and the default, unless the store had them running (adopted)
                # or failed; the others load when a request names them.
                self.fleet.autostart(load_default=load_default)
            log.info("daemon ready (pid %d, socket %s)", os.getpid(), self.paths.socket_path)
            task_status.started()
            await self._shutdown.wait()
            await self._stop_server()
            # This daemon's own runs (a smoke run, a build, a probe) end with it, and any a dead one left.
            with trio.move_on_after(self.config.supervisor.stop_grace_s + 15):
                await stop_abandoned(
                    runs_root(self.paths.runtime_dir), self.config.supervisor.stop_grace_s, and_mine=True
                )
            nursery.cancel_scope.cancel()

    async def _stop_server(self) -> None:
        sdnotify.stopping("stopping the servers")
        # The saves before the stop have their own budget, which scales with the KV to save; the
        # front door's requests in flight are drained first. Every server stops at once.
        drain = self.launch_settings().drain_timeout
        with trio.move_on_after(self.config.supervisor.stop_grace_s + self.snapshots.stop_budget_bound() + drain + 15):
            await self.fleet.stop_all()

    async def _handle_signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for signum in signals:
                if signum == signal.SIGHUP:
                    continue  # the config watcher already follows the file
                log.info("signal %s: shutting down", signal.Signals(signum).name)
                self.request_shutdown()
