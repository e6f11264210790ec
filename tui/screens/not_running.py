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
                yield Static(id="not-running-body")
        yield Footer()

    def on_mount(self) -> None:
        self._show()

    def watch_attempt(self) -> None:
        self._show()

    def watch_detail(self) -> None:
        self._show()

    def _show(self) -> None:
        if not self.is_mounted:
            return
        text = Text()
        text.append("Nothing answers on\n")
        text.append(f"  {self.where}\n\n", style="bold")
        text.append("Start it with ")
        text.append("stoker daemon", style="bold cyan")
        text.append(" (or through systemd / launchd).\n\n")
        text.append(f"Reconnecting by itself (attempt {self.attempt})...", style="dim")
        self.query_one("#not-running-body", Static).update(text)
