"""Which bundle manifests the daemon believes: signed by a configured key, fresh, never older.

The policy (docs/mirror.md, "What the daemon accepts"), applied to the bytes of a manifest
before anything in it is used:

- With `[bundles] trusted_keys` configured, every manifest, a local file included, must be a
  signed envelope (daemon/core/signing.py) with a valid signature by one of those keys over
  the exact bytes it carries: unsigned or signed only by other keys is `manifest_untrusted`, a
  signature that does not verify (altered bytes, a malformed envelope) `manifest_signature_invalid`.
  Its payload must carry `version` and `expires`; past `expires` is `manifest_expired`; a version
  below the newest accepted from that key and channel, or the same version with other bytes,
  is `manifest_rollback` (store/manifests.py remembers, in SQLite, across restarts). Its
  `channel` must be the channel asked for (`stable` for installs, the update's channel for
  `stoker engine update`): another channel's manifest, though signed by the same key, is
  `manifest_wrong_channel` and moves no channel's accepted version (served at the stable URL
  it would otherwise start a sequence of its own and offer its older releases as stable's).
- With no key configured, a local manifest (a path or file://) is read as it is, signed or not:
  development, a hand-written manifest, a mirror on this disk. Its bundles are still pinned by
  sha256 and size. An http(s) manifest is refused (`manifest_untrusted`): nothing fetched from
  the network is believed without a key to check it.

Every refusal is a StokerError with its reason and evidence (source, key ids, versions, times);
the install service records it on the install machine, so history says why and nothing moves.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

from stoker.daemon.bundles.metadata import BundleManifest, format_timestamp, parse_timestamp
from stoker.daemon.bundles.mirror import DEFAULT_CHANNEL, MANIFEST_PAYLOAD_TYPE
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.signing import Envelope, SignatureError, key_id, parse_public_key
from stoker.states.reasons import ReasonCode
from stoker.store.database import Store
from stoker.store.manifests import ManifestVersions


def is_remote(source: str) -> bool:
    """Whether the manifest is fetched over the network (http or https)."""
    return source.startswith(("http://", "https://"))


def manifest_base(source: str) -> str:
    """The URL relative entry URLs resolve against: the manifest's own URL."""
    if is_remote(source) or source.startswith("file://"):
        return source
    return Path(source).expanduser().absolute().as_uri()


def trusted_key_ids(texts: Sequence[str]) -> dict[str, bytes]:
    """key id -> raw public key for each `ed25519:...` text (already checked by the config)."""
    keys = {}
    for text in texts:
        raw = parse_public_key(text)
        keys[key_id(raw)] = raw
    return keys


@attrs.frozen
class Admitted:
    """A manifest the daemon believes, and how it came to (the install's evidence)."""

    manifest: BundleManifest
    provenance: dict[str, Any]


