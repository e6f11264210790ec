"""The Stoker TUI: a thin client of the daemon's control socket.

One exclusive thread worker reads the daemon's event stream and posts messages; short-lived
thread workers make the calls (status, history, telemetry, snapshots, actions). Widgets get
their data as attributes and send requests up as messages; only this module talks to the
daemon, through a `DaemonLink`.
"""

from __future__ import annotations

import threading
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Header, TabbedContent, TabPane
from textual.worker import get_current_worker

from stoker.daemon.core.errors import StokerError
from stoker.tui.link import DaemonLink
from stoker.tui.messages import (
    Connected,
    DaemonEvent,
    Disconnected,
    HistoryLoaded,
    ModelHistoryLoaded,
    SnapshotsLoaded,
    StatusLoaded,
    TelemetryLoaded,
)
from stoker.tui.screens.backend_choice import BackendChoiceScreen
from stoker.tui.screens.confirm import ConfirmScreen
from stoker.tui.screens.help import HelpScreen
from stoker.tui.screens.not_running import NotRunningScreen
from stoker.tui.widgets.backend_card import BackendCard
from stoker.tui.widgets.history_view import HistoryView, row_from_event
from stoker.tui.widgets.install_progress import InstallProgress
from stoker.tui.widgets.models_view import ModelsView
from stoker.tui.widgets.pull_progress import PullProgress
from stoker.tui.widgets.snapshots_view import SnapshotsView, snapshot_id
from stoker.tui.widgets.telemetry_panel import TelemetryPanel

HISTORY_LIMIT = 200
TELEMETRY_POINTS = 60
# What the daemon answers for a method it does not have (the reason string, not the enum:
# the TUI does not import states/).
UNKNOWN_METHOD = "unknown_method"


def topic_of(event: dict[str, Any]) -> str:
    """Events name themselves in `topic` (the protocol's convention) or `type` (machines)."""
    return str(event.get("topic") or "")


