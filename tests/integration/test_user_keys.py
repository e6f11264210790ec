"""`stoker key create | list | revoke` against a real daemon: the key is shown once, the
database never holds it, revoke stops it, and the state files stay private (0600)."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys

from stoker.store import open_store
from tests.integration.daemon_harness import tiny_config, write_config
from stoker.store.keys import KeyStore


def stoker(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=daemon.env, capture_output=True, text=True, timeout=60
    )


def db_bytes(daemon) -> bytes:
    db = daemon.paths.db_file
    return b"".join(p.read_bytes() for p in db.parent.glob(db.name + "*") if p.is_file())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_keys_through_the_cli_are_shown_once_stored_hashed_and_revocable(daemon, model):
    # A port of its own for the front door: the default one may be held by another daemon here.
    write_config(daemon.paths, tiny_config(model) + f"[frontdoor]\nport = {free_port()}\n")
    daemon.start()

    shown = stoker(daemon, "key", "create", "--name", "webui")
    assert shown.returncode == 0, shown.stderr
    key = next(word for word in shown.stdout.split() if word.startswith("sk-stoker-"))
    assert "only time the key is shown" in shown.stdout
    made = json.loads(stoker(daemon, "key", "create", "--json").stdout)
    assert made["key"].startswith("sk-stoker-") and made["key"] != key and "note" in made

    listed = stoker(daemon, "key", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)["keys"]
    assert [r["name"] for r in rows] == ["webui", None]
    assert not any(r["revoked"] for r in rows)
    human = stoker(daemon, "key", "list").stdout
    assert key not in human and made["key"] not in human and key[:18] in human  # the prefix only

    # The database (main file and WAL) never holds either key, whole or its secret part.
    daemon.call("ping")
    raw = db_bytes(daemon)
    for k in (key, made["key"]):
        assert k.encode() not in raw and k[len("sk-stoker-") + 8 :].encode() not in raw
    # Nor does the daemon's log.
    assert key not in daemon.log_text() and made["key"] not in daemon.log_text()

    # A second reader of the same database (what the front door does) checks the keys.
    store = open_store(daemon.paths.db_file)
    try:
        keys = KeyStore(store)
        assert keys.check(key) is not None and keys.check(made["key"]) is not None

        revoked = stoker(daemon, "key", "revoke", rows[0]["prefix"], "--json")
        assert revoked.returncode == 0, revoked.stderr
        assert json.loads(revoked.stdout)["revoked"] is True
        assert keys.check(key) is None  # at once
        assert keys.check(made["key"]) is not None
    finally:
        store.close()

    rows = json.loads(stoker(daemon, "key", "list", "--json").stdout)["keys"]
    assert [r["revoked"] for r in rows] == [True, False]
    assert rows[1]["last_used_at"] is not None and rows[0]["last_used_at"] is not None

    unknown = stoker(daemon, "key", "revoke", "999", "--json")
    assert unknown.returncode != 0
    assert json.loads(unknown.stdout)["error"]["reason"] == "key_not_found"

    # The state files stay private.
    for path in daemon.paths.db_file.parent.glob(daemon.paths.db_file.name + "*"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
