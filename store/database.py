"""The Store: one SQLite database (sqlite-utils) holding machines and their history.

Connection settings, chosen on purpose (docs/store.md says why):
- WAL, so the CLI can read history while the daemon writes;
- busy_timeout, so a reader holding a lock makes a writer wait instead of fail;
- synchronous=NORMAL: in WAL mode a kill -9 of the daemon never loses a committed
  transition; only a power cut can drop the last few, and never corrupts the file;
- foreign_keys=ON, so history rows always belong to a machine row.
- no sqlite-utils plugins: none of them is Stoker's, and finding them scans the entry points
  of every installed distribution (~50-100 ms at every daemon start; nothing of theirs may
  touch the state database anyway);
- a transition's two writes are plain prepared statements, not sqlite-utils' `upsert` and
  `insert`, which read the schema again on every call: 18 statements and 0.55-0.69 ms of CPU
  a transition, against 5 and 0.20-0.24 ms (2-core machine); a plan records 6-8 of them before
  its engine's spawn.

A disk that refuses a write (full, read-only, failing) never stops a machine: the transition
waits in memory, in order, and is written when the disk takes writes again (`flush`, which
every later write and the daemon's store keeper call); `health()` says why meanwhile. A write
SQLite refuses for what it is (a constraint) still raises. `checkpoint()` copies the WAL into
the main file, so that history does not live only in the -wal file until a clean close.
"""

from __future__ import annotations

import collections
import json
import os
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import attrs

from stoker.states.reasons import ReasonCode
from stoker.store.errors import StoreError
from stoker.store.migrations import MIGRATIONS, Migration, migrate
from stoker.store.records import MachineRecord, TransitionRecord
from stoker.store.sqlitedb import Database

BUSY_TIMEOUT_MS = 5000
MEMORY = ":memory:"
# Unwritten transitions kept while the disk refuses writes; past this the oldest history rows
# are dropped (counted in health), never the machines' latest rows (the newest step carries them).
MAX_PENDING = 10_000
# SQLite's primary result codes that say the disk or the file refuses writes now, not that the
# write is wrong: full, I/O error, read-only, cannot open, locked by another process.
_DISK_REFUSALS = frozenset(
    {sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN}
    | {sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_PROTOCOL}
)


def _primary_code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def refused_by_disk(exc: sqlite3.Error) -> bool:
    """Whether SQLite's error says the disk refuses writes now (worth a retry when it recovers)."""
    return _primary_code(exc) in _DISK_REFUSALS


# A transition's two writes (the tables of store/migrations.py m001_initial).
_MACHINE_COLUMNS = ("id", "kind", "state", "data", "reason", "evidence", "updated_at", "seq")
_UPSERT_MACHINE = (
    f"INSERT INTO machines ({', '.join(_MACHINE_COLUMNS)}) VALUES ({', '.join(':' + c for c in _MACHINE_COLUMNS)}) "
    f"ON CONFLICT(id) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in _MACHINE_COLUMNS[1:])}"
)
_TRANSITION_COLUMNS = (
    "machine_id",
    "kind",
    "from_state",
    "event",
    "event_data",
    "to_state",
    "reason",
    "evidence",
    "at",
    "seq",
)
_INSERT_TRANSITION = (
    f"INSERT INTO transitions ({', '.join(_TRANSITION_COLUMNS)}) "
    f"VALUES ({', '.join(':' + c for c in _TRANSITION_COLUMNS)})"
)


@attrs.frozen
class StoreHealth:
    """Whether transitions reach the disk; while they cannot, why, since when, how many wait."""

    writable: bool
    reason: str | None  # store_write_failed while not writable
    error: str | None  # SQLite's words for the last refusal ("database or disk is full")
    since: float | None  # wall clock of the first refused write
    pending: int  # transitions kept in memory, to be written in order
    dropped: int = 0  # history rows dropped beyond MAX_PENDING (the machines' rows are kept)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class _PendingStep:
    machine: dict[str, Any]
    transition: dict[str, Any]


def _dumps(value: Mapping[str, Any] | None) -> str:
    # Evidence is diagnostic: an odd value (a path, a set) is kept as its text, not refused.
    return json.dumps(dict(value or {}), sort_keys=True, separators=(",", ":"), default=str)


