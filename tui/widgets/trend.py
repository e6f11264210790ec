"""A one-line history of a figure: `▁▁▃▇██▆▂▁`, newest last, on a fixed scale.

Textual's Sparkline stretches its data between the series' own minimum and maximum, which
turns a 20 MiB wobble in 140 GiB of VRAM into a full-height bar; a trend here is drawn from
zero to `ceiling` (a percentage's 100, the card's memory) so that its height means something.
"""

from __future__ import annotations

from typing import Sequence

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

BLOCKS = " ▁▂▃▄▅▆▇█"


def trend_line(values: Sequence[float | None], width: int, ceiling: float | None) -> str:
    """The last `width` values as block characters (a gap is a space)."""
    shown = list(values)[-width:] if width > 0 else []
    top = ceiling if ceiling else max([v for v in shown if v is not None] or [0.0]) or 1.0
    cells = []
    for value in shown:
        if value is None:
            cells.append(" ")
            continue
        level = max(0.0, min(1.0, float(value) / top))
        cells.append(BLOCKS[max(1, round(level * (len(BLOCKS) - 1)))])
    return "".join(cells).ljust(width)


class Trend(Widget):
    """Follows `values` (oldest first) on the scale 0..`ceiling` (None: the series' peak)."""

    DEFAULT_CSS = "Trend { height: 1; width: 1fr; color: $accent; }"

    values: reactive[list[float | None]] = reactive(list, always_update=True)
    ceiling: reactive[float | None] = reactive(None)

    def __init__(self, ceiling: float | None = None, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.ceiling = ceiling

    def render(self) -> Text:
        return Text(trend_line(self.values, self.size.width, self.ceiling))
