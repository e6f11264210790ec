"""`stoker up --wait` waits for the daemon's ready event, not by polling status.

The CLI is run as a user runs it (`python -m stoker.daemon up`), twice in a row with the daemon
left running, on the tiny model. Its control connections go through a recording relay (its own
STOKER_HOME whose socket forwards to the daemon's), so the test sees what it asked: it
subscribes, asks status once, then again only when a launch machine moves; its last status
request follows the ready event it was sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.integration.daemon_harness import DaemonProcess

pytestmark = [pytest.mark.engine]


class RecordingRelay:
    """A Unix socket that forwards every connection to `target` and records each frame:
    (seconds, connection number, "ask" or "told", the decoded JSON)."""

    def __init__(self, path: Path, target: Path) -> None:
        self.path, self.target = path, target
        self.frames: list[tuple[float, int, str, dict]] = []
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        self._listener.bind(str(path))
        os.chmod(path, 0o600)
        self._listener.listen()
        self._count = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(str(self.target))
            self._count += 1
            for src, dst, way in ((client, upstream, "ask"), (upstream, client, "told")):
                threading.Thread(target=self._pump, args=(src, dst, way, self._count), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str, conn: int) -> None:
        pending = b""
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            with self._lock:
                for line in lines:
                    if line.strip():
                        self.frames.append((time.monotonic(), conn, way, json.loads(line)))
            try:
                dst.sendall(data)
            except OSError:
                return

    def take(self) -> list[tuple[float, int, str, dict]]:
        with self._lock:
            taken, self.frames = self.frames, []
        return taken

    def close(self) -> None:
        self._listener.close()


def up_wait(daemon: DaemonProcess, home: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "up", "--wait", "--json"],
        env={**daemon.env, "STOKER_HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=180,
    )


def asked(frames: list, method: str) -> list:
    return [f for f in frames if f[2] == "ask" and f[3].get("method") == method]


def test_up_wait_returns_on_the_ready_event_twice_in_a_row(daemon, model, tmp_path):
    daemon.start()
    assert daemon.call("status")["state"] in ("stopped", "idle", "planning", "starting", "loading", "ready")
    cli_home = tmp_path / "cli-home"
    relay = RecordingRelay(cli_home / "run" / "stoker.sock", daemon.paths.socket_path)
    try:
        daemon.call("down")
        daemon.wait_state("stopped")

        first = up_wait(daemon, cli_home)
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["state"] == "ready"
        frames = relay.take()
        assert len(asked(frames, "subscribe")) == 1, "it waits on the daemon's events"
        launch = [
            f
            for f in frames
            if f[2] == "told" and str(f[3].get("params", {}).get("topic", "")).startswith("machine.launch.")
        ]
        ready = [f for f in launch if f[3]["params"]["topic"] == "machine.launch.ready"]
        assert ready, "the ready event reached it"
        statuses = asked(frames, "status")
        # Once on subscribing, then once per launch transition at most: no polling in between.
        assert 1 <= len(statuses) <= 1 + len(launch)
        # Its last status came after a launch event: an event prompted it. (It may come before
        # the ready event itself: the transition before it (LaunchSucceeded) prompts a status
        # that can already read ready, the two transitions being a fraction of a ms apart.)
        assert statuses[-1][0] >= launch[0][0], "its last status followed a launch event"

        second = up_wait(daemon, cli_home)  # the daemon left running, its model ready
        assert second.returncode == 0, second.stderr
        assert json.loads(second.stdout)["state"] == "ready"
        frames = relay.take()
        assert len(asked(frames, "status")) == 1, "already ready: one status, no waiting"
    finally:
        relay.close()
