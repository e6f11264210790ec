"""The backend card: what serves, why, and since when."""

from __future__ import annotations

import os
from typing import Any

from rich.table import Table
from rich.text import Text
from textual.reactive import reactive
from textual.widgets import Static

from stoker.tui import quantities as q

STATE_STYLE = {
    "ready": "bold green",
    "planning": "bold yellow",
    "starting": "bold yellow",
    "loading": "bold yellow",
    "stopping": "bold yellow",
    "backoff": "bold yellow",
    "crashed": "bold red",
    "failed": "bold red",
    "stopped": "bold",
}


def layers_text(layers: dict[str, Any] | None, backend: str | None) -> str:
    """'29/29 offloaded (planned 99)', or 'CPU only' on the CPU."""
    layers = layers or {}
    if backend == "cpu":
        return "CPU only (no offload)"
    planned, offloaded, total = layers.get("planned"), layers.get("offloaded"), layers.get("total")
    if planned is None and offloaded is None:
        return "-"
    actual = "?" if offloaded is None else f"{offloaded}/{total if total is not None else '?'}"
    return f"{actual} offloaded (planned {planned if planned is not None else 'auto'})"


def workers_lines(workers: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(label, text, style) per RPC worker: used ones with the model MiB the engine's lines put
    there (or the free MiB planned on, before load), left-out ones with their reason."""
    if not workers:
        return []
    held = workers.get("workers_model_mib") or {}
    lines = []
    for used in workers.get("used") or []:
        address = used.get("address")
        devices = ", ".join(used.get("devices") or [])
        mib = held.get(address)
        where = f"{mib:g} MiB of the model" if mib else f"planned on {sum(used.get('free_mib') or [])} MiB free"
        lines.append(("worker", f"{address} ({devices}): {where}", "green" if mib else ""))
    for out in workers.get("left_out") or []:
        lines.append(("worker", f"{out.get('address')}: left out, {out.get('reason')}", "yellow"))
    confirmed = workers.get("confirmed")
    if workers.get("used") and confirmed is False:
        lines.append(("", f"not every worker holds layers: {', '.join(workers.get('missing') or [])}", "bold yellow"))
    return lines


def backend_text(st: dict[str, Any]) -> str:
    """'cuda (avx2)', and how much of the model it holds when not all of it:
    'cuda (avx2; partial: 15/33 layers)'."""
    backend = st.get("backend") or "-"
    layers = st.get("layers") or {}
    details = [st["variant"]] if st.get("variant") else []
    if st.get("offload") == "partial":
        details.append(f"partial: {layers.get('offloaded')}/{layers.get('total')} layers")
    return backend + (f" ({'; '.join(details)})" if details else "")


def fallbacks_by_reason(fallbacks: list[dict[str, Any]]) -> dict[str, list[str]]:
    """{reason: [backend, ...]} in the order the daemon tried them (one line per reason)."""
    grouped: dict[str, list[str]] = {}
    for fallback in fallbacks:
        grouped.setdefault(str(fallback.get("reason")), []).append(str(fallback.get("backend")))
    return grouped


def model_line(m: dict[str, Any]) -> Text:
    """One model of several: its name, its own state, the backend it really uses, and why."""
    state = str(m.get("state") or "?")
    line = Text(f"{m.get('name')} ", style="bold")
    line.append(state, style=STATE_STYLE.get(state, "bold"))
    if m.get("backend"):
        line.append(f" on {m['backend']}")
    why = m.get("reason") or m.get("down_cause") or ("loads on demand" if m.get("loads_on_demand") else None)
    if why:
        line.append(f"  {why}", style="dim")
    return line


class BackendCard(Static):
    """State, backend, reason code and message, model, endpoint, layers, uptime."""

    status: reactive[dict[str, Any] | None] = reactive(None, layout=True)

    def on_mount(self) -> None:
        self.border_title = "Backend"

    def render(self) -> Table | Text:
        st = self.status
        if st is None:
            return Text("waiting for the daemon...", style="dim")
        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column(style="dim", no_wrap=True)
        grid.add_column(ratio=1, overflow="fold")
        state = st.get("state") or "?"
        grid.add_row("state", Text(state, style=STATE_STYLE.get(state, "bold")))
        line = Text(backend_text(st), style="bold")
        preference = st.get("preference") or {}
        if preference.get("forced"):
            line.append("  forced", style="bold magenta")  # never falls back: fails with the reason
        grid.add_row("backend", line)
        for reason, backends in fallbacks_by_reason(st.get("fallbacks") or []).items():
            grid.add_row("fell back", Text(f"{', '.join(backends)}: {reason}", style="yellow"))
        for hint in dict.fromkeys((f.get("evidence") or {}).get("hint") for f in st.get("fallbacks") or []):
            if hint:  # what to change (e.g. the fit margin when no layer fitted)
                grid.add_row("hint", Text(str(hint)))
        if st.get("reason"):
            grid.add_row(
                "reason", Text(st["reason"], style="bold red" if state in ("failed", "crashed") else "bold yellow")
            )
            if st.get("message"):
                grid.add_row("", Text(st["message"]))
        model = st.get("model")
        grid.add_row("model", os.path.basename(model) if model else "-")
        models = st.get("models") or []
        if len(models) > 1:  # the card describes one; every model's own state stands here
            for m in models:
                grid.add_row("", model_line(m))
        grid.add_row("endpoint", st.get("endpoint") or "-")
        workers = st.get("workers") or {}
        if workers.get("used"):  # layers on RPC devices, whatever the local backend
            layers = st.get("layers") or {}
            grid.add_row("layers", f"{layers.get('offloaded', '?')}/{layers.get('total', '?')} on devices (RPC first)")
        else:
            grid.add_row("layers", layers_text(st.get("layers"), st.get("backend")))
        for label, text, style in workers_lines(st.get("workers")):
            grid.add_row(label, Text(text, style=style))
        if st.get("n_ctx"):
            grid.add_row("context", f"{st['n_ctx']} tokens")
        uptime = q.duration(st.get("uptime_s")) if st.get("uptime_s") is not None else "-"
        extra = []
        if st.get("pid"):
            extra.append(f"pid {st['pid']}")
        if st.get("restarts"):
            extra.append(f"restarts {st['restarts']}")
        grid.add_row("uptime", uptime + ("   " + "  ".join(extra) if extra else ""))
        store = st.get("store") or {}
        if store.get("writable") is False:  # the daemon keeps running; what waits is written later
            grid.add_row(
                "state db",
                Text(
                    f"cannot write ({store.get('error')}); {store.get('pending', 0)} transition(s) held back",
                    style="bold red",
                ),
            )
        problems = (st.get("config") or {}).get("problems") or []
        if problems:
            grid.add_row(
                "config", Text(f"invalid ({len(problems)} problem(s)); running the previous one", style="yellow")
            )
        return grid
