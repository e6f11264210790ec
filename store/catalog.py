"""The model catalog: every model pulled or added, with the facts that were verified and read.

A row is written by the pull machine's `Commit` (daemon/models/pull.py), after the file's
sha256 was checked against its source and its GGUF header read, and the file renamed into
place; so the catalog never names a half-downloaded file. `put` is an upsert: `Commit` is
re-sent when a pull is resumed and must be idempotent.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import attrs

from stoker.states.convert import unstructure
from stoker.states.reasons import ReasonCode
from stoker.store.errors import StoreError
from stoker.store.rows import StoredRecord

if TYPE_CHECKING:
    from stoker.store.database import Store


@attrs.frozen
class ModelRecord(StoredRecord):
    """A cataloged model: its name, where it came from, the file, and its header's facts."""

    json_columns = ("facts",)

    name: str
    spec: str
    source: str  # hf | pypi | local
    origin: str | None
    revision: str | None
    path: str
    size: int
    sha256: str
    owned: bool  # Stoker downloaded it (rm deletes the file) or it is a user's own file
    architecture: str | None
    parameters: int | None
    quantization: str | None
    context_length: int | None
    chat_template: bool | None
    facts: dict[str, Any] = attrs.field(factory=dict, hash=False)
    pulled_at: float = 0.0

    def to_row(self) -> dict[str, Any]:
        row: dict[str, Any] = unstructure(self)  # SQLite stores the booleans as 0 and 1
        row["facts"] = json.dumps(self.facts, sort_keys=True, default=str)
        return row

    def to_public(self) -> dict[str, Any]:
        """What `model.list` and `stoker models --json` show."""
        return attrs.asdict(self)


@attrs.define(eq=False)
class ModelCatalog:
    """The `models` table: put (upsert), find/get, all, by_path, remove."""

    store: Store

    def put(self, record: ModelRecord) -> ModelRecord:
        """Write (or rewrite) `record`'s row."""
        with self.store.transaction() as db:
            db.table("models").upsert(record.to_row(), pk="name")
        return record

    def find(self, name: str) -> ModelRecord | None:
        """The model named `name`, or None."""
        rows = list(self.store.db.query("select * from models where name = ?", (name,)))
        return ModelRecord.from_row(rows[0]) if rows else None

    def get(self, name: str) -> ModelRecord:
        """The model named `name`; model_not_in_catalog when there is none."""
        found = self.find(name)
        if found is None:
            raise StoreError(ReasonCode.MODEL_NOT_IN_CATALOG, evidence={"name": name, "known": self.names()})
        return found

    def names(self) -> list[str]:
        return [row["name"] for row in self.store.db.query("select name from models order by name")]

    def all(self) -> list[ModelRecord]:
        """Every cataloged model, by name."""
        return [ModelRecord.from_row(row) for row in self.store.db.query("select * from models order by name")]

    def by_path(self, path: str) -> list[ModelRecord]:
        """The models whose file is `path` (a local file may be added under several names)."""
        return [ModelRecord.from_row(r) for r in self.store.db.query("select * from models where path = ?", (path,))]

    def remove(self, name: str) -> None:
        """Drop the row (the file is the caller's business)."""
        with self.store.transaction() as db:
            db.execute("delete from models where name = ?", (name,))
