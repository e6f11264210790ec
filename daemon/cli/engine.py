"""`stoker engine update|rollback|status`: move an engine bundle slot to a newer engine through its
gates, put the previous one back, or say what a slot holds.

The daemon does the work (the `engine.update`, `engine.rollback` and `engine.status` socket
methods; daemon/install/update.py); each step is printed as its machine takes it (the
`machine.engine_update.*` events of the subscribe stream), then the outcome. A refusal or a
rollback exits 1 with its reason code (engine_update_rejected, engine_update_rolled_back) and
the gate that failed.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from stoker.daemon.cli.output import emit, fail, json_option, reported
from stoker.daemon.core.errors import StokerError

if TYPE_CHECKING:
    from stoker.daemon.control.replies import EngineOutcome, EngineSlot, EngineStatus

UPDATE_TIMEOUT_S = 3600.0  # a download, two smoke runs and every server's restart
SLOT_OPTIONS = (
    click.option("--backend", default=None, help="The engine's backend (default: the one the default model runs on)."),
    click.option("--variant", default=None, help="Its variant (default: the installed one)."),
)


def _slot_options(fn: Any) -> Any:
    for option in reversed(SLOT_OPTIONS):
        fn = option(fn)
    return fn


def _params(**given: Any) -> dict[str, Any]:
    return {k: v for k, v in given.items() if v is not None}


def _watch(stream: Any, stop: threading.Event) -> None:
    """Print each step of an update machine as it is taken."""
    for event in stream:
        if stop.is_set():
            break
        if not str(event.get("topic", "")).startswith("machine.engine_update."):
            continue
        line = f"  {event.get('from')} -> {event.get('to')}  ({event.get('event')})"
        if event.get("reason"):
            line += f" [{event['reason']}]"
        click.echo(line, err=True)


def _call_watched(method: str, as_json: bool, **params: Any) -> tuple[Any, EngineOutcome]:
    """The daemon's outcome as sent (for --json) and as its record (for the text)."""
    from stoker.daemon.cli.lifecycle import _client
    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.control.replies import EngineOutcome

    stop = threading.Event()
    if not as_json:
        with reported(as_json):
            stream = _client().subscribe()
        threading.Thread(target=_watch, args=(stream, stop), daemon=True).start()
    try:
        reply = _client(timeout=UPDATE_TIMEOUT_S).call(method, **params)
        return reply, typed_reply(method, reply, EngineOutcome)
    except StokerError as err:
        stop.set()
        if as_json:
            fail(as_json, err)
        _explain(err)
    finally:
        stop.set()


def _explain(err: StokerError) -> NoReturn:
    """A refused or rolled-back update for a person: the code, the gate and its figures."""
    import sys

    click.secho(f"error [{err.reason}]: {err.message}", fg="red", err=True)
    for key, value in err.evidence.items():
        if key not in ("outcome", "log_tail"):
            click.echo(f"  {key}: {value}", err=True)
    outcome = err.evidence.get("outcome")
    if outcome:
        from stoker.daemon.control.client import typed_reply
        from stoker.daemon.control.replies import EngineOutcome

        try:
            serving: EngineSlot | None = typed_reply("engine.update", outcome, EngineOutcome).engine
        except StokerError:
            serving = None  # an outcome this CLI cannot read: the code and the gate above say enough
        if serving is not None:
            click.echo(f"  serving: {_engine_line(serving)}", err=True)
    sys.exit(1)


def _engine_line(engine: EngineSlot) -> str:
    kept = f"previous {engine.previous} kept" if engine.previous else "no previous kept"
    return f"{engine.slot} {engine.version or '-'} ({kept})"


def format_outcome(result: EngineOutcome) -> str:
    """An update's or rollback's outcome for a person."""
    lines = []
    if result.state == "current" and result.reason:  # a newer release is offered, held back
        lines.append(f"not updated ({result.reason}): {result.message}")
    elif result.state == "current":
        lines.append(f"up to date: {result.message or result.installed}")
    elif result.state == "updated":
        lines.append(f"updated {result.slot}: {result.installed} -> {result.candidate}")
    elif result.state == "rolled_back":
        lines.append(f"rolled back {result.slot} by hand")
    else:
        lines.append(f"{result.slot}: {result.state}")
    for verdict in result.verdicts:
        layers = verdict.get("offloaded_layers")
        shown = "" if layers is None else f", {layers}/{verdict.get('total_layers')} layers offloaded"
        lines.append(f"  {verdict.get('name')}: {verdict.get('outcome')}{shown}")
    lines.append(f"engine  {_engine_line(result.engine)}")
    return "\n".join(lines)


def format_engine_status(status: EngineStatus) -> str:
    """A slot's engine, its update machine's state and last steps, for a person."""
    lines = [f"engine  {_engine_line(status)}"]
    if status.update_state:
        reason = f" [{status.update_reason}]" if status.update_reason else ""
        lines.append(f"update  {status.update_state}{reason}")
    lines.extend(f"  {h['from']} -> {h['to']}  ({h['event']})" for h in status.history)
    return "\n".join(lines)


def _emit_outcome(as_json: bool, method: str, **params: Any) -> None:
    reply, outcome = _call_watched(method, as_json, **params)
    emit(as_json, reply, lambda _: format_outcome(outcome))


@click.group()
def engine() -> None:
    """Engine updates: stage, gate, switch, and the way back."""


@engine.command("update")
@_slot_options
@click.option("--channel", default=None, help="The update channel ([engine.channels]; default [engine] channel).")
@click.option(
    "--bundle",
    "bundle",
    default=None,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Update to this bundle zip instead of the channel's.",
)
@json_option
def update(backend: str | None, variant: str | None, channel: str | None, bundle: Path | None, as_json: bool) -> None:
    """Stage a newer engine, verify it (smoke gate; its tokens must equal the serving engine's, both
    run here), switch, restart what ran on it, and roll back by itself when a server does not get
    ready on it or offloads no layers where it did."""
    params = _params(
        backend=backend, variant=variant, channel=channel, bundle=None if bundle is None else str(bundle.absolute())
    )
    _emit_outcome(as_json, "engine.update", **params)


@engine.command("rollback")
@_slot_options
@json_option
def rollback(backend: str | None, variant: str | None, as_json: bool) -> None:
    """Put the previous engine back (the replaced one is kept as the previous: a second rollback undoes it)."""
    _emit_outcome(as_json, "engine.rollback", **_params(backend=backend, variant=variant))


@engine.command("status")
@_slot_options
@json_option
def status(backend: str | None, variant: str | None, as_json: bool) -> None:
    """The engine a slot holds, the previous one kept, and its last update's steps."""
    from stoker.daemon.cli.lifecycle import ask
    from stoker.daemon.control.replies import EngineStatus

    reply, slot = ask("engine.status", as_json, EngineStatus, **_params(backend=backend, variant=variant))
    emit(as_json, reply, lambda _: format_engine_status(slot))


def register(group: click.Group) -> None:
    group.add_command(engine)
