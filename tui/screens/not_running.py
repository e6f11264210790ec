"""Shown while no daemon answers; the event worker keeps trying and pops it on success."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Vertical
from textual.reactive import reactive
from textual.screen import Screen
from textual.widgets import Footer, Label, Static


class NotRunningScreen(Screen[None]):
    """The daemon is not running: say so, say how to start it, reconnect by itself."""

    BINDINGS = [Binding("q", "app.quit", "Quit")]

    attempt: reactive[int] = reactive(0)
    detail: reactive[str] = reactive("")

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def compose(self) -> ComposeResult:
        with Center():
            with Vertical(id="not-running", classes="dialog"):
                yield Label("The Stoker daemon is not running", classes="dialog-title")
                yield Static(self._body(), id="not-running-body")
        yield Footer()

    def watch_attempt(self) -> None:
        self._show()

    def watch_detail(self) -> None:
        self._show()

    def _body(self) -> Text:
        text = Text()
        text.append("Nothing answers on\n")
        text.append(f"  {self.where}\n\n", style="bold")
        text.append("Start it with ")
        text.append("stoker daemon", style="bold cyan")
        text.append(" (or through systemd or launchd).\n\n")
        text.append(f"Reconnecting by itself (attempt {self.attempt})...", style="dim")
        return text

    def _show(self) -> None:
        for body in self.query("#not-running-body").results(Static):
            body.update(self._body())
