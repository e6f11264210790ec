"""`stoker snapshot list | save | restore ID | rm ID`: KV slot snapshots."""

from __future__ import annotations

import time

import click

from daemon.cli.output import emit, json_option
from daemon.cli.service import call


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
        f"{len(rows)} snapshot(s), {_mib(data.get('total_bytes'))} of {_mib(data.get('max_bytes'))}{auto}, "
        f"at most {data.get('max_count')} per slot and model; {data.get('dir')}"
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
@json_option
def list_(as_json: bool) -> None:
    """Every snapshot, newest first, and whether it fits the running server."""
    emit(as_json, call("snapshot.list", as_json), format_list)


@snapshot.command()
@click.option("--slot", type=int, default=None, help="Save only this slot.")
@json_option
def save(slot: int | None, as_json: bool) -> None:
    """Save the server's non-empty slots now."""
    params = {} if slot is None else {"slot": slot}
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
@json_option
def restore(snapshot_id: int, slot: int | None, as_json: bool) -> None:
    """Restore snapshot ID into the running server (refused if it does not fit)."""
    params = {"id": snapshot_id, **({} if slot is None else {"slot": slot})}
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
@json_option
def rm(snapshot_id: int, as_json: bool) -> None:
    """Remove snapshot ID (its file and its catalogue row)."""
    emit(as_json, call("snapshot.rm", as_json, id=snapshot_id), lambda d: f"removed snapshot {d['removed']}")


def register(cli: click.Group) -> None:
    cli.add_command(snapshot)
