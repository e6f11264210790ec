"""`stoker ps` and `stoker show NAME`, run as a user runs them, twice in a row, with a real engine."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.daemon_harness import DaemonProcess

pytestmark = [pytest.mark.engine]


def stoker(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args],
        check=False,
        env=daemon.env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_ps_lists_what_is_loaded_and_show_describes_the_model(daemon, model):
    daemon.start()
    daemon.wait_state("ready")
    for _ in range(2):
        listed = stoker(daemon, "ps")
        assert listed.returncode == 0, listed.stderr
        head, row = listed.stdout.splitlines()
        assert head.split() == ["NAME", "STATE", "BACKEND", "LAYERS", "CTX", "MEMORY", "IDLE", "UNLOADS"]
        assert row.split()[:5] == ["default", "ready", "cpu", "cpu", "256"]  # the context the server allocated
        as_json = json.loads(stoker(daemon, "ps", "--json").stdout)
        (loaded,) = as_json["models"]
        assert loaded["name"] == "default" and loaded["pid"] == daemon.call("status")["pid"]

        shown = stoker(daemon, "show", "default")
        assert shown.returncode == 0, shown.stderr
        text = shown.stdout
        assert text.startswith("default: ")
        assert f"file          {model}" in text
        assert "state         ready on cpu" in text
        assert "placement     ram " in text  # the plan's estimate, as status reads it
        details = json.loads(stoker(daemon, "show", "default", "--json").stdout)
        assert details["path"] == str(model) and details["facts"]["block_count"] >= 1

    daemon.call("down")
    daemon.wait_state("stopped")
    idle = stoker(daemon, "ps")
    assert idle.returncode == 0 and idle.stdout.startswith("no model is loaded")


def test_show_reads_a_file_without_a_daemon_and_names_a_missing_model(daemon, model):
    shown = stoker(daemon, "show", str(model))
    assert shown.returncode == 0, shown.stderr
    assert "placement     not planned yet" in shown.stdout
    missing = stoker(daemon, "show", "no-such-model")
    assert missing.returncode == 1
    assert "error [model_not_found]" in missing.stderr and "stoker pull no-such-model" in missing.stderr
