"""Frozen records read back from the store, each with a named constructor from a row."""

from __future__ import annotations

import json
from typing import Any, Mapping

import attrs


def _json(text: str | None) -> Any:
    return json.loads(text) if text else {}


@attrs.frozen
class MachineRecord:
    """A machine's current row: its state, its data (as JSON) and why it is there."""

    id: str
    kind: str
    state: str
    data: dict[str, Any] = attrs.field(hash=False)
    reason: str | None
    evidence: dict[str, Any] = attrs.field(hash=False)
    updated_at: float
    seq: int

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "MachineRecord":
        return cls(
            id=row["id"],
            kind=row["kind"],
            state=row["state"],
            data=_json(row["data"]),
            reason=row["reason"],
            evidence=_json(row["evidence"]),
            updated_at=row["updated_at"],
            seq=row["seq"],
        )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class TransitionRecord:
    """One accepted event: from, event, to, reason and evidence, at a wall-clock time."""

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

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "TransitionRecord":
        return cls(
            id=row["id"],
            machine_id=row["machine_id"],
            kind=row["kind"],
            from_state=row["from_state"],
            event=row["event"],
            event_data=_json(row["event_data"]),
            to_state=row["to_state"],
            reason=row["reason"],
            evidence=_json(row["evidence"]),
            at=row["at"],
            seq=row["seq"],
        )

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)
