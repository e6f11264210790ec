"""`stoker snapshot list | save | restore ID | rm ID [--model NAME]`: KV slot snapshots, each
model's own (the default model's without --model)."""

from __future__ import annotations

import time
from typing import Any

import click

from daemon.cli.output import emit, json_option
from daemon.cli.service import call

model_option = click.option(
    "--model",
    "model",
    default=None,
    metavar="NAME",
    help="The model whose snapshots these are (its [models.NAME]); default: the default model.",
)


def _model(model: str | None) -> dict[str, Any]:
    # dict[str, Any]: a dict[str, str] spread could fill call's timeout, says mypy
    return {} if model is None else {"model": model}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def format_list(data: dict) -> str:
    lines = []
    server = data.get("server") or {}
    if not data.get("enabled"):
        lines.append("snapshots are off ([snapshots] enabled = false)")
    if server:
        benefit = "yes" if server.get("benefit") else f"no - {server.get('why')}"
        lines.append(f"server    resumes from snapshots: {benefit}")
        if server.get("swa_full_cost_mib") is not None:
            lines.append(
                f"          --swa-full: KV {server['kv_mib_with_swa_full']} MiB instead of "
                f"{server['kv_mib_without_swa_full']} MiB (+{server['swa_full_cost_mib']} MiB)"
            )
    rows = data.get("snapshots") or []
    auto = " (auto)" if data.get("max_bytes_setting") == "auto" else ""
    lines.append(
        f"{len(rows)} snapshot(s) of model {data.get('model')}, {_mib(data.get('total_bytes'))}; every model's "
        f"{_mib(data.get('all_bytes'))} of {_mib(data.get('max_bytes'))}{auto}, at most {data.get('max_count')} "
        f"per slot and model; {data.get('dir')}"
    )
    for drop in (data.get("dropped") or [])[-5:]:  # never silent: the latest given up, and why
        when = time.strftime("%H:%M:%S", time.localtime(drop.get("at") or 0))
        if drop.get("snapshot_id") is not None:
            what = f"snapshot {drop['snapshot_id']}"
        else:
            what = f"slots {drop['slots']}" if "slots" in drop else f"slot {drop.get('slot')}"
        lines.append(f"dropped   {when} {what}: {drop['reason']} {drop.get('why') or drop.get('phase') or ''}".rstrip())
    if rows:
        lines.append(
            f"{'id':>5} {'slot':>4} {'tokens':>7} {'size':>10} {'cause':>8}  {'created':19}  {'backend':8} fits"
        )
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created_at"]))
        fits = {True: "yes", False: f"no ({r.get('why_not')})", None: "-"}[r.get("fits_server")]
        lines.append(
            f"{r['id']:>5} {r['slot_id']:>4} {r['n_tokens']:>7} {_mib(r['file_size']):>10} {r['cause']:>8}  "
            f"{created}  {r.get('backend') or '-':8} {fits}"
        )
    return "\n".join(lines)


@click.group()
def snapshot() -> None:
    """KV slot snapshots: conversations that survive restarts."""


@snapshot.command("list")
@model_option
@json_option
def list_(model: str | None, as_json: bool) -> None:
    """A model's snapshots, newest first, and whether each fits its running server."""
    emit(as_json, call("snapshot.list", as_json, **_model(model)), format_list)


@snapshot.command()
@click.option("--slot", type=int, default=None, help="Save only this slot.")
@model_option
@json_option
def save(slot: int | None, model: str | None, as_json: bool) -> None:
    """Save a model's non-empty slots now."""
    params = {**({} if slot is None else {"slot": slot}), **_model(model)}
    data = call("snapshot.save", as_json, timeout=120.0, **params)
    emit(
        as_json,
        data,
        lambda d: "\n".join(
            [
                f"saved slot {r['slot_id']} as snapshot {r['id']}: {r['n_tokens']} tokens, {_mib(r['file_size'])}"
                for r in d["saved"]
            ]
            or ["no slot holds anything to save"]
        ),
    )


@snapshot.command()
@click.argument("snapshot_id", type=int)
@click.option("--slot", type=int, default=None, help="Restore into this slot instead of the one it came from.")
@model_option
@json_option
def restore(snapshot_id: int, slot: int | None, model: str | None, as_json: bool) -> None:
    """Restore snapshot ID into its model's running server (refused if it does not fit, or if
    another model saved it: a conversation never moves between models)."""
    params = {"id": snapshot_id, **({} if slot is None else {"slot": slot}), **_model(model)}
    data = call("snapshot.restore", as_json, timeout=120.0, **params)
    emit(
        as_json,
        data,
        lambda d: (
            f"restored snapshot {d['id']} into slot {d['slot']}: "
            f"{d['n_tokens']} tokens in {d.get('restore_ms')} ms" + (f"\nnote: {d['note']}" if d.get("note") else "")
        ),
    )


@snapshot.command()
@click.argument("snapshot_id", type=int)
@model_option
@json_option
def rm(snapshot_id: int, model: str | None, as_json: bool) -> None:
    """Remove a model's snapshot ID (its file and its catalogue row)."""
    data = call("snapshot.rm", as_json, id=snapshot_id, **_model(model))
    emit(as_json, data, lambda d: f"removed snapshot {d['removed']}")


def register(cli: click.Group) -> None:
    cli.add_command(snapshot)
