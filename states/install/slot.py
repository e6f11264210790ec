"""A bundle slot as the install machine records it: what the slot and its `.previous` hold, who
put it there, and what an offered bundle means for it.

One slot (`<backend>-<variant>`) has one record, the install machine's (states/install/table.py): an
install's promote, an engine update's switch and a rollback all end in it (`Promoted`,
`SlotChanged`), so `status` and the next install read what really is in the slot, not what the
last install put there. A bundle is known by its digest (the sha256 of its bundle.json, which
lists every file's sha256: one per build) and, where it came from a zip, that zip's sha256 (what
a manifest entry names before anything is downloaded).

What an offer means (`offer_verdict`), decided here from facts the service reads:
  current   the slot already holds it (the same digest; or the same zip as the record's, and the
            slot still holds what the record says): nothing is fetched
  kept      an engine update rejected or rolled it back on this slot and the slot holds a
            bundle: the slot keeps it (only a bundle the user names, `stoker bundle install FILE`
            or `stoker engine update --bundle`, brings a rejected one back)
  rejected  the same with an empty slot: this source has nothing acceptable, the next is tried
  install   anything else

One writer per slot (`writer_conflict`): an install and an engine update of one slot never run
at once; a second request of the same machine waits for the first, the other machine's request
is refused with `engine_slot_busy`.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.machine import str_tuple


class SlotWriter(enum.StrEnum):
    """What put the slot's bundle there."""

    INSTALL = "install"
    ENGINE_UPDATE = "engine_update"
    ENGINE_ROLLBACK = "engine_rollback"


@attrs.frozen
class SlotBundle:
    """One bundle in a slot (or its `.previous`): its digest and version as read from disk, and
    what is known of where it came from (the zip's sha256, the source, the origin, the writer)."""

    digest: str
    version: str
    sha256: str | None = None
    source: str | None = None
    origin: str | None = None
    by: SlotWriter | None = None

    def known_as(self, *records: "SlotBundle | None") -> "SlotBundle":
        """This bundle with what an earlier record of the same digest knew (its zip, source...)."""
        for record in records:
            if record is not None and record.digest == self.digest:
                return attrs.evolve(
                    self,
                    sha256=self.sha256 or record.sha256,
                    source=self.source or record.source,
                    origin=self.origin or record.origin,
                    by=self.by or record.by,
                )
        return self


@attrs.frozen
class Rejection:
    """An engine update's refusal of one bundle on this slot: the facts the install reads."""

    version: str
    reason: str
    gate: str | None = None
    refs: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    why: str | None = None  # what the failing gate saw, in a few words (a server that exited, ...)

    def names(self, *ids: str | None) -> bool:
        """Whether any of these identities (a zip's sha256, a bundle's digest) is this bundle's."""
        return any(i is not None and i in self.refs for i in ids)


class Offer(enum.StrEnum):
    """What a source's offer means for the slot (`offer_verdict`)."""

    INSTALL = "install"
    CURRENT = "current"
    KEPT = "kept"
    REJECTED = "rejected"


def offer_verdict(
    now: SlotBundle | None,
    record: SlotBundle | None,
    sha256: str | None,
    digest: str | None,
    rejection: Rejection | None,
    named: bool,
) -> Offer:
    """What the offered bundle (its zip `sha256`, its `digest` where known before download) means
    for a slot that holds `now` (read from disk) and whose record says `record`."""
    if now is not None:
        same_digest = digest is not None and digest == now.digest
        same_zip = record is not None and record.digest == now.digest and sha256 is not None and record.sha256 == sha256
        if same_digest or same_zip:
            return Offer.CURRENT
    if rejection is not None and not named:
        return Offer.KEPT if now is not None else Offer.REJECTED
    return Offer.INSTALL


def offer_facts(verdict: Offer, rejection: Rejection | None, now: SlotBundle | None) -> dict[str, Any]:
    """What history and the CLI say of an offer not installed: the rejection, and why."""
    if verdict is Offer.CURRENT:
        held = "" if now is None else f" ({now.version})"
        return {"message": f"The slot already holds this bundle{held}: nothing to install."}
    if rejection is None:
        return {}
    rejected = {"version": rejection.version, "reason": rejection.reason, "gate": rejection.gate}
    return {"rejected": rejected, "cause": rejection.reason, "message": rejection_sentence(rejection, now)}


def rejection_sentence(rejection: Rejection, kept: SlotBundle | None) -> str:
    """Why an offered bundle is not installed, for history and the CLI."""
    how = "rolled back" if rejection.reason == "engine_update_rolled_back" else "rejected"
    gate = f" at its {rejection.gate} gate" if rejection.gate else ""
    keeps = f"; the slot keeps {kept.version}" if kept is not None else ""
    return (
        f"{rejection.version} was {how} by an engine update here{gate}{keeps}. Only a bundle named by hand "
        f"(`stoker bundle install FILE`, `stoker engine update --bundle FILE`) brings it back."
    )


def writer_conflict(slot: str, requester: str, holder: str | None, pending: str | None) -> dict[str, Any] | None:
    """Whether `requester` (a machine id) may write `slot` now: None, or the refusal's evidence
    (`holder`: the machine writing it in this daemon; `pending`: one a killed daemon left mid-way,
    not resumed yet). The same machine is never in conflict with itself: its requests queue."""
    blocker = holder if holder not in (None, requester) else pending if pending not in (None, requester) else None
    if blocker is None:
        return None
    return {
        "slot": slot,
        "writer": blocker,
        "requester": requester,
        "message": (
            f"The {slot} engine slot is being written by {blocker}; one install or update runs on a slot at a time. "
            "Try again when it is done (`stoker status`, `stoker history --machine " + blocker + "`)."
        ),
    }
