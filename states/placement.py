"""Placement of several models (pure): which stopped model a request may load, and what loading
one more takes when `[placement] max_loaded` are loaded.

Not a machine: like frontdoor_policy.py, each load asks with the facts of the moment (every
model's launch state, whether it is pinned, its requests in flight and held, how long it has
been idle) and daemon/fleet/ acts on the answer: start it, unload the one named first (a
planned stop: drained, snapshots saved, TERM), or wait until one frees.

A model counts as loaded from the moment it is planned until its server is gone (stopping
included: it still holds its memory). Only a ready, unpinned model with no request in flight
and none held for it may be unloaded to make room; of those, the least recently used goes.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import attrs

from states.launch_records import DownCause, LaunchState

S = LaunchState
# A model in these states holds no server (none runs, none is on its way).
UNLOADED = frozenset({S.STOPPED, S.FAILED})


def occupies(state: LaunchState) -> bool:
    """Whether a model in `state` takes one of max_loaded's places."""
    return state not in UNLOADED


def loads_on_demand(state: LaunchState, down_cause: DownCause | None) -> bool:
    """Whether a request that names a stopped model loads it (and is held meanwhile): yes unless
    the user stopped it (`stoker down`). A failed model stays failed until `stoker up`, as a
    single server always has."""
    return state is S.STOPPED and down_cause is not DownCause.USER


def capacity(max_loaded: int, pinned: int) -> int:
    """How many may be loaded at once: max_loaded, but never fewer than the pinned models (they
    are never unloaded, and each must be able to start)."""
    return max(max_loaded, pinned)


@attrs.frozen
class Resident:
    """One configured model's facts at the moment of a placement."""

    name: str
    state: LaunchState
    pinned: bool = False
    in_flight: int = 0  # requests sent to its engine whose answer is not over
    waiting: int = 0  # requests held until it is ready
    idle_s: float = 0.0  # seconds since its last request ended (or since it became ready)

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
        }


class Verdict(enum.StrEnum):
    LOAD = "load"  # there is room: start it
    EVICT = "evict"  # unload `victim` first, then ask again
    WAIT_STOP = "wait_stop"  # a loaded model is already stopping: ask again once it is gone
    NO_ROOM = "no_room"  # every loaded model is pinned, busy or on its way up: wait for one to free


@attrs.frozen
class Placement:
    verdict: Verdict
    victim: str | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, hash=False)


def place(wanted: str, residents: Sequence[Resident], max_loaded: int) -> Placement:
    """What loading `wanted` takes now."""
    loaded = [r for r in residents if r.name != wanted and occupies(r.state)]
    room = capacity(max_loaded, sum(1 for r in residents if r.pinned))
    evidence: dict[str, Any] = {"for": wanted, "max_loaded": room, "loaded": [r.to_json() for r in loaded]}
    if len(loaded) < room:
        return Placement(Verdict.LOAD, evidence=evidence)
    idle = [r for r in loaded if r.evictable]
    if idle:
        # The least recently used: the longest idle (ties: the first configured keeps its place).
        victim = max(reversed(idle), key=lambda r: r.idle_s)
        return Placement(Verdict.EVICT, victim.name, {**evidence, "idle_s": round(victim.idle_s, 1)})
    if any(r.state is S.STOPPING for r in loaded):
        return Placement(Verdict.WAIT_STOP, evidence=evidence)
    return Placement(Verdict.NO_ROOM, evidence=evidence)
