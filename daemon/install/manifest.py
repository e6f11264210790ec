"""The bundle manifest: where published bundles are listed, and which entry fits this machine.

The manifest (docs/bundles.md, docs/mirror.md) is read from a path, a file:// URL or an http(s)
URL, named by `[bundles] manifest` or STOKER_MANIFEST_URL, and believed only as the trust policy
says (daemon/install/trust.py: signed by a configured key, not expired, never older than the
last one accepted; a local one may be unsigned while no key is configured). Of its entries for a
backend and this platform,
`choose_entry` keeps those the backend's plugin accepts for the detected hardware (driver
floor, CUDA architectures vs compute capability, ...) and lets the plugin pick the variant.
Every "cannot" is a StokerError (bundle_missing) whose evidence lists what was refused and why;
the install service records it on the install machine. `download_bundle` fetches the bundle an
entry names, for an install and an engine update alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote, urlparse

import attrs
import trio

from stoker.daemon.backends.base import Backend, Detection
from stoker.daemon.bundles.metadata import BundleManifest, ManifestEntry
from stoker.daemon.bundles.mirror import DEFAULT_CHANNEL
from stoker.daemon.bundles.variants import host_platform
from stoker.daemon.core.download import download, fetch_bytes
from stoker.daemon.core.download_records import DownloadError, DownloadProgress, DownloadResult
from stoker.daemon.core.errors import StokerError
from stoker.daemon.install.trust import ManifestTrust
from stoker.states.engine_update.table import version_key
from stoker.states.reasons import ReasonCode

MANIFEST_ENV = "STOKER_MANIFEST_URL"
MANIFEST_MAX_BYTES = 4 * 2**20
MAX_BUNDLE_BYTES = 8 * 2**30  # the archive checker's own total cap


async def download_bundle(
    url: str,
    dest: Path,
    sha256: str,
    size: int | None,
    *,
    progress: Callable[[DownloadProgress], Any] | None = None,
    failure_reason: ReasonCode = ReasonCode.BUNDLE_VERIFY_FAILED,
) -> DownloadResult:
    """Download one bundle zip to `dest`, checked against its sha256 and size and held to the
    archive checker's cap: the one way an install and an engine update fetch a bundle."""
    return await download(
        url,
        dest,
        expected_sha256=sha256,
        expected_size=size,
        max_bytes=MAX_BUNDLE_BYTES,
        progress=progress,
        failure_reason=failure_reason,
    )


async def load_manifest(
    source: str, trust: ManifestTrust | None = None, channel: str = DEFAULT_CHANNEL
) -> BundleManifest:
    """Read `channel`'s manifest from a path, a file:// URL or an http(s) URL and admit it through
    `trust` (None: no key configured, nothing remembered); StokerError if unusable or not believed.
    Each entry's `origin` says how it was trusted."""
    if not source:
        raise StokerError(
            ReasonCode.BUNDLE_MISSING,
            f"No bundle manifest is configured; set `[bundles] manifest` in the config or {MANIFEST_ENV}.",
            {"manifest": None},
        )
    trust = trust if trust is not None else ManifestTrust()
    trust.may_fetch(source)
    try:
        if source.startswith(("http://", "https://")):
            text = await trio.to_thread.run_sync(
                lambda: fetch_bytes(source, max_bytes=MANIFEST_MAX_BYTES, reason=ReasonCode.BUNDLE_MISSING),
                abandon_on_cancel=True,
            )
        else:
            path = Path(unquote(urlparse(source).path)) if source.startswith("file://") else Path(source).expanduser()
            text = await trio.to_thread.run_sync(lambda: path.read_bytes()[:MANIFEST_MAX_BYTES])
    except DownloadError as err:  # an error status, or no connection
        status, cause = err.evidence.get("status"), err.evidence.get("cause")
        said = f"answered HTTP {status}" if status else f"cannot be read: {cause}"
        evidence = {"manifest": source, "status": status, "error": cause}
        raise StokerError(ReasonCode.BUNDLE_MISSING, f"The manifest at {source} {said}.", evidence) from None
    except OSError as err:  # the manifest cannot be read
        raise StokerError(
            ReasonCode.BUNDLE_MISSING,
            f"The bundle manifest {source} cannot be read: {err}.",
            {"manifest": source, "error": f"{type(err).__name__}: {err}"},
        ) from None
    try:
        admitted = trust.admit(source, text, channel)
    except StokerError as err:
        if err.reason != ReasonCode.BUNDLE_METADATA_MISMATCH:
            raise  # a refusal of trust says what it is itself
        raise StokerError(
            err.reason, f"The bundle manifest {source} is invalid: {err.message}", {"manifest": source, **err.evidence}
        ) from None
    manifest = admitted.manifest
    return attrs.evolve(manifest, bundles=tuple(attrs.evolve(b, origin=admitted.provenance) for b in manifest.bundles))


def choose_entry(
    manifest: BundleManifest,
    backend: str,
    *,
    variant: str | None = None,
    detection: Detection | None = None,
    plugin: Backend | None = None,
    platform: str | None = None,
    keep_archs: tuple[str, ...] | None = None,
) -> ManifestEntry:
    """The manifest entry for this backend that fits the detected hardware (driver floor,
    CUDA architectures vs compute capability, ...), the backend's own variant choice first, of
    the newest release that has one.

    `keep_archs`, an update's: the CUDA architectures of the bundle installed now. Only entries
    built for all of them fit (the same family first, then a wider one): a mirror offering each
    family as its own bundle never swaps a machine's family for another on an update."""
    platform = platform or host_platform()
    entries = manifest.select(backend, platform, variant)
    if entries and keep_archs:
        covering = [e for e in entries if set(keep_archs) <= set(e.cuda_archs)]
        if not covering:
            raise StokerError(
                ReasonCode.BUNDLE_MISSING,
                f"The manifest lists no {backend} bundle built for the installed one's CUDA architectures "
                f"({';'.join(keep_archs)}).",
                {
                    "backend": backend,
                    "installed_archs": list(keep_archs),
                    "listed": [list(e.cuda_archs) for e in entries],
                },
            )
        entries = tuple(sorted(covering, key=lambda e: tuple(e.cuda_archs) != tuple(keep_archs)))
    if not entries:
        raise StokerError(
            ReasonCode.BUNDLE_MISSING,
            f"The manifest lists no {backend} bundle{f' ({variant})' if variant else ''} for {platform}.",
            {
                "backend": backend,
                "variant": variant,
                "platform": platform,
                "listed": [f"{e.backend}-{e.variant} {e.platform}" for e in manifest.bundles],
            },
        )
    refused: dict[str, Any] = {}
    fitting = list(entries)
    if detection is not None and plugin is not None:
        fitting = []
        for entry in entries:
            check = plugin.explain_bundle(detection, entry.to_dict())
            if check.ok:
                fitting.append(entry)
            else:
                refused[f"{entry.variant} {entry.version}"] = {
                    "reason": str(check.reason),
                    "message": check.message,
                    **dict(check.evidence),
                }
        if fitting and variant is None:
            chosen = plugin.choose_variant(detection, [e.variant for e in fitting])
            if chosen is not None:
                fitting = [e for e in fitting if e.variant == chosen]
    if not fitting:
        raise StokerError(
            ReasonCode.BUNDLE_MISSING,
            f"No {backend} bundle in the manifest fits this machine.",
            {"backend": backend, "platform": platform, "refused": refused},
        )
    # A mirror keeps its earlier releases: the newest fitting one, the first listed among equals.
    return max(fitting, key=lambda e: version_key(e.version))
