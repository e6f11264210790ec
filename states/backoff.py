"""The restart backoff of a crashed process (pure): how long to wait before the next attempt.

One policy for every machine that restarts a process after a crash: the launch machine's
llama-server (its `StartBackoff`) and the worker machine's ggml-rpc-server. The machine counts
the attempt; the daemon draws the jitter (a fraction in [0, 1)) and sleeps for the delay this
says: capped exponential, from `initial_s` doubling per attempt up to `cap_s`, then jittered
into [50 %, 100 %] of that step, so that servers which crashed together do not come back in
step. Never zero: a process that dies at once is not respawned in a busy loop.
"""

from __future__ import annotations

import attrs

JITTER_FLOOR = 0.5  # the least share of a step a delay may be


@attrs.frozen
class Backoff:
    """Capped exponential backoff: `initial_s` for the first attempt, doubling, at most `cap_s`."""

    initial_s: float = 0.5  # [supervisor] backoff_initial_s
    cap_s: float = 30.0  # [supervisor] backoff_max_s

    def step(self, attempt: int) -> float:
        """The un-jittered delay before `attempt` (1-based)."""
        return min(self.cap_s, self.initial_s * 2.0 ** max(attempt - 1, 0))

    def delay(self, attempt: int, jitter: float) -> float:
        """Seconds to wait before `attempt`, with `jitter` in [0, 1) placing it within [50 %, 100 %] of the step."""
        share = JITTER_FLOOR + (1 - JITTER_FLOOR) * min(max(jitter, 0.0), 1.0)
        return round(self.step(attempt) * share, 4)
