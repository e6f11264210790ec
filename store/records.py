"""Frozen records read back from the store, each with a named constructor from a row."""

from __future__ import annotations

from typing import Any

import attrs

from stoker.store.rows import StoredRecord


@attrs.frozen
class MachineRecord(StoredRecord):
    """A machine's current row: its state, its data (as JSON) and why it is there."""

    json_columns = ("data", "evidence")

    id: str
    kind: str
    state: str
    data: dict[str, Any] = attrs.field(hash=False)
    reason: str | None
    evidence: dict[str, Any] = attrs.field(hash=False)
    updated_at: float
    seq: int


@attrs.frozen
class TransitionRecord(StoredRecord):
    """One accepted event: from, event, to, reason and evidence, at a wall-clock time."""

    json_columns = ("event_data", "evidence")

    id: int | None  # write order; None while it waits in memory for a disk that refused it
    machine_id: str
    kind: str
    from_state: str
    event: str
    event_data: dict[str, Any] = attrs.field(hash=False)
    to_state: str
    reason: str | None
    evidence: dict[str, Any] = attrs.field(hash=False)
    at: float
    seq: int
