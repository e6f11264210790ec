"""The install machine's sources: where an engine bundle may come from, in which order, and
what one try of a source leaves in the history.

A source with nothing to offer hands the install to the next one (so does one whose offer an
engine update rejected on this slot while the slot is empty: states/install/slot.py); a refused
mirror (REFUSALS) and a bundle a source offered that then failed a step end the install, except
for the sources in RETRY_NEXT_ON_FAILURE.
The table in states/install/table.py applies this; docs/bundles.md ("Where the engine comes from")
says why.
"""

from __future__ import annotations

import enum
from typing import Any

from stoker.states.reasons import ReasonCode


class Source(enum.StrEnum):
    """Where a bundle comes from (what history and status name as its `source`)."""

    FILE = "file"  # a local zip the user named (`stoker bundle install`)
    MIRROR = "mirror"  # the configured manifest's entry
    BUILD_CACHE = "build-cache"  # a finished build in the local build cache
    LOCAL_BUILD = "local-build"  # built here from the pinned source


SOURCE_ORDER = (Source.FILE, Source.MIRROR, Source.BUILD_CACHE, Source.LOCAL_BUILD)
CHAIN = (Source.MIRROR, Source.BUILD_CACHE, Source.LOCAL_BUILD)  # an install that names no file
# The build cache is this machine's own scratch (an older build, a damaged entry): a cached
# bundle that fails a check leaves the install to a local build. A mirror's bundle that fails
# its digest, archive or smoke check is a publishing bug or an attack: the user must see it.
RETRY_NEXT_ON_FAILURE = frozenset({Source.BUILD_CACHE})
# A configured mirror whose manifest is refused (not signed by a trusted key, altered, expired,
# replayed, malformed) is a mirror lying or broken, not one with nothing to offer: the install
# ends there with the refusal's code, the installed bundle untouched, for the user to see (a
# mirror merely not configured, unreachable or listing nothing for this machine hands on).
REFUSALS = frozenset(
    {
        ReasonCode.MANIFEST_UNTRUSTED,
        ReasonCode.MANIFEST_SIGNATURE_INVALID,
        ReasonCode.MANIFEST_EXPIRED,
        ReasonCode.MANIFEST_ROLLBACK,
        ReasonCode.MANIFEST_WRONG_CHANNEL,
        ReasonCode.BUNDLE_METADATA_MISMATCH,
    }
)


def sources_of(items: Any) -> tuple[Source, ...]:
    """Stored or requested source names as Sources (an unknown name is a ValueError)."""
    return tuple(Source(i) for i in items)


def tries_of(items: Any) -> tuple[dict[str, Any], ...]:
    return tuple(dict(i) for i in items)


def next_source(sources: tuple[Source, ...], current: Source | None) -> Source | None:
    """The source after `current` in this request's chain; None after the last."""
    if current is None or current not in sources:
        return None
    later = sources[sources.index(current) + 1 :]
    return later[0] if later else None


def attempt_record(
    step: str, source: Source | None, origin: str | None, outcome: str, evidence: dict[str, Any], seconds: float | None
) -> dict[str, Any]:
    """One source's try as history and status show it: {source, origin, outcome (unavailable,
    failed, installed), reason (the precise cause), message, step, seconds}."""
    return {
        "source": None if source is None else source.value,
        "origin": origin,
        "outcome": outcome,
        "reason": evidence.get("cause"),
        "message": evidence.get("message"),
        "step": step,
        "seconds": seconds,
    }
