"""One engine bundle slot as the install and update services share it: who writes it now, and the
facts an offered bundle is judged by (states/install/slot.py decides).

- `SlotWriters.claim`: one writer per slot. The install machine and the engine update machine of
  a slot never run at once (two promotes into one slot would leave either `.previous` or the
  record wrong): the other machine's request is refused with `engine_slot_busy`, at once and
  before anything is touched, so no request can wait on one that waits on it (an update's restart
  waits on a server whose fallback may ask for an install). A machine a killed daemon left mid-way
  counts as a writer until it is resumed. Requests of one machine queue on its own lock.
- `slot_bundle` / `slot_pair`: what the slot and its `.previous` hold (digest and version).
- `rejection_for`: the slot's engine update machine's record of refusing a bundle.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import attrs

from stoker.daemon.bundles.installed import PREVIOUS, find_installed
from stoker.daemon.bundles.metadata import BundleMeta
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.install.update_steps import bundle_digest
from stoker.states.engine_update import table as U
from stoker.states.install import table as I
from stoker.states.install.slot import Rejection, SlotBundle, writer_conflict
from stoker.states.machine import data_from_json
from stoker.states.reasons import ReasonCode
from stoker.store.database import Store


@attrs.define(eq=False)
class SlotWriters:
    """The machine writing each slot now (one per slot), shared by the install and update services."""

    store: Store
    _holders: dict[str, str] = attrs.field(factory=dict, init=False)

    def writer(self, slot: str) -> str | None:
        """The machine writing `slot` in this daemon now, if any."""
        return self._holders.get(slot)

    @contextlib.contextmanager
    def claim(self, slot: str, machine_id: str) -> Iterator[None]:
        """Write `slot` as `machine_id`; StokerError(engine_slot_busy) if another machine does."""
        holder = self._holders.get(slot)
        refusal = writer_conflict(slot, machine_id, holder, self._pending(slot, machine_id))
        if refusal is not None:
            raise StokerError(ReasonCode.ENGINE_SLOT_BUSY, refusal["message"], refusal)
        self._holders[slot] = machine_id
        try:
            yield
        finally:
            if holder is None:
                self._holders.pop(slot, None)

    def _pending(self, slot: str, requester: str) -> str | None:
        """The other machine of this slot, if a killed daemon left it mid-way (not resumed yet)."""
        for spec, working in ((I.INSTALL, I.WORKING), (U.ENGINE_UPDATE, U.WORKING)):
            machine_id = spec.machine_id(slot)
            if machine_id == requester:
                continue
            record = self.store.machine(machine_id)
            if record is not None and record.state in {s.value for s in working}:
                return machine_id
        return None


def slot_bundle(root: Path) -> SlotBundle | None:
    """The bundle in a slot directory (digest and version); None when it holds none readable."""
    digest = bundle_digest(root)
    if digest is None:
        return None
    try:
        return SlotBundle(digest, BundleMeta.read(root).version)
    except (StokerError, OSError):
        return None


def slot_pair(paths: StokerPaths, slot: str) -> tuple[SlotBundle | None, SlotBundle | None]:
    """What the slot and its `.previous` hold."""
    return slot_bundle(paths.bundles_dir / slot), slot_bundle(paths.bundles_dir / (slot + PREVIOUS))


def serving(paths: StokerPaths, backend: str, variant: str) -> SlotBundle | None:
    """What a launch of this slot would run now: the slot, or its `.previous` mid-promote."""
    bundle = find_installed(paths, backend, variant)
    return None if bundle is None else slot_bundle(bundle.root)


def rejection_for(store: Store, backend: str, variant: str, *ids: str | None) -> Rejection | None:
    """The engine update machine's rejection of the bundle known by any of `ids` on this slot."""
    record = store.machine(U.ENGINE_UPDATE.machine_id(backend, variant))
    if record is None or not any(ids):
        return None
    return U.rejection_of(data_from_json(U.ENGINE_UPDATE, record.data or {}), *ids)
