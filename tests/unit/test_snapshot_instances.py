"""A snapshot belongs to the server instance that saved it (two [models.NAME] may serve
the same file): the catalogue's instance key, the migration that gives older rows their owner from
the launch history, the per-instance listing, count and retention, and the refusal across
instances."""

from __future__ import annotations

from pathlib import Path

import pytest

from stoker.daemon.config.model import Config
from stoker.daemon.core.errors import StokerError
from stoker.daemon.snapshots.layout import check_identity
from stoker.daemon.snapshots.listing import listing_of
from stoker.states.reasons import ReasonCode, message_for
from stoker.store import open_store
from stoker.store.migrations import MIGRATIONS
from stoker.store.snapshots import SnapshotCatalog, retention_victims
from tests.unit.test_snapshots import IDENTITY, _row

FILE, OTHER = "/models/tiny.gguf", "/models/other.gguf"


def _serve(store, machine: str, path: str, ready: float, stop: float, stopped: float) -> None:
    """One launch of `machine` on `path` in its history: ready at `ready`, stopping from `stop`."""
    steps = [
        ("stopped", "UpRequested", {}, "planning", ready - 0.3),
        (
            "planning",
            "PlanReady",
            {"plan": {"model_path": path, "backend": "cpu"}, "request": 1},
            "starting",
            ready - 0.2,
        ),
        ("starting", "Ready", {}, "ready", ready),
        ("ready", "DownRequested", {"cause": "idle"}, "stopping", stop),
        ("stopping", "StopCompleted", {}, "stopped", stopped),
    ]
    for from_state, event, data, to_state, at in steps:
        store.record_step(
            machine_id=machine,
            kind="launch",
            from_state=from_state,
            event=event,
            event_data=data,
            to_state=to_state,
            data={},
            at=at,
        )


def _old_row(at: float, path: str = FILE, cause: str = "idle", slot: int = 0) -> dict:
    row = _row(slot=slot, at=at, cause=cause, model_path=path, swa_full=0, kv_unified=0)
    row.pop("instance")  # written before m007
    return row


def test_the_migration_gives_each_older_row_to_the_instance_its_history_names(tmp_path):
    path = tmp_path / "old.db"
    store = open_store(path, migrations=MIGRATIONS[:6])
    # default (no [models]) ran FILE from 10 to 20; then a and b both ran FILE, c ran OTHER.
    _serve(store, "launch", FILE, ready=10, stop=19, stopped=20)
    _serve(store, "launch:a", FILE, ready=30, stop=39, stopped=40)
    _serve(store, "launch:b", FILE, ready=31, stop=45, stopped=46)
    _serve(store, "launch:c", OTHER, ready=30, stop=60, stopped=61)
    rows = {
        "default's stop": _old_row(19.5),
        "a's stop (b ready meanwhile)": _old_row(39.5, slot=0),
        "a manual save while only a was up": _old_row(30.5, cause="manual"),
        "b's stop": _old_row(45.5),
        "both ready, manual: which one asked?": _old_row(35.0, cause="manual"),
        "c's file": _old_row(50.0, path=OTHER, cause="manual"),
        "no server then": _old_row(70.0),
    }
    table = store.db.table("snapshots")
    ids = {what: table.insert(row).last_pk for what, row in rows.items()}
    store.close()

    store = open_store(path)
    try:
        owner = {rec.id: rec.instance for rec in SnapshotCatalog(store).list()}
        assert {what: owner[i] for what, i in ids.items()} == {
            "default's stop": "default",
            "a's stop (b ready meanwhile)": "a",  # b was ready, not stopping: an idle save is a stop's
            "a manual save while only a was up": "a",
            "b's stop": "b",
            "both ready, manual: which one asked?": "default",  # the history cannot say: never a nor b
            "c's file": "c",
            "no server then": "default",
        }
    finally:
        store.close()


def test_the_migration_on_a_fresh_or_empty_store_adds_the_key():
    store = open_store(":memory:")
    try:
        rec = SnapshotCatalog(store).add(_row())
        assert rec.instance == "default"
        assert SnapshotCatalog(store).add(_row(at=2.0, instance="a")).instance == "a"
    finally:
        store.close()


@pytest.fixture
def catalog():
    store = open_store(":memory:")
    yield SnapshotCatalog(store)
    store.close()


def test_each_instance_lists_counts_and_keeps_its_own(catalog):
    a0 = catalog.add(_row(slot=0, at=1.0, instance="a"))
    a1 = catalog.add(_row(slot=1, at=2.0, instance="a", n_slots=2))
    b0 = catalog.add(_row(slot=0, at=3.0, instance="b"))
    assert catalog.list(instance="a") == [a1, a0] and catalog.list(instance="b") == [b0]
    assert catalog.list(instance="a", slot_id=0) == [a0] and catalog.list(instance="c") == []
    # Retention's count is per instance: b's snapshot of the same slot and model is not a's older one.
    assert retention_victims(catalog.list(), max_count=1, max_bytes=10**9) == []
    b0_newer = catalog.add(_row(slot=0, at=3.5, instance="b"))
    assert retention_victims(catalog.list(), max_count=1, max_bytes=10**9) == [b0]
    catalog.remove([b0.id])
    # What a load like the last one restores: the slots of the newest row's model and layout.
    assert (catalog.slots_saved("b"), catalog.slots_saved("c")) == (1, 0) and b0_newer.instance == "b"
    assert catalog.slots_saved("a") == 1  # a0 is of another layout (n_slots 1) than a's newest
    catalog.add(_row(slot=0, at=4.0, instance="a", n_slots=2))
    assert catalog.slots_saved("a") == 2


def test_another_instances_snapshot_never_fits_even_of_the_same_file(catalog):
    rec = catalog.add(_row(instance="a"))
    check_identity(rec.identity(), {**IDENTITY, "instance": "a"}, snapshot_id=rec.id)
    with pytest.raises(StokerError) as err:
        check_identity(rec.identity(), {**IDENTITY, "instance": "b"}, snapshot_id=rec.id)
    assert err.value.reason == ReasonCode.SNAPSHOT_INSTANCE_MISMATCH
    assert err.value.evidence == {"snapshot_id": rec.id, "saved_by": "a", "model": "b"}
    assert "model a, not of b" in err.value.message and "--model a" in err.value.message
    assert "--model" in message_for(ReasonCode.SNAPSHOT_INSTANCE_MISMATCH)


def test_a_listing_is_one_instances_beside_the_shared_budget(catalog):
    catalog.add(_row(slot=0, at=1.0, size=100, instance="a"))
    b = catalog.add(_row(slot=0, at=2.0, size=300, instance="b"))
    reply = listing_of(
        "b", catalog.list(), None, Config().snapshots, max_bytes=1000, snapshots_dir=Path("/s"), dropped=[]
    )
    assert [r["id"] for r in reply["snapshots"]] == [b.id] and reply["model"] == "b"
    assert (reply["total_bytes"], reply["all_bytes"]) == (300, 400)
