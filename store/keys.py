"""User API keys: the keys a client presents to the front door, stored hashed, shown once.

A key is `sk-stoker-` followed by 32 random bytes in base64url (43 characters). The table holds
its sha256 (never the key), and a short non-secret `prefix` (the first 8 characters of the
random part) to show and to find a key's row. sha256 and not a slow password hash: the key is
256 bits from `secrets`, so no dictionary or brute force reaches it, and a fast hash keeps the
check on every request cheap (docs/store.md says more). `check` compares digests with
`hmac.compare_digest`, ignores revoked keys, and writes `last_used_at` at most once a minute.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import re
import secrets
import sqlite3
import time
from typing import Any, Callable

import attrs

from stoker.states.reasons import ReasonCode
from stoker.store.database import Store
from stoker.store.errors import StoreError
from stoker.store.rows import StoredRecord

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-stoker-"
KEY_BYTES = 32
PREFIX_CHARS = 8  # of the random part: 48 bits shown, 208 left secret
LAST_USED_EVERY_S = 60.0
_KEY_RE = re.compile(r"^sk-stoker-[A-Za-z0-9_-]{43}$")


def new_key() -> str:
    """A fresh key: `sk-stoker-` and 32 random bytes in base64url, without padding."""
    return KEY_PREFIX + base64.urlsafe_b64encode(secrets.token_bytes(KEY_BYTES)).rstrip(b"=").decode("ascii")


def key_hash(key: str) -> str:
    """The stored form of a key: sha256 of its text, in hex."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_prefix(key: str) -> str | None:
    """The non-secret prefix a key's row is found by; None for text that is not a Stoker key."""
    if not _KEY_RE.match(key):
        return None
    return key[len(KEY_PREFIX) : len(KEY_PREFIX) + PREFIX_CHARS]


@attrs.frozen
class KeyRecord(StoredRecord):
    """A key's row: never the key, only its hash and the prefix shown to tell keys apart."""

    id: int
    name: str | None
    prefix: str
    key_sha256: str = attrs.field(repr=False)
    created_at: float
    last_used_at: float | None
    revoked_at: float | None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def display(self) -> str:
        """How the key is shown: `sk-stoker-AbCdEfGh...`."""
        return f"{KEY_PREFIX}{self.prefix}..."

    def to_public(self) -> dict[str, Any]:
        """What `key.list` shows: everything but the hash."""
        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.display,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "revoked": self.revoked,
            "revoked_at": self.revoked_at,
        }


@attrs.frozen
class CreatedKey:
    """A key just made: its record, and the key itself, to be shown once and forgotten."""

    record: KeyRecord
    key: str = attrs.field(repr=False)


@attrs.define(eq=False)
class KeyStore:
    """The `user_keys` table: create, list, revoke, and the check a request's key goes through."""

    store: Store
    clock: Callable[[], float] = time.time

    def _rows(self, where: str, params: tuple[Any, ...]) -> list[KeyRecord]:
        rows = self.store.db.query(f"select * from user_keys where {where} order by id", params)
        return [KeyRecord.from_row(r) for r in rows]

    def create(self, name: str | None = None) -> CreatedKey:
        """A new key; the only time its text exists outside the client's hands."""
        key = new_key()
        prefix = key_prefix(key)
        assert prefix is not None
        row = {
            "name": name,
            "prefix": prefix,
            "key_sha256": key_hash(key),
            "created_at": self.clock(),
            "last_used_at": None,
            "revoked_at": None,
        }
        with self.store.transaction() as db:
            table = db.table("user_keys")
            table.insert(row)
            key_id = table.last_pk
        return CreatedKey(record=KeyRecord.from_row({**row, "id": key_id}), key=key)

    def list(self) -> list[KeyRecord]:
        return self._rows("1", ())

    def get(self, ident: int | str) -> KeyRecord:
        """One key by its id, or by its prefix (`AbCdEfGh` or `sk-stoker-AbCdEfGh...`)."""
        if isinstance(ident, int) or (isinstance(ident, str) and ident.isdigit()):
            found = self._rows("id = ?", (int(ident),))
        else:
            text = ident.removeprefix(KEY_PREFIX).rstrip(".").rstrip("\u2026")
            found = self._rows("prefix = ?", (text,)) if text else []
        if len(found) != 1:
            raise StoreError(ReasonCode.KEY_NOT_FOUND, evidence={"key": str(ident), "matches": len(found)})
        return found[0]

    def revoke(self, ident: int | str) -> KeyRecord:
        """Revoke a key: it stops working at once; its row stays, to be listed as revoked."""
        record = self.get(ident)
        if record.revoked_at is not None:
            return record
        at = self.clock()
        with self.store.transaction() as db:
            db.execute("update user_keys set revoked_at = ? where id = ?", (at, record.id))
        return attrs.evolve(record, revoked_at=at)

    def check(self, presented: str | None) -> KeyRecord | None:
        """The live key `presented` is, or None: wrong, unknown, malformed or revoked."""
        if not presented:
            return None
        digest = key_hash(presented)  # computed for every input, a Stoker key or not
        prefix = key_prefix(presented)
        if prefix is None:
            return None
        match = None
        for record in self._rows("prefix = ? and revoked_at is null", (prefix,)):
            if hmac.compare_digest(digest, record.key_sha256):
                match = record
        if match is None:
            return None
        now = self.clock()
        if match.last_used_at is None or now - match.last_used_at >= LAST_USED_EVERY_S:
            try:
                with self.store.transaction() as db:
                    db.execute("update user_keys set last_used_at = ? where id = ?", (now, match.id))
            except sqlite3.Error as exc:  # a disk that refuses writes never refuses a valid key
                log.warning("cannot record when key %s was used: %s", match.display, exc)
                return match
            match = attrs.evolve(match, last_used_at=now)
        return match
