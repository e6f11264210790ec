"""The Store: one SQLite database (sqlite-utils) holding machines and their history.

Connection settings, chosen on purpose (docs/store.md says why):
- WAL, so the CLI can read history while the daemon writes;
- busy_timeout, so a reader holding a lock makes a writer wait instead of fail;
- synchronous=NORMAL: in WAL mode a kill -9 of the daemon never loses a committed
  transition; only a power cut can drop the last few, and never corrupts the file;
- foreign_keys=ON, so history rows always belong to a machine row.
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import attrs
from sqlite_utils import Database

from states.reasons import ReasonCode
from store.errors import StoreError
from store.migrations import MIGRATIONS, Migration, migrate
from store.records import MachineRecord, TransitionRecord

BUSY_TIMEOUT_MS = 5000
MEMORY = ":memory:"


def _dumps(value: Mapping[str, Any] | None) -> str:
    # Evidence is diagnostic: an odd value (a path, a set) is kept as its text, not refused.
    return json.dumps(dict(value or {}), sort_keys=True, separators=(",", ":"), default=str)


@attrs.define(eq=False)
class Store:
    """Machines and their transition history; one transaction per transition."""

    db: Database
    path: str
    clock: Callable[[], float] = time.time

    @contextmanager
    def transaction(self) -> Iterator[Database]:
        """One atomic unit of work (nests as a savepoint), for writes by later tables."""
        with self.db.atomic():
            yield self.db

    def record_step(
        self,
        *,
        machine_id: str,
        kind: str,
        from_state: str,
        event: str,
        event_data: Mapping[str, Any],
        to_state: str,
        data: Mapping[str, Any],
        reason: str | None = None,
        evidence: Mapping[str, Any] | None = None,
        at: float | None = None,
    ) -> TransitionRecord:
        """Write the machine's new row and append its history row in ONE transaction."""
        at = self.clock() if at is None else at
        reason = None if reason is None else str(reason)
        evidence_json = _dumps(evidence)
        row = {
            "machine_id": machine_id,
            "kind": kind,
            "from_state": str(from_state),
            "event": event,
            "event_data": _dumps(event_data),
            "to_state": str(to_state),
            "reason": reason,
            "evidence": evidence_json,
            "at": at,
        }
        machine = {
            "id": machine_id,
            "kind": kind,
            "state": str(to_state),
            "data": _dumps(data),
            "reason": reason,
            "evidence": evidence_json,
            "updated_at": at,
        }
        try:
            with self.db.atomic():
                current = self.db.execute("select seq from machines where id = ?", [machine_id]).fetchone()
                seq = (current[0] if current else 0) + 1
                self.db.table("machines").upsert({**machine, "seq": seq}, pk="id")
                row["seq"] = seq
                row_id = self.db.table("transitions").insert(row).last_pk
        except sqlite3.Error as exc:
            raise StoreError(
                ReasonCode.STORE_WRITE_FAILED,
                evidence={"machine": machine_id, "event": event, "error": str(exc), "path": self.path},
            ) from exc
        return TransitionRecord.from_row({**row, "id": row_id})

    def machine(self, machine_id: str) -> MachineRecord | None:
        """The machine's current row, or None if it never moved."""
        rows = list(self.db.query("select * from machines where id = ?", [machine_id]))
        return MachineRecord.from_row(rows[0]) if rows else None

    def machines(self, kind: str | None = None) -> list[MachineRecord]:
        """Every machine (of one kind), by id."""
        if kind is None:
            rows = self.db.query("select * from machines order by id")
        else:
            rows = self.db.query("select * from machines where kind = ? order by id", [kind])
        return [MachineRecord.from_row(r) for r in rows]

    def history(
        self,
        machine: str | None = None,
        kind: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = 100,
    ) -> list[TransitionRecord]:
        """Transitions, newest first (by write order), filtered; `since <= at < until`."""
        where, params = [], []
        for clause, value in (("machine_id = ?", machine), ("kind = ?", kind), ("at >= ?", since), ("at < ?", until)):
            if value is not None:
                where.append(clause)
                params.append(value)
        sql = "select * from transitions"
        if where:
            sql += " where " + " and ".join(where)
        sql += " order by id desc"
        if limit is not None:
            sql += " limit ?"
            params.append(int(limit))
        return [TransitionRecord.from_row(r) for r in self.db.query(sql, params)]

    def count_transitions(self, machine: str | None = None) -> int:
        """How many transitions are recorded (for one machine)."""
        if machine is None:
            return int(self.db.execute("select count(*) from transitions").fetchone()[0])
        return int(self.db.execute("select count(*) from transitions where machine_id = ?", [machine]).fetchone()[0])

    def close(self) -> None:
        self.db.close()


def _corrupt(path: str, detail: Any) -> StoreError:
    return StoreError(
        ReasonCode.STORE_CORRUPT,
        f"The state database {path} is damaged ({detail}); move it aside (Stoker then starts "
        f"a fresh one) or restore a backup.",
        evidence={"path": path, "detail": detail},
    )


def open_store(
    path: str | Path,
    *,
    clock: Callable[[], float] = time.time,
    migrations: list[Migration] | None = None,
    busy_timeout_ms: int = BUSY_TIMEOUT_MS,
) -> Store:
    """Open (creating if needed), check and migrate the database; StoreError if unusable."""
    path = str(path)
    if path != MEMORY:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    db: Database | None = None
    try:
        db = Database(memory=True) if path == MEMORY else Database(path)
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        db.execute("PRAGMA foreign_keys = ON")
        problems = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise _corrupt(path, problems[:10])
        if path != MEMORY:
            db.enable_wal()
        db.execute("PRAGMA synchronous = NORMAL")
        migrate(db, MIGRATIONS if migrations is None else migrations, clock)
    except sqlite3.DatabaseError as exc:
        if db is not None:
            db.close()
        raise _corrupt(path, str(exc)) from exc
    except BaseException:
        if db is not None:
            db.close()
        raise
    return Store(db, path, clock)
