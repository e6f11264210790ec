"""Telemetry: utilisation and VRAM bars with sparklines on a GPU, CPU/RSS/tokens on the CPU."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.reactive import reactive
from textual.widgets import Label, Static

from stoker.tui import quantities as q
from stoker.tui.widgets.meter import Meter
from stoker.tui.widgets.trend import Trend

ACTIVITY = {
    "busy": ("● busy", "bold green"),
    "idle": ("○ idle", "bold cyan"),
    "unavailable": ("✕ unavailable", "bold red"),
    "stopped": ("■ no server running", "bold yellow"),
}


def series(history: list[dict[str, Any]], key: str) -> list[float | None]:
    """A trend's data: the history's values for `key` (None where it was not read)."""
    return [None if point.get(key) is None else float(point[key]) for point in history]


class TelemetryPanel(Vertical):
    """Follows `sample` and `history`; switches between GPU mode and CPU mode."""

    sample: reactive[dict[str, Any] | None] = reactive(None, always_update=True)
    history: reactive[list[dict[str, Any]]] = reactive(list, always_update=True)

    def compose(self) -> ComposeResult:
        yield Static(id="activity")
        with Vertical(id="gpu-view"):
            yield Meter("GPU", id="gpu-util")
            yield Trend(100, id="gpu-spark")
            yield Meter("VRAM", id="vram")
            yield Trend(None, id="vram-spark")
            yield Label(id="gpu-details")
        with Vertical(id="cpu-view"):
            yield Meter("CPU", id="cpu-util")
            yield Trend(None, id="cpu-spark")
            yield Label(id="cpu-details")
        yield Label(id="tokens")
        yield Trend(None, id="tokens-spark")

    def on_mount(self) -> None:
        self.border_title = "Telemetry"
        self.set_class(True, "-stopped")

    def watch_sample(self, sample: dict[str, Any] | None) -> None:
        self._render_sample(sample)

    def watch_history(self, history: list[dict[str, Any]]) -> None:
        for spark_id, key in (
            ("#gpu-spark", "gpu_utilization_percent"),
            ("#vram-spark", "memory_used_mib"),
            ("#cpu-spark", "cpu_percent"),
            ("#tokens-spark", "tokens_per_s"),
        ):
            self.query_one(spark_id, Trend).values = series(history, key)

    def _render_sample(self, sample: dict[str, Any] | None) -> None:
        activity = self.query_one("#activity", Static)
        if sample is None:
            activity.update(Text("waiting for a sample...", style="dim"))
            return
        kind = sample.get("activity", "stopped")
        label, style = ACTIVITY.get(kind, (kind, "bold"))
        line = Text(label, style=style)
        if sample.get("backend"):
            line.append(f" │ {sample['backend']} │ ", style="bold")
            line.append(f"sampled {q.clock(sample.get('time'))}", style="dim")
        activity.update(line)
        gpu_mode = bool(sample.get("backend")) and sample.get("backend") != "cpu"
        self.set_class(gpu_mode, "-gpu")
        self.set_class(not gpu_mode and kind != "stopped", "-cpu")
        self.set_class(kind == "stopped", "-stopped")
        if gpu_mode:
            self._render_gpu(sample)
        else:
            self._render_cpu(sample)
        self._render_tokens(sample)

    def _render_gpu(self, sample: dict[str, Any]) -> None:
        gpu = sample.get("gpu") or {}
        util = self.query_one("#gpu-util", Meter)
        util.percent = gpu.get("utilization_percent")
        util.caption = q.number(gpu.get("utilization_percent"), "%").rjust(4)
        used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
        vram = self.query_one("#vram", Meter)
        vram.percent = None if not total or used is None else 100 * used / total
        vram.caption = f"{q.mib(used)}/{q.mib(total)}"
        self.query_one("#vram-spark", Trend).ceiling = total
        details = self.query_one("#gpu-details", Label)
        if not gpu and sample.get("gpu_error"):
            details.update(Text(f"GPU unreadable: {sample['gpu_error']}", style="red"))
            return
        parts = [
            f"srv {q.mib(gpu.get('process_vram_mib'))}",
            f"mem {q.number(gpu.get('memory_utilization_percent'), '%')}",
            q.number(gpu.get("temperature_c"), "°C"),
            q.number(gpu.get("power_w"), " W"),
        ]
        details.update("  ".join(parts))

    def _render_cpu(self, sample: dict[str, Any]) -> None:
        process = sample.get("process") or {}
        cpu = process.get("cpu_percent")
        cores = process.get("cpu_count") or 1
        meter = self.query_one("#cpu-util", Meter)
        meter.percent = None if cpu is None else cpu / cores
        # psutil's percent counts one core as 100: say it in cores, which cannot be misread.
        meter.caption = f"{q.number(None if cpu is None else cpu / 100, '', '{:.2f}')}/{cores} cores"
        self.query_one("#cpu-spark", Trend).ceiling = 100.0 * cores
        details = self.query_one("#cpu-details", Label)
        if not process:
            details.update(Text(sample.get("process_error") or "no process figures", style="dim"))
            return
        details.update(f"RSS {q.mib(process.get('rss_mib'))}   threads {q.number(process.get('threads'))}")

    def _render_tokens(self, sample: dict[str, Any]) -> None:
        tokens = self.query_one("#tokens", Label)
        engine = sample.get("engine")
        if engine:
            tokens.update(
                f"gen {q.number(engine.get('tokens_per_s'), ' tok/s', '{:.1f}')}  "
                f"prompt {q.number(engine.get('prompt_tokens_per_s'), ' tok/s', '{:.0f}')}"
            )
        elif sample.get("activity") == "stopped":
            tokens.update(Text("start the server with u", style="dim"))
        else:
            tokens.update(Text("tokens/s: " + (sample.get("engine_error") or "not yet"), style="dim"))
