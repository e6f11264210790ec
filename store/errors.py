"""The store's one exception: a reason code, a sentence that says what to do, evidence.

store/ must not import daemon/, so it shares the shape through states.reasons.ReasonedError;
the daemon reports it like any StokerError.
"""

from __future__ import annotations

from stoker.states.reasons import ReasonedError


class StoreError(ReasonedError):
    """The database cannot be used: corrupt, written by a newer Stoker, or a write failed."""
