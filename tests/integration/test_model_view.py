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


# `stoker status` and `stoker ps` as the daemon renders them: the same text the full command line
# prints from the status document, without loading click or the records (daemon/cli/quick.py).
QUICK = (
    "import atexit, sys\n"
    "atexit.register(lambda: print('LOADED', *sorted(m for m in ('click', 'attrs', 'cattrs') if m in sys.modules), file=sys.stderr))\n"
    "from stoker.daemon.cli import main\n"
    "sys.argv[0] = 'stoker'\n"
    "main()\n"
)
FULL = "import sys\nfrom stoker.daemon.cli.group import cli\ncli(prog_name='stoker')\n"


def _steady(text: str) -> str:
    """The text with its clocks (uptime, idle seconds) taken out: they move between two runs."""
    import re

    return re.sub(r"\b\d+(s|m)\b", "N", text)


@pytest.mark.parametrize("args", [("status",), ("status", "default"), ("ps",)], ids=["status", "status-model", "ps"])
def test_status_and_ps_print_the_daemons_text_without_click_twice_over(daemon, args):
    daemon.start()
    daemon.wait_state("ready")
    for _ in range(2):
        quick = subprocess.run(
            [sys.executable, "-c", QUICK, *args], env=daemon.env, capture_output=True, text=True, timeout=60
        )
        full = subprocess.run(
            [sys.executable, "-c", FULL, *args], env=daemon.env, capture_output=True, text=True, timeout=60
        )
        assert quick.returncode == full.returncode == 0, (quick.stderr, full.stderr)
        assert "LOADED\n" in quick.stderr  # none of click, attrs or cattrs was imported
        assert _steady(quick.stdout) == _steady(full.stdout)
        assert ("backend   cpu" in quick.stdout) if args[0] == "status" else quick.stdout.startswith("NAME ")


def test_status_of_an_unknown_model_or_without_a_daemon_says_so_as_the_full_command_does(daemon):
    daemon.start()
    daemon.wait_state("ready")
    unknown = stoker(daemon, "status", "no-such-model")
    assert unknown.returncode == 1 and "error [model_not_found]" in unknown.stderr
    # The daemon gone: the full command line says so, with its exit code.
    daemon.stop()
    gone = stoker(daemon, "status")
    assert gone.returncode == 3 and "daemon_not_running" in gone.stderr
