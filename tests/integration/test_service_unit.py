"""`stoker service install | status | uninstall`, run as a user runs them, twice in a row.

The machine running the suite may have no systemd (a container): the unit is then checked with
`systemd-analyze verify`, and its ExecStart line is run the way systemd runs a Type=notify
service (NOTIFY_SOCKET set, SIGTERM to stop), so the unit is proven to start a daemon that says
READY=1 once its server answers.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from stoker.daemon.core.paths import StokerPaths

from tests.integration.daemon_harness import servers_for, tiny_config, write_config

STOKER = Path(sys.executable).with_name("stoker")


def stoker(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(STOKER), *args], check=False, env=env, capture_output=True, text=True, timeout=120)


def systemd_runs() -> bool:
    try:
        return Path("/proc/1/comm").read_text().strip() == "systemd"
    except OSError:
        return False


@pytest.fixture
def user_env(stoker_home, tmp_path):
    home = tmp_path / "user"
    home.mkdir()
    return {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "STOKER_HOME": str(stoker_home)}


def unit_lines(path: Path) -> dict[str, list[str]]:
    lines: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            lines.setdefault(key, []).append(value)
    return lines


def test_install_twice_writes_a_unit_that_starts_the_daemon(user_env, installed_cpu_bundle, model, tmp_path):
    first = stoker(user_env, "service", "install", "--no-start", "--json")
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)
    unit = Path(report["unit"])
    assert unit == Path(user_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "stoker.service"
    assert report["changed"] is True and report["installed"] is True
    again = stoker(user_env, "service", "install", "--no-start")
    assert again.returncode == 0 and again.stdout.startswith(f"unchanged {unit}")

    fields = unit_lines(unit)
    assert fields["Type"] == ["notify"]
    command = shlex.split(fields["ExecStart"][0])
    assert command == [str(STOKER), "daemon"]  # the stoker that was run, as installed
    assert fields["Environment"] == [f"STOKER_HOME={user_env['STOKER_HOME']}"]
    if shutil.which("systemd-analyze"):
        verified = subprocess.run(
            ["systemd-analyze", "verify", str(unit)], check=False, capture_output=True, text=True, timeout=60
        )
        assert verified.returncode == 0, verified.stderr

    # Start it as systemd would: its ExecStart, its Environment, a notify socket; READY=1 comes
    # once the server answers, and SIGTERM (KillMode=mixed) ends the daemon and its server.
    paths = StokerPaths.from_env(user_env)
    write_config(paths, tiny_config(model))
    notify = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(notify))
        listener.settimeout(120)
        env = {**user_env, **dict(e.split("=", 1) for e in fields["Environment"]), "NOTIFY_SOCKET": str(notify)}
        proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            said = ""
            while "READY=1" not in said:
                said += listener.recv(4096).decode()
            status = stoker(user_env, "status", "--json")
            assert json.loads(status.stdout)["state"] == "ready"
            assert servers_for(model)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    assert servers_for(model) == []

    shown = stoker(user_env, "service", "status")
    assert shown.returncode == 0 and shown.stdout.startswith(f"unit {unit}")
    removed = stoker(user_env, "service", "uninstall")
    assert removed.returncode == 0 and removed.stdout.strip() == f"removed {unit}"
    assert not unit.exists()
    gone = stoker(user_env, "service", "uninstall")
    assert gone.returncode == 0 and gone.stdout.strip() == f"not installed (no {unit})"


@pytest.mark.skipif(systemd_runs(), reason="systemd runs here: install would really enable the unit")
def test_install_without_systemd_keeps_the_unit_and_says_how_to_start(user_env):
    done = stoker(user_env, "service", "install")
    assert done.returncode == 1
    assert "error [service_manager_unavailable]" in done.stderr
    assert "stoker daemon" in done.stderr
    unit = Path(user_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "stoker.service"
    assert unit.exists()  # written and checked; only enabling it failed


def test_a_unit_systemd_refuses_is_never_written(user_env, tmp_path):
    # A stoker executable that is not executable: systemd-analyze refuses its ExecStart.
    if not shutil.which("systemd-analyze"):
        pytest.skip("no systemd-analyze on this machine")
    fake = tmp_path / "bin" / "stoker"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o644)
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.argv[0] = sys.argv[1]; del sys.argv[1]; from stoker.daemon.cli import main; main()",
            str(fake),
            "service",
            "install",
            "--no-start",
        ],
        check=False,
        env=user_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout
    assert "error [service_unit_invalid]" in done.stderr
    assert not (Path(user_env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "stoker.service").exists()
