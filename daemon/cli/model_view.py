"""`stoker ps` (the models loaded now) and `stoker show NAME` (one model: its file, its GGUF facts,
its template, its settings, and where its layers go on this machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import click
from stoker.daemon.cli.lifecycle import ask
from stoker.daemon.cli.output import emit, fail, json_option
from stoker.daemon.control.status_records import Status
from stoker.daemon.control.status_text import DOWN, mib_text, ps_text
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


@click.command()
@json_option
def ps(as_json: bool) -> None:
    """The models loaded now: state, backend, layers, context, memory, idle time, when each unloads."""
    reply, status = ask("status", as_json, Status)
    if as_json:
        emit(True, {"models": [m for m in reply["models"] if m["state"] not in DOWN]})
        return
    click.echo(ps_text(status))


def _catalog_path(name: str) -> Path | None:
    from stoker.daemon.cli.models import list_models
    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.control.replies import ModelList

    listed = typed_reply("model.list", list_models(as_json=False), ModelList)
    return next((Path(m.path) for m in listed.models if m.name == name), None)


def _settings(name: str) -> dict[str, Any]:
    from stoker.daemon.config.model import ConfigError, load_config

    try:
        config = load_config()
    except ConfigError:
        return {}
    for model in config.models:
        if model.name == name:
            return {k: v for k, v in attrs.asdict(model).items() if k != "name"}
    return {}


def describe(name: str, status: Status | None) -> dict[str, Any]:
    """What `show` prints: where the file is, its facts and template, settings and placement."""
    from stoker.daemon.models.facts import model_facts, read_header

    served = next((m for m in status.models if m.name == name), None) if status is not None else None
    path = Path(served.path) if served is not None and served.path else _catalog_path(name)
    if path is None and Path(name).is_file():
        path = Path(name)
    if path is None:
        raise StokerError(
            ReasonCode.MODEL_NOT_FOUND,
            f"No model named {name!r} in the catalog or the config: `stoker models` lists them, `stoker pull {name}` adds it.",
            {"name": name},
        )
    try:
        header = read_header(path)
        facts = model_facts(path).to_dict()
    except (OSError, ValueError) as err:
        raise StokerError(
            ReasonCode.MODEL_LOAD_FAILED, f"{path} cannot be read as a GGUF: {err}", {"path": str(path)}
        ) from None
    template = header.get("tokenizer.chat_template")
    return {
        "name": name,
        "path": str(path),
        "size_bytes": path.stat().st_size,
        "architecture": header.get("general.architecture"),
        "title": header.get("general.name"),
        "facts": facts,
        "chat_template": template if isinstance(template, str) else None,
        "settings": _settings(name),
        "state": served.state if served is not None else None,
        "backend": served.backend if served is not None else None,
        "layers": attrs.asdict(served.layers) if served is not None else None,
        "estimate": served.memory.estimate if served is not None else None,
    }


def show_text(d: dict[str, Any]) -> str:
    facts = d["facts"]
    lines = [
        f"{d['name']}: {d['title'] or d['architecture'] or '?'}",
        f"  file          {d['path']} ({mib_text(d['size_bytes'] / 2**20)})",
        f"  architecture  {d['architecture'] or '?'}",
    ]
    lines += [f"  {key:<13} {value}" for key, value in facts.items() if value is not None]
    if d["state"] is not None:
        lines.append(f"  state         {d['state']}" + (f" on {d['backend']}" if d["backend"] else ""))
    estimate = d["estimate"]
    if estimate:
        devices = ", ".join(f"{k} {mib_text(v)}" for k, v in (estimate.get("devices") or {}).items())
        lines.append(
            f"  placement     {'partial ' if estimate.get('partial') else ''}ram {mib_text(estimate.get('ram_mib'))}"
            + (f" + vram {mib_text(estimate.get('vram_mib'))}" if estimate.get("vram_mib") else "")
            + (f" ({devices})" if devices else "")
            + f" by {estimate.get('source')}"
        )
    else:
        lines.append(f"  placement     not planned yet: `stoker up {d['name']}` plans and loads it")
    if d["layers"] and d["layers"].get("total") is not None:
        lines.append(f"  layers        {d['layers'].get('offloaded')}/{d['layers']['total']} offloaded")
    settings = {k: v for k, v in d["settings"].items() if v not in (None, (), [], {}, "")}
    lines += [f"  setting       {k} = {v}" for k, v in settings.items()] or [
        "  settings      none ([models.NAME] in config.toml adds them)"
    ]
    template = d["chat_template"]
    if template:
        shown = template.strip().splitlines()
        lines.append(f"  template      {len(template)} chars; first lines:")
        lines += [f"    {line}" for line in shown[:6]] + (["    ..."] if len(shown) > 6 else [])
    else:
        lines.append("  template      none in the file (the engine's default applies)")
    return "\n".join(lines)


@click.command()
@click.argument("name")
@json_option
def show(name: str, as_json: bool) -> None:
    """One model: its file, GGUF facts, chat template, settings, and where its layers go."""
    from stoker.daemon.control.client import ControlClient, typed_reply
    from stoker.daemon.core.paths import StokerPaths

    status: Status | None
    try:
        with ControlClient(StokerPaths.from_env().socket_path, timeout=10.0) as client:
            status = typed_reply("status", client.call("status"), Status)
    except StokerError as err:
        if err.reason != ReasonCode.DAEMON_NOT_RUNNING:
            fail(as_json, err)
        status = None  # without a daemon: the file, its facts and settings still show
    try:
        emit(as_json, describe(name, status), show_text)
    except StokerError as err:
        fail(as_json, err)


def register(cli: click.Group) -> None:
    cli.add_command(ps)
    cli.add_command(show)
