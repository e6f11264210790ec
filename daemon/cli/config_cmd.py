"""`stoker config check [PATH]`: validate a config file without touching the daemon."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from stoker.daemon.cli.output import EXIT_FAILURE, emit, fail, json_option


def register(cli: click.Group) -> None:
    """Add the `config` group to the root CLI."""
    cli.add_command(config_group)


@click.group("config")
def config_group() -> None:
    """Inspect the config file."""


@config_group.command("check")
@click.argument("path", required=False, type=click.Path(dir_okay=False, path_type=Path))
@json_option
def check(path: Path | None, as_json: bool) -> None:
    """Validate PATH (default: the config file in use); list every problem."""
    from stoker.daemon.config.model import ConfigError, default_config_path, load_config

    path = default_config_path() if path is None else path
    try:
        config = load_config(path)
    except ConfigError as err:
        if as_json:
            fail(True, err)
        click.secho(f"error [{err.reason}]: {err.message}", fg="red", err=True)
        for problem in err.problems:
            click.echo(f"  - {problem}", err=True)
        sys.exit(EXIT_FAILURE)
    exists = path.exists()
    data = {"ok": True, "path": str(path), "exists": exists, "config": config.to_dict()}

    def human(_data: object) -> str:
        if not exists:
            return f"{path}: no such file; the defaults apply (valid)."
        return f"{path}: valid."

    emit(as_json, data, human)
