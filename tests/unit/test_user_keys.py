"""User API keys (store/keys.py): hashed at rest, shown once, checked in constant time, revocable."""

from __future__ import annotations

import hmac

import attrs
import pytest

from stoker.store import StoreError, open_store
from stoker.store.keys import KEY_PREFIX, LAST_USED_EVERY_S, KeyRecord, KeyStore, key_hash, key_prefix, new_key


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def keys(tmp_path):
    store = open_store(tmp_path / "stoker.db")
    yield KeyStore(store, clock=Clock())
    store.close()


def test_a_key_is_256_random_bits_in_the_documented_shape():
    a, b = new_key(), new_key()
    assert a != b
    assert a.startswith(KEY_PREFIX) and len(a) == len(KEY_PREFIX) + 43
    assert key_prefix(a) == a[len(KEY_PREFIX) : len(KEY_PREFIX) + 8]
    assert key_prefix("sk-other-" + a[len(KEY_PREFIX) :]) is None
    assert key_hash(a) != key_hash(b) and len(key_hash(a)) == 64


def test_created_key_checks_and_the_table_holds_only_its_hash(keys):
    created = keys.create("laptop")
    assert keys.check(created.key) == attrs.evolve(created.record, last_used_at=1000.0)
    values = [str(v) for v in keys.store.db.execute("select * from user_keys").fetchone()]
    assert created.key not in values and created.key[len(KEY_PREFIX) :] not in values
    assert key_hash(created.key) in values
    assert created.key not in repr(created) and key_hash(created.key) not in repr(created.record)


def test_a_wrong_a_malformed_and_an_empty_key_are_refused(keys):
    created = keys.create()
    wrong = created.key[:-1] + ("A" if created.key[-1] != "A" else "B")  # same prefix, other key
    assert keys.check(wrong) is None
    assert keys.check(new_key()) is None
    assert keys.check("Bearer " + created.key) is None
    assert keys.check("") is None and keys.check(None) is None
    assert keys.check(created.key) is not None


def test_a_revoked_key_stops_working_at_once_and_is_listed_as_revoked(keys):
    kept, gone = keys.create("kept"), keys.create("gone")
    keys.clock.now = 1010.0
    revoked = keys.revoke(gone.record.id)
    assert revoked.revoked and revoked.revoked_at == 1010.0
    assert keys.check(gone.key) is None
    assert keys.check(kept.key) is not None
    listed = {r.id: r.to_public() for r in keys.list()}
    assert listed[gone.record.id]["revoked"] is True and listed[kept.record.id]["revoked"] is False
    assert all("key_sha256" not in r for r in listed.values())


def test_revoke_by_prefix_and_unknown_keys(keys):
    created = keys.create()
    assert keys.revoke(created.record.display).revoked
    assert keys.check(created.key) is None
    with pytest.raises(StoreError) as err:
        keys.revoke(9999)
    assert err.value.reason == "key_not_found"
    with pytest.raises(StoreError):
        keys.revoke("nothere1")


def test_last_used_is_written_at_most_once_a_minute(keys):
    created = keys.create()
    assert keys.list()[0].last_used_at is None
    keys.check(created.key)
    assert keys.list()[0].last_used_at == 1000.0
    keys.clock.now = 1000.0 + LAST_USED_EVERY_S - 1
    assert keys.check(created.key).last_used_at == 1000.0
    assert keys.list()[0].last_used_at == 1000.0
    keys.clock.now = 1000.0 + LAST_USED_EVERY_S
    keys.check(created.key)
    assert keys.list()[0].last_used_at == 1000.0 + LAST_USED_EVERY_S


def test_the_check_compares_digests_in_constant_time(keys, monkeypatch):
    created = keys.create()
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("store.keys.hmac.compare_digest", spy)
    assert keys.check(created.key) is not None
    assert calls == [(key_hash(created.key), key_hash(created.key))]


def test_record_round_trips_through_its_row(keys, tmp_path):
    created = keys.create("ci")
    store2 = open_store(tmp_path / "stoker.db")
    try:
        (again,) = KeyStore(store2).list()
    finally:
        store2.close()
    assert again == created.record
    assert isinstance(again, KeyRecord) and again.name == "ci" and not again.revoked
    assert again.to_public()["prefix"] == KEY_PREFIX + created.record.prefix + "..."
