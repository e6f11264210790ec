"""The one exception type a user can meet: a reason code, a sentence and its evidence."""

from __future__ import annotations

from typing import Any

from stoker.states.reasons import ReasonedError


class StokerError(ReasonedError):
    """A failure with a stable reason code, a message that says what to do, and evidence."""

    @property
    def cause(self) -> str:
        """The precise code of what went wrong: the reason, unless a subclass knows better (a
        download's digest mismatch under an install's `*_bundle_install_failed`)."""
        return str(self.reason)


def cause_of(err: BaseException) -> dict[str, Any]:
    """A failed step's evidence: its precise code as `cause`, its sentence and its evidence; an
    exception that is not a StokerError (a bug) is `internal_error` with the exception named."""
    if isinstance(err, StokerError):
        return {"cause": err.cause, "message": err.message, **err.evidence}
    return {"cause": "internal_error", "message": f"{type(err).__name__}: {err}"}
