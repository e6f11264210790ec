"""The snapshot catalogue: one row per complete KV slot file, the moving figures that judge
snapshots on this machine, and (for rows from before model ids) the model digest cache.

A row is written only after its file is complete, checked and renamed into place, so the
catalogue never names a half-written file. Files and rows leave together (`remove`). A row's
`sealed_at` and `file_sha256` are filled in later, by the background work after a save.
"""

from __future__ import annotations

import sqlite3
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, TypeVar

import attrs

from stoker.states.reasons import ReasonCode
from stoker.states.snapshots.policy import Figure, fold
from stoker.store.errors import StoreError
from stoker.store.rows import StoredRecord

if TYPE_CHECKING:
    from stoker.store.database import Store
    from stoker.store.sqlitedb import Database

# Which server instance a snapshot belongs to (a [models.NAME]; "default" without [models]): a
# conversation never moves between instances, even two serving the same file (migration m007).
INSTANCE_FIELD = "instance"
DEFAULT_INSTANCE = "default"
# Which model a snapshot belongs to: `model_id` (daemon/models/identity.py); rows written
# before it existed have only the model file's full sha256 (see `same_model`).
MODEL_FIELDS = ("model_id", "model_sha256")
# The fields that must match between a snapshot and a server before the engine sees the file.
LAYOUT_FIELDS = (
    "engine_build",
    "n_ctx",
    "n_slots",
    "flash_attn",
    "cache_type_k",
    "cache_type_v",
    "swa_full",
    "kv_unified",
)
IDENTITY_FIELDS = (INSTANCE_FIELD,) + MODEL_FIELDS + LAYOUT_FIELDS

T = TypeVar("T")


def same_model(snapshot: Mapping[str, Any], server: Mapping[str, Any]) -> bool:
    """Whether a snapshot was written by the server's model: by model id; a row from before
    model ids, by the full sha256 the daemon of that time cached for this exact file."""
    if snapshot.get("model_id"):
        return bool(snapshot["model_id"] == server.get("model_id"))
    return bool(snapshot.get("model_sha256")) and snapshot.get("model_sha256") == server.get("model_sha256")


def model_key(rec: "SnapshotRecord") -> tuple[str, str]:
    """The instance and model a row belongs to, for retention's per-model count."""
    return rec.instance, rec.model_id or rec.model_sha256 or ""


