"""The one exception type a user can meet: a reason code, a sentence and its evidence."""

from __future__ import annotations

from states.reasons import ReasonedError


class StokerError(ReasonedError):
    """A failure with a stable reason code, a message that says what to do, and evidence."""
