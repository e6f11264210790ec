"""The SQLite store: pragmas, migrations, integrity check, one transaction per transition."""

from __future__ import annotations

import sqlite3

import pytest

from store import MachineRecord, StoreError, TransitionRecord, open_store
from store.migrations import MIGRATIONS, applied, migrate


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def record(store, machine="launch", kind="launch", frm="stopped", to="planning", event="UpRequested", **kw):
    return store.record_step(
        machine_id=machine,
        kind=kind,
        from_state=frm,
        event=event,
        event_data=kw.pop("event_data", {}),
        to_state=to,
        data=kw.pop("data", {"crashes": 0}),
        **kw,
    )


@pytest.fixture
def store():
    s = open_store(":memory:", clock=Clock())
    yield s
    s.close()


def test_pragmas_on_a_file(tmp_path):
    s = open_store(tmp_path / "sub" / "stoker.db")
    try:
        one = lambda sql: s.db.execute(sql).fetchone()[0]  # noqa: E731
        assert one("PRAGMA journal_mode") == "wal"
        assert one("PRAGMA synchronous") == 1  # NORMAL
        assert one("PRAGMA foreign_keys") == 1
        assert one("PRAGMA busy_timeout") == 5000
    finally:
        s.close()


def test_migrations_recorded_and_idempotent(tmp_path):
    path = tmp_path / "stoker.db"
    open_store(path).close()
    s = open_store(path)
    try:
        assert applied(s.db) == [m.__name__ for m in MIGRATIONS]
        assert migrate(s.db) == []
        assert {"machines", "transitions", "_migrations"} <= set(s.db.table_names())
    finally:
        s.close()


def test_new_migration_is_one_function(tmp_path):
    path = tmp_path / "stoker.db"
    open_store(path).close()

    def m002_bundles(db):
        db["bundles"].create({"id": str, "backend": str}, pk="id")

    s = open_store(path, migrations=[*MIGRATIONS, m002_bundles])
    try:
        assert "bundles" in s.db.table_names()
        assert applied(s.db)[-1] == "m002_bundles"
    finally:
        s.close()
    # the older code now meets a database from the future
    with pytest.raises(StoreError) as info:
        open_store(path)
    assert info.value.reason == "store_schema_too_new"
    assert info.value.evidence["unknown_migrations"] == ["m002_bundles"]


def test_failing_migration_leaves_no_trace(tmp_path):
    path = tmp_path / "stoker.db"

    def m002_broken(db):
        db["half"].create({"id": int}, pk="id")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        open_store(path, migrations=[*MIGRATIONS, m002_broken])
    s = open_store(path)
    try:
        assert "half" not in s.db.table_names()
        assert applied(s.db) == [m.__name__ for m in MIGRATIONS]
    finally:
        s.close()


def test_reopen_keeps_machines_and_history(tmp_path):
    path = tmp_path / "stoker.db"
    s = open_store(path)
    record(s, evidence={"why": "user"}, at=1001.0)
    record(s, frm="planning", to="starting", event="PlanReady", event_data={"plan": {"backend": "cpu"}}, at=1002.0)
    s.close()
    s = open_store(path)
    try:
        m = s.machine("launch")
        assert m == MachineRecord("launch", "launch", "starting", {"crashes": 0}, None, {}, 1002.0, 2)
        assert [t.event for t in s.history()] == ["PlanReady", "UpRequested"]
        assert s.history()[0].event_data == {"plan": {"backend": "cpu"}}
        assert s.history()[1].evidence == {"why": "user"}
    finally:
        s.close()


def test_garbage_file_gives_a_clear_error(tmp_path):
    path = tmp_path / "stoker.db"
    path.write_bytes(b"this is not a database at all" * 200)
    with pytest.raises(StoreError) as info:
        open_store(path)
    assert info.value.reason == "store_corrupt"
    assert str(path) in info.value.message and "move it aside" in info.value.message
    assert info.value.to_dict()["evidence"]["path"] == str(path)


