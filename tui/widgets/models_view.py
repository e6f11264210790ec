"""Models: every configured model at a glance, the highlighted one in detail with its history.

The app feeds `status` (its `models[]`), the latest telemetry sample (live figures of the model
it samples: the default) and the highlighted model's history; the view posts `Highlighted` up
when the cursor moves to a model (the app asks the daemon for that model's history) and
`HistoryRequested` on Enter (the app opens the History tab filtered to that model).
"""

from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import DataTable, Static

from stoker.tui import quantities as q
from stoker.tui.widgets.backend_card import STATE_STYLE
from stoker.tui.widgets.history_view import fill_table, row_key
from stoker.tui.widgets.pull_progress import PullProgress
from stoker.tui.widgets.remote_models import describe_remote, remote_row

HISTORY_ROWS = 50


def short_mib(n: float | None) -> str:
    """812M, 5.6G: a table cell's width."""
    if n is None:
        return "?"
    return f"{n / 1024:.1f}G" if n >= 1024 else f"{n:.0f}M"


def live_figures(model: dict[str, Any], sample: dict[str, Any] | None) -> dict[str, Any] | None:
    """The telemetry sample's figures when it is of this model's server (same pid), else None."""
    if not sample or model.get("pid") is None or sample.get("pid") != model.get("pid"):
        return None
    gpu, process = sample.get("gpu") or {}, sample.get("process") or {}
    return {"rss_mib": process.get("rss_mib"), "vram_mib": gpu.get("process_vram_mib"), "time": sample.get("time")}


def memory_figures(model: dict[str, Any], sample: dict[str, Any] | None) -> tuple[float | None, float | None, str]:
    """(RSS, VRAM, where the VRAM figure comes from: live | ready | unknown | none). Live
    telemetry wins where it samples this server; else the status' RSS and the proof's VRAM."""
    memory = model.get("memory") or {}
    rss, vram = memory.get("rss_mib"), memory.get("vram_mib")
    live = live_figures(model, sample)
    if live is not None:
        rss = live["rss_mib"] if live["rss_mib"] is not None else rss
        if memory.get("on_accelerator") and live["vram_mib"] is not None:
            return rss, live["vram_mib"], "live"
    if not memory.get("on_accelerator"):
        return rss, None, "none"
    return rss, vram, "ready" if vram is not None else "unknown"


def memory_cell(model: dict[str, Any], sample: dict[str, Any] | None) -> Text:
    """`812M` on the CPU, `812M + 5.6G` on an accelerator, `812M + ?` (yellow) where its VRAM is unknown."""
    rss, vram, source = memory_figures(model, sample)
    if rss is None and vram is None:
        return Text("-", style="dim")
    text = Text(short_mib(rss))
    if source != "none":
        text.append(" + ")
        text.append(short_mib(vram), style="yellow" if source == "unknown" else "")
    return text


def backend_cell(model: dict[str, Any]) -> Text:
    """The backend really in use; `cuda→cpu` when the plan's was another."""
    backend, planned = model.get("backend"), model.get("planned_backend")
    if not backend:
        return Text("-", style="dim")
    if planned and planned != backend:
        return Text.assemble((planned, "dim"), "→", (backend, "bold yellow"))
    return Text(backend, style="bold")


def layers_cell(model: dict[str, Any]) -> str:
    layers = model.get("layers") or {}
    offloaded, total = layers.get("offloaded"), layers.get("total")
    if offloaded is None and total is None:
        return "-"
    return f"{'-' if offloaded is None else offloaded}/{'?' if total is None else total}"


def unload_cell(model: dict[str, Any]) -> Text:
    """The idle countdown: `in 4m48s`; `pinned`; `never` without a TTL; `idle` once unloaded for it."""
    if model.get("pinned"):
        return Text("pinned", style="cyan")
    if model.get("state") == "stopped" and model.get("down_cause") == "idle":
        return Text("unloaded", style="dim")
    if model.get("idle_unload_in_s") is not None:
        return Text(f"in {q.duration(model['idle_unload_in_s'])}", style="yellow")
    if not model.get("idle_ttl_s"):
        return Text("never", style="dim")
    return Text("-", style="dim")


def why_cell(model: dict[str, Any]) -> Text:
    """The reason code, else who stopped it, else whether a request loads it."""
    if model.get("reason"):
        failed = model.get("state") in ("failed", "crashed")
        return Text(str(model["reason"]), style="red" if failed else "yellow")
    if model.get("state") == "stopped" and model.get("down_cause") == "idle":
        saved = model.get("slots_saved")
        return Text("idle" + ("" if saved is None else f", {saved} slots saved"), style="dim")
    if model.get("down_cause"):
        return Text(f"{model['down_cause']}", style="dim")
    if model.get("loads_on_demand"):
        return Text("on demand", style="dim")
    return Text("")


