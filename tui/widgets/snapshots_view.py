"""The KV snapshot catalogue, with save / restore / delete (the app asks the daemon)."""

from __future__ import annotations

import os
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Button, DataTable, Static

from tui import quantities as q


def snapshot_id(item: dict[str, Any]) -> Any:
    return item.get("id", item.get("filename"))


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

    def compose(self) -> ComposeResult:
        yield Static(Text("loading the catalogue...", style="dim"), id="snapshots-note")
        yield DataTable(id="snapshots-table", cursor_type="row", zebra_stripes=True)
        with Horizontal(id="snapshot-buttons"):
            yield Button("Save", id="snapshot-save", variant="primary")
            yield Button("Restore", id="snapshot-restore")
            yield Button("Delete", id="snapshot-rm", variant="error")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        for label, width in (("id", 3), ("taken", 11), ("slot", 4), ("tokens", 6), ("size", 10), ("cause", 7), ("backend", 7), ("model", None)):
            table.add_column(label, key=label, width=width)

    def load(self, items: list[dict[str, Any]]) -> None:
        self.items = list(items)
        self.set_class(False, "-unavailable")
        note = self.query_one("#snapshots-note", Static)
        note.update(Text(f"{len(items)} snapshot(s)" if items else "no snapshots yet: s saves one", style="dim"))
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
                str(item.get("backend") or "-"),
                os.path.basename(model) if model else "-",
                key=str(snapshot_id(item)),
            )
        self._enable(True)

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
        if not self.items or table.cursor_row is None or not 0 <= table.cursor_row < len(self.items):
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
