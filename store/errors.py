"""The store's one exception: a reason code, a sentence that says what to do, evidence.

store/ must not import daemon/, so this mirrors StokerError's shape (`reason`, `message`,
`evidence`, `to_dict()`); the daemon turns it into a StokerError with the same fields.
"""

from __future__ import annotations

from typing import Any, Mapping

from states.reasons import ReasonCode, message_for


class StoreError(Exception):
    """The database cannot be used: corrupt, written by a newer Stoker, or a write failed."""

    def __init__(
        self,
        reason: ReasonCode | str,
        message: str | None = None,
        evidence: Mapping[str, Any] | None = None,
    ) -> None:
        self.reason = ReasonCode(reason)
        self.message = message or message_for(self.reason)
        self.evidence = dict(evidence or {})
        super().__init__(f"{self.reason}: {self.message}")

    def to_dict(self) -> dict[str, Any]:
        return {"reason": str(self.reason), "message": self.message, "evidence": self.evidence}
