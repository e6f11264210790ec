"""`stoker chat`, `stoker run` and `stoker logs` against a real daemon and llama-server.

`stoker chat` asks through the front door (the address status reports), one-shot, --json, from
stdin and on a terminal; it is held across a restart like any client of the front door; a 503
shows the front door's reason, a 401 names `stoker key create`, and a front door that is off is
said, never bypassed. `stoker run` answers through the front door too. `stoker logs -n` prints
the tails of the daemon's log and the server's.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time

import psutil
import pytest

from tests.integration.daemon_harness import (
    DaemonProcess,
    free_port,
    start_with_frontdoor as start,
    tiny_config,
    write_config,
)

pytestmark = [pytest.mark.engine]


def stoker(daemon: DaemonProcess, *args: str, stdin: str = "", env: dict | None = None, timeout: float = 120):
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args],
        env={**daemon.env, **(env or {})},
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_chat_answers_through_the_front_door_and_is_held_across_a_restart(daemon, model):
    base = start(daemon, model)
    st = daemon.wait_state("ready")
    assert st["frontdoor"]["url"] == base and st["endpoint"] != base

    # Greedy: the random tiny model, sampled, can say its end-of-text at its first token.
    said = stoker(daemon, "chat", "Hello", "--max-tokens", "8", "--temperature", "0")
    assert said.returncode == 0, said.stderr
    assert said.stdout.strip(), "the answer is printed"
    assert f"through {base}" in said.stderr  # the footer names the address it used

    got = stoker(daemon, "chat", "Hello", "--max-tokens", "4", "--temperature", "0", "--json")
    assert got.returncode == 0, got.stderr
    answer = json.loads(got.stdout)
    assert answer["ok"] and answer["url"] == base and answer["prompt"] == "Hello"
    assert answer["tokens"] >= 1 and answer["content"] and answer["seconds"] > 0

    piped = stoker(daemon, "chat", "--max-tokens", "4", "--temperature", "0", "--json", stdin="Hello\n")
    assert piped.returncode == 0, piped.stderr
    assert json.loads(piped.stdout)["content"] == answer["content"]  # the same greedy answer

    # Sent while the server restarts: the engine's port and key change, the front door holds it.
    first = daemon.call("status")
    daemon.call("restart")
    held = stoker(daemon, "chat", "Hello", "--max-tokens", "2", "--json")
    assert held.returncode == 0, held.stderr
    assert daemon.wait_state("ready")["pid"] != first["pid"]

    # A down server: the front door's 503 and its reason, shown as the reason-coded error.
    daemon.call("down")
    down = stoker(daemon, "chat", "Hello", "--max-tokens", "2")
    assert down.returncode == 1
    assert "error [frontdoor_server_down]" in down.stderr and "stoker up" in down.stderr
    down_json = json.loads(stoker(daemon, "chat", "Hello", "--json").stdout)
    assert down_json["error"]["reason"] == "frontdoor_server_down"
    assert int(down_json["error"]["evidence"]["retry_after_s"]) > 0

    # `stoker logs -n` of both logs, read from the files the daemon writes.
    daemon_tail = stoker(daemon, "logs", "-n", "5")
    assert daemon_tail.returncode == 0, daemon_tail.stderr
    daemon_log = daemon.paths.logs_dir / "daemon.log"
    lines = daemon_tail.stdout.splitlines()  # the daemon may have logged a line since: a run of 5 lines
    assert len(lines) == 5 and "\n".join(lines) + "\n" in daemon_log.read_text(), lines
    assert "front door on http://127.0.0.1:" in stoker(daemon, "logs", "-n", "1000").stdout
    server_log = daemon.paths.logs_dir / "llama-server.log"
    server_tail = stoker(daemon, "logs", "--server", "-n", "3")
    assert server_tail.stdout.splitlines() == server_log.read_text(errors="replace").splitlines()[-3:]
    both = json.loads(stoker(daemon, "logs", "--all", "-n", "2", "--json").stdout)["logs"]
    assert [(entry["log"], len(entry["lines"])) for entry in both] == [("daemon", 2), ("server", 2)]


def test_chat_asks_for_a_key_where_keys_are_required(daemon, model):
    start(daemon, model, require_keys="true")
    daemon.wait_state("ready")
    refused = stoker(daemon, "chat", "Hello", "--max-tokens", "2")
    assert refused.returncode == 1
    assert "error [invalid_api_key]" in refused.stderr and "stoker key create" in refused.stderr

    key = json.loads(stoker(daemon, "key", "create", "--json").stdout)["key"]
    assert stoker(daemon, "chat", "Hello", "--max-tokens", "2", "--key", key).returncode == 0
    by_env = stoker(daemon, "chat", "Hello", "--max-tokens", "2", env={"STOKER_API_KEY": key})
    assert by_env.returncode == 0, by_env.stderr
    wrong = stoker(daemon, "chat", "Hello", "--key", "sk-stoker-" + "A" * 43)
    assert wrong.returncode == 1 and "refused the API key given" in wrong.stderr


def test_chat_says_the_front_door_is_off_and_does_not_go_around_it(daemon, model):
    start(daemon, model, enabled="false")
    daemon.wait_state("ready")
    off = stoker(daemon, "chat", "Hello", "--max-tokens", "2")
    assert off.returncode == 1 and not off.stdout
    assert "error [frontdoor_unavailable]" in off.stderr and "enabled = false" in off.stderr
    assert "frontdoor off" in stoker(daemon, "status").stdout


def read_until(fd: int, wanted: bytes, timeout: float) -> bytes:
    got = b""
    deadline = time.monotonic() + timeout
    while wanted not in got:
        left = deadline - time.monotonic()
        assert left > 0, f"never saw {wanted!r}; got {got!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                got += os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
    return got


def test_chat_on_a_terminal_is_a_conversation(daemon, model):
    start(daemon, model)
    daemon.wait_state("ready")
    parent, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "stoker.daemon", "chat", "--max-tokens", "4"],
        env={**daemon.env, "TERM": "dumb"},
        stdin=child,
        stdout=child,
        stderr=child,
        close_fds=True,
    )
    os.close(child)
    try:
        read_until(parent, b">>> ", 30)
        os.write(parent, b"Hello\n")
        read_until(parent, b">>> ", 60)  # answered, and asking for the next turn
        os.write(parent, b"/exit\n")
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(parent)


def test_stoker_run_answers_through_the_front_door(daemon, model):
    port = free_port()
    write_config(daemon.paths, tiny_config(model) + f"[frontdoor]\nport = {port}\n")
    ran = stoker(daemon, "run", "--prompt", "Hello", "--json", timeout=300)
    try:
        assert ran.returncode == 0, ran.stdout + ran.stderr
        result = json.loads(ran.stdout)
        assert result["ok"] and result["answer"]["url"] == f"http://127.0.0.1:{port}/v1"
        assert result["answer"]["tokens"] >= 1 and result["status"]["state"] == "ready"
    finally:
        # `stoker run` left its daemon running (detached): stop it and wait until it is gone.
        try:
            pid = daemon.call("status")["daemon"]["pid"]
            daemon.call("shutdown")
            psutil.Process(pid).wait(60)
        except Exception:
            pass
