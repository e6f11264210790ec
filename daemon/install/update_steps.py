"""The engine update's blocking steps (run in a thread by daemon/install/update.py): a bundle's
identity, staging and verifying a candidate, the old engine's smoke tokens, and putting the
previous bundle back into its slot. Each answers with the update machine's event (facts); the
table in states/engine_update/table.py judges them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from stoker.daemon.bundles.archive import check_digest, unpack_bundle
from stoker.daemon.bundles.installed import PREVIOUS, find_installed, list_installed, promote
from stoker.daemon.bundles.metadata import BUNDLE_JSON, BundleMeta
from stoker.daemon.bundles.smoke import SmokeSpec, run_smoke
from stoker.daemon.core.digests import fsync_dir
from stoker.daemon.core.errors import StokerError, cause_of
from stoker.daemon.core.paths import StokerPaths
from stoker.states.engine_update import records as UR
from stoker.states.reasons import ReasonCode


def bundle_digest(path: Path) -> str | None:
    """The identity of a bundle directory or zip: the sha256 of its bundle.json (which lists every
    file's sha256); None when there is none to read."""
    try:
        if path.is_dir():
            data = (path / BUNDLE_JSON).read_bytes()
        else:
            with zipfile.ZipFile(path) as zf:
                data = zf.read(BUNDLE_JSON)
    except (OSError, KeyError, zipfile.BadZipFile):
        return None
    return hashlib.sha256(data).hexdigest()


# What `bundle_facts` read, by bundle directory, with the stat of the bundle.json it read: every
# status document asks for each slot's (and its previous'), and reading and parsing the file (it
# lists every file's sha256) was a third of the document's CPU. An install or a promote puts a
# new file there (a new inode), so a kept answer is never stale.
_FACTS: dict[Path, tuple[tuple[int, int, int], UR.BundleFacts]] = {}


def bundle_facts(root: Path) -> UR.BundleFacts | None:
    """A bundle directory's version and identity; None when it holds no readable bundle."""
    try:
        st = (root / BUNDLE_JSON).stat()
    except OSError:
        return None
    seen = (st.st_ino, st.st_mtime_ns, st.st_size)
    kept = _FACTS.get(root)
    if kept is not None and kept[0] == seen:
        return kept[1]
    digest = bundle_digest(root)
    if digest is None:
        return None
    try:
        facts = UR.BundleFacts(BundleMeta.read(root).version, digest)
    except (StokerError, OSError):
        return None
    _FACTS[root] = (seen, facts)
    return facts


def check_archive(path: Path, sha256: str, size: int | None) -> None:
    """A manifest's local (file://) zip is the one it lists: its size and sha256, else
    bundle_digest_mismatch (a download checks the same as it streams)."""
    try:
        path.stat()
    except OSError as err:
        raise StokerError(ReasonCode.BUNDLE_MISSING, f"{path} cannot be read: {err}.", {"path": str(path)}) from None
    check_digest(path, sha256, size)


def installed_slots(paths: StokerPaths) -> set[tuple[str, str]]:
    """Every installed (backend, variant)."""
    return {(b.meta.backend, b.meta.variant) for b in list_installed(paths)}


def installed_facts(paths: StokerPaths, backend: str, variant: str) -> UR.BundleFacts | None:
    """What the slot serves: the slot, or its `.previous` while a promote is half-way."""
    bundle = find_installed(paths, backend, variant)
    return None if bundle is None else bundle_facts(bundle.root)


def stage_and_verify(
    archive: Path, staging: Path, effect: UR.Stage, candidate: UR.Candidate
) -> UR.Staged | UR.GateFailed:
    from stoker.daemon.bundles.verify import check_smoke, verify_dir

    shutil.rmtree(staging.parent, ignore_errors=True)
    try:
        unpack_bundle(archive, staging)
        report = verify_dir(
            staging, expect_backend=effect.backend, expect_variant=effect.variant, expect_version=candidate.version
        )
    except (StokerError, OSError, ValueError) as err:
        return UR.GateFailed(UR.Gate.VERIFY, cause_of(err))
    try:
        tokens = check_smoke(staging / report.meta.server, report.meta)
    except StokerError as err:
        return UR.GateFailed(UR.Gate.SMOKE, cause_of(err))
    digest = bundle_digest(staging)
    if digest is None:
        return UR.GateFailed(UR.Gate.VERIFY, {"message": "the staged bundle has no bundle.json"})
    evidence = {"steps": [*report.steps, "smoke"], "version_line": report.version_line, "smoke_tokens": len(tokens)}
    return UR.Staged(UR.BundleFacts(report.meta.version, digest), str(staging), tokens, evidence)


def old_tokens(paths: StokerPaths, backend: str, variant: str, staging: Path) -> UR.TokensCompared | UR.GateFailed:
    """The serving engine's greedy tokens on the staged bundle's smoke model, run here."""
    old = find_installed(paths, backend, variant)
    try:
        meta = BundleMeta.read(staging)
        if old is None:
            raise StokerError(ReasonCode.BUNDLE_MISSING, "The slot holds no engine to compare with.")
        if meta.smoke is None:
            raise StokerError(ReasonCode.BUNDLE_VERIFY_FAILED, "The staged bundle records no smoke model.")
        model = {k: v for k, v in meta.smoke.model.items() if k != "sha256"}
        spec = SmokeSpec(model=model, prompt=meta.smoke.prompt, n_predict=meta.smoke.n_predict)
        with tempfile.TemporaryDirectory(prefix="stoker-update-") as scratch:
            tokens = run_smoke(old.server, spec, Path(scratch))
    except StokerError as err:
        return UR.GateFailed(UR.Gate.TOKENS, {"engine": "old", **cause_of(err)})
    return UR.TokensCompared(tokens, {"old_version": old.meta.version})


def put_back(bundles: Path, effect: UR.RollBack) -> UR.RolledBack | UR.RollbackFailed:
    """Make the slot hold `effect.restore` again; idempotent (a resumed rollback finds it done).

    `.previous` is first renamed into a hidden rollback dir, then promoted: the slot keeps serving
    until promote's renames, and between them `.previous` (the replaced bundle) serves."""
    slot, previous = bundles / effect.slot, bundles / (effect.slot + PREVIOUS)
    parked = bundles / f".rollback-{effect.slot}" / "bundle"
    if bundle_digest(slot) != effect.restore:
        if bundle_digest(parked) != effect.restore:
            if bundle_digest(previous) != effect.restore:
                return UR.RollbackFailed(
                    {
                        "message": "the bundle to restore is neither in the slot nor kept as its previous",
                        "restore": effect.restore,
                        "slot": bundle_digest(slot),
                        "previous": bundle_digest(previous),
                    }
                )
            shutil.rmtree(parked.parent, ignore_errors=True)
            parked.parent.mkdir(parents=True)
            os.replace(previous, parked)
            fsync_dir(bundles)
        promote(parked, bundles, slot=effect.slot)
    shutil.rmtree(parked.parent, ignore_errors=True)
    discarded = None
    if effect.discard is not None and bundle_digest(previous) == effect.discard:
        discarded = bundle_facts(previous)
        shutil.rmtree(previous, ignore_errors=True)  # the rejected engine: never served again from here
        fsync_dir(bundles)
    restored = bundle_facts(slot)
    kept = bundle_facts(previous)
    return UR.RolledBack(
        {
            "restored": None if restored is None else restored.version,
            "discarded": None if discarded is None else discarded.version,
            "previous_kept": None if kept is None else kept.version,
        }
    )
