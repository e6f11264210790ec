"""The version of Stoker that is running, as its installed distribution says."""

from __future__ import annotations

import functools
from importlib import metadata


@functools.cache
def stoker_version() -> str | None:
    """The `stoker` distribution's version, or None where it runs from a tree never installed."""
    try:
        return metadata.version("stoker")
    except metadata.PackageNotFoundError:
        return None
