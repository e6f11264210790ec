"""Remote models in the Models view: `[models.NAME]` sections served by an external endpoint.

A `status` reply lists them under `remotes` (no server of Stoker's, so none of a model's
layers, memory or idle figures). `remote_row` makes one a row of the models table (state: the
endpoint's reachability; backend: remote); `describe_remote` draws the highlighted one: its
endpoint, the name it is sent as, the last check (latency, HTTP status, error), the last
request, its key's variable (set or not: never the key), and acceleration as unknown.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from stoker.tui import quantities as q

REACHABILITY = {True: "reachable", False: "unreachable", None: "unchecked"}
STYLE = {"reachable": "green", "unreachable": "bold red", "unchecked": "dim"}


def remote_row(remote: dict[str, Any]) -> dict[str, Any]:
    """A remote model shaped as a models-table row (the fields the table's cells read)."""
    return {
        "name": remote.get("name"),
        "state": REACHABILITY[remote.get("reachable")],
        "backend": "remote",
        "default": remote.get("default"),
        "reason": remote.get("reason"),
        "in_flight": remote.get("in_flight"),
        "remote": remote,
    }


def reading_line(reading: dict[str, Any] | None) -> Text:
    """One reading of the endpoint: when, what it answered, how fast, and its error."""
    if not reading:
        return Text("none yet", style="dim")
    state = REACHABILITY[reading.get("reachable")]
    text = Text(state, style=STYLE.get(state, ""))
    if reading.get("http_status") is not None:
        text.append(f"  HTTP {reading['http_status']}")
    if reading.get("latency_ms") is not None:
        text.append(f"  {reading['latency_ms']:.0f} ms")
    text.append(f"  at {q.clock(reading.get('at'))}", style="dim")
    if reading.get("reason"):
        text.append(f"  {reading['reason']}", style="yellow")
    if reading.get("error"):
        text.append(f": {reading['error']}", style="dim")
    return text


def describe_remote(remote: dict[str, Any]) -> Table:
    """The highlighted remote model in full."""
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(ratio=1, overflow="fold")
    state = REACHABILITY[remote.get("reachable")]
    head = Text(str(remote.get("name")), style="bold")
    head.append(f"  {state}", style=STYLE.get(state, ""))
    head.append("  remote", style="cyan")
    if remote.get("default"):
        head.append("  default", style="cyan")
    grid.add_row("model", head)
    if remote.get("reason"):
        grid.add_row("reason", Text(f"{remote['reason']}: {remote.get('message') or ''}", style="yellow"))
    grid.add_row("endpoint", f"{remote.get('endpoint')}  (sent as {remote.get('remote_model')})")
    env = remote.get("api_key_env")
    if env:
        key = Text(f"${env} ")
        key.append("set" if remote.get("key_set") else "NOT SET", style="" if remote.get("key_set") else "bold red")
        grid.add_row("key", key)
    else:
        grid.add_row("key", Text("none sent", style="dim"))
    grid.add_row("check", reading_line(remote.get("check")))
    grid.add_row("last request", reading_line(remote.get("last_request")))
    grid.add_row("backend", Text("remote: Stoker runs nothing there, so acceleration is unknown", style="dim"))
    grid.add_row("requests", f"{remote.get('in_flight') or 0} in flight")
    return grid
