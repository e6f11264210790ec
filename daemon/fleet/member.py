"""One configured model and everything that serves it: its server instance, launch supervisor,
fallback orchestrator and use at the front door.

Each member has its own launch and fallback machines (`launch:<NAME>`, `fallback:<NAME>`; the
`default` instance of a config without [models] keeps `launch` and `fallback`), history and
reason codes, so one model can run on a GPU while another has fallen back to the CPU. They
share the daemon's probes, installs, pulls, snapshots and event bus (`Services`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Mapping

import attrs
import trio

from stoker.daemon.backends.base import Backend
from stoker.daemon.config.model import Config
from stoker.daemon.config.instances import ServedModel
from stoker.daemon.core.machines import Publish
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.fallback.memory import with_memory
from stoker.daemon.fallback.orchestrator import FallbackOrchestrator
from stoker.daemon.fleet.usage import ChangeSignal, Usage
from stoker.daemon.install.installer import InstallService
from stoker.daemon.launch.instance import ServerInstance
from stoker.daemon.launch.supervisor import Supervisor, launch_settings
from stoker.daemon.models.pull import PullService
from stoker.daemon.probes.verdicts import ProbeService
from stoker.daemon.snapshots.save_restore import SnapshotService
from stoker.daemon.telemetry.sampler import ServerTarget
from stoker.store.catalog import ModelRecord
from stoker.states.fallback import table as F
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.fleet.idle_unload import IdleFacts
from stoker.states.launch.context import planned_ctx_size
from stoker.states.pull.lookup import ModelForm, model_form
from stoker.states.reasons import message_for
from stoker.states.fleet.placement import Footprint, Resident, loads_on_demand, occupies
from stoker.store.database import Store

log = logging.getLogger(__name__)


@attrs.frozen
class Services:
    """What every member shares: the daemon's stores, services and event bus."""

    paths: StokerPaths
    store: Store
    probes: ProbeService
    installs: InstallService
    backends: Mapping[str, Backend]
    pulls: PullService
    snapshots: SnapshotService
    publish: Publish
    change_signal: ChangeSignal


