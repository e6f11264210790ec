"""The `stoker` command line: `main` is the console script.

`stoker status` and `stoker ps` print the text the daemon renders for them (daemon/cli/quick.py)
before click or any record loads; every other command, and those two when the daemon cannot
answer so, goes through the click group of daemon/cli/group.py.
"""

from __future__ import annotations


def main() -> None:
    """Console-script entry point."""
    import sys

    from stoker.daemon.cli.quick import answered

    code = answered(sys.argv[1:])
    if code is not None:
        sys.exit(code)
    from stoker.daemon.cli.group import cli
    from stoker.daemon.cli.output import run_guarded

    run_guarded(cli)
