"""Install progress from `install.progress` events: bytes, speed, ETA per bundle."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static


def _first(event: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if event.get(key) is not None:
            return event[key]
    return None


def progress_figures(event: dict[str, Any]) -> dict[str, Any]:
    """The figures of an `install.progress` event, whatever the names its producer chose."""
    done = _first(event, "bytes_done", "received", "bytes", "downloaded")
    total = _first(event, "total", "bytes_total", "size")
    speed = _first(event, "rate", "speed", "bytes_per_s")
    eta = _first(event, "eta", "eta_s")
    if eta is None and speed and total is not None and done is not None:
        eta = max(0.0, (total - done) / speed)
    what = "/".join(str(x) for x in (event.get("backend"), event.get("variant")) if x) or "bundle"
    return {
        "what": what,
        "done": done,
        "total": total,
        "speed": speed,
        "eta": eta,
        "phase": _first(event, "phase", "state", "step"),
        "percent": event.get("percent"),  # a local build's (no bytes to count)
        "line": event.get("line"),
    }


def progress_line(fig: dict[str, Any]) -> Text:
    from stoker.tui import quantities as q

    text = Text(f"{fig['what']}  ", style="bold")
    if fig.get("phase"):
        text.append(f"{fig['phase']}  ", style="cyan")
    if fig.get("done") is None and (fig.get("percent") is not None or fig.get("line")):
        percent = "" if fig.get("percent") is None else f"{fig['percent']}%  "
        text.append(percent)
        text.append(str(fig.get("line") or "")[:80], style="dim")
        return text
    text.append(f"{q.size(fig['done'])} / {q.size(fig['total'])}")
    text.append(f"  {q.rate(fig['speed'])}  ETA {q.duration(fig['eta'])}", style="dim")
    return text


class InstallEntry(Vertical):
    """One bundle being installed."""

    def compose(self) -> ComposeResult:
        yield Static(classes="install-line")
        yield ProgressBar(total=100, show_eta=False, show_percentage=True)

    def show(self, fig: dict[str, Any]) -> None:
        self.query_one(".install-line", Static).update(progress_line(fig))
        bar = self.query_one(ProgressBar)
        if fig.get("percent") is not None and fig["done"] is None:
            bar.update(total=100, progress=fig["percent"])
        elif fig["total"]:
            bar.update(total=fig["total"], progress=fig["done"] or 0)
        else:
            bar.update(total=None)


class InstallProgress(Vertical):
    """Hidden until an install reports progress; one entry per backend/variant."""

    def on_mount(self) -> None:
        self.border_title = "Install"
        self.display = False

    def update_from(self, event: dict[str, Any]) -> None:
        fig = progress_figures(event)
        entry_id = "install-" + "".join(ch if ch.isalnum() else "-" for ch in fig["what"])
        found = self.query(f"#{entry_id}")
        if found:
            entry = found.first(InstallEntry)
            entry.show(fig)
        else:
            entry = InstallEntry(id=entry_id)
            self.mount(entry)
            self.call_after_refresh(entry.show, fig)
        self.display = True
