"""The control socket of a real daemon with no server to run (no engine needed): the methods'
one validator, the status record's JSON, telemetry from its service, and `stoker shutdown`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from stoker.daemon.core.errors import StokerError
from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config
from tests.unit.test_control_methods import STATUS_KEYS


@pytest.fixture
def idle_daemon(stoker_home, tmp_path):
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(tmp_path / "absent.gguf"))
    d.start()
    try:
        yield d
    finally:
        d.stop()


def raw_reply(d: DaemonProcess, frame: bytes) -> dict:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(d.paths.socket_path))
        s.sendall(frame + b"\n")
        return json.loads(s.makefile().readline())


def refused(d: DaemonProcess, method: str, **params) -> StokerError:
    with pytest.raises(StokerError) as info:
        d.call(method, **params)
    return info.value


def test_status_reply_carries_every_key_clients_read(idle_daemon):
    st = idle_daemon.wait_for(lambda s: s["state"] in ("failed", "stopped"), 30, "the plan to fail")
    assert set(st) == STATUS_KEYS
    assert st["backend"] is None and st["uptime_s"] is None and st["endpoint"] is None
    assert st["daemon"]["pid"] == idle_daemon.proc.pid and st["config"]["valid"] is True


def test_parameters_are_refused_before_anything_runs(idle_daemon):
    d = idle_daemon
    for method, params, param in [
        ("history", {"limit": True}, "limit"),
        ("history", {"since": 2**63}, "since"),  # used to reach SQLite: OverflowError, internal_error
        ("snapshot.rm", {"id": "7"}, "id"),
        ("snapshot.restore", {"id": 1, "slot": 1.5}, "slot"),
        ("probe", {"backends": ["no-such-backend"]}, "backends"),
    ]:
        err = refused(d, method, **params)
        assert (err.reason, err.evidence.get("param")) == ("bad_request", param), (method, params)
    assert refused(d, "ping", extra=1).evidence["unknown"] == ["extra"]
    assert refused(d, "snapshot.rm", id=2**40).reason == "snapshot_not_found"  # valid, just absent
    assert len(d.call("history", limit=2, since=0)) == 2


def test_a_request_naming_a_key_twice_is_bad_request(idle_daemon):
    reply = raw_reply(idle_daemon, b'{"jsonrpc":"2.0","id":9,"method":"history","params":{"limit":1,"limit":5}}')
    assert reply["id"] == 9 and reply["error"]["reason"] == "bad_request"
    assert reply["error"]["data"] == {"duplicate_key": "limit"}


def test_telemetry_comes_from_the_service_started_with_the_daemon(idle_daemon):
    idle_daemon.wait_for(lambda s: s["state"] in ("failed", "stopped"), 30, "the plan to fail")
    reply = idle_daemon.call("telemetry")
    assert reply["sample"]["activity"] == "stopped" and reply["ttl_s"] == 5.0


@pytest.mark.parametrize("attempt", range(3))
def test_stoker_shutdown_exits_0_when_it_worked(stoker_home, tmp_path, attempt):
    # It exited 3 about half the time: the daemon's cancellation caught the reply unsent.
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(tmp_path / "absent.gguf"))
    d.start()
    try:
        d.wait_for(lambda s: s["state"] in ("failed", "stopped"), 30, "the plan to fail")
        env = {**os.environ, "STOKER_HOME": str(stoker_home)}
        out = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "shutdown"], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "daemon stopping" in out.stdout
        assert d.proc.wait(30) == 0
    finally:
        d.stop()
