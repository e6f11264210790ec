"""`stoker key create [--name N] | list | revoke ID | require [--off]`: the user's API keys for
the front door, and whether every client must present one."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import click

from stoker.daemon.cli.output import emit, json_option
from stoker.daemon.cli.lifecycle import ask

if TYPE_CHECKING:
    from stoker.daemon.control.replies import CreatedApiKey, KeyList, KeyRequirement

SHOWN_ONCE = "This is the only time the key is shown: Stoker keeps only its hash. Store it now."


def _when(at: float | None) -> str:
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def format_created(created: CreatedApiKey) -> str:
    name = f" ({created.name})" if created.name else ""
    return f"created key {created.id}{name}:\n\n    {created.key}\n\n{SHOWN_ONCE}"


def format_list(listed: KeyList) -> str:
    if not listed.keys:
        return "no API keys; `stoker key create` makes one"
    lines = [f"{'id':>4}  {'prefix':22} {'name':16} {'created':19}  {'last used':19}  state"]
    for r in listed.keys:
        state = f"revoked {_when(r.revoked_at)}" if r.revoked else "active"
        lines.append(
            f"{r.id:>4}  {r.prefix:22} {r.name or '-':16} {_when(r.created_at):19}  {_when(r.last_used_at):19}  {state}"
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
    from stoker.daemon.control.replies import CreatedApiKey

    params: dict[str, Any] = {} if name is None else {"name": name}
    reply, created = ask("key.create", as_json, CreatedApiKey, **params)
    emit(as_json, {**reply, "note": SHOWN_ONCE}, lambda _: format_created(created))


@key.command("list")
@json_option
def list_(as_json: bool) -> None:
    """Every key (its prefix, never the key), revoked ones marked."""
    from stoker.daemon.control.replies import KeyList

    reply, listed = ask("key.list", as_json, KeyList)
    emit(as_json, reply, lambda _: format_list(listed))


@key.command()
@click.argument("ident", metavar="ID")
@json_option
def revoke(ident: str, as_json: bool) -> None:
    """Revoke key ID (its id or its prefix, as `stoker key list` shows them)."""
    from stoker.daemon.control.replies import ApiKey

    reply, revoked = ask("key.revoke", as_json, ApiKey, id=ident)
    emit(as_json, reply, lambda _: f"revoked key {revoked.id} ({revoked.prefix}): it no longer opens the front door")


def format_requirement(done: KeyRequirement) -> str:
    fd = done.frontdoor
    where = fd.url or fd.address
    if done.require_keys:
        said = f"the front door ({where}) requires a key: clients send one made with `stoker key create`"
    else:
        said = f"the front door ({where}) requires no key: any local user can use it"
    return f"{said} ({'set' if done.changed else 'already set'} in {done.config_path})"


@key.command()
@click.option("--off", is_flag=True, help="Stop requiring a key: any local user may call without one.")
@json_option
def require(off: bool, as_json: bool) -> None:
    """Require a key of every front door client ([frontdoor] require_keys), applied at once."""
    from stoker.daemon.control.replies import KeyRequirement

    reply, done = ask("key.require", as_json, KeyRequirement, off=off)
    emit(as_json, reply, lambda _: format_requirement(done))


def register(cli: click.Group) -> None:
    cli.add_command(key)