@attrs.define(eq=False)
class Store:
    """Machines and their transition history; one transaction per transition."""

    db: Database
    path: str
    clock: Callable[[], float] = time.time
    # Called with the new health when writes start failing and when they catch up.
    on_health: Callable[[StoreHealth], None] | None = None
    _pending: collections.deque[_PendingStep] = attrs.field(factory=collections.deque, init=False)
    _failure: tuple[str, float] | None = attrs.field(default=None, init=False)  # (error, since)
    _dropped: int = attrs.field(default=0, init=False)
    _unsynced: bool = attrs.field(default=False, init=False)  # written since the last checkpoint

    @contextmanager
    def transaction(self) -> Iterator[Database]:
        """One atomic unit of work (nests as a savepoint), for writes by later tables."""
        with self.db.atomic():
            yield self.db
        self._unsynced = True

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
        seq: int | None = None,
    ) -> TransitionRecord:
        """Write the machine's new row and append its history row in ONE transaction.

        The machine's transition number is one past the stored one (a waiting one included);
        `seq`, the caller's count, stands in only when the disk cannot even be read. When the
        disk refuses the write, the transition waits in memory behind any earlier one and the
        record comes back with `id` None; a write refused for what it is raises StoreError.
        """
        at = self.clock() if at is None else at
        reason = None if reason is None else str(reason)
        evidence_json = _dumps(evidence)
        try:
            seq = self._stored_seq(machine_id) + 1
        except sqlite3.Error as exc:  # a failing disk that cannot even be read
            if seq is None or not refused_by_disk(exc):
                raise StoreError(
                    ReasonCode.STORE_WRITE_FAILED,
                    evidence={"machine": machine_id, "event": event, "error": str(exc), "path": self.path},
                ) from exc
        row: dict[str, Any] = {
            "machine_id": machine_id,
            "kind": kind,
            "from_state": str(from_state),
            "event": event,
            "event_data": _dumps(event_data),
            "to_state": str(to_state),
            "reason": reason,
            "evidence": evidence_json,
            "at": at,
            "seq": seq,
        }
        machine = {
            "id": machine_id,
            "kind": kind,
            "state": str(to_state),
            "data": _dumps(data),
            "reason": reason,
            "evidence": evidence_json,
            "updated_at": at,
            "seq": seq,
        }
        step = _PendingStep(machine, row)
        if self._pending:
            self.flush()  # the earlier ones first: history keeps write order
        if not self._pending:
            try:
                row_id = self._write(step)
            except sqlite3.Error as exc:
                if not refused_by_disk(exc):
                    raise StoreError(
                        ReasonCode.STORE_WRITE_FAILED,
                        evidence={"machine": machine_id, "event": event, "error": str(exc), "path": self.path},
                    ) from exc
                self._refused(exc)
            else:
                return TransitionRecord.from_row({**row, "id": row_id})
        self._keep(step)
        return TransitionRecord.from_row({**row, "id": None})

    def _stored_seq(self, machine_id: str) -> int:
        for step in reversed(self._pending):
            if step.machine["id"] == machine_id:
                return int(step.machine["seq"])
        current = self.db.execute("select seq from machines where id = ?", [machine_id]).fetchone()
        return int(current[0]) if current else 0

    def _write(self, step: _PendingStep) -> int:
        # Two statements sqlite3 prepares once and caches (the module's docstring says why).
        with self.db.atomic():
            self.db.conn.execute(_UPSERT_MACHINE, step.machine)
            row_id = self.db.conn.execute(_INSERT_TRANSITION, step.transition).lastrowid
        self._unsynced = True
        assert isinstance(row_id, int), f"transition row id {row_id!r}"
        return row_id

    def _keep(self, step: _PendingStep) -> None:
        if len(self._pending) >= MAX_PENDING:
            self._pending.popleft()
            self._dropped += 1
        self._pending.append(step)

    def _refused(self, exc: sqlite3.Error) -> None:
        first = self._failure is None
        self._failure = (str(exc), self._failure[1] if self._failure else self.clock())
        if first:
            self._report()

    def _report(self) -> None:
        if self.on_health is not None:
            self.on_health(self.health())

    def flush(self) -> int:
        """Write the transitions kept while the disk refused them, oldest first; how many were
        written. Stops at the first refusal (they wait for the next try); reopens a connection
        that SQLite opened read-only, since only a fresh one can write once the file can be."""
        written = 0
        reopened = False
        while self._pending:
            step = self._pending[0]
            try:
                self._write(step)
            except sqlite3.Error as exc:
                if _primary_code(exc) == sqlite3.SQLITE_READONLY and not reopened and self.path != MEMORY:
                    reopened = True
                    if self._reopen():
                        continue
                if refused_by_disk(exc):
                    self._refused(exc)
                    return written
                # Refused for what it is (it can never be written): drop it, keep the rest coming.
                self._pending.popleft()
                self._dropped += 1
                continue
            self._pending.popleft()
            written += 1
        if self._failure is not None:
            self._failure = None
            self._report()
        return written

    def _reopen(self) -> bool:
        try:
            fresh = _connect(self.path, BUSY_TIMEOUT_MS)
        except sqlite3.Error:
            return False
        old, self.db = self.db, fresh
        try:
            old.close()
        except sqlite3.Error:
            pass
        return True

    def health(self) -> StoreHealth:
        """Whether writes reach the disk now, and what waits for it."""
        if self._failure is None:
            return StoreHealth(True, None, None, None, len(self._pending), self._dropped)
        error, since = self._failure
        return StoreHealth(False, ReasonCode.STORE_WRITE_FAILED.value, error, since, len(self._pending), self._dropped)

    def checkpoint(self) -> bool:
        """Copy the WAL into the main file (PASSIVE: never waits for a reader) if anything was
        written since the last one; True if it ran. A disk that refuses it is no error: the WAL
        keeps the rows and the next checkpoint tries again."""
        if not self._unsynced or self.path == MEMORY:
            return False
        try:
            busy, _log, _done = self.db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:
            return False
        self._unsynced = bool(busy)
        return True

    def machine(self, machine_id: str) -> MachineRecord | None:
        """The machine's current row (an unwritten one included), or None if it never moved."""
        for step in reversed(self._pending):
            if step.machine["id"] == machine_id:
                return MachineRecord.from_row(step.machine)
        rows = list(self.db.query("select * from machines where id = ?", [machine_id]))
        return MachineRecord.from_row(rows[0]) if rows else None

    def machines(self, kind: str | None = None) -> list[MachineRecord]:
        """Every machine (of one kind), by id."""
        if kind is None:
            rows = self.db.query("select * from machines order by id")
        else:
            rows = self.db.query("select * from machines where kind = ? order by id", [kind])
        found = {r["id"]: MachineRecord.from_row(r) for r in rows}
        for step in self._pending:
            if kind is None or step.machine["kind"] == kind:
                found[step.machine["id"]] = MachineRecord.from_row(step.machine)
        return [found[k] for k in sorted(found)]

    def history(
        self,
        machine: str | None = None,
        kind: str | None = None,
        since: float | None = None,
        until: float | None = None,
        limit: int | None = 100,
        machines: Sequence[str] | None = None,
    ) -> list[TransitionRecord]:
        """Transitions, newest first (by write order), filtered; `since <= at < until`;
        `machines`: only these machine ids. Unwritten ones (id None) come first: they are the newest."""
        unwritten = [
            TransitionRecord.from_row({**step.transition, "id": None})
            for step in reversed(self._pending)
            if _matches(step.transition, machine, kind, since, until)
            and (machines is None or step.transition["machine_id"] in machines)
        ]
        if limit is not None:
            unwritten = unwritten[: max(int(limit), 0)]
        where, params = [], []
        for clause, value in (("machine_id = ?", machine), ("kind = ?", kind), ("at >= ?", since), ("at < ?", until)):
            if value is not None:
                where.append(clause)
                params.append(value)
        if machines is not None:
            where.append(f"machine_id in ({', '.join('?' for _ in machines) or 'null'})")
            params.extend(machines)
        sql = "select * from transitions"
        if where:
            sql += " where " + " and ".join(where)
        sql += " order by id desc"
        if limit is not None:
            sql += " limit ?"
            params.append(max(int(limit) - len(unwritten), 0))
        return unwritten + [TransitionRecord.from_row(r) for r in self.db.query(sql, params)]

    def transitions_after(self, after_id: int, kinds: Sequence[str], limit: int) -> list[TransitionRecord]:
        """Up to `limit` written transitions of these machine kinds with an id above `after_id`,
        in write order: for a reader that keeps its place (the front door's counters read only
        what is new, in batches). Transitions still waiting for the disk have no id yet; they
        come once written."""
        if not kinds:
            return []
        marks = ", ".join("?" for _ in kinds)
        # `+kind`: walk the id range (what is new), not the (kind, at) index (all of a kind).
        rows = self.db.query(
            f"select * from transitions where id > ? and +kind in ({marks}) order by id limit ?",
            [int(after_id), *kinds, max(int(limit), 0)],
        )
        return [TransitionRecord.from_row(r) for r in rows]

    def count_transitions(self, machine: str | None = None) -> int:
        """How many transitions are recorded (for one machine), the unwritten included."""
        waiting = sum(1 for step in self._pending if machine is None or step.transition["machine_id"] == machine)
        if machine is None:
            return waiting + int(self.db.execute("select count(*) from transitions").fetchone()[0])
        written = self.db.execute("select count(*) from transitions where machine_id = ?", [machine]).fetchone()[0]
        return waiting + int(written)

    def close(self) -> None:
        """Write what waits if the disk takes it now, then close (SQLite checkpoints at close)."""
        if self._pending:
            self.flush()
        self.db.close()


