"""The `stoker` group loads a command's module only when the command runs: the table that says
which module registers which command must be exactly what the modules register."""

from __future__ import annotations

import importlib
import subprocess
import sys

import click

from stoker.daemon.cli import COMMAND_MODULES, COMMANDS


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
        "from stoker.daemon.cli import cli\n"
        "r = CliRunner().invoke(cli, ['key', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith(('stoker.daemon.cli.', 'numpy', 'gguf')))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "stoker.daemon.cli.key" in out
    assert not [
        m for m in out if m.startswith(("numpy", "gguf", "stoker.daemon.cli.worker", "stoker.daemon.cli.bundle"))
    ], out
