"""Idle unload (pure): whether a model is due to be unloaded for idleness, and when the next one is.

Not a machine: like placement.py, daemon/fleet/idle.py asks with the facts of the moment (the
time now, when each model was last used, its requests in flight and held, whether it is pinned,
its launch state, its `[models.NAME] idle_ttl_s`) and acts on the answer: a planned stop with
cause idle (`DownRequested(DownCause.IDLE)`: drained, its slots saved by the snapshot hook
before TERM), then it sleeps until the time `next_in` names, or until something changes.

A model is due when it has a TTL (0: never), is not pinned, is ready, has no request in flight
and none held for it, and its TTL has passed since it was last used: since its last request
ended, or since it became ready if that is later (a model loaded and never asked is idle from
its ready). A model on its way up or down, stopped or failed has nothing to unload.
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

import attrs

from stoker.states.launch.records import LaunchState


@attrs.frozen
class IdleFacts:
    """One model's facts at the moment of the question."""

    name: str
    state: LaunchState
    idle_ttl_s: float  # [models.NAME] idle_ttl_s; 0: never unloaded for idleness
    pinned: bool = False
    in_flight: int = 0  # requests sent to its engine whose answer is not over
    waiting: int = 0  # requests held until it is ready
    last_used: float | None = None  # when its last request ended, or it became ready if later (Unix time)
    # The last request's own `keep_alive` (seconds; inf: never unloaded; 0: as soon as it is
    # answered), which wins over idle_ttl_s as Ollama's does; None: the request set none.
    keep_alive_s: float | None = None

    @property
    def ttl_s(self) -> float:
        """Seconds of idleness before it is unloaded (inf: never)."""
        if self.keep_alive_s is not None:
            return self.keep_alive_s
        return self.idle_ttl_s if self.idle_ttl_s > 0 else math.inf


def due_in(facts: IdleFacts, now: float) -> float | None:
    """Seconds until `facts`' model is due for an idle unload (0: now); None: not as things
    stand (no TTL, pinned, not ready, in use, or never used nor ready)."""
    if math.isinf(facts.ttl_s) or facts.pinned or facts.state is not LaunchState.READY:
        return None
    if facts.in_flight or facts.waiting or facts.last_used is None:
        return None
    return max(0.0, facts.last_used + facts.ttl_s - now)


@attrs.frozen
class IdleUnload:
    """A model to unload now, and the evidence its history records."""

    name: str
    evidence: dict[str, Any] = attrs.field(factory=dict, hash=False)


@attrs.frozen
class IdleReview:
    due: tuple[IdleUnload, ...]  # to unload now
    next_in: float | None  # seconds until the next one is due as things stand; None: none will be


def review(models: Sequence[IdleFacts], now: float) -> IdleReview:
    """Which models to unload now, and how long until the next is due."""
    due: list[IdleUnload] = []
    later: list[float] = []
    for facts in models:
        wait = due_in(facts, now)
        if wait is None:
            continue
        if wait > 0:
            later.append(wait)
            continue
        assert facts.last_used is not None  # due_in answers a number only with it
        idle_s = now - facts.last_used
        evidence: dict[str, Any] = {"idle_s": round(idle_s, 1), "idle_ttl_s": facts.idle_ttl_s}
        if facts.keep_alive_s is not None:
            evidence["keep_alive_s"] = facts.keep_alive_s
        due.append(IdleUnload(facts.name, evidence))
    return IdleReview(tuple(due), min(later, default=None))


_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_seconds(value: Any) -> float | None:
    """A request's `keep_alive`, as Ollama's clients send it: seconds as a number, or a duration
    ("5m", "1h", "30s", "250ms"); negative keeps the model loaded for good (inf), 0 unloads it
    once answered. None: absent; ValueError: not a duration."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError('keep_alive must be a number of seconds or a duration such as "5m"')
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        found = _DURATION.match(str(value))
        if found is None:
            raise ValueError(f'keep_alive must be a number of seconds or a duration such as "5m", got {value!r}')
        seconds = float(found.group(1)) * _UNIT_S[found.group(2)]
    if math.isnan(seconds):
        raise ValueError("keep_alive must be a number")
    return math.inf if seconds < 0 else seconds
