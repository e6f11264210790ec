"""The fleet: every configured model's member, found by the names a request may use, loaded on
demand within `[placement] max_loaded`.

`load` is the one way a model starts once the daemon runs (a request held at the front door,
`stoker up MODEL`, the daemon's own autostart of the default and pinned models): under one
placement lock it asks states/fleet/placement.py what loading it takes with the facts of the moment,
and does that: start it, unload the model it names first (a planned stop: drained, snapshots
saved, TERM; recorded in that model's history as placement_evicted with the model it made
room for), or wait for a place to free (a request waits within its hold bound; `up` does not
wait and answers placement_no_room).

Each member's supervisor runs in the fleet's nursery under its own cancel scope, so a model
added to the config starts without a daemon restart, and one removed is stopped (drained like
any planned stop) and then forgotten. A server of an instance the config no longer names (a
daemon killed before its config lost that section) is adopted at start and stopped the same way.
Beside the supervisors runs the idle unload (daemon/fleet/idle.py: `[models.NAME] idle_ttl_s`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import attrs
import psutil
import trio

from stoker.daemon.config.model import Config, needs_relaunch
from stoker.daemon.config.placement import max_loaded_for
from stoker.daemon.config.instances import ServedModel, served_models
from stoker.daemon.core.errors import StokerError
from stoker.daemon.fleet.idle import serve_idle_unloads
from stoker.daemon.fleet.member import Member, Services, build_member
from stoker.daemon.fleet.remote import Remotes
from stoker.daemon.fleet.room import RoomMaker
from stoker.daemon.launch.instance import ServerInstance
from stoker.states.launch import records as LR
from stoker.states.fleet.placement import UNLOADED, Verdict, capacity, place
from stoker.states.reasons import ReasonCode
from stoker.daemon.models.known import same_model
from stoker.store.catalog import ModelRecord

log = logging.getLogger(__name__)

LAUNCH_KIND = "launch"


def _total_ram() -> int | None:
    try:
        return int(psutil.virtual_memory().total)
    except (OSError, RuntimeError):  # pragma: no cover - psutil answers on every supported platform
        return None


@attrs.define(eq=False)
class Fleet:
    """The members by NAME (config order), the placement lock and the supervisors' nursery."""

    services: Services
    config: Config
    may_start: Callable[[], bool] = lambda: True  # False while no valid config was ever read
    total_ram: int | None = attrs.field(factory=_total_ram)
    members: dict[str, Member] = attrs.field(factory=dict)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _nursery: trio.Nursery | None = None
    room: RoomMaker = attrs.field(init=False)
    # [models.NAME] served by an external endpoint: no member, nothing placed (daemon/fleet/remote.py)
    remotes: Remotes = attrs.field(factory=Remotes)

    def __attrs_post_init__(self) -> None:
        self.room = RoomMaker(self.serving, lambda: self.config.placement, self._lock, self.services.change_signal)
        self.remotes.apply(self.config)
        for served in served_models(self.config, self._catalog(), same_model):
            self.members[served.name] = self._build(served)
        for member in self._leftovers():
            self.members[member.name] = member

    def _catalog(self) -> list[ModelRecord]:
        return self.services.pulls.models()

    def catalog_changed(self) -> None:
        """A model was pulled or removed: serve the catalog as it is now (a new model servable by
        its name at once, a removed one retired)."""
        if self._nursery is not None:
            self.apply(self.config, catalog_only=True)

    def _build(self, served: ServedModel) -> Member:
        return build_member(served, self.services, self.room.make_room)

    # --- lookup ----------------------------------------------------------------------------

    def serving(self) -> list[Member]:
        """The configured members, in config order (not those being retired)."""
        return [m for m in self.members.values() if not m.retiring]

    @property
    def default(self) -> Member:
        """The default model's member (the one a request without a known model goes to)."""
        serving = self.serving()
        return next((m for m in serving if m.served.default), serving[0])

    def lookup(self, model: str | None) -> Member | None:
        """The member a request's `model` names: a NAME first, then "default", then any other
        name a member answers to (its file, its stem, its engine's id); None: not served."""
        if model is None:
            return self.default
        serving = self.serving()
        exact = next((m for m in serving if m.name == model), None)
        if exact is not None:
            return exact
        if model == "default":
            return self.default
        return next((m for m in serving if model in m.names()), None)

    def member(self, model: str | None) -> Member:
        """`lookup`, or StokerError(model_not_found) naming the configured models."""
        found = self.lookup(model)
        if found is None and (remote := self.remotes.get(model)) is not None:
            raise StokerError(
                ReasonCode.MODEL_NOT_FOUND,
                f"{model} is served by its endpoint {remote.config.endpoint}: Stoker runs no server for it, so there "
                f"is none to start, stop or restart (`stoker status` shows the endpoint's reachability).",
                {"model": model, "endpoint": remote.config.endpoint},
            )
        if found is None:
            names = [m.name for m in self.serving()]
            raise StokerError(
                ReasonCode.MODEL_NOT_FOUND,
                f"No model is named {model!r}; Stoker serves {', '.join(names)} (a name Stoker knows, or any "
                f"spec, is pulled and served by `stoker run {model}`).",
                {"model": model, "models": names},
            )
        return found

    def max_loaded(self) -> int:
        """How many models may be loaded at once now ([placement] max_loaded, never below the pinned)."""
        setting = max_loaded_for(self.config.placement.max_loaded, self.total_ram)
        return capacity(setting, sum(1 for m in self.serving() if m.served.pinned))

    # --- loading -----------------------------------------------------------------------------

    async def load(self, member: Member, *, wait: bool) -> None:
        """Start `member`, making room first as states/fleet/placement.py says. `wait`: wait for a place
        to free (the caller bounds it); else placement_no_room when none can be made now."""
        if not self.may_start():
            raise StokerError(ReasonCode.CONFIG_INVALID, "No valid config was read yet; fix the file first.")
        while True:
            # The lock is not held while waiting: a plan being placed by memory (room.py) takes it too.
            async with self._lock:
                if self._try_load(member, wait):
                    return
                changed = self.services.change_signal.armed()
            await changed.wait()  # a model stopped, a request ended

    def _try_load(self, member: Member, wait: bool) -> bool:
        """One placement under the lock: True once `member` is started (or on its way); False to
        wait for a change; StokerError(placement_no_room) when it must not wait."""
        while True:
            if member.state not in UNLOADED:  # already loaded, or on its way (a stop turns back)
                member.supervisor.offer(LR.UpRequested(member.settings()))
                return True
            now = time.time()
            placement = place(member.name, [m.resident(now) for m in self.serving()], self.max_loaded())
            if placement.verdict is Verdict.LOAD:
                member.supervisor.fire(LR.UpRequested(member.settings()))
                return True
            if placement.verdict is Verdict.EVICT:
                victim = self.members[str(placement.victim)]
                log.info("unloading %s to make room for %s: %s", victim.name, member.name, placement.evidence)
                victim.supervisor.fire(LR.DownRequested(LR.DownCause.EVICTED, placement.evidence))
                continue
            if placement.verdict is Verdict.NO_ROOM and not wait:
                loaded = ", ".join(f"{r['name']} ({r['state']})" for r in placement.evidence["loaded"])
                raise StokerError(
                    ReasonCode.PLACEMENT_NO_ROOM,
                    f"{member.name} cannot be loaded: {placement.evidence['max_loaded']} models are loaded "
                    f"({loaded}), each pinned or answering requests. Stop one (`stoker down MODEL`) or raise "
                    f"[placement] max_loaded.",
                    placement.evidence,
                )
            return False

    async def _autostart(self, members: list[Member]) -> None:
        for member in members:
            try:
                await self.load(member, wait=False)
            except StokerError as err:
                log.warning("%s not started: %s %s", member.name, err.reason, err.message)

    def autostart(self, *, load_default: bool = True) -> None:
        """Start the pinned models, then the default (`load_default`), where the store does not
        hold them already running (adopted) or failed (a failure stays until `stoker up`)."""
        wanted = sorted(
            (m for m in self.serving() if m.served.pinned or (load_default and m.served.default)),
            key=lambda m: not m.served.pinned,
        )
        wanted = [
            m for m in wanted if not m.supervisor.runner.resumed or m.supervisor.loaded_state is LR.LaunchState.STOPPED
        ]
        self._tasks.start_soon(self._autostart, wanted)

    # --- the supervisors ---------------------------------------------------------------------

    @property
    def _tasks(self) -> trio.Nursery:
        assert self._nursery is not None, "the fleet is not serving"
        return self._nursery

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every member's supervisor (each proves its identity file before this reports
        started), retire the leftovers, then serve until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for member in list(self.members.values()):
                await nursery.start(self._run, member)
            for member in list(self.members.values()):
                if member.retiring:
                    nursery.start_soon(self._retire, member)
            await nursery.start(serve_idle_unloads, self.serving, self.services.change_signal)
            await nursery.start(self.remotes.serve)
            task_status.started()
            self.catalog_changed()  # pulls that finished while the members started
            await trio.sleep_forever()

    async def _run(self, member: Member, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with member.scope:
            async with trio.open_nursery() as beside:  # its orchestrator's builds beside
                member.orchestrator.tasks = beside
                try:
                    await member.supervisor.run(task_status=task_status)
                finally:
                    member.orchestrator.tasks = None

    async def _add(self, member: Member) -> None:
        await self._tasks.start(self._run, member)
        if member.served.autostart:
            await self._autostart([member])

    async def _retire(self, member: Member) -> None:
        """Stop a member for good (drained like any planned stop), then forget it."""
        member.retiring = True
        member.supervisor.offer(LR.DownRequested(LR.DownCause.REMOVED))
        await member.wait_state(UNLOADED)
        if member.retiring and self.members.get(member.name) is member:
            member.scope.cancel()
            del self.members[member.name]
            log.info("%s is no longer served", member.name)

    def _leftovers(self) -> list[Member]:
        """Members for instances the config does not name whose server may still run: adopted
        (proven) at start, then retired."""
        found = []
        for record in self.services.store.machines(kind=LAUNCH_KIND):
            instance = ServerInstance.of_machine(LAUNCH_KIND, record.id)
            if instance is None or instance.name in self.members:
                continue
            running = record.state not in {s.value for s in UNLOADED}
            if not running and not instance.identity_file(self.services.paths).exists():
                continue
            member = self._build(ServedModel(instance.name, self.config))
            member.retiring = True
            found.append(member)
        return found

    # --- config reload and shutdown ------------------------------------------------------------

    def relaunches(self, new: Config) -> list[ServedModel]:
        """The configured models whose server `new` changes (relaunched if it runs)."""
        return [
            served
            for served in served_models(new, self._catalog(), same_model)
            if (member := self.members.get(served.name)) is not None
            and not member.retiring
            and needs_relaunch(member.served.config, served.config)
        ]

    def apply(self, new: Config, *, catalog_only: bool = False) -> None:
        """Put `new` in force: each member gets its model's config (relaunched where it changed
        what its server runs), new sections get members, removed ones are retired.
        `catalog_only`: the config is the same, the catalog changed (no member is told of a new config)."""
        self.config = new
        self.remotes.apply(new)
        wanted = served_models(new, self._catalog(), same_model)
        for served in wanted:
            member = self.members.get(served.name)
            if member is None:
                member = self._build(served)
                self.members[served.name] = member
                self._tasks.start_soon(self._add, member)
                continue
            old, member.served, member.retiring = member.served, served, False
            member.supervisor.config = served.config
            if needs_relaunch(old.config, served.config) or (member.state in UNLOADED and not catalog_only):
                member.supervisor.offer(LR.ConfigChanged(member.settings()))
        names = {served.name for served in wanted}
        for member in list(self.members.values()):
            if member.name not in names and not member.retiring:
                member.retiring = True
                self._tasks.start_soon(self._retire, member)

    async def stop_all(self) -> None:
        """The daemon's shutdown: stop every server at once (each drained, its snapshots saved)."""
        for member in list(self.members.values()):
            member.supervisor.shutting_down = True
            member.supervisor.offer(LR.DownRequested(LR.DownCause.SHUTDOWN))
        for member in list(self.members.values()):
            await member.wait_state(UNLOADED)
