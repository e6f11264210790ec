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


def test_stoker_key_require_says_who_can_reach_the_front_door_and_switches_it_twice_over(daemon, model):
    """By default any local user can chat through the front door without a key: `stoker status`
    says so. `stoker key require` (run twice: the second changes nothing) writes `[frontdoor]
    require_keys = true` and applies it at once: a keyless request gets 401; `--off` (twice)
    puts it back."""
    import httpx

    port = free_port()
    write_config(daemon.paths, tiny_config(model) + f"[frontdoor]\nport = {port}\n")
    daemon.start()
    daemon.wait_state("ready")
    base = f"http://127.0.0.1:{port}/v1"

    def keyless() -> int:
        body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return httpx.post(f"{base}/chat/completions", json=body, timeout=60, trust_env=False).status_code

    def frontdoor_line() -> str:
        shown = stoker(daemon, "status")
        assert shown.returncode == 0, shown.stderr
        return next(line for line in shown.stdout.splitlines() if line.startswith("frontdoor "))

    assert frontdoor_line() == (
        f"frontdoor {base}, no key required: any local user can use it (`stoker key require` to ask for one)"
    )
    assert keyless() == 200

    for said in ("set in", "already set in"):
        done = stoker(daemon, "key", "require")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"requires a key: clients send one made with `stoker key create` ({said} " in done.stdout, done.stdout
        assert keyless() == 401
    text = daemon.paths.config_file.read_text()
    assert text.count("require_keys = true") == 1 and f"port = {port}" in text, text
    assert frontdoor_line() == f"frontdoor {base}, key required (`stoker key create`)"
    key = json.loads(stoker(daemon, "key", "create", "--json").stdout)["key"]
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    keyed = httpx.post(
        f"{base}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False
    )
    assert keyed.status_code == 200, keyed.text

    for changed in (True, False):
        done = stoker(daemon, "key", "require", "--off", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        reply = json.loads(done.stdout)
        assert (reply["require_keys"], reply["changed"]) == (False, changed), reply
        assert reply["frontdoor"]["url"] == base and reply["frontdoor"]["require_keys"] is False
        assert keyless() == 200
    assert daemon.paths.config_file.read_text().count("require_keys = false") == 1
    assert "no key required: any local user can use it" in frontdoor_line()
    assert daemon.call("status")["config"]["valid"]
