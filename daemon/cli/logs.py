"""`stoker logs [-f] [-n N] [--daemon | --access | --server [NAME] | --all] [--json]`: read the logs.

Like `journalctl`: the daemon's own log by default, `--access` for only its front door access
lines (one per request: daemon/frontdoor/access.py), `--server` for the engine's (llama-server's
stdout and stderr, `llama-server-NAME.log` for an instance other than the default), `--all` for
both. The files are read where the daemon writes them (`logs/` in the data directory), so it
works whether the daemon runs or not. `-f` follows them like `tail -F`: across the daemon log's
rotation, the server log's trim, and a file removed and created again (daemon/core/logtail.py),
until Ctrl-C.

With several logs every line is prefixed with the log's name (`daemon | `, `server | `), as
`docker compose logs` does: the server's lines carry no time stamp, so they cannot be sorted
into the daemon's by time. `--json` prints one document; with `-f`, one JSON object a line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import click

from stoker.daemon.cli.output import json_option, reported
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.logtail import FollowedLine, LogFollower, last_lines
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.config.instances import DEFAULT_INSTANCE
from stoker.daemon.frontdoor.access import ACCESS_LOGGER
from stoker.daemon.launch.instance import ServerInstance
from stoker.states.reasons import ReasonCode

DAEMON_LOG = "daemon.log"
POLL_S = 0.2  # how often -f looks for new lines
# What marks an access line in the daemon's log: its logger's name, as the log's format writes it.
ACCESS_MARK = f" {ACCESS_LOGGER}: "


@attrs.frozen
class Source:
    """One log to read: its name as printed (`daemon`, `access`, `server`, `server:NAME`), its
    file, and the mark its lines carry when only some of the file's lines are this log's."""

    name: str
    path: Path
    mark: str | None = None

    def keeps(self, text: str) -> bool:
        return self.mark is None or self.mark in text


def daemon_source(paths: StokerPaths) -> Source:
    return Source("daemon", paths.logs_dir / DAEMON_LOG)


def access_source(paths: StokerPaths) -> Source:
    """The front door's access lines, which the daemon writes into its own log."""
    return Source("access", paths.logs_dir / DAEMON_LOG, ACCESS_MARK)


def server_source(paths: StokerPaths, instance: str) -> Source:
    try:
        server = ServerInstance(instance)
    except ValueError as exc:
        raise StokerError(ReasonCode.BAD_REQUEST, f"--server: {exc}.") from None
    return Source("server" if server.is_default else f"server:{server.name}", server.log_path(paths))


def every_server(paths: StokerPaths) -> list[Source]:
    """The default server's log and every other instance's found beside it."""
    found = [server_source(paths, DEFAULT_INSTANCE)]
    for path in sorted(paths.logs_dir.glob("llama-server-*.log")):
        name = path.name[len("llama-server-") : -len(".log")]
        try:
            found.append(server_source(paths, name))
        except StokerError:
            continue  # not a name an instance can have: not ours
    return found


def choose(
    paths: StokerPaths, daemon: bool, server: str | None, everything: bool, access: bool = False
) -> list[Source]:
    """The logs asked for: the daemon's unless only --server or --access is given; --all, every
    log; --access, the daemon's access lines (in place of the whole daemon log)."""
    first = access_source(paths) if access else daemon_source(paths)
    if everything:
        servers = [server_source(paths, server)] if server else every_server(paths)
        return [first, *servers]
    sources = [first] if daemon or access or server is None else []
    if server is not None:
        sources.append(server_source(paths, server))
    return sources


def _line(source: Source, text: str, prefixed: bool) -> str:
    return f"{source.name} | {text}" if prefixed else text


def last_of(source: Source, n: int) -> list[str]:
    """The source's last `n` lines: for a marked source, reading further back (into the rotated
    generations too) until `n` of its lines are found or the log has no more."""
    if source.mark is None:
        return last_lines(source.path, n)
    window = max(n, 1) * 8
    while True:
        lines = last_lines(source.path, window)
        kept = [text for text in lines if source.keeps(text)]
        if len(kept) >= n or len(lines) < window:
            return kept[-n:] if n else []
        window *= 4


def show_last(sources: list[Source], n: int, as_json: bool) -> None:
    """The last `n` lines of each log, or one JSON document with them."""
    prefixed = len(sources) > 1
    if as_json:
        logs = [
            {"log": s.name, "path": str(s.path), "exists": s.path.exists(), "lines": last_of(s, n)} for s in sources
        ]
        click.echo(json.dumps({"logs": logs}, indent=2))
        return
    for source in sources:
        if not source.path.exists():
            click.secho(f"no {source.name} log yet: {source.path} does not exist", fg="yellow", err=True)
            continue
        for text in last_of(source, n):
            click.echo(_line(source, text, prefixed))


def _emit_json_line(source: Source, item: FollowedLine) -> None:
    record: dict[str, Any] = {"log": source.name, ("notice" if item.notice else "line"): item.text}
    click.echo(json.dumps(record))


def follow(sources: list[Source], n: int, as_json: bool) -> None:
    """The last `n` lines of each log, then every line written to them, until Ctrl-C."""
    prefixed = len(sources) > 1
    # Opened at their ends before the last lines are read: a line written in between is printed
    # once, by the follower (and, rarely, by last_lines too) rather than missed.
    followers = [(source, LogFollower.from_end(source.path)) for source in sources]
    for source in sources:
        for text in last_of(source, n):
            if as_json:
                _emit_json_line(source, FollowedLine(text))
            else:
                click.echo(_line(source, text, prefixed))
    while True:
        for source, follower in followers:
            for item in follower.poll():
                if not item.notice and not source.keeps(item.text):
                    continue
                if as_json:
                    _emit_json_line(source, item)
                elif item.notice:
                    click.secho(f"==> {item.text}", fg="cyan", err=True)
                else:
                    click.echo(_line(source, item.text, prefixed))
        time.sleep(POLL_S)


@click.command("logs")
@click.option("-n", "--lines", "n", default=20, show_default=True, type=click.IntRange(min=0), help="Lines to show.")
@click.option(
    "-f", "--follow", "following", is_flag=True, help="Keep printing lines as they are written (Ctrl-C stops)."
)
@click.option("--daemon", "daemon_log", is_flag=True, help="The daemon's own log (the default).")
@click.option(
    "--access", "access", is_flag=True, help="Only the front door's access lines (one per request) of the daemon's log."
)
@click.option(
    "--server",
    "server",
    is_flag=False,
    flag_value=DEFAULT_INSTANCE,
    default=None,
    metavar="[NAME]",
    help="The engine's log (llama-server's output); NAME: another instance's.",
)
@click.option("--all", "everything", is_flag=True, help="The daemon's log and every server's, each line prefixed.")
@json_option
def logs(
    n: int, following: bool, daemon_log: bool, access: bool, server: str | None, everything: bool, as_json: bool
) -> None:
    """Print the last lines of the daemon's log (or the engine's), and follow them with -f."""
    paths = StokerPaths.from_env()
    with reported(as_json):
        sources = choose(paths, daemon_log, server, everything, access)
    try:
        if following:
            follow(sources, n, as_json)
        else:
            show_last(sources, n, as_json)
    except KeyboardInterrupt:
        return  # Ctrl-C is how -f ends: exit 0, no traceback
    except BrokenPipeError:
        # The reader left (`stoker logs -f | head`): stop without a traceback, and keep Python's
        # own flush at exit from raising again on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def register(cli: click.Group) -> None:
    cli.add_command(logs)
