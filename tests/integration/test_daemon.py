"""The daemon with the real engine and a tiny generated model, driven over its socket."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import httpx
import psutil
import pytest

from stoker.daemon.core.errors import StokerError
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config

pytestmark = [pytest.mark.engine]


def transitions(d: DaemonProcess, machine: str = "launch") -> list[tuple[str, str, str]]:
    return [(h["from_state"], h["event"], h["to_state"]) for h in reversed(d.history(machine=machine, limit=500))]


def test_up_ready_chat_down(daemon, model):
    daemon.start()
    st = daemon.wait_state("ready")
    assert st["backend"] == "cpu" and st["endpoint"].startswith("http://127.0.0.1:")
    assert st["pid"] in [p.pid for p in servers_for(model)]
    # The per-launch key is required; with it, a completion is served.
    body = {"prompt": "hello", "n_predict": 4, "temperature": 0}
    assert httpx.post(f"{st['endpoint']}/completion", json=body, timeout=30).status_code == 401
    reply = httpx.post(
        f"{st['endpoint']}/completion", json=body, headers={"Authorization": f"Bearer {st['api_key']}"}, timeout=30
    )
    assert reply.status_code == 200 and reply.json()["tokens_predicted"] == 4
    st = daemon.call("down")
    assert st["state"] == "stopped" and st["endpoint"] is None
    assert servers_for(model) == []
    path = [t[2] for t in transitions(daemon)]
    assert path[:5] == ["planning", "starting", "starting", "loading", "ready"]
    assert path[-2:] == ["stopping", "stopped"]


def test_a_fresh_daemon_probes_its_backends_once_and_ahead_where_it_has_the_cores(daemon):
    """Where the probes get cores of their own (daemon/start.py) they start while the daemon's
    code loads: each candidate's probe is asked for before the default model's launch machine
    moves, and the plan joins it; elsewhere the plan asks for them. Either way, once each."""
    from stoker.daemon.start import AHEAD_MIN_CORES, usable_cores

    daemon.start()
    daemon.wait_state("ready")
    rows = daemon.history(kind="probe", limit=500)
    asked = sorted(r["machine_id"] for r in rows if r["event"] == "ProbeRequested")
    assert asked == sorted(f"probe:{name}" for name in daemon.call("status")["probes"]), rows
    first_launch = min(r["id"] for r in daemon.history(machine="launch", limit=500))
    ahead = max(r["id"] for r in rows if r["event"] == "ProbeRequested") < first_launch
    assert ahead == (usable_cores() >= AHEAD_MIN_CORES)


def test_killed_server_is_restarted_and_history_says_so(daemon, model):
    daemon.start()
    first = daemon.wait_state("ready")
    os.kill(first["pid"], signal.SIGKILL)
    second = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 60, "a new server")
    assert second["restarts"] == 1
    rows = daemon.history(machine="launch")
    crash = next(r for r in rows if r["to_state"] == "crashed")
    assert crash["reason"] == "server_crashed"
    assert crash["evidence"]["signal"] == "SIGKILL"
    assert [p.pid for p in servers_for(model)] == [second["pid"]]


def test_rejected_option_fails_at_once_without_retrying(daemon, model):
    write_config(daemon.paths, tiny_config(model, extra_args=["--no-such-flag-exists"]))
    daemon.start()
    st = daemon.wait_state("failed", timeout=60)
    assert st["reason"] == "server_bad_arguments"
    assert "--no-such-flag-exists" in " ".join(st["evidence"].get("log_tail", [])) or st["evidence"]
    crashes = [r for r in daemon.history(machine="launch", limit=500) if r["to_state"] == "crashed"]
    assert crashes == []  # retrying cannot help, so it does not
    assert servers_for(model) == []


def test_daemon_killed_mid_run_adopts_its_server(daemon, model):
    daemon.start()
    first = daemon.wait_state("ready")
    daemon.kill9()
    assert [p.pid for p in servers_for(model)] == [first["pid"]]  # the server outlived it
    daemon.start()
    # The machine resumes in `ready` from the store; the identity proof follows (Adopted), and
    # only then does status hand out the endpoint again.
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["endpoint"], 60, "adoption")
    assert st["pid"] == first["pid"]  # adopted, not restarted
    assert [p.pid for p in servers_for(model)] == [first["pid"]]
    adopted = [r for r in daemon.history(machine="launch") if r["event"] == "Adopted"]
    assert adopted and adopted[0]["evidence"]["adopted"] is True


def test_unproven_server_is_stopped_not_adopted(daemon, model):
    daemon.start()
    first = daemon.wait_state("ready")
    daemon.kill9()
    ident_path = daemon.paths.runtime_dir / "server.json"
    ident = json.loads(ident_path.read_text())
    ident["api_key"] = "not-the-key"  # the recorded identity no longer proves this server
    ident_path.write_text(json.dumps(ident))
    daemon.start()
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 60, "a fresh server")
    assert not psutil.pid_exists(first["pid"]) or psutil.Process(first["pid"]).status() == psutil.STATUS_ZOMBIE
    assert [p.pid for p in servers_for(model)] == [st["pid"]]


def test_unrelated_process_with_recorded_pid_is_never_signalled(daemon, model):
    daemon.start()
    daemon.wait_state("ready")
    daemon.call("down")
    daemon.kill9()
    bystander = psutil.Popen(["sleep", "60"])
    try:
        ident_path = daemon.paths.runtime_dir / "server.json"
        fake = {
            "pid": bystander.pid,
            "pgid": bystander.pid,
            "create_time": bystander.create_time() - 5,
            "exe": "/bin/sleep",
            "cmdline_sha256": "0" * 64,
            "host": "127.0.0.1",
            "port": 1,
            "api_key": "x",
            "log_path": "/nonexistent",
            "started_at": 0.0,
        }
        ident_path.write_text(json.dumps(fake))
        daemon.start()
        daemon.call("status")
        time.sleep(0.5)
        assert bystander.is_running() and bystander.status() != psutil.STATUS_ZOMBIE
    finally:
        bystander.kill()


def test_second_daemon_refuses(daemon):
    daemon.start()
    second = DaemonProcess(daemon.home)
    second.start(wait=False)
    assert second.proc.wait(30) == 1
    assert "daemon_already_running" in second.log_text()
    assert daemon.call("ping")["pong"] is True


def test_missing_model_is_reason_coded(daemon, tmp_path):
    write_config(daemon.paths, tiny_config(tmp_path / "nope.gguf"))
    daemon.start()
    st = daemon.wait_state("failed")
    assert st["reason"] == "model_missing"
    assert "nope.gguf" in st["evidence"]["model"]


def test_server_dying_at_start_ends_in_crash_loop_with_port_in_use(daemon, model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        write_config(daemon.paths, tiny_config(model, port=port))
        daemon.start()
        st = daemon.wait_state("failed", timeout=60)
        assert st["reason"] == "crash_loop"
        assert st["evidence"]["last_reason"] == "port_in_use"
        assert st["evidence"]["max_restarts"] == 3
        crashes = [r for r in daemon.history(machine="launch", limit=500) if r["to_state"] == "crashed"]
        assert len(crashes) == 3 and all(r["reason"] == "port_in_use" for r in crashes)
        time.sleep(1.0)  # and it stays failed: no endless restarts
        assert daemon.call("status")["state"] == "failed"
    assert daemon.call("ping")["pong"] is True
    assert servers_for(model) == []


def test_broken_config_keeps_running_config(daemon, model):
    daemon.start()
    first = daemon.wait_state("ready")
    write_config(daemon.paths, "[server]\nctx_size = 'big'\nbogus = 1\n")
    st = daemon.wait_for(lambda s: not s["config"]["valid"], 30, "config rejected")
    assert any("server.ctx_size" in p for p in st["config"]["problems"])
    assert any("server.bogus" in p for p in st["config"]["problems"])
    assert st["state"] == "ready" and st["pid"] == first["pid"]
    rejected = daemon.history(machine="config")[0]
    assert rejected["to_state"] == "invalid" and rejected["reason"] == "config_invalid"
    # A valid change to a server setting relaunches the server with it.
    write_config(daemon.paths, tiny_config(model, ctx_size=512))
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 60, "relaunch")
    assert st["config"]["valid"] and st["n_ctx"] == 512


def test_invalid_config_at_start_refuses_up(stoker_home, installed_cpu_bundle):
    d = DaemonProcess(stoker_home)
    write_config(d.paths, "[server\n")
    d.start()
    try:
        st = d.call("status")
        assert st["state"] == "stopped" and not st["config"]["valid"]
        with pytest.raises(StokerError) as err:
            d.call("up")
        assert err.value.reason == "config_invalid"
    finally:
        d.stop()


def test_malformed_and_oversized_requests(daemon):
    daemon.start()
    path = str(daemon.paths.socket_path)
    replies = []
    for frame in (
        b"this is not json\n",
        b"[1,2,3]\n",
        b'{"jsonrpc":"2.0","id":7,"method":"nope"}\n',
        b'{"jsonrpc":"2.0","id":8,"method":"history","params":{"limit":"x"}}\n',
    ):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(path)
            s.sendall(frame)
            replies.append(json.loads(s.makefile().readline()))
    reasons = [r["error"]["reason"] for r in replies]
    assert reasons == ["bad_request", "bad_request", "unknown_method", "bad_request"]
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(path)
        try:
            s.sendall(b'{"x":"' + b"a" * (2 << 20))
            reply = json.loads(s.makefile().readline())
            assert reply["error"]["reason"] == "request_too_large"
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon may close first: what matters is that it lives on
    assert daemon.call("ping")["pong"] is True
    assert daemon.call("status")["state"] in ("planning", "starting", "loading", "ready")


def test_sd_notify_ready_and_stopping(stoker_home, installed_cpu_bundle, model, tmp_path):
    notify_path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(notify_path))
        listener.settimeout(60)
        # WATCHDOG_USEC asks for watchdog pings (at half the interval, from the event loop).
        d = DaemonProcess(stoker_home, env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "400000"})
        write_config(d.paths, tiny_config(model))
        d.start()
        messages = []
        try:
            while not any("READY=1" in m for m in messages):
                messages.append(listener.recv(4096).decode())
            st = d.call("status")
            assert st["state"] == "ready"  # READY=1 only once the server really is
            pings = sum("WATCHDOG=1" in m for m in messages)
            while pings < 3:
                pings += "WATCHDOG=1" in listener.recv(4096).decode()
            d.call("shutdown")
            while not any("STOPPING=1" in m for m in messages):
                messages.append(listener.recv(4096).decode())
        finally:
            d.stop()
        assert d.proc.wait(30) == 0
        assert servers_for(model) == []


def test_corrupt_database_refuses_to_start_and_keeps_the_file(stoker_home):
    d = DaemonProcess(stoker_home)
    d.paths.data_dir.mkdir(parents=True, exist_ok=True)
    garbage = os.urandom(8192)
    d.paths.db_file.write_bytes(garbage)
    d.start(wait=False)
    assert d.proc.wait(30) == 1
    assert "store_corrupt" in d.log_text()
    assert d.paths.db_file.read_bytes() == garbage  # nothing lost: the user decides what to do
