"""`stoker config check [PATH]`: validate a config file without touching the daemon."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from stoker.daemon.cli.output import EXIT_FAILURE, emit, fail, json_option
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

if TYPE_CHECKING:
    from stoker.daemon.config.model import Config


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
    missing = models_not_in_catalog(config, as_json)
    if missing:
        refusal = StokerError(
            ReasonCode.MODEL_NOT_IN_CATALOG,
            f"{path}: {len(missing)} model{'s' if len(missing) != 1 else ''} the config names "
            f"{'are' if len(missing) != 1 else 'is'} not in the catalog; pull {'them' if len(missing) != 1 else 'it'} "
            f"first: {'; '.join(f'{key}: {fix}' for key, _, fix in missing)}.",
            {"path": str(path), "models": [{"key": key, "model": name, "fix": fix} for key, name, fix in missing]},
        )
        fail(as_json, refusal)
    exists = path.exists()
    data = {"ok": True, "path": str(path), "exists": exists, "config": config.to_dict()}

    def human(_data: object) -> str:
        if not exists:
            return f"{path}: no such file; the defaults apply (valid)."
        return f"{path}: valid."

    emit(as_json, data, human)


def models_not_in_catalog(config: Config, as_json: bool) -> list[tuple[str, str, str]]:
    """The config's model names that no row of the catalog has and Stoker cannot pull by itself,
    as (key, name, the command that adds it): clients would otherwise meet a server that is down."""
    from stoker.daemon.cli.models import list_models
    from stoker.daemon.cli.run import ListedCatalog
    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.control.replies import ModelList
    from stoker.daemon.models.resolve import look_up
    from stoker.daemon.models.spec import parse_spec
    from stoker.states.pull.lookup import Action, ModelForm, model_form

    wanted = [(f"models.{m.name}.model", m.model) for m in config.models] or [("server.model", config.server.model)]
    wanted = [(key, name) for key, name in wanted if model_form(name) is ModelForm.NAME]
    if not wanted:
        return []
    try:
        listed = typed_reply("model.list", list_models(as_json), ModelList)
    except StokerError:
        return []  # the catalog cannot be read now: the daemon says so when it plans
    catalog = ListedCatalog({r.name: r for r in listed.models})
    missing = []
    for key, name in wanted:
        found = look_up(name, catalog)
        if found.decision.action is Action.REFUSE and found.record is None:  # no row: not in the catalog
            try:
                fix = f"`stoker pull {parse_spec(name).text}`"
            except StokerError:
                fix = f"`stoker pull SPEC --name {name}` (`stoker pull --list` shows the names Stoker knows)"
            missing.append((key, name, fix))
    return missing
