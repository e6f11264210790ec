"""What snapshots were given up, and why: never silent (retention used to delete big snapshots
without a word).

Every snapshot removed by retention, every save refused before it was paid for, every save
skipped because re-prefilling would be faster, every save cut by its budget and every file lost to a reboot before it reached the disk is one entry: a
reason code, a sentence, the figures that decided, in the daemon's log, as a `snapshot.*`
event on the bus, and in `stoker status` (`snapshots.dropped`, the latest DROPS_KEPT).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable

import attrs

from stoker.states.reasons import ReasonCode, message_for

log = logging.getLogger("stoker.daemon.snapshots")

DROPS_KEPT = 16
TOPICS = {ReasonCode.SNAPSHOT_SAVE_TIMEOUT: "save_timeout", ReasonCode.SNAPSHOT_SAVE_SKIPPED: "save_skipped"}
# What each `why` of a snapshot_dropped means, for the log line and the status entry.
WHY = {
    "count": "beyond [snapshots] max_count for its slot and model",
    "bytes": "retention's byte budget ([snapshots] max_bytes) was exceeded; the oldest go first",
    "too_big": "the save would be bigger than [snapshots] max_bytes on its own: not saved",
    "no_space": "not enough free disk space for the save: not saved",
    "unsealed_before_reboot": "the machine restarted before the file reached the disk: it may be torn",
    "file_check": "the file no longer matches what was saved",
}


@attrs.define(eq=False)
class DropLog:
    """The latest drops, for status; each one is also logged and published."""

    publish: Callable[[dict[str, Any]], Any] | None = None
    entries: collections.deque[dict[str, Any]] = attrs.field(factory=lambda: collections.deque(maxlen=DROPS_KEPT))

    def record(self, reason: ReasonCode, *, quiet: bool = False, **figures: Any) -> dict[str, Any]:
        """One drop: `why` (a key of WHY) and the figures that decided. `quiet`: routine (count
        rotation), logged at info instead of warning."""
        why = figures.get("why")
        entry = {
            "reason": str(reason),
            "message": WHY.get(why, message_for(reason)) if isinstance(why, str) else message_for(reason),
            "at": round(time.time(), 3),
            **figures,
        }
        self.entries.append(entry)
        log.log(logging.INFO if quiet else logging.WARNING, "%s: %s %s", reason, entry["message"], figures)
        if self.publish is not None:
            self.publish({"topic": f"snapshot.{TOPICS.get(reason, 'dropped')}", **entry})
        return entry

    def latest(self) -> list[dict[str, Any]]:
        return list(self.entries)