@attrs.define(eq=False)
class ManifestTrust:
    """The trust policy for one daemon: its configured keys, and the store that remembers the
    newest manifest accepted per key and channel (None: nothing remembered, e.g. a unit test)."""

    keys: tuple[str, ...] = ()
    store: Store | None = None
    clock: Callable[[], float] = time.time

    def may_fetch(self, source: str) -> None:
        """Refuse, before a byte is fetched, a network manifest that no configured key could check."""
        if not self.keys and is_remote(source):
            raise StokerError(
                ReasonCode.MANIFEST_UNTRUSTED,
                f"The manifest at {source} comes over the network and no `[bundles] trusted_keys` is configured "
                "to check it, so it was not fetched. Add the mirror's public key to trusted_keys.",
                {"manifest": source, "signed": None, "trusted_keys": []},
            )

    def admit(self, source: str, raw: bytes, channel: str = DEFAULT_CHANNEL) -> Admitted:
        """The manifest in `raw` (read from `source`, asked for as `channel`'s) if it may be
        believed; else StokerError."""
        base = manifest_base(source)
        try:
            document = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested past Python's stack
            document = None  # not JSON: BundleManifest says so below, after the trust checks
        signed = Envelope.looks_like(document)
        evidence: dict[str, Any] = {"manifest": source, "signed": signed}
        if not self.keys:
            self.may_fetch(source)
            payload = self._envelope(document, evidence).payload if signed else raw
            manifest = BundleManifest.from_json(payload, base)
            return Admitted(manifest, {**evidence, "trust": "local manifest, no trusted_keys configured: not checked"})
        if not signed:
            raise StokerError(
                ReasonCode.MANIFEST_UNTRUSTED,
                f"The manifest {source} is not signed, and `[bundles] trusted_keys` is configured, so it was not used.",
                {**evidence, "trusted_keys": sorted(trusted_key_ids(self.keys))},
            )
        envelope = self._envelope(document, evidence)
        return self._admit_signed(source, base, envelope, {**evidence, "channel_asked": channel})

    def _envelope(self, document: Any, evidence: dict[str, Any]) -> Envelope:
        try:
            envelope = Envelope.from_document(document)
        except SignatureError as err:
            raise StokerError(
                ReasonCode.MANIFEST_SIGNATURE_INVALID,
                f"The manifest {evidence['manifest']} is a malformed signed envelope: {err}.",
                {**evidence, "error": str(err)},
            ) from None
        if envelope.payload_type != MANIFEST_PAYLOAD_TYPE:
            raise StokerError(
                ReasonCode.MANIFEST_SIGNATURE_INVALID,
                f"The envelope at {evidence['manifest']} signs a {envelope.payload_type!r}, not a bundle manifest.",
                {**evidence, "payload_type": envelope.payload_type, "expected": MANIFEST_PAYLOAD_TYPE},
            )
        return envelope

    def _admit_signed(self, source: str, base: str, envelope: Envelope, evidence: dict[str, Any]) -> Admitted:
        trusted = trusted_key_ids(self.keys)
        claimed = [k for k, _ in envelope.signatures]
        evidence = {**evidence, "trusted_keys": sorted(trusted), "signed_by": claimed}
        signers = envelope.signers(trusted)
        if not signers:
            if any(k in trusted for k in claimed):
                raise StokerError(
                    ReasonCode.MANIFEST_SIGNATURE_INVALID,
                    f"The manifest {source} names a trusted key ({', '.join(k for k in claimed if k in trusted)}) "
                    "but its signature does not verify over the bytes served: altered after signing.",
                    evidence,
                )
            raise StokerError(
                ReasonCode.MANIFEST_UNTRUSTED,
                f"The manifest {source} is signed by {', '.join(claimed) or 'no key'}, not by a key in "
                f"`[bundles] trusted_keys` ({', '.join(sorted(trusted))}).",
                evidence,
            )
        signer = signers[0]
        manifest = BundleManifest.from_json(envelope.payload, base)
        channel = manifest.channel or DEFAULT_CHANNEL
        evidence = {**evidence, "key_id": signer, "channel": channel, "version": manifest.version}
        if channel != evidence["channel_asked"]:
            raise StokerError(
                ReasonCode.MANIFEST_WRONG_CHANNEL,
                f"The manifest {source} is signed for channel {channel!r} (version {manifest.version}, key "
                f"{signer}), but it was read as channel {evidence['channel_asked']!r}'s: a mirror serving another "
                "channel's manifest at this URL. Point the channel at its own manifest.",
                evidence,
            )
        if manifest.version is None or manifest.expires is None:
            raise StokerError(
                ReasonCode.BUNDLE_METADATA_MISMATCH,
                f"The signed manifest {source} lacks a version or an expiry; a mirror's manifest needs both.",
                {**evidence, "expires": manifest.expires},
            )
        now = self.clock()
        expires_at = parse_timestamp(manifest.expires)
        if now >= expires_at:
            raise StokerError(
                ReasonCode.MANIFEST_EXPIRED,
                f"The manifest {source} (version {manifest.version}, key {signer}) expired at {manifest.expires}; "
                f"it is now {format_timestamp(now)}. The publisher must re-sign it.",
                {**evidence, "expires": manifest.expires, "now": format_timestamp(now)},
            )
        digest = hashlib.sha256(envelope.payload).hexdigest()
        provenance = {**evidence, "trust": "signed", "expires": manifest.expires, "payload_sha256": digest}
        if self.store is not None:
            step = ManifestVersions(self.store, clock=self.clock).advance(
                key_id=signer,
                channel=channel,
                version=manifest.version,
                payload_sha256=digest,
                source=source,
                expires=manifest.expires,
            )
            previous = step.previous
            if not step.accepted and previous is not None:
                what = "other contents under the same version" if previous.version == manifest.version else "older"
                raise StokerError(
                    ReasonCode.MANIFEST_ROLLBACK,
                    f"The manifest {source} is version {manifest.version} of channel {channel}, but version "
                    f"{previous.version} signed by key {signer} was already accepted (from {previous.source}): "
                    f"this one is {what}, a replayed or forked manifest.",
                    {
                        **evidence,
                        "accepted_version": previous.version,
                        "accepted_sha256": previous.payload_sha256,
                        "payload_sha256": digest,
                        "accepted_from": previous.source,
                    },
                )
            provenance["previous_version"] = None if previous is None else previous.version
        return Admitted(manifest, provenance)
