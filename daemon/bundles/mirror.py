"""A static mirror of engine bundles: the zips and one signed manifest, for any web server.

    DIR/manifest.json              a signed envelope (daemon/core/signing.py) whose payload is
                                   the manifest (metadata.BundleManifest: entries, version,
                                   expires, channel)
    DIR/bundles/<sha256>.zip       each bundle, named by its content's sha256

`publish_mirror` copies the bundles in (content-addressed: a name is never reused for other
bytes, so a cache or a half-synced mirror cannot serve a stale zip under a current name), then
writes the manifest last, atomically: a client never sees a manifest naming a zip not there yet.
Entry URLs are relative to the manifest, so the directory can be served from anywhere (a web
server, a release page, a file:// path). Publishing into an existing mirror keeps its other
entries (the same release, `release_key`: replaced) and raises the version past the
previous one, which daemons that accepted it require (docs/mirror.md).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import attrs

from stoker.daemon.bundles.installed import bundle_meta_of
from stoker.daemon.bundles.metadata import (
    MANIFEST_SCHEMA_VERSION,
    BundleManifest,
    BundleMeta,
    ManifestEntry,
    format_timestamp,
    release_key,
)
from stoker.daemon.core.digests import fsync_dir, sha256_file
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.signing import Envelope, SignatureError, SigningKey, sign_envelope
from stoker.states.reasons import ReasonCode

MANIFEST_NAME = "manifest.json"
BUNDLES_DIR = "bundles"
MANIFEST_PAYLOAD_TYPE = "application/vnd.stoker.manifest+json"
DEFAULT_CHANNEL = "stable"
DEFAULT_EXPIRES_DAYS = 30.0


@attrs.frozen
class PublishResult:
    """What `publish_mirror` wrote."""

    directory: Path
    manifest: Path
    version: int
    previous_version: int | None
    expires: str
    channel: str
    key_id: str
    public_key: str
    entries: tuple[dict[str, Any], ...]  # as written: relative url, sha256, size, backend...
    added: tuple[str, ...]  # the zips copied in now (relative paths); the others were there

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "manifest": str(self.manifest),
            "version": self.version,
            "previous_version": self.previous_version,
            "expires": self.expires,
            "channel": self.channel,
            "key_id": self.key_id,
            "public_key": self.public_key,
            "entries": [dict(e) for e in self.entries],
            "added": list(self.added),
        }


def entry_for(meta: BundleMeta, sha256: str, size: int) -> dict[str, Any]:
    """A manifest entry for a bundle (url relative to the manifest): every fact of bundle.json a
    daemon chooses by before downloading (backend, variant, platform, driver floor, archs)."""
    return ManifestEntry(
        url=f"{BUNDLES_DIR}/{sha256}.zip",
        sha256=sha256,
        size=size,
        backend=meta.backend,
        variant=meta.variant,
        version=meta.version,
        platform=meta.platform,
        min_driver=meta.min_driver,
        cuda_archs=tuple(meta.cuda_archs),
    ).to_dict()


def read_previous(directory: Path) -> tuple[dict[str, Any] | None, Envelope | None]:
    """The payload document of the mirror's current manifest, if any (its own bytes, read to
    carry its entries and version on; a plain unsigned manifest is read too)."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None, None
    try:
        document = json.loads(path.read_bytes())
        if Envelope.looks_like(document):
            envelope = Envelope.from_document(document)
            return json.loads(envelope.payload), envelope
        return document, None
    except (ValueError, SignatureError, RecursionError) as err:
        raise StokerError(
            ReasonCode.BUNDLE_METADATA_MISMATCH,
            f"The mirror's current {MANIFEST_NAME} cannot be read ({err}); move it aside to publish afresh.",
            {"manifest": str(path), "error": str(err)},
        ) from None