def describe_model(model: dict[str, Any], sample: dict[str, Any] | None) -> Table:
    """The highlighted model in full: state and why, backend in use and planned, layers, memory
    and where each figure comes from, idle countdown, requests, process."""
    grid = Table.grid(padding=(0, 1), expand=True)
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column(ratio=1, overflow="fold")
    state = str(model.get("state") or "?")
    head = Text(str(model.get("name")), style="bold")
    head.append(f"  {state}", style=STATE_STYLE.get(state, "bold"))
    for flag in ("default", "pinned"):
        if model.get(flag):
            head.append(f"  {flag}", style="cyan")
    grid.add_row("model", head)
    if model.get("reason"):
        reason = Text()
        reason.append(str(model["reason"]), style="bold red" if state in ("failed", "crashed") else "bold yellow")
        if model.get("message"):
            reason.append(f": {model['message']}")
        grid.add_row("reason", reason)
    backend, planned = model.get("backend"), model.get("planned_backend")
    if backend:
        line = Text(backend, style="bold")
        if planned and planned != backend:
            line.append(f"  (planned {planned})", style="yellow")
        grid.add_row("backend", line)
    elif planned:
        grid.add_row("backend", Text(f"- (last planned {planned})", style="dim"))
    layers = model.get("layers") or {}
    if layers.get("offloaded") is not None or layers.get("total") is not None:
        grid.add_row("layers", f"{layers_cell(model)} offloaded")
    grid.add_row("memory", memory_line(model, sample))
    estimate = estimate_line(model)
    if estimate is not None:
        grid.add_row("estimate", estimate)
    grid.add_row("idle", idle_line(model))
    requests = [
        f"{model[k]} {word}" for k, word in (("in_flight", "in flight"), ("waiting", "waiting")) if model.get(k)
    ]
    if requests:
        grid.add_row("requests", ", ".join(requests))
    if model.get("pid"):
        grid.add_row("process", f"pid {model['pid']}   restarts {model.get('restarts') or 0}")
    return grid


def memory_line(model: dict[str, Any], sample: dict[str, Any] | None) -> Text:
    rss, vram, source = memory_figures(model, sample)
    if rss is None and vram is None:
        return Text("- (no server process)", style="dim")
    text = Text(f"ram {q.mib(rss)}")
    if source == "live":
        text.append(f", vram {q.mib(vram)}")
        text.append(" (live)", style="dim")
    elif source == "ready":
        text.append(f", vram {q.mib(vram)}")
        text.append(" (read at ready)", style="dim")
    elif source == "unknown":
        text.append(", vram unknown: partial", style="yellow")
    return text


def estimate_line(model: dict[str, Any]) -> Text | None:
    """Which estimate answered its plan, its figures, and what placement counts for it now
    (`memory.estimate`, `memory.placed`); None without a plan."""
    memory = model.get("memory") or {}
    estimate, placed = memory.get("estimate"), memory.get("placed")
    if not estimate:
        return None
    text = Text(f"{estimate.get('source')}: ram {q.mib(estimate.get('ram_mib'))}")
    if estimate.get("vram_mib"):
        text.append(f", vram {q.mib(estimate['vram_mib'])}")
    host = (estimate.get("parts") or {}).get("Host") or {}
    if host:
        text.append(" (" + ", ".join(f"{q.mib(v)} {k}" for k, v in host.items()) + ")", style="dim")
    if estimate.get("partial"):
        text.append(" partial", style="yellow")
    if estimate.get("detail"):
        text.append(f"; {estimate['detail']}", style="dim")
    if placed and placed.get("reading") == "engine":
        text.append(f"; counted {q.mib(placed.get('ram_mib'))}", style="dim")
        if placed.get("vram_mib"):
            text.append(f" + {q.mib(placed['vram_mib'])}", style="dim")
        text.append(" (engine's buffers)", style="dim")
    return text


def idle_line(model: dict[str, Any]) -> Text:
    ttl = model.get("idle_ttl_s") or 0
    if model.get("pinned"):
        return Text("pinned: never unloaded for idleness or to make room")
    if model.get("state") == "stopped" and model.get("down_cause") == "idle":
        saved = model.get("slots_saved")
        kept = "" if saved is None else f", {saved} slot(s) saved for its next load"
        return Text(f"unloaded after {q.duration(ttl)} idle{kept}")
    if not ttl:
        return Text("no idle unload (idle_ttl_s = 0)", style="dim")
    idle = model.get("idle_s")
    text = Text(f"{q.duration(idle) if idle is not None else '-'} of {q.duration(ttl)}")
    if model.get("idle_unload_in_s") is not None:
        text.append(f": unloads in {q.duration(model['idle_unload_in_s'])}", style="yellow")
    return text


