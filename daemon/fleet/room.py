"""Memory-aware placement: room for a planned server beside the loaded ones, made before it starts.

When a model's plan is complete (its `memory`: the engine's fitter's projection, or Stoker's
estimate, daemon/fallback/memory.py), the fleet gathers the facts of the moment under its
placement lock: the RAM available now (psutil), the `[placement]` caps, and every other model's
state, use and memory by the reading that decides (`Member.footprint`: the engine's own buffers
once ready, else its plan's estimate; a model admitted a moment ago but not yet spawned counts
with the estimate it was admitted with). states/fleet/placement.py's `place_memory` decides, and this
acts: the plan goes on (LOAD); the least recently used idle unpinned models named are unloaded
first (a planned stop recorded as placement_evicted, with the figures that decided, in their
history), then it asks again once they are gone; it waits for models already stopping; or the
plan fails with placement_no_room and the figures (needed vs available vs cap), which the front
door answers a held request with (503, Retry-After). Nothing is unloaded when unloading every
idle model would not make room.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import attrs
import psutil
import trio

from stoker.daemon.config.placement import PlacementConfig
from stoker.daemon.core.errors import StokerError
from stoker.daemon.fallback.memory import estimate_json
from stoker.daemon.fleet.usage import ChangeSignal
from stoker.states.launch import records as LR
from stoker.states.fleet.placement import (
    ARRIVING,
    FULL_OFFLOAD,
    UNLOADED,
    Footprint,
    MemoryRoom,
    Placement,
    Resident,
    Verdict,
    place_memory,
    place_offload,
)
from stoker.states.reasons import ReasonCode

if TYPE_CHECKING:
    from stoker.daemon.fleet.member import Member

log = logging.getLogger(__name__)

MIB = 2**20


def available_ram_mib() -> float | None:
    """RAM available now (the kernel's MemAvailable: free plus what it can reclaim), in MiB."""
    try:
        return psutil.virtual_memory().available / MIB
    except (OSError, RuntimeError):  # pragma: no cover - psutil answers on every supported platform
        return None


def need_of(plan: LR.LaunchPlan) -> Footprint:
    """What a plan's server will hold, by its estimate (nothing known: nothing counted)."""
    memory = plan.memory
    if memory is None:
        return Footprint(reading="none", partial=True)
    return Footprint(memory.host_mib, memory.vram_mib, memory.source, memory.partial)


def _mib(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0f} MiB"


def no_room_sentence(name: str, placement: Placement) -> str:
    """placement_no_room's sentence, from the figures that decided."""
    ev = placement.evidence
    need = ev["need"]
    # Every figure said is one the verdict was computed from: what stays loaded once every idle
    # model is unloaded (a NO_ROOM verdict's `staying_after_evicting_all`), so they add up.
    left = ev.get("short_after_evicting_all")
    short = left if left is not None else ev.get("short") or {}
    stay = ev.get("staying_after_evicting_all") or {}
    ram = stay.get("ram_mib", ev["used_ram_mib"])
    vram = stay.get("vram_mib", ev["used_vram_mib"])
    said = []
    if "ram_cap" in short:
        said.append(
            f"with what stays loaded ({_mib(ram)} of RAM) it would pass [placement] max_ram_mib = "
            f"{ev['max_ram_mib']} by {_mib(short['ram_cap'])}"
        )
    if "vram_cap" in short:
        said.append(
            f"with what stays loaded ({_mib(vram)} of VRAM) it would pass [placement] max_vram_mib = "
            f"{ev['max_vram_mib']} by {_mib(short['vram_cap'])}"
        )
    if "ram_available" in short:
        freed, arriving = stay.get("freed_ram_mib") or 0, stay.get("arriving_ram_mib") or 0
        said.append(
            f"only {_mib(ev['available_ram_mib'])} of RAM is available"
            + (f", {_mib(freed)} more once the idle models are unloaded" if freed else "")
            + (f", {_mib(arriving)} of it still to be taken by models on their way up" if arriving else "")
            + f" (short by {_mib(short['ram_available'])})"
        )
    busy = [r["name"] for r in ev["loaded"] if r["state"] != LR.LaunchState.STOPPING.value]
    others = f" The loaded models ({', '.join(busy)}) are pinned, busy or on their way up." if busy else ""
    return (
        f"{name} cannot be loaded: its server needs {_mib(need['ram_mib'])} of RAM and {_mib(need['vram_mib'])} of "
        f"VRAM by {need['reading']}, and {'; '.join(said) or 'it does not fit'}.{others} Raise the cap, lower "
        f"its ctx_size, or stop a model (`stoker down MODEL`)."
    )


@attrs.define(eq=False)
class RoomMaker:
    """Makes room for a planned server under the fleet's placement lock (the same lock `Fleet.load`
    takes for max_loaded), so that two plans are never admitted on one reading."""

    serving: Callable[[], Iterable[Member]]
    settings: Callable[[], PlacementConfig]
    lock: trio.Lock
    change_signal: ChangeSignal
    available: Callable[[], float | None] = available_ram_mib
    # Admitted but maybe not yet spawned: what each was admitted with (its plan's estimate).
    admitted: dict[str, Footprint] = attrs.field(factory=dict)

    def _for_full_offload(self, name: str, plan: LR.LaunchPlan, residents: list[Resident]) -> Placement | None:
        """EVICT the idle models whose VRAM makes a short GPU plan whole; None when it is whole
        already or they would not (it loads as fitted)."""
        memory = plan.memory
        if plan.on_cpu or memory is None or not memory.whole:
            return None
        placement = place_offload(name, memory.vram_mib, memory.whole_vram_mib, residents)
        if placement.verdict is not Verdict.EVICT:
            log.info(
                "%s runs partly off the GPU: unloading the idle models would not make it whole: %s",
                name,
                placement.evidence,
            )
            return None
        return placement

    def resident_footprint(self, member: Member) -> Footprint:
        """A member's memory for placement: its admitted estimate while it is on its way up, else its own reading."""
        if member.state in ARRIVING and member.name in self.admitted:
            return self.admitted[member.name]
        return member.footprint()

    async def make_room(
        self, member: Member, plan: LR.LaunchPlan, replan: Callable[[], Awaitable[LR.LaunchPlan]]
    ) -> LR.LaunchPlan:
        """Return `plan` once its server fits beside the loaded models (idle ones unloaded first
        where that is what it takes); StokerError(placement_no_room) when it cannot. A GPU plan
        the engine fitted short of every layer gets the idle models' VRAM where that makes it
        whole (`[placement] unload_for_full_offload`), once: it is then planned again (`replan`),
        its layer estimate and the fitter reading the VRAM they freed."""
        need = need_of(plan)
        offload_asked = False
        while True:
            async with self.lock:
                settings = self.settings()
                room = MemoryRoom(self.available(), settings.max_ram_mib, settings.max_vram_mib)
                members = {m.name: m for m in self.serving()}
                now = time.time()
                residents = [
                    attrs.evolve(m.resident(now), footprint=self.resident_footprint(m)) for m in members.values()
                ]
                placement = place_memory(member.name, need, residents, room)
                if placement.verdict is Verdict.LOAD and not offload_asked and settings.unload_for_full_offload:
                    offload_asked = True
                    placement = self._for_full_offload(member.name, plan, residents) or placement
                if placement.verdict is Verdict.LOAD:
                    self.admitted[member.name] = need
                    log.info("%s fits: %s", member.name, placement.evidence)
                    return plan
                if placement.verdict is Verdict.NO_ROOM:
                    raise StokerError(
                        ReasonCode.PLACEMENT_NO_ROOM, no_room_sentence(member.name, placement), placement.evidence
                    )
                victims = [members[name] for name in placement.victims]
                for victim in victims:
                    log.info("unloading %s to make room for %s: %s", victim.name, member.name, placement.evidence)
                    victim.supervisor.fire(LR.DownRequested(LR.DownCause.EVICTED, placement.evidence))
                changed = self.change_signal.armed()
            if placement.verdict is Verdict.EVICT:
                for victim in victims:
                    await victim.wait_state(UNLOADED)
                if placement.evidence.get("why") == FULL_OFFLOAD:
                    plan = await replan()  # the free VRAM read again, the fitter's too
                    need = need_of(plan)
                    log.info("%s after unloading for a full offload: %s", member.name, estimate_json(plan.memory))
            else:
                await changed.wait()  # a model that was stopping is gone, or something else changed
