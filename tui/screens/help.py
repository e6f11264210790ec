"""What the keys do."""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

KEYS = (
    ("p", "probe every backend again (fresh)"),
    ("u", "start the server"),
    ("d", "stop the server (asks first)"),
    ("r", "restart the server (asks first)"),
    ("u d r", "on the models tab: the highlighted model's"),
    ("b", "choose the backend: auto, cpu, cuda, ..."),
    ("s", "save a KV snapshot of the server's slots"),
    ("1 2 3 4", "overview, history, snapshots, models"),
    ("enter", "on a model: all of its history"),
    ("?", "this help"),
    ("q", "quit (the daemon keeps running)"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, what in KEYS:
            table.add_row(key, what)
        with Vertical(id="help-dialog", classes="dialog"):
            yield Label("Stoker keys", classes="dialog-title")
            yield Static(table)
            yield Label("Everything here is also in the CLI: stoker --help", classes="dim")

    def action_close(self) -> None:
        self.dismiss(None)