def publish_mirror(
    directory: Path,
    zips: Iterable[Path],
    key: SigningKey,
    *,
    version: int | None = None,
    expires_days: float = DEFAULT_EXPIRES_DAYS,
    channel: str | None = None,
    clock: Callable[[], float] = time.time,
    progress: Callable[[str], None] = lambda _: None,
) -> PublishResult:
    """Copy `zips` into the mirror at `directory` and sign its new manifest with `key`."""
    directory = Path(directory)
    if expires_days <= 0:
        raise StokerError(ReasonCode.BAD_REQUEST, "--expires must be a positive number of days.", {})
    previous, _ = read_previous(directory)
    prev_version = previous.get("version") if previous else None
    prev_version = prev_version if isinstance(prev_version, int) and not isinstance(prev_version, bool) else None
    if version is None:
        version = 1 if prev_version is None else prev_version + 1
    elif prev_version is not None and version <= prev_version:
        raise StokerError(
            ReasonCode.MANIFEST_ROLLBACK,
            f"The mirror's manifest is already version {prev_version}; --version {version} would be refused as a "
            "rollback by every daemon that accepted it. Give a higher version (or none: the next one).",
            {"version": version, "previous_version": prev_version},
        )
    if version < 1:
        raise StokerError(ReasonCode.BAD_REQUEST, "--version must be a positive integer.", {"version": version})
    channel = channel or (previous or {}).get("channel") or DEFAULT_CHANNEL
    entries: list[dict[str, Any]] = list((previous or {}).get("bundles") or [])
    store = directory / BUNDLES_DIR
    store.mkdir(parents=True, exist_ok=True)
    added = []
    for path in zips:
        meta = bundle_meta_of(Path(path))
        digest = sha256_file(path)
        size = Path(path).stat().st_size
        entry = entry_for(meta, digest, size)
        target = directory / entry["url"]
        if not (target.is_file() and target.stat().st_size == size and sha256_file(target) == digest):
            tmp = target.with_name(f".{target.name}.tmp")
            shutil.copyfile(path, tmp)
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
            added.append(entry["url"])
            progress(f"added {entry['url']} ({meta.backend}-{meta.variant} {meta.version}, {size} bytes)")
        entries = [e for e in entries if release_key(e) != release_key(entry)]
        entries.append(entry)
    fsync_dir(store)
    expires = format_timestamp(clock() + expires_days * 86400)
    doc = {
        "schema_version": MANIFEST_SCHEMA_VERSION,
        "version": version,
        "expires": expires,
        "channel": channel,
        "published": format_timestamp(clock()),
        "bundles": entries,
    }
    payload = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
    # What a daemon will parse must parse here first: a publisher never signs a manifest it refuses.
    BundleManifest.from_json(payload, (directory / MANIFEST_NAME).absolute().as_uri())
    envelope = sign_envelope(payload, MANIFEST_PAYLOAD_TYPE, key)
    manifest = directory / MANIFEST_NAME
    tmp = manifest.with_name(f".{MANIFEST_NAME}.tmp")
    tmp.write_bytes(envelope.to_json())
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.chmod(tmp, 0o644)
    os.replace(tmp, manifest)
    fsync_dir(directory)
    progress(f"signed {MANIFEST_NAME} version {version} ({channel}) with key {key.keyid}, expires {expires}")
    return PublishResult(
        directory=directory,
        manifest=manifest,
        version=version,
        previous_version=prev_version,
        expires=expires,
        channel=channel,
        key_id=key.keyid,
        public_key=key.public_text,
        entries=tuple(entries),
        added=tuple(added),
    )


def newest_cached_zips(results: Iterable[Any]) -> list[Path]:
    """One zip per release (`release_key`: backend, variant, platform, version, CUDA family) from
    the build cache's entries (`build.cached_builds`): the highest builder revision, then the
    newest file."""
    best: dict[tuple[Any, ...], tuple[tuple[int, float], Path]] = {}
    for result in results:
        meta = result.meta
        revision = meta.build.get("builder_revision")
        rank = (revision if isinstance(revision, int) else 0, Path(result.zip_path).stat().st_mtime)
        key = release_key(attrs.asdict(meta, recurse=False))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, Path(result.zip_path))
    return [path for _, path in sorted(best.values(), key=lambda item: str(item[1]))]
