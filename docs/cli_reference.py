"""Write docs/cli.md from the click commands themselves: `python docs/cli_reference.py [--check]`."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from stoker.daemon.cli.group import cli

PAGE = Path(__file__).resolve().parent / "cli.md"

INTRO = """# CLI reference

Every command talks to the daemon over its Unix socket (except `daemon`, `bundle`, `config
check` and `run`, which work without one). Every command takes `--json` and prints one JSON
document; exit codes: 0 success, 1 a reason-coded failure (see [reason-codes.md](reason-codes.md)),
2 a usage error, 3 the daemon is not running.

Generated from the commands by `python docs/cli_reference.py`; never edit by hand.
"""


def _walk(command: click.Command, ctx: click.Context):
    yield ctx
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):  # the root loads each command's module here
            sub = command.get_command(ctx, name)
            assert sub is not None, name
            # A child context inherits the root's settings (-h/--help), as at the command line.
            yield from _walk(sub, click.Context(sub, info_name=name, parent=ctx))


def document() -> str:
    parts = [INTRO]
    root = click.Context(cli, info_name="stoker", terminal_width=100, max_content_width=100, **cli.context_settings)
    for ctx in _walk(cli, root):
        if ctx.parent is None:
            continue
        parts.append(f"## `{ctx.command_path}`\n\n```\n{ctx.command.get_help(ctx)}\n```\n")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    from page_check import write_or_check  # docs/ is sys.path[0] when run as a script

    return write_or_check(PAGE, document(), argv, "docs/cli_reference.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
