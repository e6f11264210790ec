"""How every command prints: human text by default, one JSON document with --json.

Exit codes: 0 success, 1 a reason-coded failure, 2 a usage error (click's own), 3 the daemon
is not running.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, NoReturn

import click

from daemon.core.errors import StokerError
from states.reasons import ReasonCode

EXIT_FAILURE = 1
EXIT_NOT_RUNNING = 3

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document.")


def emit(as_json: bool, data: Any, human: Callable[[Any], str] | None = None) -> None:
    """Print `data` as JSON, or through `human` as text."""
    if as_json:
        click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    elif human is not None:
        click.echo(human(data))
    else:
        click.echo(data)


def fail(as_json: bool, err: StokerError) -> NoReturn:
    """Report a reason-coded failure and exit non-zero."""
    code = EXIT_NOT_RUNNING if err.reason == ReasonCode.DAEMON_NOT_RUNNING else EXIT_FAILURE
    if as_json:
        click.echo(json.dumps({"ok": False, "error": err.to_dict()}, indent=2, sort_keys=True, default=str))
    else:
        click.secho(f"error [{err.reason}]: {err.message}", fg="red", err=True)
        for key, value in err.evidence.items():
            click.echo(f"  {key}: {value}", err=True)
    sys.exit(code)


def run_guarded(group: click.Group) -> None:
    """Run the CLI; a StokerError that escapes a command still exits with its reason code."""
    try:
        group(standalone_mode=True)
    except StokerError as err:  # pragma: no cover - commands normally call fail() themselves
        fail("--json" in sys.argv, err)
