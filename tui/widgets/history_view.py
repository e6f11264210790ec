"""History: every machine's transitions, newest first, filterable by machine or by model (its
launch and fallback machines), with evidence on selection."""

from __future__ import annotations

import json
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, Label, Select, Static

from stoker.tui import quantities as q

ALL = "*"
MODEL = "model="  # a filter value naming a model rather than a machine
MAX_ROWS = 500
EVIDENCE_CHARS = 160  # per value; the whole record is in `stoker history --json`


def row_from_event(event: dict[str, Any]) -> dict[str, Any] | None:
    """A `machine.<kind>.<state>` event as a history row (the `history` reply's shape)."""
    kind = str(event.get("topic") or "")
    if not kind.startswith("machine.") or "machine" not in event:
        return None
    return {
        "machine_id": event["machine"],
        "kind": kind.split(".")[1] if kind.count(".") >= 2 else "",
        "from_state": event.get("from"),
        "to_state": event.get("to"),
        "event": event.get("event"),
        "event_data": event.get("event_data") or {},
        "reason": event.get("reason"),
        "evidence": event.get("evidence") or {},
        "at": event.get("at") or event.get("time"),
    }


def row_key(row: dict[str, Any]) -> str:
    return f"{row.get('machine_id')}|{row.get('at')}|{row.get('from_state')}|{row.get('to_state')}|{row.get('event')}"


def fill_table(table: DataTable[Any], rows: list[dict[str, Any]]) -> None:
    """Show `rows` in `table`, one transition a line: when, which machine, from → to, reason."""
    table.clear()
    for row in rows:
        reason = row.get("reason")
        table.add_row(
            q.clock(row.get("at")),
            str(row.get("machine_id")),
            f"{row.get('from_state')} → {row.get('to_state')}",
            Text(reason, style="yellow") if reason else "",
            key=row_key(row),
        )


def describe(row: dict[str, Any]) -> Text:
    """The detail pane: the transition, its reason, its evidence and event data."""
    text = Text()
    text.append(f"{row.get('machine_id')}  ", style="bold")
    text.append(f"{row.get('from_state')} --{row.get('event')}--> {row.get('to_state')}\n")
    text.append(f"at {q.stamp(row.get('at'))}\n", style="dim")
    if row.get("reason"):
        text.append("reason  ", style="dim")
        text.append(f"{row['reason']}\n", style="bold yellow")
    for title, key in (("evidence", "evidence"), ("data", "event_data")):
        value = row.get(key) or {}
        for index, name in enumerate(sorted(value)):
            text.append(f"{title if index == 0 else '':<9}", style="dim")
            text.append(f"{name}: ", style="cyan")
            item = value[name]
            shown = item if isinstance(item, str) else json.dumps(item, default=str)
            text.append((shown if len(shown) <= EVIDENCE_CHARS else shown[: EVIDENCE_CHARS - 1] + "…") + "\n")
    text.rstrip()
    return text


class HistoryView(Vertical):
    """The transitions table; the app feeds rows in with `load` and `add`."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: list[dict[str, Any]] = []
        self._keys: set[str] = set()
        self._machine = ALL
        self.models: dict[str, tuple[str, ...]] = {}  # model NAME -> its machines (from status)

    def compose(self) -> ComposeResult:
        with Horizontal(id="history-bar"):
            yield Label("machine ", id="history-label")
            yield Select([("all machines", ALL)], value=ALL, allow_blank=False, id="history-filter")
        yield DataTable(id="history-table", cursor_type="row", zebra_stripes=True)
        yield Static(Text("select a transition to see its reason and evidence", style="dim"), id="history-detail")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_column("time", key="time", width=8)
        table.add_column("machine", key="machine", width=14)
        table.add_column("transition", key="transition", width=26)
        table.add_column("reason", key="reason")

    def load(self, rows: list[dict[str, Any]]) -> None:
        """Replace everything with `rows` (newest first, as the daemon returns them)."""
        self.rows = list(rows)[:MAX_ROWS]
        self._keys = {row_key(r) for r in self.rows}
        self._refresh_machines()
        self._fill()

    def add(self, row: dict[str, Any]) -> None:
        """A live transition goes on top."""
        key = row_key(row)
        if key in self._keys:
            return
        self._keys.add(key)
        self.rows.insert(0, row)
        del self.rows[MAX_ROWS:]
        self._refresh_machines()
        if self._shows(row):
            self._fill()

    def merge(self, rows: list[dict[str, Any]]) -> None:
        """Rows asked for on purpose (one model's, older than the latest): kept in time order."""
        new = [r for r in rows if row_key(r) not in self._keys]
        if not new:
            return
        self._keys.update(row_key(r) for r in new)
        self.rows = sorted(self.rows + new, key=lambda r: (r.get("at") or 0, r.get("id") or 0), reverse=True)
        self._refresh_machines()
        self._fill()

    def set_models(self, models: dict[str, tuple[str, ...]]) -> None:
        """The configured models and their machines: each becomes a filter."""
        if models != self.models:
            self.models = dict(models)
            self._refresh_machines()

    def show_model(self, name: str) -> None:
        """Filter to model `name`'s machines."""
        self._machine = MODEL + name
        self._refresh_machines()
        self._fill()

    def _shows(self, row: dict[str, Any]) -> bool:
        if self._machine == ALL:
            return True
        if self._machine.startswith(MODEL):
            return row.get("machine_id") in self.models.get(self._machine.removeprefix(MODEL), ())
        return row.get("machine_id") == self._machine

    def _refresh_machines(self) -> None:
        select = self.query_one("#history-filter", Select)
        machines = sorted({str(r.get("machine_id")) for r in self.rows})
        # Each configured model is a filter too: its launch and fallback machines.
        models = [(f"model {n}", MODEL + n) for n in self.models]
        options = [("all machines", ALL)] + models + [(m, m) for m in machines]
        with select.prevent(Select.Changed):
            if [value for _, value in options] != getattr(self, "_options", None):
                self._options = [value for _, value in options]
                select.set_options(options)
            if self._machine not in self._options:
                self._machine = ALL
            if select.value != self._machine:
                select.value = self._machine

    def _visible(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if self._shows(r)]

    def _fill(self) -> None:
        fill_table(self.query_one(DataTable), self._visible())

    def on_select_changed(self, event: Select.Changed) -> None:
        event.stop()
        self._machine = str(event.value) if event.value is not Select.NULL else ALL
        self._fill()

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        key = event.row_key.value
        row = next((r for r in self.rows if row_key(r) == key), None)
        detail = self.query_one("#history-detail", Static)
        if row is not None:
            detail.update(describe(row))
