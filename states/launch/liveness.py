"""The liveness judgement: does a ready llama-server still show a sign of life? (pure)

A watchdog that judges wall time kills long generations: a reasoning run of many minutes is
one request that takes many minutes. This one judges progress. After ready, the daemon samples
the server every few seconds (`WatchLiveness`): did `/health` answer in time, did `/slots`
answer and did a slot move, did the process use CPU time, what state the kernel says it is in.
`sign_of_life` judges a sample against the one before it; while none shows a sign of life the
daemon reports `EngineSilent(silent_for)`, and the launch table stops a server silent for
`hung_after` seconds as hung (`is_hung`): counted as a crash, snapshot attempted, respawned.

A long generation is never a hang: `/health` answers while the engine computes, its slot's
counters move, and its process burns CPU; any one of them is enough. A SIGSTOPped engine
(or one frozen in a debugger) shows none: the kernel says it is stopped, whatever it
answered before.
"""

from __future__ import annotations

from typing import Any

import attrs

# Process states (psutil's names for /proc/PID/stat) in which nothing can progress.
FROZEN_PROCESS_STATES = frozenset({"stopped", "tracing-stop", "zombie", "dead"})

# How a sample's /health request ended.
HEALTH_OK = "ok"  # 200 within the time allowed
HEALTH_ANSWERS = frozenset({HEALTH_OK, "loading", "error", "timeout", "refused"})


def _slots(value: Any) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    return tuple(tuple(int(n) for n in slot) for slot in value)


@attrs.frozen
class LivenessSample:
    """One look at a ready server: facts only, judged by `sign_of_life`."""

    health: str  # HEALTH_OK, "loading" (503), "error" (another answer), "timeout", "refused"
    # Per slot, its progress counters (task id, prompt tokens processed, tokens decoded...);
    # None when /slots did not answer in time (or was not asked: /health already answered).
    slots: tuple[tuple[int, ...], ...] | None = attrs.field(default=None, converter=_slots)
    cpu_seconds: float | None = None  # user + system CPU time of the process; None: unreadable
    process: str | None = None  # the kernel's state of the process (psutil), None: unreadable

    def __attrs_post_init__(self) -> None:
        if self.health not in HEALTH_ANSWERS:
            raise ValueError(f"health must be one of {sorted(HEALTH_ANSWERS)}, got {self.health!r}")

    def to_evidence(self) -> dict[str, Any]:
        """The sample as history evidence."""
        return {
            "health": self.health,
            "slots": None if self.slots is None else [list(s) for s in self.slots],
            "cpu_seconds": self.cpu_seconds,
            "process": self.process,
        }


def sign_of_life(before: LivenessSample | None, now: LivenessSample) -> bool:
    """Whether `now` shows the engine alive: not frozen by the kernel, and /health answered,
    or since `before` a slot moved or the process used CPU time."""
    if now.process in FROZEN_PROCESS_STATES:
        return False
    if now.health == HEALTH_OK:
        return True
    if before is None:
        return False
    if now.slots is not None and before.slots is not None and now.slots != before.slots:
        return True
    if now.cpu_seconds is not None and before.cpu_seconds is not None and now.cpu_seconds > before.cpu_seconds:
        return True
    return False


def is_hung(silent_for: float, hung_after: float) -> bool:
    """A ready server silent for `hung_after` seconds is hung; 0 turns the judgement off."""
    return hung_after > 0 and silent_for >= hung_after


def liveness_cadence(hung_after: float) -> tuple[float, float]:
    """(seconds between samples, seconds a request may take): a few samples per `hung_after`,
    at most 5 s apart, so a hang is seen within about hung_after + 5 s."""
    every = min(5.0, max(0.25, hung_after / 4))
    return every, every
