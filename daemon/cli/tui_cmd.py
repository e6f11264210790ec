"""`stoker tui`: the Textual app, a thin client of the daemon's control socket."""

from __future__ import annotations

import click

from stoker.daemon.core.paths import StokerPaths


@click.command()
@click.option(
    "--socket",
    "socket_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="The daemon's control socket (default: the usual one, or under STOKER_HOME).",
)
def tui(socket_path: str | None) -> None:
    """Watch and drive the daemon: backend, telemetry, history, snapshots."""
    from stoker.tui.app import StokerApp
    from stoker.tui.link import SocketLink

    path = socket_path or StokerPaths.from_env().socket_path
    StokerApp(SocketLink(path)).run()


def register(cli: click.Group) -> None:
    cli.add_command(tui)
