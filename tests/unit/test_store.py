"""The SQLite store: pragmas, migrations, integrity check, one transaction per transition."""

from __future__ import annotations

import sqlite3

import attrs
import pytest

from stoker.store import MachineRecord, StoreError, TransitionRecord, open_store
from stoker.store.migrations import MIGRATIONS, applied, migrate


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


def test_no_sqlite_utils_plugin_touches_the_state_database(tmp_path, monkeypatch):
    """An installed sqlite-utils plugin (its prepare_connection hook) is never run on Stoker's
    database, and none is looked for: finding them scans every distribution's entry points."""
    from sqlite_utils import hookimpl, plugins

    prepared = []

    class Plugin:
        @hookimpl
        def prepare_connection(self, conn):
            prepared.append(conn)

    monkeypatch.setattr(plugins, "_plugins_loaded", True)  # as if the entry points had been read
    plugins.pm.register(Plugin(), name="test-plugin")
    try:
        open_store(tmp_path / "stoker.db").close()
        open_store(":memory:").close()
    finally:
        plugins.pm.unregister(name="test-plugin")
    assert prepared == []


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


def test_a_store_a_newer_daemon_wrote_still_reads(tmp_path):
    """Columns this daemon does not know (a newer one added them) are ignored, in every table."""
    from stoker.store.catalog import ModelCatalog, ModelRecord
    from stoker.store.keys import KeyStore
    from stoker.store.manifests import ManifestVersions

    path = tmp_path / "stoker.db"
    s = open_store(path)
    record(s, evidence={"why": "user"})
    facts = ("llama", None, None, 2048, True)  # architecture, parameters, quantization, context, template
    model = ModelRecord("tiny", "tiny.gguf", "local", None, None, "/m/tiny.gguf", 10, "a" * 64, False, *facts)
    ModelCatalog(s).put(attrs.evolve(model, facts={"n_layer": 2}))
    KeyStore(s).create("ci")
    ManifestVersions(s).advance(
        key_id="k", channel="stable", version=3, payload_sha256="b" * 64, source="m", expires=None
    )
    for table in ("machines", "transitions", "models", "user_keys", "manifest_versions"):
        s.db.table(table).add_column("from_the_future", str)
        s.db.execute(f"update {table} set from_the_future = 'x'")
    s.close()
    s = open_store(path)
    try:
        assert s.machine("launch").evidence == {"why": "user"}
        assert [t.evidence for t in s.history()] == [{"why": "user"}]
        (read,) = ModelCatalog(s).all()
        assert read.chat_template is True and read.owned is False and read.facts == {"n_layer": 2}
        assert [k.name for k in KeyStore(s).list()] == ["ci"]
        assert ManifestVersions(s).last("k", "stable").version == 3
    finally:
        s.close()


def test_a_row_from_before_a_column_existed_reads_with_the_records_default():
    from stoker.store.rows import record_from_row

    @attrs.frozen
    class Row:
        name: str
        facts: dict = attrs.field(factory=dict)
        instance: str = "default"  # a column a later migration added
        seen: float | None = None

    assert record_from_row({"name": "a"}, Row) == Row("a")  # a reader newer than the row
    assert record_from_row({"name": "a", "instance": None, "facts": None}, Row, json_columns=["facts"]) == Row("a")
    assert record_from_row({"name": "a", "facts": '{"k": 1}', "seen": 2}, Row, json_columns=["facts"]) == Row(
        "a", {"k": 1}, seen=2.0
    )


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


def test_history_of_several_machines_at_once(tmp_path):
    """A model's history is its launch and fallback machines together (`stoker history --model`),
    written or still waiting for the disk."""
    s = open_store(tmp_path / "stoker.db", clock=Clock())
    record(s, machine="launch:chat")
    record(s, machine="fallback:chat", kind="fallback", frm="idle", to="checking", event="PlanRequested")
    record(s, machine="launch:code")
    record(s, machine="launch")
    _fill(s)
    record(s, machine="launch:chat", frm="planning", to="starting", event="PlanReady", evidence=BIG)
    rows = s.history(machines=("launch:chat", "fallback:chat"))
    assert [(t.machine_id, t.to_state) for t in rows] == [
        ("launch:chat", "starting"),  # unwritten: the newest, first
        ("fallback:chat", "checking"),
        ("launch:chat", "planning"),
    ]
    assert len(s.history(machines=("launch:chat", "fallback:chat"), limit=2)) == 2
    assert s.history(machines=()) == [] and len(s.history(machines=("launch",))) == 1
    s.close()


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


