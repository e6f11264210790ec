"""Installed bundles: one slot per backend and variant under the data dir's `bundles/`.

Install = unpack (or copy) into a hidden staging directory beside the slots, verify there,
then `promote`: the one way a bundle enters its slot, used by the install service's Promote
step (every install Stoker's commands make, daemon.install.installer) and by `install_bundle`
(the same unpack, verify and promote without the machine: how tests and benchmarks set up a
data directory). Promote makes the staged files durable (fsync every file and directory),
renames the old slot to `<slot>.previous`, renames the staged tree into the slot and fsyncs
`bundles/`, so that after a crash the slot holds either the old bundle or the whole new one,
never names without their data. Staging names start with a dot and are never found by
`find_installed`, so nothing half-installed is ever launched. If a crash falls between the
two renames, the slot is missing and its `.previous` still there: `find_installed` then
returns the previous bundle.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable

import attrs

from stoker.daemon.bundles.archive import unpack_bundle
from stoker.daemon.bundles.metadata import BUNDLE_JSON, BundleMeta
from stoker.daemon.bundles.variants import SAFE_CPU_VARIANTS, cpu_flags, variant_fits
from stoker.daemon.bundles.verify import VerifyReport, verify_dir
from stoker.daemon.core.digests import fsync_dir
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

Progress = Callable[[str], None]
PREVIOUS = ".previous"


@attrs.frozen
class InstalledBundle:
    root: Path
    meta: BundleMeta
    server: Path  # the llama-server executable

    @classmethod
    def from_dir(cls, root: Path) -> "InstalledBundle":
        root = Path(root)
        meta = BundleMeta.read(root)
        return cls(root, meta, root / meta.server)

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": str(self.root),
            "server": str(self.server),
            "backend": self.meta.backend,
            "variant": self.meta.variant,
            "version": self.meta.version,
            "cache_key": self.meta.build.get("cache_key"),
        }


def bundle_meta_of(path: Path) -> BundleMeta:
    """bundle.json of a bundle zip (read without unpacking anything) or directory."""
    path = Path(path)
    if path.is_dir():
        return BundleMeta.read(path)
    if not path.is_file():
        raise StokerError(ReasonCode.BUNDLE_MISSING, "The bundle does not exist.", {"path": str(path)})
    try:
        with zipfile.ZipFile(path) as zf:
            info = zf.getinfo(BUNDLE_JSON)
            if info.file_size > 16 << 20:
                raise StokerError(
                    ReasonCode.BUNDLE_UNSAFE_ARCHIVE, evidence={"entry": BUNDLE_JSON, "size": info.file_size}
                )
            return BundleMeta.from_json(zf.read(info))
    except KeyError:
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED, "The bundle has no bundle.json.", {"path": str(path)}
        ) from None
    except (zipfile.BadZipFile, OSError) as err:
        raise StokerError(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, evidence={"path": str(path), "error": str(err)}) from None


def _copy_dir_into(src: Path, staging: Path) -> None:
    # Links are copied as links so that verification sees and refuses them.
    shutil.copytree(src, staging, symlinks=True, dirs_exist_ok=True)


def _sync_tree(root: Path) -> None:
    """fsync every file and directory under `root`, deepest first: its data and names are on
    disk before a rename makes them launchable."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue  # verification refuses links; nothing to make durable
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def promote(staged: Path, bundles_dir: Path, *, slot: str | None = None) -> InstalledBundle:
    """Move a verified staged bundle into its slot, durably; the old slot becomes `.previous`.

    `slot`: the slot the caller staged for (a manifest entry's); a staged bundle whose
    metadata names another is refused. Idempotent for a resumed install: with the staged tree
    gone and the slot in place, the rename already happened and the slot is returned.
    """
    staged = Path(staged)
    if not staged.is_dir():
        if slot is not None and (bundles_dir / slot).is_dir():
            return InstalledBundle.from_dir(bundles_dir / slot)
        raise StokerError(
            ReasonCode.BUNDLE_MISSING,
            "Neither the staged bundle nor the slot exists.",
            {"staging": str(staged), "slot": None if slot is None else str(bundles_dir / slot)},
        )
    meta = BundleMeta.read(staged)
    if slot is not None and meta.slot != slot:
        raise StokerError(
            ReasonCode.BUNDLE_METADATA_MISMATCH,
            "The staged bundle belongs to another slot.",
            {"staged": meta.slot, "slot": slot},
        )
    _sync_tree(staged)
    target = bundles_dir / meta.slot
    previous = bundles_dir / (meta.slot + PREVIOUS)
    if target.exists():
        shutil.rmtree(previous, ignore_errors=True)
        os.replace(target, previous)  # between these two renames find_installed uses .previous
    os.replace(staged, target)
    fsync_dir(bundles_dir)
    return InstalledBundle.from_dir(target)


def install_bundle(
    zip_or_dir: str | Path,
    paths: StokerPaths,
    *,
    expect_backend: str | None = None,
    expect_version: str | None = None,
    expect_variant: str | None = None,
    smoke: bool = False,
    progress: Progress = lambda _: None,
) -> InstalledBundle:
    """Verify a bundle zip or directory in staging and `promote` it into its slot.

    Blocking, and without the install machine or its history: the tests' and benchmarks'
    way to set up a data directory. Stoker's commands install through the install service."""
    source = Path(zip_or_dir)
    if not source.exists():
        raise StokerError(ReasonCode.BUNDLE_MISSING, "The bundle to install does not exist.", {"path": str(source)})
    bundles = paths.bundles_dir
    bundles.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=bundles))
    try:
        unpacked = staging / "bundle"
        if source.is_dir():
            _copy_dir_into(source, unpacked)
        else:
            unpack_bundle(source, unpacked)
        progress(f"unpacked into {unpacked}")
        report: VerifyReport = verify_dir(
            unpacked,
            expect_backend=expect_backend,
            expect_version=expect_version,
            expect_variant=expect_variant,
            smoke=smoke,
            progress=progress,
        )
        installed = promote(unpacked, bundles, slot=report.meta.slot)
        progress(f"installed {report.meta.slot} at {installed.root}")
        return installed
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load(root: Path) -> InstalledBundle | None:
    try:
        bundle = InstalledBundle.from_dir(root)
    except (StokerError, OSError):
        return None  # a damaged slot is not launchable; `bundle list` shows it absent
    return bundle if bundle.server.is_file() else None


def list_installed(paths: StokerPaths) -> list[InstalledBundle]:
    """Every launchable installed bundle, one per slot (a slot lost mid-install shows its previous)."""
    root = paths.bundles_dir
    if not root.is_dir():
        return []
    slots = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")}
    out = []
    for name in sorted(slots):
        if name.endswith(PREVIOUS):
            base = name[: -len(PREVIOUS)]
            if base in slots:
                continue
        bundle = _load(root / name)
        if bundle is not None:
            out.append(bundle)
    return out


def find_installed(paths: StokerPaths, backend: str, variant: str | None = None) -> InstalledBundle | None:
    """The installed bundle for `backend` (and `variant`), or None.

    Without a variant, the first safe variant this CPU can run wins (avx2, then compat);
    a `native` bundle is only ever returned when asked for by name.
    """
    candidates = [b for b in list_installed(paths) if b.meta.backend == backend]
    if variant is not None:
        return next((b for b in candidates if b.meta.variant == variant), None)
    flags = cpu_flags()
    for name in SAFE_CPU_VARIANTS:
        for bundle in candidates:
            if bundle.meta.variant == name and variant_fits(bundle.meta.cpu_requires, flags):
                return bundle
    return None
