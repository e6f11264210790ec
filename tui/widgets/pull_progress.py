"""Pulls under way: the last `pull.progress` event of each, as a bar with bytes, speed and ETA.

Fed by the status' `pulls` (what is under way when the view opens, with its last figures) and
by the event stream (`pull.progress`, and the pull machine's transitions: a pull that reached
`cataloged` or `failed` leaves the panel). Hidden while nothing is pulled.
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import ProgressBar, Static

from stoker.tui import quantities as q

# The pull machine's states in which it works (states/pull/table.py WORKING); any other ends it here.
WORKING = frozenset({"requested", "resolving", "downloading", "inspecting"})


def pull_line(pull: dict[str, Any]) -> Text:
    """`qwen  downloading  3.0 MiB / 12.0 MiB  1.0 MiB/s  ETA 9s`."""
    text = Text(f"{pull.get('name')}  ", style="bold")
    text.append(f"{pull.get('phase') or pull.get('state') or ''}  ", style="cyan")
    if pull.get("bytes_done") is not None:
        text.append(f"{q.size(pull.get('bytes_done'))} / {q.size(pull.get('total'))}")
        text.append(f"  {q.rate(pull.get('rate'))}  ETA {q.duration(pull.get('eta'))}", style="dim")
    return text


def entry_id(name: str) -> str:
    return "pull-" + "".join(ch if ch.isalnum() else "-" for ch in name)


class PullEntry(Vertical):
    """One pull: its line and its bar."""

    def __init__(self, pull: dict[str, Any], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.pull = pull

    def compose(self) -> ComposeResult:
        yield Static(classes="pull-line")
        yield ProgressBar(total=100, show_eta=False, show_percentage=True)

    def on_mount(self) -> None:
        self.show(self.pull)

    def show(self, pull: dict[str, Any]) -> None:
        self.pull = pull
        lines, bars = self.query(".pull-line"), self.query(ProgressBar)
        if not lines or not bars:
            return  # not composed yet (drawn at mount), or already removed
        lines.first(Static).update(pull_line(pull))
        bar = bars.first(ProgressBar)
        if pull.get("total"):
            bar.update(total=pull["total"], progress=pull.get("bytes_done") or 0)
        else:
            bar.update(total=None)


class PullProgress(Vertical):
    """One entry per pull under way; hidden while there is none."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.pulls: dict[str, dict[str, Any]] = {}

    def on_mount(self) -> None:
        self.border_title = "Pulls"
        self.display = False

    def show_status(self, pulls: list[dict[str, Any]]) -> None:
        """The status' pulls under way: the truth at that moment (a pull gone from it is over)."""
        under_way = {str(p.get("name")): p for p in pulls}
        for name in set(self.pulls) - set(under_way):
            self._drop(name)
        for name, pull in under_way.items():
            known = self.pulls.get(name, {})
            # An event newer than the status keeps its figures; the status fills what it lacks.
            self._show(name, {**pull, **{k: v for k, v in known.items() if v is not None}})

    def progress(self, event: dict[str, Any]) -> None:
        """A `pull.progress` event."""
        name = str(event.get("name"))
        self._show(name, {**self.pulls.get(name, {}), **event})

    def transition(self, name: str, state: str | None) -> None:
        """The pull machine of `name` moved to `state`: out of the panel once it stops working."""
        if state not in WORKING:
            self._drop(name)
        elif name in self.pulls:
            self._show(name, {**self.pulls[name], "state": state})
        else:
            self._show(name, {"name": name, "state": state})

    def _show(self, name: str, pull: dict[str, Any]) -> None:
        self.pulls[name] = pull
        found = self.query(f"#{entry_id(name)}")
        if found:
            found.first(PullEntry).show(pull)
        else:
            self.mount(PullEntry(pull, id=entry_id(name)))
        self.display = True

    def _drop(self, name: str) -> None:
        self.pulls.pop(name, None)
        for entry in self.query(f"#{entry_id(name)}"):
            entry.remove()
        self.display = bool(self.pulls)
