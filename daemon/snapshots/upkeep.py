"""The snapshot files and their rows: what happens to a file after the engine wrote it.

A saved file is catalogued at once (so that a restart's restore finds it), then sealed (fsync,
its directory too) and digested (its full sha256) in the background: a stop waits for the
engine's write and nothing else. A row not sealed when the machine restarted may name a torn
file and is dropped, saying so; one a killed daemon did not seal or digest is queued again.
Retention and cleanup after a kill live here too; every drop is reported (drops.py).
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import trio

from stoker.daemon.core.digests import fsync_dir, sha256_file
from stoker.daemon.core.errors import StokerError
from stoker.daemon.snapshots.drops import DropLog
from stoker.daemon.snapshots.files import FileFacts, boot_id, seal
from stoker.states.reasons import ReasonCode, ReasonedError
from stoker.store.snapshots import SnapshotCatalog, SnapshotRecord, retention_plan

log = logging.getLogger(__name__)

SEAL_AT_EXIT_S = 30.0  # at daemon exit, the pending fsyncs may take this long
PARTIAL_PREFIX = "partial-"
_FINAL_NAME = re.compile(r"^slot\d+-\d+-[0-9a-f]+\.bin$")


@attrs.define(eq=False)
class SnapshotUpkeep:
    """The snapshots dir and its catalogue: sealing, digests, retention, cleanup."""

    dir: Path
    catalog: SnapshotCatalog
    drops: DropLog
    publish: Callable[[dict[str, Any]], Any] | None = None
    inflight: set[str] = attrs.field(factory=set)  # partial files a save is writing now
    boot: str | None = attrs.field(factory=boot_id)
    _background: trio.Nursery | None = None
    _unsealed: dict[int, Path] = attrs.field(factory=dict)  # catalogued, fsync pending
    _digesting: set[int] = attrs.field(factory=set)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The background work after saves, in the root nursery. At exit the pending fsyncs
        finish (bounded): a catalogued file's data is on the disk."""
        async with trio.open_nursery() as nursery:
            self._background = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._background = None
                with trio.move_on_after(SEAL_AT_EXIT_S) as scope:
                    scope.shield = True
                    for snapshot_id, path in list(self._unsealed.items()):
                        await self._seal(snapshot_id, path)

    async def after_save(self, rec: SnapshotRecord) -> None:
        """fsync, then the full sha256: in the background when the upkeep runs, else now."""
        path = self.dir / rec.filename
        self._unsealed[rec.id] = path
        if self._background is not None:
            self._background.start_soon(self._seal_and_digest, rec.id, path)
        else:
            await self._seal_and_digest(rec.id, path)

    async def _seal_and_digest(self, snapshot_id: int, path: Path) -> None:
        try:
            await self._seal(snapshot_id, path)
            await self._digest(snapshot_id, path)
        except Exception:  # background work never takes the daemon down; the next ready redoes it
            log.exception("after-save work on snapshot %d failed", snapshot_id)

    async def _seal(self, snapshot_id: int, path: Path) -> None:
        if self._unsealed.pop(snapshot_id, None) is None:
            return
        try:
            await trio.to_thread.run_sync(seal, path)
            await trio.to_thread.run_sync(fsync_dir, path.parent)
            self.catalog.update(snapshot_id, sealed_at=time.time())
        except (OSError, ReasonedError) as exc:  # removed meanwhile, or the store refuses: redone at next ready
            log.info("snapshot %d not sealed: %s", snapshot_id, exc)

    async def _digest(self, snapshot_id: int, path: Path) -> None:
        if snapshot_id in self._digesting:
            return
        self._digesting.add(snapshot_id)
        try:
            rec = self.catalog.get(snapshot_id)
            before = FileFacts.of(path)
            digest = await trio.to_thread.run_sync(sha256_file, path, abandon_on_cancel=True)
            # Vouch only for the file as catalogued: not one changed before or while it was read.
            catalogued = rec is not None and (before.size, before.mtime_ns, before.inode) == (
                rec.file_size,
                rec.file_mtime_ns,
                rec.file_inode,
            )
            if catalogued and FileFacts.of(path) == before and self.catalog.get(snapshot_id) is not None:
                self.catalog.update(snapshot_id, file_sha256=digest)
        except (OSError, ReasonedError) as exc:
            log.info("snapshot %d not digested: %s", snapshot_id, exc)
        finally:
            self._digesting.discard(snapshot_id)

    # --- the catalogue --------------------------------------------------------------------

    def get(self, snapshot_id: Any) -> SnapshotRecord:
        rec = (
            self.catalog.get(snapshot_id)
            if isinstance(snapshot_id, int) and not isinstance(snapshot_id, bool)
            else None
        )
        if rec is None:
            raise StokerError(ReasonCode.SNAPSHOT_NOT_FOUND, evidence={"id": snapshot_id})
        return rec

    def remove(self, records: list[SnapshotRecord]) -> None:
        """Files first, then rows: a kill in between leaves rows without files (cleaned up)."""
        for rec in records:
            (self.dir / rec.filename).unlink(missing_ok=True)
            self._unsealed.pop(rec.id, None)
        self.catalog.remove(r.id for r in records)
        if records and self.publish is not None:
            self.publish({"topic": "snapshot.removed", "ids": [r.id for r in records]})

    def apply_retention(self, max_count: int, max_bytes: int) -> list[SnapshotRecord]:
        """Remove what retention removes, and say so (count rotation quietly, bytes loudly)."""
        records = self.catalog.list()
        total = sum(r.file_size for r in records)
        plan = retention_plan(records, max_count, max_bytes)
        self.remove([rec for rec, _ in plan])
        for rec, why in plan:
            self.drops.record(
                ReasonCode.SNAPSHOT_DROPPED,
                quiet=why == "count",
                why=why,
                snapshot_id=rec.id,
                slot=rec.slot_id,
                n_tokens=rec.n_tokens,
                file_size=rec.file_size,
                total_bytes=total,
                max_bytes=max_bytes,
                max_count=max_count,
            )
        return [rec for rec, _ in plan]

    def cleanup_files(self) -> list[str]:
        """Remove what a kill left behind: partial files and uncatalogued snapshot files."""
        if not self.dir.is_dir():
            return []
        known = self.catalog.filenames()
        removed = []
        for entry in self.dir.iterdir():
            name = entry.name
            stray = name.startswith(PARTIAL_PREFIX) and name not in self.inflight
            if stray or (_FINAL_NAME.match(name) and name not in known):
                entry.unlink(missing_ok=True)
                removed.append(name)
        if removed:
            log.info("removed leftover snapshot files: %s", removed)
        return removed

    def cleanup_rows(self) -> None:
        """Drop rows whose file is gone (removed by hand, or a kill between unlink and delete),
        and rows never sealed before the machine restarted (their data may be torn); queue the
        fsync and digest a killed daemon did not finish."""
        gone, torn = [], []
        for rec in self.catalog.list():
            path = self.dir / rec.filename
            if not path.is_file():
                gone.append(rec)
            elif rec.sealed_at is None and rec.boot_id is not None and rec.boot_id != self.boot:
                torn.append(rec)
            elif self._background is None:
                continue
            elif rec.sealed_at is None and rec.file_sample_sha256 is not None and rec.id not in self._unsealed:
                self._unsealed[rec.id] = path
                self._background.start_soon(self._seal_and_digest, rec.id, path)
            elif rec.sealed_at is not None and rec.file_sha256 is None and rec.id not in self._digesting:
                self._background.start_soon(self._seal_and_digest, rec.id, path)
        self.catalog.remove(r.id for r in gone)
        for rec in gone:
            self.drops.removed(rec, "file_gone", filename=rec.filename)
        self.remove(torn)
        for rec in torn:
            self.drops.record(
                ReasonCode.SNAPSHOT_DROPPED,
                why="unsealed_before_reboot",
                snapshot_id=rec.id,
                slot=rec.slot_id,
                n_tokens=rec.n_tokens,
                saved_boot=rec.boot_id,
                this_boot=self.boot,
            )
