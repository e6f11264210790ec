"""What snapshots were given up, and why: never silent (retention used to delete big snapshots
without a word).

Every snapshot removed by retention, every save refused before it was paid for, every save
skipped because re-prefilling would be faster, every save cut by its budget and every file lost to a reboot before it reached the disk is one entry: a
reason code, a sentence, the figures that decided, in the daemon's log, as a `snapshot.*`
event on the bus, in `stoker status` (`snapshots.dropped`, the latest DROPS_KEPT) and in the
store's history (`stoker history --machine snapshots`): one row per drop, machine `snapshots`
(kind `snapshot`), the event its `why` (or what happened), the reason code and the figures as
its evidence. A snapshot removed on request (`stoker snapshot rm`) or whose file was gone is
one too (snapshot_removed), and so is a file the restore's checks refused (snapshot_corrupt:
the file is kept, since it may be put back).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import attrs

from stoker.states.reasons import ReasonCode, ReasonedError, message_for
from stoker.states.snapshots.policy import drop_state

if TYPE_CHECKING:
    from stoker.store.database import Store

log = logging.getLogger("stoker.daemon.snapshots")

DROPS_KEPT = 16
TOPICS = {
    ReasonCode.SNAPSHOT_SAVE_TIMEOUT: "save_timeout",
    ReasonCode.SNAPSHOT_SAVE_SKIPPED: "save_skipped",
    ReasonCode.SNAPSHOT_REMOVED: "removed",
    ReasonCode.SNAPSHOT_CORRUPT: "refused",
}
HISTORY_MACHINE = "snapshots"  # the history rows' machine id and kind (`stoker history --machine snapshots`)
HISTORY_KIND = "snapshot"
# What each `why` of a snapshot_dropped means, for the log line and the status entry.
WHY = {
    "count": "beyond [snapshots] max_count for its slot and model",
    "bytes": "retention's byte budget ([snapshots] max_bytes) was exceeded; the oldest go first",
    "too_big": "the save would be bigger than [snapshots] max_bytes on its own: not saved",
    "no_space": "not enough free disk space for the save: not saved",
    "unsealed_before_reboot": "the machine restarted before the file reached the disk: it may be torn",
    "file_check": "the file no longer matches what was saved",
    "rm": "removed on request (stoker snapshot rm)",
    "file_gone": "its file is gone from the snapshots directory: its row is dropped",
}


@attrs.define(eq=False)
class DropLog:
    """The latest drops, for status; each one is also logged and published."""

    publish: Callable[[dict[str, Any]], Any] | None = None
    store: Store | None = None  # where each drop becomes a history row
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
        topic = TOPICS.get(reason, "dropped")
        if self.publish is not None:
            self.publish({"topic": f"snapshot.{topic}", **entry})
        self._history(reason, why if isinstance(why, str) else topic, entry)
        return entry

    def removed(self, rec: Any, why: str, **figures: Any) -> dict[str, Any]:
        """A snapshot record gone from the catalog (`why`: "rm" asked, "file_gone" found)."""
        return self.record(
            ReasonCode.SNAPSHOT_REMOVED,
            quiet=True,
            why=why,
            snapshot_id=rec.id,
            slot=rec.slot_id,
            n_tokens=rec.n_tokens,
            **figures,
        )

    def _history(self, reason: ReasonCode, event: str, entry: dict[str, Any]) -> None:
        """One history row: a snapshot that existed goes saved -> dropped (a file that failed the
        restore's checks: saved -> refused, it is kept in case it is put back); one never saved
        (skipped, refused, cut by its budget) unsaved -> dropped."""
        if self.store is None:
            return
        saved = entry.get("snapshot_id") is not None
        try:
            self.store.record_step(
                machine_id=HISTORY_MACHINE,
                kind=HISTORY_KIND,
                from_state="saved" if saved else "unsaved",
                event=event,
                event_data={k: entry[k] for k in ("snapshot_id", "slot", "slots") if k in entry},
                to_state=drop_state(reason),
                data={},
                reason=str(reason),
                evidence=entry,
                at=entry["at"],
            )
        except ReasonedError as err:  # a store that refuses it: the log line and status still say it
            log.info("snapshot drop not in history: %s", err.evidence)

    def latest(self) -> list[dict[str, Any]]:
        return list(self.entries)
