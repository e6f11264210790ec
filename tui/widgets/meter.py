"""A one-line labelled bar: `GPU  ██████░░░░░░  87%`."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

LABEL_WIDTH = 7


class Meter(Widget):
    """A percentage bar with a label and a caption; None draws an empty, dimmed bar."""

    DEFAULT_CSS = "Meter { height: 1; }"

    label: reactive[str] = reactive("")
    percent: reactive[float | None] = reactive(None)
    caption: reactive[str] = reactive("")

    def __init__(self, label: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.label = label

    def render(self) -> Text:
        width = self.size.width
        caption = f" {self.caption}" if self.caption else ""
        bar_width = max(4, width - LABEL_WIDTH - len(caption))
        text = Text(self.label[: LABEL_WIDTH - 1].ljust(LABEL_WIDTH), style="dim")
        if self.percent is None:
            text.append("░" * bar_width, style="dim")
        else:
            pct = max(0.0, min(100.0, float(self.percent)))
            filled = round(pct / 100 * bar_width)
            style = "green" if pct < 70 else "yellow" if pct < 90 else "red"
            text.append("█" * filled, style=style)
            text.append("░" * (bar_width - filled), style="dim")
        text.append(caption)
        return text
