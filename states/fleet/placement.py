"""Placement of several models (pure): which stopped model a request may load, what loading
one more takes when `[placement] max_loaded` are loaded, and whether its server's memory fits
(`place_memory`: the RAM available now and the `[placement]` memory caps, beside what is loaded).

Not a machine: like frontdoor_policy.py, each load asks with the facts of the moment (every
model's launch state, whether it is pinned, its requests in flight and held, how long it has
been idle) and daemon/fleet/ acts on the answer: start it, unload the one named first (a
planned stop: drained, snapshots saved, TERM), or wait until one frees.

A model counts as loaded from the moment it is planned until its server is gone (stopping
included: it still holds its memory), but a stopping model's place is already on its way back:
a load waits for it instead of unloading another (one eviction per place needed). Only a ready, unpinned model with no request in flight
and none held for it may be unloaded to make room; of those, the least recently used goes.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import attrs

from stoker.states.launch.records import DownCause, LaunchState
from stoker.states.reasons import ReasonCode

S = LaunchState
# A model in these states holds no server (none runs, none is on its way).
UNLOADED = frozenset({S.STOPPED, S.FAILED})
# A model in these states is on its way up: the memory its plan projects is not (all) taken yet,
# so the RAM available now does not show it.
ARRIVING = frozenset({S.PLANNING, S.STARTING, S.LOADING, S.CRASHED, S.BACKOFF})


def occupies(state: LaunchState) -> bool:
    """Whether a model in `state` takes one of max_loaded's places."""
    return state not in UNLOADED


def loads_on_demand(state: LaunchState, down_cause: DownCause | None, reason: ReasonCode | None = None) -> bool:
    """Whether a request that names a stopped model loads it (and is held meanwhile): yes unless
    the user stopped it (`stoker down`). A failed model stays failed until `stoker up`, as a
    single server always has, except one that failed only for want of room (placement_no_room):
    the next request asks again, since room may have been freed meanwhile."""
    if state is S.FAILED:
        return reason == ReasonCode.PLACEMENT_NO_ROOM  # a StrEnum or the string read back
    return state is S.STOPPED and down_cause is not DownCause.USER


def capacity(max_loaded: int, pinned: int) -> int:
    """How many may be loaded at once: max_loaded, but never fewer than the pinned models (they
    are never unloaded, and each must be able to start)."""
    return max(max_loaded, pinned)


@attrs.frozen
class Footprint:
    """A model's memory in MiB as one reading says it: RAM and VRAM (summed over its devices),
    which reading (the plan's estimate, "llama-fit-params", "stoker-bound" or "stoker", or "engine": the buffers
    its server reported as it loaded), and whether that reading leaves something out."""

    ram_mib: float = 0.0
    vram_mib: float = 0.0
    reading: str = "none"
    partial: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "ram_mib": round(self.ram_mib, 1),
            "vram_mib": round(self.vram_mib, 1),
            "reading": self.reading,
            "partial": self.partial,
        }


@attrs.frozen
class Resident:
    """One configured model's facts at the moment of a placement."""

    name: str
    state: LaunchState
    pinned: bool = False
    in_flight: int = 0  # requests sent to its engine whose answer is not over
    waiting: int = 0  # requests held until it is ready
    idle_s: float = 0.0  # seconds since its last request ended (or since it became ready)
    footprint: Footprint = Footprint()  # what it holds (or, on its way up, will), by its best reading

    @property
    def evictable(self) -> bool:
        """Ready, unpinned, and nobody using it or waiting for it."""
        return self.state is S.READY and not self.pinned and self.in_flight == 0 and self.waiting == 0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state.value,
            "pinned": self.pinned,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "idle_s": round(self.idle_s, 1),
            "memory": self.footprint.to_json(),
        }


class Verdict(enum.StrEnum):
    LOAD = "load"  # there is room: start it
    EVICT = "evict"  # unload `victim` first, then ask again
    WAIT_STOP = "wait_stop"  # a loaded model is already stopping: ask again once it is gone
    NO_ROOM = "no_room"  # every loaded model is pinned, busy or on its way up: wait for one to free