@attrs.define(eq=False)
class Member:
    """A configured model: its instance's supervisor and orchestrator, and its use."""

    served: ServedModel
    supervisor: Supervisor
    orchestrator: FallbackOrchestrator
    usage: Usage
    change_signal: ChangeSignal
    snapshots: SnapshotService
    retiring: bool = False  # its section left the config (or it was found unconfigured): stopping for good
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)  # its supervisor's task

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def instance(self) -> ServerInstance:
        return self.supervisor.instance

    @property
    def slots_saved(self) -> int | None:
        """The slots its next load restores: what its last stop saved, read from its own snapshot
        rows (so a daemon restart keeps it; another instance's never count); None: snapshots off."""
        return self.snapshots.slots_saved(self.name)

    @property
    def state(self) -> LR.LaunchState:
        return self.supervisor.state

    @property
    def data(self) -> LR.LaunchData:
        return self.supervisor.data

    def endpoint(self) -> tuple[str | None, str | None]:
        """The engine's base URL and per-launch key (None, None without a server)."""
        return self.supervisor.endpoint()

    @property
    def machines(self) -> tuple[str, ...]:
        """Its launch and fallback machines' store ids (its history)."""
        return (self.instance.machine_id(L.LAUNCH.name), self.instance.machine_id(F.FALLBACK.name))

    def server_target(self) -> ServerTarget | None:
        """Its live server as telemetry and /metrics read it: the backend really in use (a GPU
        server that offloaded nothing computes on the CPU), the planned one, the layers the
        engine offloaded; None when no server process runs."""
        sup = self.supervisor
        server, plan = sup.server, sup.data.plan
        if server is None or plan is None:
            return None
        base_url, api_key = sup.endpoint()
        ready = sup.state is LR.LaunchState.READY
        in_use = self.orchestrator.effective_backend(plan) or plan.backend
        proven = sup.ready_evidence or {}
        return ServerTarget(
            backend=in_use,
            pid=server.pid,
            state=sup.state.value,
            base_url=base_url if ready else None,
            api_key=api_key if ready else None,
            planned_backend=None if in_use == plan.backend else plan.backend,
            offloaded_layers=proven.get("offloaded_layers"),
            total_layers=proven.get("total_layers"),
        )

    def settings(self) -> LR.LaunchSettings:
        """The launch machine's knobs from this model's config."""
        return launch_settings(self.served.config)

    @property
    def occupies(self) -> bool:
        """Loaded, or on its way up or down: it takes one of max_loaded's places."""
        return occupies(self.state)

    @property
    def loads_on_demand(self) -> bool:
        """Stopped, and a request naming it loads it (states/fleet/placement.py)."""
        return not self.retiring and loads_on_demand(self.state, self.data.down_cause, self.data.reason)

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since its last request (or since ready); 0 while a request is in flight."""
        return self.usage.idle_s(time.time() if now is None else now, self.supervisor.ready_at)

    def resident(self, now: float) -> Resident:
        """Its facts for a placement decision."""
        return Resident(
            self.name,
            self.state,
            pinned=self.served.pinned,
            in_flight=self.usage.in_flight,
            waiting=self.usage.waiting,
            idle_s=self.idle_s(now),
        )

    def footprint(self) -> Footprint:
        """What its server holds by the reading that decides: the buffers the engine reported as it
        loaded once it is ready (RAM: the host's, VRAM: the devices'), else its plan's estimate;
        nothing without a plan."""
        plan, ready = self.data.plan, self.supervisor.ready_evidence
        if plan is None:
            return Footprint()
        buffers = (ready or {}).get("buffers") if self.state is LR.LaunchState.READY else None
        if buffers:
            ram = sum(b["mib"] for b in buffers if on_host(str(b["device"])))
            vram = sum(b["mib"] for b in buffers if not on_host(str(b["device"])))
            return Footprint(round(ram, 1), round(vram, 1), "engine")
        memory = plan.memory
        if memory is None:
            return Footprint(reading="none", partial=True)
        return Footprint(memory.host_mib, memory.vram_mib, memory.source, memory.partial)

    def idle_facts(self) -> IdleFacts:
        """Its facts for the idle unload (states/fleet/idle_unload.py): last used is its last request's
        end, or its ready if that is later."""
        used = [t for t in (self.usage.last_used, self.supervisor.ready_at) if t is not None]
        return IdleFacts(
            self.name,
            self.state,
            self.served.idle_ttl_s,
            pinned=self.served.pinned,
            in_flight=self.usage.in_flight,
            waiting=self.usage.waiting,
            last_used=max(used, default=None),
            keep_alive_s=self.usage.keep_alive_s,
        )

    def names(self) -> frozenset[str]:
        """What a request's `model` may say to reach it: its NAME, "default" for the default
        model, the model as configured (with its file name and stem), and the path its engine
        was launched with (the id the engine's own /v1/models reports), with its name and stem."""
        names = {self.name, self.served.spec, *self.served.aliases}
        if self.served.default:
            names.add("default")
        plan = self.data.plan
        if plan is not None:
            names.add(plan.model_path)
        for name in list(names - {self.name, "default", *self.served.aliases}):
            names.update({Path(name).name, Path(name).stem})
        return frozenset(names)

    def serves(self, record: ModelRecord) -> bool:
        """Whether it serves that catalog model: configured by its catalog name, or configured
        with (or last launched on) the same file."""
        spec = self.served.spec
        if model_form(spec) is ModelForm.NAME and spec == record.name:
            return True
        files = [self.data.plan.model_path] if self.data.plan else []
        if model_form(spec) is ModelForm.PATH:
            files.append(os.path.expanduser(spec))
        wanted = os.path.realpath(record.path)
        return any(os.path.realpath(f) == wanted for f in files)

    async def wait_state(self, states: Iterable[LR.LaunchState]) -> None:
        """Return once its launch machine is in one of `states`."""
        wanted = set(states)
        while self.state not in wanted:
            await self.change_signal.wait()

    def effective_backend(self) -> str | None:
        """The backend really in use (status's `backend`): the CPU after a late demotion."""
        return self.orchestrator.effective_backend(self.data.plan)


def reason_message(data: LR.LaunchData) -> str | None:
    """Why a launch machine is where it is, in words: its evidence's own sentence where it has one
    (a forced backend, ...), else the reason code's (None when healthy)."""
    specific = data.evidence.get("message")
    if data.reason and isinstance(specific, str) and specific:
        return specific
    return message_for(data.reason) if data.reason else None


def on_host(device: str) -> bool:
    """Whether an engine buffer's device is host memory: "CPU", "CPU_Mapped", "CPU_REPACK", and
    the accelerators' pinned host buffers ("CUDA_Host"); anything else is a device's."""
    return device.startswith("CPU") or device.endswith("_Host")


# Room for a member's planned server (daemon/fleet/room.py): the plan back once it fits.
# (the member, its plan, how to plan it again once models were unloaded for it) -> the plan to start
MakeRoom = Callable[[Member, LR.LaunchPlan, Callable[[], Awaitable[LR.LaunchPlan]]], Awaitable[LR.LaunchPlan]]


def build_member(served: ServedModel, services: Services, make_room: MakeRoom | None = None) -> Member:
    """A member for `served`: its instance's orchestrator and supervisor wired to the shared
    services, its supervisor's drain its own requests in flight; each plan goes through
    `make_room` (memory-aware placement) before the launch machine gets it."""
    instance = ServerInstance(served.name)
    usage = Usage(on_change=services.change_signal.fire)
    orchestrator = FallbackOrchestrator(
        services.paths,
        services.store,
        services.probes,
        services.installs,
        services.backends,
        publish=services.publish,
        instance=instance,
        alias=served.engine_alias,
        pulls=services.pulls,
    )
    snapshots = services.snapshots

    async def on_ready(supervisor: Supervisor, evidence: dict[str, Any]) -> dict[str, Any]:
        # First prove the backend is really in use (or demote it), then restore snapshots.
        try:
            extra = dict(await orchestrator.on_ready(supervisor, evidence) or {})
        except Exception:  # never keep a serving server from ready, nor skip the restore
            log.exception("verifying the backend in use failed")
            extra = {}
        extra.update(await snapshots.on_ready(supervisor, {**evidence, **extra}) or {})
        return extra

    async def plan(config: Config, effect: LR.MakePlan) -> LR.LaunchPlan:
        if effect.ctx_size is not None:  # a request's larger context (states/launch/context.py)
            server = attrs.evolve(config.server, ctx_size=planned_ctx_size(config.server.ctx_size, effect.ctx_size))
            config = attrs.evolve(config, server=server)

        async def planned() -> LR.LaunchPlan:
            made = await orchestrator.plan(config, effect)
            return await with_memory(made, orchestrator.fit_room)

        first = await planned()
        return first if make_room is None else await make_room(member, first, planned)

    supervisor = Supervisor(
        services.paths,
        services.store,
        served.config,
        plan,
        instance=instance,
        publish=services.publish,
        ready_hook=on_ready,
        before_stop=snapshots.before_stop,
        drain=functools.partial(usage.drain_within, name=served.name),
    )
    member = Member(served, supervisor, orchestrator, usage, services.change_signal, snapshots)
    # A GPU bundle built beside is installed: the planned restart that switches to it.
    orchestrator.restart = functools.partial(supervisor.offer, LR.RestartRequested())
    return member