def _matches(
    row: Mapping[str, Any], machine: str | None, kind: str | None, since: float | None, until: float | None
) -> bool:
    return (
        (machine is None or row["machine_id"] == machine)
        and (kind is None or row["kind"] == kind)
        and (since is None or row["at"] >= since)
        and (until is None or row["at"] < until)
    )


def _corrupt(path: str, detail: Any) -> StoreError:
    return StoreError(
        ReasonCode.STORE_CORRUPT,
        f"The state database {path} is damaged ({detail}); move it aside (Stoker then starts "
        f"a fresh one) or restore a backup.",
        evidence={"path": path, "detail": detail},
    )


def _private(path: str) -> None:
    """The database and its -wal/-shm files readable by their owner only (they hold every
    transition's evidence): created 0600, an existing looser one tightened. SQLite gives the
    -wal and -shm files the main file's mode."""
    Path(path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        pass
    except OSError:
        return  # a read-only or full disk: opening says what is wrong
    for name in (path, path + "-wal", path + "-shm"):
        try:
            if os.stat(name).st_mode & 0o077:
                os.chmod(name, 0o600)
        except OSError:
            pass  # absent, or on a read-only mount: nothing to tighten there


def _connect(path: str, busy_timeout_ms: int) -> Database:
    """A connection with the settings above (WAL is a property of the file, set once)."""
    db = Database(memory=True, execute_plugins=False) if path == MEMORY else Database(path, execute_plugins=False)
    try:
        db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
        db.execute("PRAGMA foreign_keys = ON")
        db.execute("PRAGMA synchronous = NORMAL")
    except BaseException:
        db.close()
        raise
    return db


def open_store(
    path: str | Path,
    *,
    clock: Callable[[], float] = time.time,
    migrations: list[Migration] | None = None,
    busy_timeout_ms: int = BUSY_TIMEOUT_MS,
) -> Store:
    """Open (creating if needed, 0600), check and migrate the database; StoreError if unusable:
    store_corrupt for a damaged file, store_write_failed for a disk that refuses what must be
    written before the daemon can start (a new database, a migration)."""
    path = str(path)
    if path != MEMORY:
        _private(path)
    db: Database | None = None
    try:
        db = _connect(path, busy_timeout_ms)
        problems = [row[0] for row in db.execute("PRAGMA quick_check").fetchall()]
        if problems != ["ok"]:
            raise _corrupt(path, problems[:10])
        if path != MEMORY:
            db.enable_wal()
        migrate(db, MIGRATIONS if migrations is None else migrations, clock)
    except sqlite3.DatabaseError as exc:
        if db is not None:
            db.close()
        if refused_by_disk(exc):
            raise StoreError(
                ReasonCode.STORE_WRITE_FAILED,
                f"The state database {path} cannot be written ({exc}); free space on its disk or make it "
                f"writable, then start Stoker again.",
                evidence={"path": path, "error": str(exc)},
            ) from exc
        raise _corrupt(path, str(exc)) from exc
    except BaseException:
        if db is not None:
            db.close()
        raise
    return Store(db, path, clock)