# --- a disk that refuses writes: transitions wait in memory, in order, and catch up -----------


def _fill(store) -> None:
    """The database may not grow by one page more: SQLite answers SQLITE_FULL, as on a full disk."""
    pages = store.db.execute("PRAGMA page_count").fetchone()[0]
    store.db.execute(f"PRAGMA max_page_count = {pages}")


BIG = {"blob": "x" * 20_000}  # needs new pages, so a full database refuses it


def test_a_full_disk_keeps_transitions_in_memory_in_order_and_catches_up(tmp_path):
    path = tmp_path / "stoker.db"
    s = open_store(path, clock=Clock())
    seen = []
    s.on_health = seen.append
    record(s)
    _fill(s)
    t2 = record(s, frm="planning", to="starting", event="PlanReady", evidence=BIG)
    t3 = record(s, machine="probe:cpu", kind="probe", frm="idle", to="probing", evidence=BIG)
    t4 = record(s, frm="starting", to="loading", event="Spawned", evidence=BIG)
    # Nothing raised: each transition is kept, numbered as it will be written.
    assert (t2.id, t3.id, t4.id) == (None, None, None)
    assert (t2.seq, t3.seq, t4.seq) == (2, 1, 3)
    health = s.health()
    assert not health.writable and health.reason == "store_write_failed" and health.pending == 3
    assert "full" in health.error and health.since is not None
    assert [h.writable for h in seen] == [False]
    # Reads tell the whole story, the unwritten part included.
    assert [t.to_state for t in s.history()] == ["loading", "probing", "starting", "planning"]
    assert s.machine("launch").state == "loading" and s.machine("probe:cpu").seq == 1
    assert s.count_transitions() == 4
    assert s.flush() == 0 and s.health().pending == 3  # still full: nothing written, nothing lost
    s.db.execute("PRAGMA max_page_count = 1073741823")
    assert s.flush() == 3
    assert s.health().writable and s.health().pending == 0 and [h.writable for h in seen] == [False, True]
    s.close()
    again = open_store(path)
    rows = list(reversed(again.history()))
    assert [(t.machine_id, t.seq, t.to_state) for t in rows] == [
        ("launch", 1, "planning"),
        ("launch", 2, "starting"),
        ("probe:cpu", 1, "probing"),
        ("launch", 3, "loading"),
    ]
    assert again.machine("launch").state == "loading" and again.machine("launch").seq == 3
    again.close()


def test_a_later_write_waits_behind_the_unwritten_ones(tmp_path):
    s = open_store(tmp_path / "stoker.db", clock=Clock())
    record(s)
    _fill(s)
    record(s, frm="planning", to="starting", event="PlanReady", evidence=BIG)
    s.db.execute("PRAGMA max_page_count = 1073741823")
    # Space is back: the next transition first writes the one before it (history stays in order).
    t3 = record(s, frm="starting", to="loading", event="Spawned")
    assert t3.id is not None and s.health().writable
    assert [t.seq for t in reversed(s.history())] == [1, 2, 3]
    assert [t.id for t in reversed(s.history())] == sorted(t.id for t in s.history())
    s.close()


def test_a_read_only_connection_is_reopened_to_catch_up(tmp_path):
    s = open_store(tmp_path / "stoker.db", clock=Clock())
    record(s)
    s.db.execute("PRAGMA query_only = ON")  # like a file opened read-only: SQLITE_READONLY
    t = record(s, frm="planning", to="starting", event="PlanReady")
    assert t.id is None and "readonly" in s.health().error
    assert s.flush() == 1 and s.health().writable  # a fresh connection can write
    assert s.count_transitions() == 2
    s.close()


