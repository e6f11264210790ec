"""The snapshot catalogue: one row per complete KV slot file, and the model digest cache.

A row is written only after its file is complete, checked and renamed into place, so the
catalogue never names a half-written file. Files and rows leave together (`remove`).
"""

from __future__ import annotations

import sqlite3
from typing import Any, Callable, Iterable, Mapping, TypeVar

import attrs
from sqlite_utils import Database

from states.reasons import ReasonCode
from store.database import Store
from store.errors import StoreError

# The fields that must match between a snapshot and a server before the engine sees the file.
IDENTITY_FIELDS = (
    "model_sha256",
    "engine_build",
    "n_ctx",
    "n_slots",
    "flash_attn",
    "cache_type_k",
    "cache_type_v",
    "swa_full",
    "kv_unified",
)

T = TypeVar("T")


@attrs.frozen
class SnapshotRecord:
    """A catalogued snapshot: where its file is, what it fits, and how it came to be."""

    id: int
    filename: str
    slot_id: int
    model_path: str | None
    model_sha256: str
    engine_build: str
    backend: str | None
    variant: str | None
    n_ctx: int
    n_slots: int
    flash_attn: str | None
    cache_type_k: str | None
    cache_type_v: str | None
    swa_full: bool
    n_tokens: int
    file_size: int
    file_sha256: str
    cause: str
    save_ms: float | None
    created_at: float
    kv_unified: bool | None = None  # None: catalogued before it was recorded

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "SnapshotRecord":
        fields = {f.name for f in attrs.fields(cls)}
        data = {k: row[k] for k in fields}
        data["swa_full"] = bool(row["swa_full"])
        data["kv_unified"] = None if row.get("kv_unified") is None else bool(row["kv_unified"])
        return cls(**data)

    def identity(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in IDENTITY_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.define(eq=False)
class SnapshotCatalog:
    """Snapshot rows and cached model digests in the daemon's store."""

    store: Store

    def _write(self, what: str, fn: Callable[[Database], T]) -> T:
        try:
            with self.store.transaction() as db:
                return fn(db)
        except sqlite3.Error as exc:
            raise StoreError(ReasonCode.STORE_WRITE_FAILED, evidence={"table": what, "error": str(exc)}) from exc

    def add(self, row: Mapping[str, Any]) -> SnapshotRecord:
        """Catalogue a complete snapshot file; returns its record."""
        unified = row.get("kv_unified")
        row = {
            **row,
            "swa_full": int(bool(row.get("swa_full"))),
            "kv_unified": None if unified is None else int(bool(unified)),
        }
        new_id = self._write("snapshots", lambda db: db.table("snapshots").insert(row).last_pk)
        record = self.get(new_id) if isinstance(new_id, int) else None
        assert record is not None, f"snapshot row {new_id!r} not read back"
        return record

    def get(self, snapshot_id: int) -> SnapshotRecord | None:
        rows = list(self.store.db.query("select * from snapshots where id = ?", [snapshot_id]))
        return SnapshotRecord.from_row(rows[0]) if rows else None

    def list(self, *, model_sha256: str | None = None, slot_id: int | None = None) -> list[SnapshotRecord]:
        """Snapshots, newest first (optionally of one model and slot)."""
        where, params = [], []
        for clause, value in (("model_sha256 = ?", model_sha256), ("slot_id = ?", slot_id)):
            if value is not None:
                where.append(clause)
                params.append(value)
        sql = "select * from snapshots" + (" where " + " and ".join(where) if where else "")
        sql += " order by created_at desc, id desc"
        return [SnapshotRecord.from_row(r) for r in self.store.db.query(sql, params)]

    def remove(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if ids:
            marks = ",".join("?" * len(ids))
            self._write("snapshots", lambda db: db.execute(f"delete from snapshots where id in ({marks})", ids))

    def filenames(self) -> set[str]:
        return {r[0] for r in self.store.db.execute("select filename from snapshots").fetchall()}

    # --- the model digest cache ----------------------------------------------------------

    def cached_digest(self, path: str, size: int, mtime_ns: int) -> str | None:
        """The model's sha256 if it was computed for this exact path, size and mtime."""
        row = self.store.db.execute(
            "select sha256 from model_digests where path = ? and size = ? and mtime_ns = ?", [path, size, mtime_ns]
        ).fetchone()
        return row[0] if row else None

    def remember_digest(self, path: str, size: int, mtime_ns: int, sha256: str) -> None:
        row = {"path": path, "size": size, "mtime_ns": mtime_ns, "sha256": sha256, "computed_at": self.store.clock()}
        self._write("model_digests", lambda db: db.table("model_digests").upsert(row, pk="path"))


def retention_victims(records: list[SnapshotRecord], max_count: int, max_bytes: int) -> list[SnapshotRecord]:
    """Which snapshots retention removes: beyond `max_count` newest per (slot, model), then the
    oldest until the total fits `max_bytes`. Pure: the caller deletes files and rows."""
    newest_first = sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)
    seen: dict[tuple[int, str], int] = {}
    keep: list[SnapshotRecord] = []
    victims: list[SnapshotRecord] = []
    for rec in newest_first:
        key = (rec.slot_id, rec.model_sha256)
        seen[key] = seen.get(key, 0) + 1
        (keep if seen[key] <= max_count else victims).append(rec)
    total = sum(r.file_size for r in keep)
    while keep and total > max_bytes:
        oldest = keep.pop()
        total -= oldest.file_size
        victims.append(oldest)
    return victims
