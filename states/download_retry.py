"""When a download tries again: which failures pass, how many tries, how long between them.

One table for every resumable download (engine bundles, mirrors, models): the downloader names
what went wrong (`DownloadFailure`), asks `retry_after`, and waits what it is told (a trio sleep)
or gives up with that failure. A try that brought bytes starts the count again: a 15 GB model on
a connection that drops every few minutes still arrives, while a server that answers nothing is
given up on after RETRY_TABLE's tries.
"""

from __future__ import annotations

import enum
from typing import Mapping

import attrs


class DownloadFailure(enum.StrEnum):
    """What a failed try of a download was, as far as trying again goes."""

    CUT = "cut"  # refused, reset, cut mid-body or silent: the network or the server's process
    BUSY = "busy"  # HTTP 408, 429 or 5xx: the server is there and may answer later
    REFUSED = "refused"  # any other 4xx: this URL will not give this file
    CHANGED = "changed"  # the file changed under its validator: the part starts over at once


@attrs.frozen
class RetryRule:
    """`tries` failures in a row are tried again, the n-th after `waits[n-1]` seconds (the last
    wait repeats); the failure after them gives up."""

    tries: int
    waits: tuple[float, ...] = ()


RetryTable = Mapping[DownloadFailure, RetryRule]

RETRY_TABLE: RetryTable = {
    DownloadFailure.CUT: RetryRule(5, (0.5, 1.0, 2.0, 4.0, 8.0)),
    DownloadFailure.BUSY: RetryRule(5, (1.0, 2.0, 4.0, 8.0, 16.0)),
    DownloadFailure.REFUSED: RetryRule(0),
    DownloadFailure.CHANGED: RetryRule(3, (0.0,)),
}


def retry_after(failure: DownloadFailure, in_a_row: int, table: RetryTable = RETRY_TABLE) -> float | None:
    """Seconds to wait before the next try after the `in_a_row`-th failure with no byte gained
    (1 for the first); None: give up."""
    rule = table[failure]
    if in_a_row > rule.tries or not rule.waits:
        return None
    return rule.waits[min(in_a_row, len(rule.waits)) - 1]
