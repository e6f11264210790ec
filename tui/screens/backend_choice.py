"""Choose the backend preference: auto, or force one (a forced backend never falls back)."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

CHOICES = (
    ("auto", "auto: the best backend that works (falls back)"),
    ("cpu", "cpu"),
    ("cuda", "cuda: NVIDIA (forced: fails, never falls back)"),
    ("rocm", "rocm: AMD (forced)"),
    ("vulkan", "vulkan (forced)"),
    ("metal", "metal: Apple (forced)"),
)


class BackendChoiceScreen(ModalScreen[str | None]):
    """Dismisses with the chosen backend name, or None."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, current: str | None = None) -> None:
        super().__init__()
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="backend-dialog", classes="dialog"):
            yield Label("Backend preference", classes="dialog-title")
            yield OptionList(*(Option(text, id=name) for name, text in CHOICES), id="backend-options")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        names = [name for name, _ in CHOICES]
        options.highlighted = names.index(self.current) if self.current in names else 0
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)