@attrs.frozen
class Placement:
    verdict: Verdict
    victim: str | None = None  # the first (least recently used) of `victims`
    evidence: dict[str, Any] = attrs.field(factory=dict, hash=False)
    victims: tuple[str, ...] = ()  # EVICT: every model to unload (memory may need more than one)


def place(wanted: str, residents: Sequence[Resident], max_loaded: int) -> Placement:
    """What loading `wanted` takes now."""
    loaded = [r for r in residents if r.name != wanted and occupies(r.state)]
    room = capacity(max_loaded, sum(1 for r in residents if r.pinned))
    evidence: dict[str, Any] = {"for": wanted, "max_loaded": room, "loaded": [r.to_json() for r in loaded]}
    if len(loaded) < room:
        return Placement(Verdict.LOAD, evidence=evidence)
    # A model already stopping gives its place back by itself: one freeing is one place made, so
    # a load that a stop makes room for waits for it rather than evicting another idle model.
    staying = [r for r in loaded if r.state is not S.STOPPING]
    if len(staying) < room:
        return Placement(Verdict.WAIT_STOP, evidence=evidence)
    idle = [r for r in loaded if r.evictable]
    if idle:
        # The least recently used: the longest idle (ties: the first configured keeps its place).
        victim = max(reversed(idle), key=lambda r: r.idle_s)
        return Placement(
            Verdict.EVICT, victim.name, {**evidence, "idle_s": round(victim.idle_s, 1)}, victims=(victim.name,)
        )
    return Placement(Verdict.NO_ROOM, evidence=evidence)


# --- memory ---------------------------------------------------------------------------------

# An eviction's `why` when it is for a GPU plan's every layer (place_offload), not for room.
FULL_OFFLOAD = "full_offload"


@attrs.frozen
class MemoryRoom:
    """The memory facts of the moment: the RAM available now (None: unreadable), and the
    `[placement]` caps on what the loaded models may hold together (0: no cap)."""

    available_ram_mib: float | None
    max_ram_mib: int = 0
    max_vram_mib: int = 0


def _lru(models: Sequence[Resident]) -> list[Resident]:
    """Least recently used first (ties: the first configured keeps its place)."""
    return sorted(reversed(models), key=lambda r: r.idle_s, reverse=True)


def _short(need: Footprint, loaded: Sequence[Resident], gone: Sequence[Resident], room: MemoryRoom) -> dict[str, float]:
    """By how many MiB `need` misses each limit with `gone` unloaded first: "ram_cap",
    "vram_cap" (the caps against what stays loaded) and "ram_available" (RAM available now, less
    what models on their way up will still take, plus what the unloaded ones free)."""
    staying = [r for r in loaded if r not in gone]
    short: dict[str, float] = {}
    if room.max_ram_mib:
        over = sum(r.footprint.ram_mib for r in staying) + need.ram_mib - room.max_ram_mib
        if over > 0:
            short["ram_cap"] = round(over, 1)
    if room.max_vram_mib:
        over = sum(r.footprint.vram_mib for r in staying) + need.vram_mib - room.max_vram_mib
        if over > 0:
            short["vram_cap"] = round(over, 1)
    if room.available_ram_mib is not None:
        arriving = sum(r.footprint.ram_mib for r in staying if r.state in ARRIVING)
        freed = sum(r.footprint.ram_mib for r in gone)
        over = need.ram_mib - (room.available_ram_mib - arriving + freed)
        if over > 0:
            short["ram_available"] = round(over, 1)
    return short


