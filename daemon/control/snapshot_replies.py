"""`snapshot.restore`'s reply record, on its own: `stoker snapshot restore` is judged against a
re-prefill, so it imports this and not replies.py (which brings the backends and the store's
records, a few hundred ms of imports on a busy machine). replies.py re-exports it.
"""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class SnapshotRestored:
    """`snapshot.restore`: the restore's figures (the engine's, the daemon's) and the decision that judged it."""

    id: int
    slot: int
    n_tokens: int
    restore_ms: float | None
    checked: str  # how the file was checked: stat+sample or full_sha256
    resident: float | None  # the share of the file in the page cache before
    saved_on: str | None
    restored_on: str | None
    cross_backend: bool
    note: str | None = None  # what a restore across backends keeps
    daemon_ms: float | None = None  # the daemon's side: its checks and the engine's restore
    restored: bool = True  # False: left to a re-prefill (`if_faster`, and re-prefilling is faster)
    decision: dict[str, Any] | None = None  # restore or reprefill, why, both estimates
