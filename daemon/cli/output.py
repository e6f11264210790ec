"""How every command prints: human text by default, one JSON document with --json.

Exit codes: 0 success, 1 a reason-coded failure, 2 a usage error (click's own), 3 the daemon
is not running.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, NoReturn

import click

# The reason codes and StokerError load when a failure is reported, not at every start: they cost
# ~45 ms of each `stoker` run (attrs and the reason table), `stoker --help` included.
if TYPE_CHECKING:
    from stoker.daemon.core.errors import StokerError

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
    code = EXIT_NOT_RUNNING if err.reason == "daemon_not_running" else EXIT_FAILURE
    if as_json:
        click.echo(json.dumps({"ok": False, "error": err.to_dict()}, indent=2, sort_keys=True, default=str))
    else:
        click.secho(f"error [{err.reason}]: {err.message}", fg="red", err=True)
        for key, value in err.evidence.items():
            click.echo(f"  {key}: {value}", err=True)
    sys.exit(code)


class _Reported:
    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: Any) -> None:
        if err is not None:
            from stoker.daemon.core.errors import StokerError

            if isinstance(err, StokerError):
                fail(self.as_json, err)


def reported(as_json: bool) -> _Reported:
    """`with reported(as_json):` a reason-coded failure raised inside is reported (`fail`) and exits."""
    return _Reported(as_json)


def run_guarded(group: click.Group) -> None:
    """Run the CLI; a StokerError that escapes a command still exits with its reason code."""
    try:
        group(standalone_mode=True)
    except Exception as err:  # pragma: no cover - commands normally call fail() themselves
        from stoker.daemon.core.errors import StokerError

        if not isinstance(err, StokerError):
            raise
        fail("--json" in sys.argv, err)


def invoked_path() -> Path | None:
    """The `stoker` executable running now, as an absolute path (None under `python -m`)."""
    argv0 = Path(sys.argv[0])
    return argv0.absolute() if argv0.name == "stoker" and argv0.exists() else None


def invoked_as() -> str:
    """How the user calls Stoker, for hints: `stoker` when that is what PATH finds, else the path."""
    import shutil

    path = invoked_path()
    if path is None:
        return f"{Path(sys.executable).name} -m stoker.daemon"
    found = shutil.which("stoker")
    if found is not None and Path(found).resolve() == path.resolve():
        return "stoker"
    return sys.argv[0]