def place_memory(wanted: str, need: Footprint, residents: Sequence[Resident], room: MemoryRoom) -> Placement:
    """Whether `wanted`'s server, projected to hold `need`, fits beside the loaded models: LOAD;
    EVICT `victims` (the fewest least recently used idle unpinned models whose unloading makes it
    fit); WAIT_STOP (it fits once the models already stopping are gone); NO_ROOM (it does not
    fit even with every idle unpinned model unloaded: nothing is unloaded for nothing).

    VRAM has no "available" check here: a GPU plan's layers are fitted to the free VRAM by the
    engine itself (`-ngl auto`, or the fitter's projection at the plan's count); the cap bounds
    what the models hold together."""
    loaded = [r for r in residents if r.name != wanted and occupies(r.state)]
    evidence: dict[str, Any] = {
        "for": wanted,
        "need": need.to_json(),
        "available_ram_mib": None if room.available_ram_mib is None else round(room.available_ram_mib, 1),
        "max_ram_mib": room.max_ram_mib,
        "max_vram_mib": room.max_vram_mib,
        "loaded": [r.to_json() for r in loaded],
        "used_ram_mib": round(sum(r.footprint.ram_mib for r in loaded), 1),
        "used_vram_mib": round(sum(r.footprint.vram_mib for r in loaded), 1),
    }
    short = _short(need, loaded, (), room)
    if not short:
        return Placement(Verdict.LOAD, evidence=evidence)
    victims: list[Resident] = []
    for candidate in _lru([r for r in loaded if r.evictable]):
        victims.append(candidate)
        if not _short(need, loaded, victims, room):
            names = tuple(v.name for v in victims)
            freed = {
                "ram_mib": round(sum(v.footprint.ram_mib for v in victims), 1),
                "vram_mib": round(sum(v.footprint.vram_mib for v in victims), 1),
            }
            decided = {**evidence, "short": short, "victims": list(names), "freed": freed}
            return Placement(Verdict.EVICT, names[0], {**decided, "idle_s": round(victims[0].idle_s, 1)}, names)
    stopping = [r for r in loaded if r.state is S.STOPPING]
    if stopping and not _short(need, loaded, [*victims, *stopping], room):
        return Placement(Verdict.WAIT_STOP, evidence={**evidence, "short": short})
    left = _short(need, loaded, victims, room)
    staying = [r for r in loaded if r not in victims]
    after = {  # the figures `left` was computed from, so that a sentence built on them adds up
        "ram_mib": round(sum(r.footprint.ram_mib for r in staying), 1),
        "vram_mib": round(sum(r.footprint.vram_mib for r in staying), 1),
        "freed_ram_mib": round(sum(r.footprint.ram_mib for r in victims), 1),
        "arriving_ram_mib": round(sum(r.footprint.ram_mib for r in staying if r.state in ARRIVING), 1),
    }
    return Placement(
        Verdict.NO_ROOM,
        evidence={**evidence, "short": short, "short_after_evicting_all": left, "staying_after_evicting_all": after},
    )


def place_offload(
    wanted: str, fitted_vram_mib: float, whole_vram_mib: float, residents: Sequence[Resident]
) -> Placement:
    """For a GPU plan that the engine fitted to the free VRAM short of every layer (or of its
    context): EVICT the fewest least recently used idle unpinned models holding VRAM whose
    unloading frees what the whole offload lacks (`whole_vram_mib` - `fitted_vram_mib`), so that
    the model runs wholly on the GPU rather than partly on the CPU beside a model nobody uses;
    LOAD as fitted when there is nothing short, or when even all of them would not free enough
    (nothing is unloaded for a partial gain).

    What a model frees is its VRAM by the reading that decides, summed over its devices (on a
    machine of several GPUs, an approximation: the devices are not matched)."""
    loaded = [r for r in residents if r.name != wanted and occupies(r.state)]
    short = round(whole_vram_mib - fitted_vram_mib, 1)
    evidence: dict[str, Any] = {
        "for": wanted,
        "why": FULL_OFFLOAD,
        "fitted_vram_mib": round(fitted_vram_mib, 1),
        "whole_vram_mib": round(whole_vram_mib, 1),
        "short_mib": short,
    }
    if short <= 0:
        return Placement(Verdict.LOAD, evidence=evidence)
    victims: list[Resident] = []
    freed = 0.0
    for candidate in _lru([r for r in loaded if r.evictable and r.footprint.vram_mib > 0]):
        victims.append(candidate)
        freed += candidate.footprint.vram_mib
        if freed >= short:
            names = tuple(v.name for v in victims)
            decided = {
                **evidence,
                "victims": list(names),
                "freed_vram_mib": round(freed, 1),
                "loaded": [r.to_json() for r in loaded],
                "idle_s": round(victims[0].idle_s, 1),
            }
            return Placement(Verdict.EVICT, names[0], decided, names)
    return Placement(Verdict.LOAD, evidence={**evidence, "idle_vram_mib": round(freed, 1)})