def test_a_refused_write_that_is_not_the_disk_still_raises(store):
    # Only the disk's refusals wait for space; a write SQLite refuses for what it is raises.
    record(store)
    store.db.execute("CREATE TEMP TRIGGER refuse BEFORE INSERT ON transitions BEGIN SELECT RAISE(ABORT, 'no'); END")
    with pytest.raises(StoreError):
        record(store, frm="planning", to="starting")
    assert store.health().writable and store.health().pending == 0


def test_history_reaches_the_main_file_at_each_checkpoint(tmp_path):
    """A lost -wal file loses at most what came after the last checkpoint, not every row."""
    import shutil

    path = tmp_path / "stoker.db"
    s = open_store(path, clock=Clock())
    for i in range(20):
        record(s, frm=f"s{i}", to=f"s{i + 1}")
    lost_wal = tmp_path / "copy-before.db"
    shutil.copy(path, lost_wal)  # the main file alone, as after a lost -wal
    assert s.checkpoint() is True
    checkpointed = tmp_path / "copy-after.db"
    shutil.copy(path, checkpointed)
    assert s.checkpoint() is False  # nothing new since: no work
    s.close()
    assert open_store(lost_wal).count_transitions() == 0  # what the issue saw
    assert open_store(checkpointed).count_transitions() == 20


def test_a_machine_steps_on_while_the_disk_is_full_and_resumes_from_the_caught_up_rows(tmp_path):
    from stoker.daemon.core.machines import MachineRunner
    from stoker.states.launch import table as L
    from stoker.states.launch import records as LR
    from stoker.states.reasons import ReasonCode

    path = tmp_path / "stoker.db"
    s = open_store(path)
    seen = []
    runner = MachineRunner(L.LAUNCH, "launch", s, seen.append)
    runner.fire(LR.UpRequested())
    _fill(s)
    step = runner.fire(LR.PlanFailed(ReasonCode.MODEL_MISSING, BIG))  # once raised and stopped the daemon
    assert runner.state is LR.LaunchState.FAILED and step.state is LR.LaunchState.FAILED
    assert [m["to"] for m in seen] == ["planning", "failed"] and runner.seq == 2
    runner.fire(LR.UpRequested())
    assert s.health().pending == 2
    s.db.execute("PRAGMA max_page_count = 1073741823")
    assert s.flush() == 2
    s.close()
    again = MachineRunner(L.LAUNCH, "launch", open_store(path))
    assert again.state is LR.LaunchState.PLANNING and again.seq == 3
    assert [t.to_state for t in again.store.history()] == ["planning", "failed", "planning"]


async def test_the_keeper_writes_held_back_rows_when_space_returns_and_checkpoints(tmp_path, autojump_clock):
    import shutil

    import trio

    from stoker.daemon.core.store_keeper import CHECKPOINT_S, RETRY_S, serve_store_keeper

    path = tmp_path / "stoker.db"
    s = open_store(path, clock=Clock())
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_store_keeper, s)
        record(s)
        _fill(s)
        record(s, frm="planning", to="starting", event="PlanReady", evidence=BIG)
        await trio.sleep(RETRY_S * 3)
        assert s.health().pending == 1  # still full
        s.db.execute("PRAGMA max_page_count = 1073741823")
        await trio.sleep(RETRY_S + 0.1)  # no new transition needed to push it
        assert s.health().writable and s.health().pending == 0
        await trio.sleep(CHECKPOINT_S + 0.1)
        main_file_only = tmp_path / "main-only.db"
        shutil.copy(path, main_file_only)
        nursery.cancel_scope.cancel()
    s.close()
    assert open_store(main_file_only).count_transitions() == 2


def test_a_transition_is_numbered_from_the_store_not_from_a_stale_count(store):
    """The caller's count only stands in when the disk cannot be read: a second runner of the same
    machine (or a stale count) never collides with a stored number."""
    record(store, seq=1)
    t = record(store, frm="planning", to="starting", seq=1)  # a stale count
    assert t.seq == 2 and t.id is not None and store.count_transitions() == 2
