"""`stoker snapshot list | save | restore ID | rm ID [--model NAME]`: KV slot snapshots, each
model's own (the default model's without --model)."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import click

from stoker.daemon.cli.output import emit, json_option
from stoker.daemon.cli.lifecycle import ask

if TYPE_CHECKING:
    from stoker.daemon.control.replies import SnapshotListing, SnapshotsSaved
    from stoker.daemon.control.snapshot_replies import SnapshotRestored

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


def format_list(listing: SnapshotListing) -> str:
    """A model's snapshots, the budgets they count against, the latest dropped, each one's fit."""
    lines = []
    server = listing.server or {}
    if not listing.enabled:
        lines.append("snapshots are off ([snapshots] enabled = false)")
    if server:
        benefit = "yes" if server.get("benefit") else f"no - {server.get('why')}"
        lines.append(f"server    resumes from snapshots: {benefit}")
        if server.get("swa_full_cost_mib") is not None:
            lines.append(
                f"          --swa-full: KV {server['kv_mib_with_swa_full']} MiB instead of "
                f"{server['kv_mib_without_swa_full']} MiB (+{server['swa_full_cost_mib']} MiB)"
            )
    rows = listing.snapshots
    auto = " (auto)" if listing.max_bytes_setting == "auto" else ""
    lines.append(
        f"{len(rows)} snapshot(s) of model {listing.model}, {_mib(listing.total_bytes)}; every model's "
        f"{_mib(listing.all_bytes)} of {_mib(listing.max_bytes)}{auto}, at most {listing.max_count} "
        f"per slot and model; {listing.dir}"
    )
    for drop in listing.dropped[-5:]:  # never silent: the latest given up, and why
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
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created_at))
        fits = {True: "yes", False: f"no ({r.why_not})", None: "-"}[r.fits_server]
        lines.append(
            f"{r.id:>5} {r.slot_id:>4} {r.n_tokens:>7} {_mib(r.file_size):>10} {r.cause:>8}  "
            f"{created}  {r.backend or '-':8} {fits}"
        )
    return "\n".join(lines)


def format_saved(saved: SnapshotsSaved) -> str:
    lines = [
        f"saved slot {r.slot_id} as snapshot {r.id}: {r.n_tokens} tokens, {_mib(r.file_size)}" for r in saved.saved
    ]
    return "\n".join(lines or ["no slot holds anything to save"])


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), so that a command can say what its
    own Python start cost; None where that is not known."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _ms(seconds: Any) -> str:
    return "-" if not isinstance(seconds, (int, float)) else f"{seconds * 1000:.0f} ms"


def format_restored(restored: SnapshotRestored, timing: dict[str, float | None] | None = None) -> str:
    """What was restored and what it took on the daemon's side (the engine's part in it), the
    estimates that judged it against a re-prefill, and what this command took on its own."""
    decision = restored.decision or {}
    estimates = f"restore ~{_ms(decision.get('restore_s_est'))}, re-prefill ~{_ms(decision.get('prefill_s_est'))}"
    if not restored.restored:
        lines = [
            f"left snapshot {restored.id} (slot {restored.slot}, {restored.n_tokens} tokens) to a re-prefill: "
            f"{decision.get('why')}"
        ]
    else:
        lines = [
            f"restored snapshot {restored.id} into slot {restored.slot}: {restored.n_tokens} tokens in "
            f"{restored.daemon_ms} ms on the daemon's side (the engine's restore {restored.restore_ms} ms)"
        ]
        if decision.get("choice") == "reprefill":
            lines.append(f"re-prefilling would have been faster here ({estimates}); --if-faster leaves it to that")
    if decision:
        lines.append(f"estimates: {estimates}")
    if timing and timing.get("wall_s") is not None:
        own = f"this command: {_ms(timing['wall_s'])} in all"
        if timing.get("start_s") is not None:
            own += f", {_ms(timing['start_s'])} of it starting Python before it asked the daemon"
        lines.append(own)
    if restored.note:
        lines.append(f"note: {restored.note}")
    return "\n".join(lines)


@click.group()
def snapshot() -> None:
    """KV slot snapshots: conversations that survive restarts."""


@snapshot.command("list")
@model_option
@json_option
def list_(model: str | None, as_json: bool) -> None:
    """A model's snapshots, newest first, and whether each fits its running server."""
    from stoker.daemon.control.replies import SnapshotListing

    reply, listing = ask("snapshot.list", as_json, SnapshotListing, **_model(model))
    emit(as_json, reply, lambda _: format_list(listing))


@snapshot.command()
@click.option("--slot", type=int, default=None, help="Save only this slot.")
@model_option
@json_option
def save(slot: int | None, model: str | None, as_json: bool) -> None:
    """Save a model's non-empty slots now."""
    params = {**({} if slot is None else {"slot": slot}), **_model(model)}
    from stoker.daemon.control.replies import SnapshotsSaved

    reply, saved = ask("snapshot.save", as_json, SnapshotsSaved, timeout=120.0, **params)
    emit(as_json, reply, lambda _: format_saved(saved))


@snapshot.command()
@click.argument("snapshot_id", type=int)
@click.option("--slot", type=int, default=None, help="Restore into this slot instead of the one it came from.")
@click.option(
    "--if-faster",
    is_flag=True,
    default=False,
    help="Leave the slot to a re-prefill where the daemon's figures say that is clearly faster.",
)
@model_option
@json_option
def restore(snapshot_id: int, slot: int | None, if_faster: bool, model: str | None, as_json: bool) -> None:
    """Restore snapshot ID into its model's running server (refused if it does not fit, or if
    another model saved it: a conversation never moves between models). Says what the restore
    took on the daemon's side, both estimates (restore, re-prefill) and this command's own time."""
    start_s = process_age_s()
    began = time.perf_counter()
    params = {
        "id": snapshot_id,
        **({} if slot is None else {"slot": slot}),
        **({"if_faster": True} if if_faster else {}),
        **_model(model),
    }
    from stoker.daemon.control.snapshot_replies import SnapshotRestored

    reply, restored = ask("snapshot.restore", as_json, SnapshotRestored, timeout=120.0, **params)
    asked_s = time.perf_counter() - began
    timing = {"start_s": start_s, "wall_s": None if start_s is None else start_s + asked_s}
    emit(as_json, reply, lambda _: format_restored(restored, timing))


@snapshot.command()
@click.argument("snapshot_id", type=int)
@model_option
@json_option
def rm(snapshot_id: int, model: str | None, as_json: bool) -> None:
    """Remove a model's snapshot ID (its file and its catalogue row)."""
    from stoker.daemon.control.replies import SnapshotRemoved

    reply, removed = ask("snapshot.rm", as_json, SnapshotRemoved, id=snapshot_id, **_model(model))
    emit(as_json, reply, lambda _: f"removed snapshot {removed.removed}")


def register(cli: click.Group) -> None:
    cli.add_command(snapshot)