def test_damaged_pages_fail_the_integrity_check(tmp_path):
    path = tmp_path / "stoker.db"
    s = open_store(path)
    for i in range(300):
        record(s, machine=f"m{i}", evidence={"pad": "x" * 200})
    s.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    page_size = s.db.execute("PRAGMA page_size").fetchone()[0]
    s.close()
    raw = bytearray(path.read_bytes())
    assert len(raw) > 8 * page_size
    for page in range(2, len(raw) // page_size):  # keep the header page: the file still opens
        start = page * page_size
        raw[start + 8 : start + page_size // 2] = b"\xff" * (page_size // 2 - 8)
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError) as info:
        open_store(path)
    assert info.value.reason == "store_corrupt"


def test_record_step_writes_row_and_history_together(store):
    t = record(store, reason="server_crashed", evidence={"returncode": -9})
    assert isinstance(t, TransitionRecord)
    assert (t.seq, t.from_state, t.to_state, t.reason, t.evidence) == (
        1,
        "stopped",
        "planning",
        "server_crashed",
        {"returncode": -9},
    )
    m = store.machine("launch")
    assert (m.state, m.reason, m.evidence, m.seq, m.updated_at) == (
        "planning",
        "server_crashed",
        {"returncode": -9},
        1,
        t.at,
    )
    assert store.machine("nope") is None


def test_failing_write_leaves_neither_row(store):
    record(store)
    store.db.execute(
        "CREATE TEMP TRIGGER refuse BEFORE INSERT ON transitions BEGIN SELECT RAISE(ABORT, 'disk says no'); END"
    )
    with pytest.raises(StoreError) as info:
        record(store, frm="planning", to="starting", event="PlanReady")
    assert info.value.reason == "store_write_failed"
    assert "disk says no" in info.value.evidence["error"]
    m = store.machine("launch")
    assert (m.state, m.seq) == ("planning", 1)
    assert store.count_transitions() == 1
    # and a brand-new machine is not created half-way either
    with pytest.raises(StoreError):
        record(store, machine="install:cuda-sm90", kind="install")
    assert store.machine("install:cuda-sm90") is None
    assert not store.db.conn.in_transaction


def test_history_filters_and_order(store):
    for i in range(5):
        record(store, machine="launch", frm=f"s{i}", to=f"s{i + 1}")
    for i in range(3):
        record(store, machine="probe:cuda", kind="probe", frm="idle", to="probing", event="ProbeRequested")
    everything = store.history(limit=None)
    assert len(everything) == 8
    assert [t.id for t in everything] == sorted((t.id for t in everything), reverse=True)
    assert len(store.history(machine="launch")) == 5
    assert {t.kind for t in store.history(kind="probe")} == {"probe"}
    assert len(store.history(limit=2)) == 2
    ats = sorted(t.at for t in everything)
    window = store.history(since=ats[2], until=ats[5])
    assert sorted(t.at for t in window) == ats[2:5]
    assert store.history(machine="launch", since=ats[5]) == []
    assert [t.seq for t in store.history(machine="launch")] == [5, 4, 3, 2, 1]
    assert store.count_transitions("probe:cuda") == 3
    assert [m.id for m in store.machines()] == ["launch", "probe:cuda"]
    assert [m.id for m in store.machines(kind="probe")] == ["probe:cuda"]


def test_history_row_needs_its_machine(store):
    with pytest.raises(sqlite3.IntegrityError):
        store.db["transitions"].insert(
            {
                "machine_id": "ghost",
                "kind": "launch",
                "from_state": "a",
                "event": "E",
                "event_data": "{}",
                "to_state": "b",
                "evidence": "{}",
                "at": 1.0,
                "seq": 1,
            }
        )


def test_explicit_time_wins_over_the_clock(store):
    t = record(store, at=42.5)
    assert t.at == 42.5 and store.machine("launch").updated_at == 42.5
