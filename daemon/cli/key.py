"""`stoker key create [--name N] | list | revoke ID`: the user's API keys for the front door."""

from __future__ import annotations

import time
from typing import Any

import click

from daemon.cli.output import emit, json_option
from daemon.cli.service import call

SHOWN_ONCE = "This is the only time the key is shown: Stoker keeps only its hash. Store it now."


def _when(at: float | None) -> str:
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def format_created(data: dict[str, Any]) -> str:
    name = f" ({data['name']})" if data.get("name") else ""
    return f"created key {data['id']}{name}:\n\n    {data['key']}\n\n{SHOWN_ONCE}"


def format_list(data: dict[str, Any]) -> str:
    rows = data.get("keys") or []
    if not rows:
        return "no API keys; `stoker key create` makes one"
    lines = [f"{'id':>4}  {'prefix':22} {'name':16} {'created':19}  {'last used':19}  state"]
    for r in rows:
        state = f"revoked {_when(r.get('revoked_at'))}" if r.get("revoked") else "active"
        lines.append(
            f"{r['id']:>4}  {r['prefix']:22} {r.get('name') or '-':16} {_when(r['created_at']):19}  "
            f"{_when(r.get('last_used_at')):19}  {state}"
        )
    return "\n".join(lines)


@click.group()
def key() -> None:
    """API keys that clients present to the front door."""


@key.command()
@click.option("--name", default=None, help="A name to tell the key apart (where it is used).")
@json_option
def create(name: str | None, as_json: bool) -> None:
    """Make a new key and print it, once."""
    params: dict[str, Any] = {} if name is None else {"name": name}
    data = call("key.create", as_json, **params)
    if as_json:
        data = {**data, "note": SHOWN_ONCE}
    emit(as_json, data, format_created)


@key.command("list")
@json_option
def list_(as_json: bool) -> None:
    """Every key (its prefix, never the key), revoked ones marked."""
    emit(as_json, call("key.list", as_json), format_list)


@key.command()
@click.argument("ident", metavar="ID")
@json_option
def revoke(ident: str, as_json: bool) -> None:
    """Revoke key ID (its id or its prefix, as `stoker key list` shows them)."""
    data = call("key.revoke", as_json, id=ident)
    emit(as_json, data, lambda d: f"revoked key {d['id']} ({d['prefix']}): it no longer opens the front door")


def register(cli: click.Group) -> None:
    cli.add_command(key)
