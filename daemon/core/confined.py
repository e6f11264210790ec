"""Paths that come from outside (a Hub's file listing, a wheel's member, a manifest's or an
archive's entry, a catalog row) kept under the directory they belong to.

The one rule: a name is joined onto its root and the result is resolved (symlinks followed,
`..` collapsed) before it is compared with the resolved root. A check of the name's text alone
misses a symlink inside the root that leads out; a check of unresolved paths lets
`root/a/../../x` pass as "under root" (`root in path.parents` compares text). Every place that
writes, unpacks or deletes at a path named from outside asks `confined` (joining) or `inside`
(a whole path), and nothing else.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


def inside(root: Path | str, path: Path | str) -> bool:
    """`path`, resolved, is `root` (resolved) or lies under it."""
    base = Path(root).resolve()
    target = Path(path).resolve()
    return target == base or target.is_relative_to(base)


def strictly_inside(root: Path | str, path: Path | str) -> bool:
    """`path`, resolved, lies under `root` (resolved) and is not `root` itself: a file to delete."""
    return Path(path).resolve() != Path(root).resolve() and inside(root, path)


def confined(root: Path | str, name: str, *, reason: ReasonCode, what: str, **evidence: Any) -> Path:
    """`root / name` when `name` is a plain relative path (forward slashes, no `..`, no NUL,
    not absolute) that still lies under `root` once resolved; else `reason`, saying `what`
    named it. The path returned is the joined one (not resolved: a models directory reached
    through a symlink keeps the user's spelling)."""
    refused = not_plain(name)
    joined = Path(root).joinpath(*PurePosixPath(name).parts) if refused is None else None
    if joined is not None and not strictly_inside(root, joined):
        refused = "it resolves outside the directory (through a symbolic link)"
    if refused is not None or joined is None:
        raise StokerError(
            reason,
            f"{what} names the path {name[:200]!r}, which Stoker refuses: {refused}. Nothing was written.",
            {**evidence, "name": name[:1000], "root": str(root), "why": refused},
        )
    return joined


def not_plain(name: str) -> str | None:
    """Why the text of `name` is no plain relative path (forward slashes, no `..`), or None:
    the check a name gets before any root is at hand (a manifest's entry as it is parsed)."""
    if not name or "\x00" in name:
        return "it is empty or holds a NUL byte"
    if "\\" in name:
        return "it holds a backslash"
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        return "it is an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "it climbs out with '..' or is not normalised"
    return None
