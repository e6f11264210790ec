"""The one exception type a user can meet: a reason code, a sentence and its evidence."""

from __future__ import annotations

from typing import Any, Mapping

from states.reasons import ReasonCode, message_for


class StokerError(Exception):
    """A failure with a stable reason code, a message that says what to do, and evidence."""

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
