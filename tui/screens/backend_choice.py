"""Choose the backend preference: auto, or force one (a forced backend never falls back).

The backends offered are the daemon's loaded plugins (the status document's `backends`), a
third party's included: the TUI knows no backend by name.
"""

from __future__ import annotations

from typing import Sequence

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

AUTO = ("auto", "auto: the best backend that works (falls back)")


def choices(backends: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """(name, label) for auto and each backend the daemon loaded."""
    return (AUTO, *((name, f"{name} (forced: fails, never falls back)") for name in backends if name != "auto"))


class BackendChoiceScreen(ModalScreen[str | None]):
    """Dismisses with the chosen backend name, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: str | None = None, backends: Sequence[str] = ()) -> None:
        super().__init__()
        self.current = current
        self.choices = choices(backends)

    def compose(self) -> ComposeResult:
        with Vertical(id="backend-dialog", classes="dialog"):
            yield Label("Backend preference", classes="dialog-title")
            yield OptionList(*(Option(text, id=name) for name, text in self.choices), id="backend-options")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        names = [name for name, _ in self.choices]
        options.highlighted = names.index(self.current) if self.current in names else 0
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
