"""The `stoker` group loads a command's module only when the command runs: the table that says
which module registers which command must be exactly what the modules register."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import click

from stoker.daemon.cli.group import COMMAND_MODULES, COMMANDS


def test_the_command_table_is_what_the_modules_register():
    registered = {}
    for name in COMMAND_MODULES:
        group = click.Group()
        importlib.import_module(f"stoker.daemon.cli.{name}").register(group)
        registered.update({command: name for command in group.commands})
    assert registered == COMMANDS


def test_a_command_imports_only_its_own_module():
    # `stoker key --help` must not pay for numpy and gguf (the bundle and worker modules).
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from stoker.daemon.cli.group import cli\n"
        "r = CliRunner().invoke(cli, ['key', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('stoker.daemon.cli.', 'numpy', 'gguf')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "stoker.daemon.cli.key" in out
    assert not [
        m for m in out if m.startswith(("numpy", "gguf", "stoker.daemon.cli.worker", "stoker.daemon.cli.bundle"))
    ], out


def test_the_help_summaries_are_the_commands_own():
    from stoker.daemon.cli.group import SUMMARIES, cli

    ctx = click.Context(cli)
    assert set(SUMMARIES) == set(COMMANDS)
    for name, summary in SUMMARIES.items():
        command = cli.get_command(ctx, name)
        assert command is not None
        for limit in (30, 45, 120):
            assert click.Command(name, help=summary).get_short_help_str(limit) == command.get_short_help_str(limit), (
                name
            )


def test_stoker_help_imports_no_command_module():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from stoker.daemon.cli.group import cli\n"
        "r = CliRunner().invoke(cli, ['--help'])\n"
        "assert r.exit_code == 0 and 'status' in r.output, r.output\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('stoker.daemon.cli.'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["stoker.daemon.cli.group"], out


def test_stoker_help_prints_clicks_own_text_without_loading_click():
    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('CLICK' if 'click' in sys.modules else 'NO CLICK', file=sys.stderr))\n"
        "sys.argv = ['/usr/local/bin/stoker', *sys.argv[1:]]\n"
        "from stoker.daemon.cli import main\n"
        "main()\n"
    )
    full = "from stoker.daemon.cli.group import cli\ncli(prog_name='stoker')\n"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    for flag in ("--help", "-h"):
        quick = subprocess.run([sys.executable, "-c", code, flag], capture_output=True, text=True, env=env, check=True)
        slow = subprocess.run([sys.executable, "-c", full, flag], capture_output=True, text=True, env=env, check=True)
        assert quick.stdout == slow.stdout and "Usage: stoker [OPTIONS] COMMAND" in quick.stdout
        assert quick.stderr.strip() == "NO CLICK"
    # A narrow terminal gets click's own layout for it.
    narrow = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, env={**env, "COLUMNS": "60"}, check=True
    )
    assert narrow.stderr.strip() == "CLICK" and max(len(line) for line in narrow.stdout.splitlines()) <= 60


def test_a_reader_that_left_gets_no_traceback():
    code = "import sys\nsys.argv = ['/usr/local/bin/stoker', '--help']\nfrom stoker.daemon.cli import main\nmain()\n"
    read, write = os.pipe()
    os.close(read)  # `stoker --help | head -0`: nobody reads
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=write, stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write)
    assert done.returncode == 1 and done.stderr == ""