class StokerApp(App[None]):
    """The dashboard: backend card, telemetry, history, install progress, snapshots, every model."""

    CSS_PATH = "app.tcss"
    TITLE = "Stoker"
    ENABLE_COMMAND_PALETTE = False  # every command has a key; the footer needs the room
    BINDINGS = [
        Binding("p", "probe", "Probe"),
        Binding("u", "up", "Up"),
        Binding("d", "down", "Down"),
        Binding("r", "restart", "Restart"),
        Binding("b", "backend", "Backend"),
        Binding("s", "snapshot", "Snapshot"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
        Binding("1", "show_tab('overview')", "Overview", show=False),
        Binding("2", "show_tab('history')", "History", show=False),
        Binding("3", "show_tab('snapshots')", "Snapshots", show=False),
        Binding("4", "show_tab('models')", "Models", show=False),
    ]

    def __init__(self, link: DaemonLink, *, retry_s: float = 1.0, poll_s: float = 2.0) -> None:
        super().__init__()
        self.link = link
        self.retry_s = retry_s
        self.poll_s = poll_s
        self.status: dict[str, Any] | None = None
        self.connected = False
        self.loaded: set[str] = set()
        self.telemetry_history: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._stream: Any = None
        self._not_running: NotRunningScreen | None = None

    # --- layout --------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Header()
        with TabbedContent(initial="overview", id="tabs"):
            with TabPane("Overview", id="overview"):
                with Horizontal(id="overview-row"):
                    yield BackendCard(id="card")
                    yield TelemetryPanel(id="telemetry")
                yield InstallProgress(id="install")
            with TabPane("History", id="history"):
                yield HistoryView(id="history-view")
            with TabPane("Snapshots", id="snapshots"):
                yield SnapshotsView(id="snapshots-view")
            with TabPane("Models", id="models"):
                yield ModelsView(id="models-view")
        yield Footer()

    DAEMON_ACTIONS = frozenset({"probe", "up", "down", "restart", "backend", "snapshot"})

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """Daemon actions are offered (and shown in the footer) only while connected."""
        if action in self.DAEMON_ACTIONS and not self.connected:
            return False
        return True

    def on_mount(self) -> None:
        self.sub_title = "connecting..."
        self.follow_events()
        self.set_interval(self.poll_s, self._poll)

    def on_unmount(self) -> None:
        self._close_event_stream()

    def _close_event_stream(self) -> None:
        self._stop.set()
        stream = self._stream
        if stream is not None:
            stream.close()

    async def action_quit(self) -> None:
        self._close_event_stream()
        self.exit()

    # --- the one event reader ------------------------------------------------------------

    @work(thread=True, exclusive=True, group="events", exit_on_error=False)
    def follow_events(self) -> None:
        """Subscribe, post every event; on failure say so and retry every `retry_s`."""
        worker = get_current_worker()
        attempt = 0
        while not (worker.is_cancelled or self._stop.is_set()):
            try:
                stream = self.link.subscribe()
            except StokerError as err:
                attempt += 1
                self.post_message(Disconnected(err.message, attempt))
                self._stop.wait(self.retry_s)
                continue
            attempt = 0
            self._stream = stream
            self.post_message(Connected())
            dropped = False
            for event in stream:
                if worker.is_cancelled or self._stop.is_set():
                    break
                dropped = topic_of(event) == "dropped"
                self.post_message(DaemonEvent(event))
            stream.close()
            self._stream = None
            if dropped:
                continue  # too slow for once: subscribe again (and reload) at once
            if not (worker.is_cancelled or self._stop.is_set()):
                attempt += 1
                self.post_message(Disconnected("The daemon closed the connection.", attempt))
                self._stop.wait(self.retry_s)

    def on_connected(self, message: Connected) -> None:
        self.connected = True
        self.refresh_bindings()
        if self._not_running is not None:
            screen, self._not_running = self._not_running, None
            if screen.is_current:
                self.pop_screen()
        self.load_all()

    def on_disconnected(self, message: Disconnected) -> None:
        self.connected = False
        self.refresh_bindings()
        self.sub_title = "daemon not running"
        if self._not_running is None:
            self._not_running = NotRunningScreen(self.link.where)
            self.push_screen(self._not_running)
        self._not_running.detail = message.message
        self._not_running.attempt = message.attempt

    def on_daemon_event(self, message: DaemonEvent) -> None:
        event = message.event
        topic = topic_of(event)
        if topic.startswith("machine."):
            row = row_from_event(event)
            if row is not None:
                self.query_one(HistoryView).add(row)
                self.query_one(ModelsView).add_history(row)
            if topic.startswith("machine.pull.") and str(event.get("machine", "")).startswith("pull:"):
                self.query_one(PullProgress).transition(str(event["machine"]).removeprefix("pull:"), event.get("to"))
            if topic.startswith("machine.launch.") or topic.startswith("machine.config."):
                self.refresh_status()
            if topic.startswith("machine.launch."):
                self.refresh_telemetry()
        elif topic.startswith("store."):  # the state database refuses writes, or takes them again
            self.refresh_status()
        elif topic == "telemetry.sample":
            self._show_sample(event.get("sample") or {}, event.get("point"))
        elif topic == "install.progress":
            self.query_one(InstallProgress).update_from(event)
        elif topic == "pull.progress":
            self.query_one(PullProgress).progress(event)
        elif topic.startswith("snapshot."):
            self.refresh_snapshots()
        elif topic == "dropped":
            self.notify("The daemon dropped this view's event stream; resubscribing.", severity="warning")

    def _show_sample(self, sample: dict[str, Any], point: dict[str, Any] | None) -> None:
        panel = self.query_one(TelemetryPanel)
        if point is not None:
            self.telemetry_history = (self.telemetry_history + [point])[-TELEMETRY_POINTS:]
            panel.history = self.telemetry_history
        panel.sample = sample
        self.query_one(ModelsView).show_sample(sample)

    def _poll(self) -> None:
        if self.connected:
            self.refresh_status()  # uptime moves; everything else arrives as events

    # --- queries (thread workers; results come back as messages) -------------------------

    def load_all(self) -> None:
        self.refresh_status()
        self.refresh_history()
        self.refresh_telemetry()
        self.refresh_snapshots()

    @work(thread=True, exclusive=True, group="status", exit_on_error=False)
    def refresh_status(self) -> None:
        try:
            status = self.link.call("status")
        except StokerError:
            return  # the event worker notices a daemon that went away
        if not get_current_worker().is_cancelled:  # a newer refresh is under way: it wins
            self.post_message(StatusLoaded(status))

    @work(thread=True, exclusive=True, group="history", exit_on_error=False)
    def refresh_history(self) -> None:
        try:
            self.post_message(HistoryLoaded(self.link.call("history", limit=HISTORY_LIMIT)))
        except StokerError:
            pass

    @work(thread=True, exclusive=True, group="model-history", exit_on_error=False)
    def load_model_history(self, name: str, merge: bool = False) -> None:
        """One model's history: its launch and fallback machines, asked of the daemon by model."""
        try:
            rows = self.link.call("history", model=name, limit=HISTORY_LIMIT)
        except StokerError:
            # A daemon that predates `history --model`: the rows this view already has.
            machines = self.query_one(HistoryView).models.get(name, ())
            rows = [r for r in self.query_one(HistoryView).rows if r.get("machine_id") in machines]
        if not get_current_worker().is_cancelled:
            self.post_message(ModelHistoryLoaded(name, list(rows), merge))

    @work(thread=True, exclusive=True, group="telemetry", exit_on_error=False)
    def refresh_telemetry(self) -> None:
        try:
            reply = self.link.call("telemetry")
        except StokerError as err:
            if err.reason == UNKNOWN_METHOD:
                self.post_message(TelemetryLoaded({"activity": "unavailable", "gpu_error": err.message}, []))
            return
        self.post_message(TelemetryLoaded(reply.get("sample") or {}, reply.get("history")))

    @work(thread=True, exclusive=True, group="snapshots", exit_on_error=False)
    def refresh_snapshots(self) -> None:
        try:
            reply = self.link.call("snapshot.list")
        except StokerError as err:
            why = (
                "This daemon has no snapshot commands yet."
                if err.reason == UNKNOWN_METHOD
                else f"{err.reason}: {err.message}"
            )
            self.post_message(SnapshotsLoaded(None, why))
            return
        if isinstance(reply, dict):
            self.post_message(SnapshotsLoaded(list(reply.get("snapshots") or []), listing=reply))
        else:
            self.post_message(SnapshotsLoaded(list(reply or [])))

    def on_status_loaded(self, message: StatusLoaded) -> None:
        self.status = message.status
        self.loaded.add("status")
        self.query_one(BackendCard).status = message.status
        st = message.status
        models = st.get("models") or []
        several = len(models) > 1 or any(m.get("name") != "default" for m in models)
        # With several models the card and the subtitle are the default model's: say which.
        self.sub_title = f"{st.get('name')}: " * several + f"{st.get('state')} on {st.get('backend') or '-'}"
        self.query_one(BackendCard).border_title = f"Backend: {st.get('name')}" if several else "Backend"
        self.query_one(ModelsView).show_status(st)
        self.query_one(HistoryView).set_models({str(m.get("name")): tuple(m.get("machines") or ()) for m in models})

    def on_history_loaded(self, message: HistoryLoaded) -> None:
        self.loaded.add("history")
        self.query_one(HistoryView).load(message.rows)

    def on_telemetry_loaded(self, message: TelemetryLoaded) -> None:
        self.loaded.add("telemetry")
        panel = self.query_one(TelemetryPanel)
        if message.history is not None:
            self.telemetry_history = list(message.history)[-TELEMETRY_POINTS:]
            panel.history = self.telemetry_history
        panel.sample = message.sample
        self.query_one(ModelsView).show_sample(message.sample)

    def on_model_history_loaded(self, message: ModelHistoryLoaded) -> None:
        if message.merge:
            self.query_one(HistoryView).merge(message.rows)
        else:
            self.query_one(ModelsView).show_history(message.name, message.rows)

    @on(ModelsView.Highlighted)
    def model_highlighted(self, message: ModelsView.Highlighted) -> None:
        self.load_model_history(message.name)

    @on(ModelsView.HistoryRequested)
    def model_history_requested(self, message: ModelsView.HistoryRequested) -> None:
        """Enter on a model: the History tab, filtered to it, with all of its history."""
        self.action_show_tab("history")
        self.query_one(HistoryView).show_model(message.name)
        self.load_model_history(message.name, merge=True)

    def on_snapshots_loaded(self, message: SnapshotsLoaded) -> None:
        self.loaded.add("snapshots")
        view = self.query_one(SnapshotsView)
        if message.items is None:
            view.unavailable(message.unavailable or "")
        else:
            view.load(message.items, message.listing)

    # --- actions -------------------------------------------------------------------------

    @work(thread=True, group="actions", exit_on_error=False)
    def send(self, method: str, params: dict[str, Any], done: str) -> None:
        """Ask the daemon to act; say how it went. State changes arrive as events."""
        try:
            result = self.link.act(method, **params)
        except StokerError as err:
            if err.reason == UNKNOWN_METHOD:
                text, severity = f"`{method}` is not available in this daemon.", "warning"
            else:
                text, severity = f"{err.reason}: {err.message}", "error"
            self.call_from_thread(self.notify, text, title=method, severity=severity, timeout=8)
            return
        note = result.get("note") if isinstance(result, dict) else None  # e.g. a restore across backends
        if note:
            self.call_from_thread(self.notify, f"{done}\n{note}", title=method, timeout=12, markup=False)
        else:
            self.call_from_thread(self.notify, done, title=method)
        if method.startswith("snapshot."):
            self.refresh_snapshots()
        self.refresh_status()

    def _send_confirmed(self, question: str, label: str, method: str, params: dict[str, Any], done: str) -> None:
        """`send` once the user answers `label` to `question`."""

        def answered(yes: bool | None) -> None:
            if yes:
                self.send(method, params, done)

        self.push_screen(ConfirmScreen(question, label), answered)

    def action_probe(self) -> None:
        self.send("probe", {"fresh": True}, "Probed every backend again.")

    def _target(self) -> tuple[dict[str, Any], str]:
        """What u/d/r act on: the model highlighted in the Models tab (its `model` parameter and
        its name in words), else the default model's server."""
        if self.query_one(TabbedContent).active == "models":
            name = self.query_one(ModelsView).selected
            if name is not None:
                return {"model": name}, f"{name}'s server"
        return {}, "the server"

    def action_up(self) -> None:
        params, what = self._target()
        self.send("up", params, f"Starting {what}.")

    def action_down(self) -> None:
        params, what = self._target()
        question = f"Stop {what}? Clients lose their endpoint until you start it again."
        self._send_confirmed(question, "Stop", "down", params, f"{what[0].upper()}{what[1:]} is stopped.")

    def action_restart(self) -> None:
        params, what = self._target()
        question = f"Restart {what}? Requests in flight are cut off."
        self._send_confirmed(question, "Restart", "restart", params, f"Restarting {what}.")

    def action_backend(self) -> None:
        def chosen(name: str | None) -> None:
            if name:
                self.send("use", {"backend": name}, f"Backend preference: {name}.")

        status = self.status or {}
        current = (status.get("preference") or {}).get("prefer")
        # The daemon's loaded backends; an older daemon's status lacks them, its probes name them.
        backends = status.get("backends") or list(status.get("probes") or {})
        self.push_screen(BackendChoiceScreen(current, backends), chosen)

    def action_snapshot(self) -> None:
        self.send("snapshot.save", {}, "Snapshot saved.")

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_show_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab

    @on(TabbedContent.TabActivated)
    def focus_pane(self, event: TabbedContent.TabActivated) -> None:
        """The table of a tab takes the keyboard (arrows move its cursor)."""
        tables = {"history": "#history-table", "snapshots": "#snapshots-table", "models": "#models-table"}
        target = tables.get(event.pane.id or "")
        if target:
            self.query_one(target).focus()

    @on(SnapshotsView.Requested)
    def snapshot_requested(self, message: SnapshotsView.Requested) -> None:
        if message.action == "save":
            self.action_snapshot()
            return
        assert message.item is not None
        ident = snapshot_id(message.item)
        if message.action == "restore":
            self.send("snapshot.restore", {"id": ident}, f"Snapshot {ident} restored.")
        elif message.action == "rm":
            question = f"Delete snapshot {ident}? Its file is removed."
            self._send_confirmed(question, "Delete", "snapshot.rm", {"id": ident}, f"Snapshot {ident} deleted.")
