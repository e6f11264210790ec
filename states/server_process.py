"""What a supervised server process reports, for every machine that runs one (pure data).

The launch machine (llama-server) and the worker machine (ggml-rpc-server) both start a
process, hear that it could not start or that it ended unasked, and count its crashes until a
crash loop. The facts of those two reports are the same for both: each machine names its own
event after them (launch's `ServerExited`, the worker's `Exited`), so its history and its
generated page read in its own words.
"""

from __future__ import annotations

from typing import Any

import attrs

from stoker.states.machine import as_evidence
from stoker.states.reasons import ReasonCode


@attrs.frozen
class ProcessExit:
    """The process ended unasked: its exit status and classified reason, with the evidence
    that decided it."""

    returncode: int | None
    reason: ReasonCode = ReasonCode.SERVER_CRASHED
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class SpawnFailure:
    """The process could not be started at all (the binary will not execute)."""

    reason: ReasonCode = ReasonCode.SERVER_SPAWN_FAILED
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


def crash_loop(crashes: int, max_restarts: int) -> bool:
    """More consecutive crashes than `max_restarts` (without a Stable in between): give up."""
    return crashes > max_restarts
