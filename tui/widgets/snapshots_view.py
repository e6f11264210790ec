"""The KV snapshot catalogue, with save / restore / delete (the app asks the daemon)."""

from __future__ import annotations

import os
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, DataTable, Static

from stoker.tui import quantities as q


def snapshot_id(item: dict[str, Any]) -> Any:
    return item.get("id", item.get("filename"))


def fits_text(item: dict[str, Any]) -> Text:
    """Whether the snapshot fits the running server (the daemon decides; '-' when unknown)."""
    fits = item.get("fits_server")
    if fits is None:
        return Text("-", style="dim")
    return Text("yes", style="green") if fits else Text("no", style="yellow")


class SnapshotsView(Vertical):
    """Gets `load(items)` or `unavailable(why)`; posts `SnapshotsView.Requested` up."""

    class Requested(Message):
        """The user asked for `action` (save | restore | rm) on a snapshot (None for save)."""

        def __init__(self, action: str, item: dict[str, Any] | None) -> None:
            super().__init__()
            self.action = action
            self.item = item

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.items: list[dict[str, Any]] = []
        self._summary = ""

    def compose(self) -> ComposeResult:
        yield Static(Text("loading the catalogue...", style="dim"), id="snapshots-note")
        yield DataTable(id="snapshots-table", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="snapshot-buttons"):
            yield Button("Save", id="snapshot-save", variant="primary")
            yield Button("Restore", id="snapshot-restore")
            yield Button("Delete", id="snapshot-rm", variant="error")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for label, width in (
            ("id", 3),
            ("taken", 11),
            ("slot", 4),
            ("tokens", 6),
            ("size", 9),
            ("cause", 7),
            ("fits", 4),
            ("model", 16),
        ):
            table.add_column(label, key=label, width=width)

    def load(self, items: list[dict[str, Any]], listing: dict[str, Any] | None = None) -> None:
        """Show the catalogue; `listing` is the rest of the `snapshot.list` reply, if any."""
        self.items = list(items)
        self.set_class(False, "-unavailable")
        listing = listing or {}
        note = self.query_one("#snapshots-note", Static)
        if listing.get("enabled") is False:
            note.update(Text("Snapshots are off: set [snapshots] enabled = true in the config.", style="yellow"))
        elif items:
            total = listing.get("total_bytes", sum(i.get("file_size") or 0 for i in items))
            self._summary = f"{len(items)} snapshot(s), {q.size(total)}"
            note.update(Text(self._summary, style="dim"))
        else:
            note.update(Text("no snapshots yet: s saves one", style="dim"))
        table = self.query_one(DataTable)
        table.clear()
        for item in self.items:
            model = item.get("model_path")
            table.add_row(
                str(snapshot_id(item)),
                q.short_stamp(item.get("created_at")),
                q.number(item.get("slot_id")),
                q.number(item.get("n_tokens")),
                q.size(item.get("file_size")),
                str(item.get("cause") or "-"),
                fits_text(item),
                os.path.basename(model) if model else "-",
                key=str(snapshot_id(item)),
            )
        self._enable(True)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        item = self.selected()
        if item is not None and item.get("fits_server") is False:
            self.query_one("#snapshots-note", Static).update(
                Text(
                    f"snapshot {snapshot_id(item)} does not fit the running server: {item.get('why_not')}",
                    style="yellow",
                )
            )
        elif item is not None:
            self.query_one("#snapshots-note", Static).update(Text(self._summary, style="dim"))

    def unavailable(self, why: str) -> None:
        self.items = []
        self.set_class(True, "-unavailable")
        self.query_one("#snapshots-note", Static).update(Text(f"Snapshots: not available. {why}", style="yellow"))
        self.query_one(DataTable).clear()
        self._enable(False)

    def _enable(self, on: bool) -> None:
        for button in self.query(Button):
            button.disabled = not on

    def selected(self) -> dict[str, Any] | None:
        table = self.query_one(DataTable)
        if not 0 <= table.cursor_row < len(self.items):
            return None
        return self.items[table.cursor_row]

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        action = (event.button.id or "").removeprefix("snapshot-")
        if action == "save":
            self.post_message(self.Requested("save", None))
            return
        item = self.selected()
        if item is None:
            self.app.notify("Select a snapshot first.", severity="warning")
            return
        self.post_message(self.Requested(action, item))