class ModelsView(Vertical):
    """The models table, the highlighted model's details and history, and the pulls under way."""

    class Highlighted(Message):
        """The cursor is on model `name` (its history is wanted)."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    class HistoryRequested(Message):
        """Enter on model `name`: show all of its history."""

        def __init__(self, name: str) -> None:
            super().__init__()
            self.name = name

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.models: list[dict[str, Any]] = []
        self.sample: dict[str, Any] | None = None
        self.selected: str | None = None
        self.history_rows: list[dict[str, Any]] = []

    def compose(self) -> ComposeResult:
        yield Static(Text("waiting for the daemon...", style="dim"), id="models-note")
        yield DataTable(id="models-table", cursor_type="row", zebra_stripes=True)
        yield PullProgress(id="pulls")
        yield Static(id="model-detail")
        yield DataTable(id="model-history", cursor_type="none", show_header=False)

    def on_mount(self) -> None:
        table = self.query_one("#models-table", DataTable)
        for label, width in (("model", 10), ("state", 8), ("backend", 9), ("layers", 6), ("memory", 11), ("unload", 9)):
            table.add_column(label, key=label, width=width)
        table.add_column("why", key="why")
        history = self.query_one("#model-history", DataTable)
        history.add_column("time", key="time", width=8)
        history.add_column("machine", key="machine", width=14)
        history.add_column("transition", key="transition", width=24)
        history.add_column("reason", key="reason")

    # --- data from the app -----------------------------------------------------------------

    def show_status(self, status: dict[str, Any]) -> None:
        """Every configured model from a `status` reply (an older daemon's has none: its one model)."""
        models = list(status.get("models") or [])
        remotes = [remote_row(r) for r in status.get("remotes") or []]  # served by an endpoint: no server here
        self.models = models + remotes
        loaded = sum(1 for m in models if m.get("state") not in ("stopped", "failed"))
        note = (
            f"{len(models)} model(s), {loaded} loaded; at most {status.get('max_loaded', '?')} at once"
            + (f"; {len(remotes)} remote" if remotes else "")
            + "   enter: a model's whole history"
        )
        if not models:
            note = "this daemon lists no models (it predates several models)"
        self.query_one("#models-note", Static).update(Text(note, style="dim"))
        self._fill()
        self.query_one(PullProgress).show_status(list(status.get("pulls") or []))

    def show_sample(self, sample: dict[str, Any] | None) -> None:
        """The latest telemetry sample: live figures of the server it samples."""
        self.sample = sample
        if self.models:
            self._fill()

    def show_history(self, name: str, rows: list[dict[str, Any]]) -> None:
        """`name`'s history (newest first), if it is still the highlighted model."""
        if name != self.selected:
            return
        self.history_rows = list(rows)[:HISTORY_ROWS]
        self._fill_history()

    def add_history(self, row: dict[str, Any]) -> None:
        """A live transition: kept if it is the highlighted model's."""
        model = self._model(self.selected)
        if model is None or row.get("machine_id") not in (model.get("machines") or ()):
            return
        if row_key(row) in {row_key(r) for r in self.history_rows}:
            return
        self.history_rows = [row, *self.history_rows][:HISTORY_ROWS]
        self._fill_history()

    # --- drawing ---------------------------------------------------------------------------

    def _model(self, name: str | None) -> dict[str, Any] | None:
        return next((m for m in self.models if m.get("name") == name), None)

    def _fill(self) -> None:
        table = self.query_one("#models-table", DataTable)
        # The row under the cursor is the user's latest move, even one whose highlight is still queued.
        keep = self._cursor_name(table) or self.selected
        names = [str(m.get("name")) for m in self.models]
        # A refill's own highlights (its first row, the cursor put back) are no move of the user's:
        # queued, they would select the first model and, read by the next refill, pull the cursor back there.
        with self.prevent(DataTable.RowHighlighted):
            table.clear()
            for model in self.models:
                name = str(model.get("name"))
                state = str(model.get("state") or "?")
                table.add_row(
                    Text(name + ("*" if model.get("default") else ""), style="bold" if model.get("default") else ""),
                    Text(state, style=STATE_STYLE.get(state, "")),
                    backend_cell(model),
                    layers_cell(model),
                    memory_cell(model, self.sample),
                    unload_cell(model),
                    why_cell(model),
                    key=name,
                )
            if keep in names:
                table.move_cursor(row=names.index(str(keep)), animate=False)
        if keep in names:
            self._select(str(keep))
        elif names:
            self._select(names[0])
        self._fill_detail()

    @staticmethod
    def _cursor_name(table: DataTable[Any]) -> str | None:
        if table.row_count == 0:
            return None
        return str(table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value)

    def _fill_detail(self) -> None:
        model = self._model(self.selected)
        detail = self.query_one("#model-detail", Static)
        if model is None:
            detail.update(Text("no model", style="dim"))
            return
        detail.update(describe_remote(model["remote"]) if model.get("remote") else describe_model(model, self.sample))

    def _fill_history(self) -> None:
        fill_table(self.query_one("#model-history", DataTable), self.history_rows)

    def _select(self, name: str) -> None:
        if name == self.selected:
            return
        self.selected = name
        self.history_rows = []
        self._fill_history()
        self._fill_detail()
        self.post_message(self.Highlighted(name))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        event.stop()
        if event.data_table.id == "models-table" and event.row_key.value is not None:
            self._select(str(event.row_key.value))

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.data_table.id == "models-table" and event.row_key.value is not None:
            self.post_message(self.HistoryRequested(str(event.row_key.value)))