@attrs.frozen
class SnapshotRecord(StoredRecord):
    """A catalogued snapshot: where its file is, what it fits, and how it came to be."""

    id: int
    filename: str
    slot_id: int
    model_path: str | None
    model_sha256: str | None  # the model file's full sha256: rows from before model ids only
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
    file_sha256: str | None  # None until the background digest after the save finished
    cause: str
    save_ms: float | None
    created_at: float
    kv_unified: bool | None = None  # None: catalogued before it was recorded
    model_id: str | None = None  # None: a row from before model ids (model_sha256 then)
    file_mtime_ns: int | None = None  # the file as it was catalogued: what the restore checks
    file_inode: int | None = None
    file_sample_sha256: str | None = None  # sha256 of the file's size, head and tail
    sealed_at: float | None = None  # its data reached the disk (fsync); None: not yet
    boot_id: str | None = None  # the boot that wrote it (an unsealed file from another boot may be torn)
    instance: str = DEFAULT_INSTANCE  # the server instance whose conversation it holds

    def identity(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in IDENTITY_FIELDS}


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

    def list(self, *, slot_id: int | None = None, instance: str | None = None) -> list[SnapshotRecord]:
        """Snapshots, newest first (optionally of one slot, of one instance)."""
        where = [(f"[{k}] = ?", v) for k, v in (("slot_id", slot_id), (INSTANCE_FIELD, instance)) if v is not None]
        sql = "select * from snapshots" + (" where " + " and ".join(c for c, _ in where) if where else "")
        sql += " order by created_at desc, id desc"
        return [SnapshotRecord.from_row(r) for r in self.store.db.query(sql, [v for _, v in where])]

    def slots_saved(self, instance: str) -> int:
        """How many slots a load of `instance` like its last one restores: the distinct slots of its
        snapshots of the model and layout its newest snapshot has (what its last stop saved, with
        any older slot the restore takes too). Read from the rows: a daemon restart keeps it."""
        records = self.list(instance=instance)
        if not records:
            return 0
        newest = records[0].identity()
        return len({r.slot_id for r in records if r.identity() == newest})

    def update(self, snapshot_id: int, **fields: Any) -> None:
        """Fill in what the background work learnt (sealed_at, file_sha256, the file's place); a
        row removed meanwhile is left alone."""
        sets = ", ".join(f"[{name}] = ?" for name in fields)
        params = [*fields.values(), snapshot_id]
        self._write("snapshots", lambda db: db.execute(f"update snapshots set {sets} where id = ?", params))

    def remove(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if ids:
            marks = ",".join("?" * len(ids))
            self._write("snapshots", lambda db: db.execute(f"delete from snapshots where id in ({marks})", ids))

    def filenames(self) -> set[str]:
        return {r[0] for r in self.store.db.execute("select filename from snapshots").fetchall()}

    # --- moving figures ------------------------------------------------------------------

    def figures(self, prefix: str = "") -> dict[str, Figure]:
        """The moving figures whose names start with `prefix`, by name."""
        rows = self.store.db.execute(
            "select name, value, samples from snapshot_figures where substr(name, 1, ?) = ?", [len(prefix), prefix]
        ).fetchall()
        return {name: Figure(value, samples) for name, value, samples in rows}

    def fold_figure(self, name: str, sample: float) -> Figure:
        """Move the figure `name` by one sample (states.snapshots.policy.fold); the new figure."""

        def write(db: Database) -> Figure:
            row = db.execute("select value, samples from snapshot_figures where name = ?", [name]).fetchone()
            new = fold(Figure(row[0], row[1]) if row else None, sample)
            db.table("snapshot_figures").upsert(
                {"name": name, "value": new.value, "samples": new.samples, "updated_at": self.store.clock()}, pk="name"
            )
            return new

        return self._write("snapshot_figures", write)

    # --- the model digest cache (rows from before model ids) -------------------------------

    def cached_digest(self, path: str, size: int, mtime_ns: int) -> str | None:
        """The model's sha256 if it was computed for this exact path, size and mtime."""
        row = self.store.db.execute(
            "select sha256 from model_digests where path = ? and size = ? and mtime_ns = ?", [path, size, mtime_ns]
        ).fetchone()
        return row[0] if row else None

    def remember_digest(self, path: str, size: int, mtime_ns: int, sha256: str) -> None:
        row = {"path": path, "size": size, "mtime_ns": mtime_ns, "sha256": sha256, "computed_at": self.store.clock()}
        self._write("model_digests", lambda db: db.table("model_digests").upsert(row, pk="path"))


def retention_plan(records: list[SnapshotRecord], max_count: int, max_bytes: int) -> list[tuple[SnapshotRecord, str]]:
    """Which snapshots retention removes, and why: "count" beyond `max_count` newest per (slot,
    instance, model), then "bytes" for the oldest until the total fits `max_bytes` (one budget for
    the snapshots dir, every instance's together). Pure: the caller deletes files and rows, and
    says what it dropped."""
    newest_first = sorted(records, key=lambda r: (r.created_at, r.id), reverse=True)
    seen: dict[tuple[int, tuple[str, str]], int] = {}
    keep: list[SnapshotRecord] = []
    victims: list[tuple[SnapshotRecord, str]] = []
    for rec in newest_first:
        key = (rec.slot_id, model_key(rec))
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= max_count:
            keep.append(rec)
        else:
            victims.append((rec, "count"))
    total = sum(r.file_size for r in keep)
    while keep and total > max_bytes:
        oldest = keep.pop()
        total -= oldest.file_size
        victims.append((oldest, "bytes"))
    return victims


def retention_victims(records: list[SnapshotRecord], max_count: int, max_bytes: int) -> list[SnapshotRecord]:
    """The snapshots `retention_plan` removes."""
    return [rec for rec, _ in retention_plan(records, max_count, max_bytes)]
