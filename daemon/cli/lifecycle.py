"""Service commands: daemon, status, up, down, restart, shutdown, history (`stoker chat` is chat.py)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import click

from stoker.daemon.cli.output import emit, json_option, reported
from stoker.daemon.control.status_text import format_status
from stoker.daemon.core.paths import StokerPaths

if TYPE_CHECKING:
    from stoker.daemon.control.client import ControlClient
    from stoker.daemon.control.status_records import Status
    from stoker.store.records import TransitionRecord

R = TypeVar("R")

READY_STATES = {"ready"}
SETTLED_FAILURES = {"failed", "stopped"}


def _client(timeout: float = 10.0) -> ControlClient:
    from stoker.daemon.control.client import ControlClient

    return ControlClient(StokerPaths.from_env().socket_path, timeout=timeout)


def call(method: str, as_json: bool, timeout: float = 10.0, returns: type | None = None, **params: Any) -> Any:
    """One request to the daemon (its reply as the record `returns` when given); a reason-coded
    failure, a daemon of another version that lacks what is needed included, exits the CLI with its code."""
    with reported(as_json):
        return _client(timeout).call(method, returns=returns, **params)


def ask(method: str, as_json: bool, returns: type[R], timeout: float = 10.0, **params: Any) -> tuple[Any, R]:
    """The daemon's reply as it was sent (what `--json` prints, so a script sees every field a
    newer daemon adds) and as the record `returns` (what the text reads). A daemon that lacks a
    field the record needs exits the CLI with daemon_version_skew, naming the field, either way."""
    from stoker.daemon.control.client import typed_reply

    reply = call(method, as_json, timeout, **params)
    with reported(as_json):
        return reply, typed_reply(method, reply, returns)


@click.command()
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning"]))
@click.option(
    "--no-default",
    is_flag=True,
    help="Load the default model at its first request, not at start (`stoker run NAME` starts it so).",
)
def daemon(log_level: str, no_default: bool) -> None:
    """Run the service in the foreground (systemd and launchd run it like this)."""
    from stoker.daemon.core.loading import keep_loaded, loading

    with loading():  # what the daemon imports, kept to its end (daemon/core/loading.py)
        from stoker.daemon.cli.foreground import run_foreground
    keep_loaded()
    code = run_foreground(StokerPaths.from_env(), log_level=log_level, load_default=not no_default)
    keep_loaded()  # and what the run left (all of it closed by now): the exit collects nothing
    sys.exit(code)


MODEL = click.argument("model", required=False)


def _named(model: str | None) -> dict[str, Any]:
    """The `model` parameter, only when one is named (a daemon from before several models knows none)."""
    return {} if model is None else {"model": model}


@click.command()
@MODEL
@json_option
def status(model: str | None, as_json: bool) -> None:
    """State, backend, reason and message, model, endpoint, layers; then every configured model.

    The details are the default model's, or MODEL's (its [models.NAME]); `--json` has them at the
    top level and every model in `models`.
    """
    from stoker.daemon.control.status_records import Status

    reply, st = ask("status", as_json, Status, **_named(model))
    emit(as_json, reply, format_status)
    if st.state == "failed":
        sys.exit(1)


def wait_for_settled(as_json: bool, timeout: float, model: str | None = None) -> tuple[Any, Status]:
    """Until the model's server is ready or has settled in failure (or time is up): the last
    status reply as sent, and as its record. It subscribes to the daemon's events first, then
    asks status, and asks again only when a launch machine moves (`machine.launch.*`), so ready
    is seen as the daemon publishes it, with no polling in between (only a stream the daemon
    dropped, its reader having fallen behind, leaves the rest of the time to polling)."""
    import threading

    from stoker.daemon.control.status_records import Status

    deadline = time.monotonic() + timeout
    with reported(as_json):
        events = _client(timeout=10.0).subscribe()
    # The stream blocks until the next event: time up closes it, and the last status stands.
    timer = threading.Timer(max(0.0, timeout), events.close)
    timer.daemon = True
    timer.start()
    try:
        reply, st = ask("status", as_json, Status, **_named(model))
        if st.state in READY_STATES | SETTLED_FAILURES:
            return reply, st
        for event in events:
            topic = str(event.get("topic", ""))
            if topic.startswith("machine.launch.") or topic == "dropped":
                reply, st = ask("status", as_json, Status, **_named(model))
                if st.state in READY_STATES | SETTLED_FAILURES:
                    return reply, st
    finally:
        timer.cancel()
        events.close()
    # The stream ended before time was up (it fell behind and was dropped): poll what is left.
    while True:
        reply, st = ask("status", as_json, Status, **_named(model))
        if st.state in READY_STATES | SETTLED_FAILURES or time.monotonic() > deadline:
            return reply, st
        time.sleep(0.2)


def _finish(as_json: bool, reply: Any, st: Status, want: str) -> None:
    emit(as_json, reply, format_status)
    if st.state != want:
        sys.exit(1)


# `up` and `restart` may first stop the least recently used model to make room: drained (its
# answers finish, up to 30 s), its snapshots saved, then TERM.
START_CALL_TIMEOUT = 120.0


@click.command()
@MODEL
@click.option("--wait/--no-wait", default=True, help="Wait until the server is ready (default).")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for ready.")
@json_option
def up(model: str | None, wait: bool, timeout: float, as_json: bool) -> None:
    """Start the default model's server, or MODEL's (making room first when max_loaded are loaded)."""
    _start("up", as_json, wait, timeout, model)


def _start(method: str, as_json: bool, wait: bool, timeout: float, model: str | None = None) -> None:
    """up or restart, then wait until ready (exit 1 if it settles otherwise), or print at once."""
    reply = call(method, as_json, START_CALL_TIMEOUT, **_named(model))
    if wait:
        reply, st = wait_for_settled(as_json, timeout, model)
        _finish(as_json, reply, st, "ready")
    else:
        emit(as_json, reply, format_status)


@click.command()
@MODEL
@json_option
def down(model: str | None, as_json: bool) -> None:
    """Stop the default model's server, or MODEL's (the daemon and the other models keep running).

    It stays down until `stoker up [MODEL]`: requests for it are answered 503 meanwhile.
    """
    from stoker.daemon.control.status_records import Status

    reply, st = ask("down", as_json, Status, 120.0, **_named(model))
    _finish(as_json, reply, st, "stopped")


@click.command()
@MODEL
@click.option("--wait/--no-wait", default=True)
@click.option("--timeout", default=900.0, show_default=True)
@json_option
def restart(model: str | None, wait: bool, timeout: float, as_json: bool) -> None:
    """Restart the default model's server, or MODEL's."""
    _start("restart", as_json, wait, timeout, model)


@click.command()
@json_option
def shutdown(as_json: bool) -> None:
    """Stop every server and the daemon."""
    result = call("shutdown", as_json, timeout=120.0)
    emit(as_json, result, lambda r: "daemon stopping")


def format_history(rows: Sequence[TransitionRecord]) -> str:
    """One line per transition: when, which machine, from --event--> to, and the reason."""
    if not rows:
        return "no transitions recorded"
    out = []
    for row in rows:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.at))
        line = f"{at}  {row.machine_id:<14} {row.from_state:>12} --{row.event}--> {row.to_state}"
        if row.reason:
            line += f"  [{row.reason}]"
        out.append(line)
    return "\n".join(out)


@click.command()
@click.option("--machine", "machine", default=None, help="Only this machine (e.g. launch, install:cuda).")
@click.option(
    "--model", "model", default=None, help="Only this model's launch and fallback machines (its [models.NAME])."
)
@click.option("--limit", default=50, show_default=True)
@click.option("--since", default=None, type=float, help="Only transitions after this unix time.")
@json_option
def history(machine: str | None, model: str | None, limit: int, since: float | None, as_json: bool) -> None:
    """Transitions of every machine, newest first."""
    from stoker.store.records import TransitionRecord

    params: dict[str, Any] = {"machine": machine, "limit": limit, "since": since, **_named(model)}
    reply, rows = ask("history", as_json, tuple[TransitionRecord, ...], **params)
    emit(as_json, reply, lambda _: format_history(rows))


def register(cli: click.Group) -> None:
    for command in (daemon, status, up, down, restart, shutdown, history):
        cli.add_command(command)
