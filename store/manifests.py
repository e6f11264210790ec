"""The newest signed bundle manifest accepted per signing key and channel (`manifest_versions`).

A mirror's manifest carries a version that its publisher raises with every publish
(docs/mirror.md). The daemon accepts a manifest only if its version is not below the one it
last accepted from the same key and channel, and a manifest of the same version only if it is
the same bytes: so a mirror (or anyone between) replaying an older manifest cannot bring an
older engine back (TUF's rollback protection). `advance` checks and records in one transaction.
"""

from __future__ import annotations

import time
from typing import Callable

import attrs

from stoker.store.database import Store
from stoker.store.rows import StoredRecord


@attrs.frozen
class AcceptedManifest(StoredRecord):
    """The newest manifest accepted from one key and channel."""

    key_id: str
    channel: str
    version: int
    payload_sha256: str
    source: str
    expires: str | None
    accepted_at: float


@attrs.frozen
class Advance:
    """What `advance` found: the row before (None the first time) and whether it was accepted."""

    accepted: bool
    previous: AcceptedManifest | None


@attrs.define(eq=False)
class ManifestVersions:
    """The `manifest_versions` table."""

    store: Store
    clock: Callable[[], float] = time.time

    def last(self, key_id: str, channel: str) -> AcceptedManifest | None:
        """The newest manifest accepted from this key and channel, if any."""
        rows = list(
            self.store.db.query("select * from manifest_versions where key_id = ? and channel = ?", (key_id, channel))
        )
        return AcceptedManifest.from_row(rows[0]) if rows else None

    def all(self) -> list[AcceptedManifest]:
        return [
            AcceptedManifest.from_row(r)
            for r in self.store.db.query("select * from manifest_versions order by key_id, channel")
        ]

    def advance(
        self, *, key_id: str, channel: str, version: int, payload_sha256: str, source: str, expires: str | None
    ) -> Advance:
        """Record this manifest as the newest from its key and channel, unless it is older than
        the one recorded (a lower version, or the same version with other bytes): then nothing
        is written and `accepted` is False. The check and the write are one transaction."""
        with self.store.transaction() as db:
            rows = list(db.query("select * from manifest_versions where key_id = ? and channel = ?", (key_id, channel)))
            previous = AcceptedManifest.from_row(rows[0]) if rows else None
            if previous is not None and (
                version < previous.version
                or (version == previous.version and payload_sha256 != previous.payload_sha256)
            ):
                return Advance(False, previous)
            db.table("manifest_versions").upsert(
                {
                    "key_id": key_id,
                    "channel": channel,
                    "version": version,
                    "payload_sha256": payload_sha256,
                    "source": source,
                    "expires": expires,
                    "accepted_at": self.clock(),
                },
                pk=("key_id", "channel"),
            )
        return Advance(True, previous)
