"""`stoker telemetry [--watch] [--json]`: the live server's GPU, CPU and throughput figures."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import click

from stoker.daemon.cli.output import emit, fail, json_option, reported
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths

if TYPE_CHECKING:
    from stoker.daemon.control.client import ControlClient

TOPIC = "telemetry.sample"


def _bar(percent: float | None, width: int = 20) -> str:
    if percent is None:
        return "-" * width
    filled = round(max(0.0, min(100.0, percent)) / 100 * width)
    return "#" * filled + "." * (width - filled)


def _num(value: Any, unit: str = "", fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value) + unit


def backend_label(sample: dict[str, Any]) -> str:
    """The backend really in use, as status names it: 'cpu (planned cuda: not accelerated)' for a
    GPU server that offloaded nothing, 'cuda (partial: 15/33 layers)' for a partial offload."""
    backend, planned = sample["backend"], sample.get("planned_backend")
    layers = sample.get("layers") or {}
    offloaded, total = layers.get("offloaded"), layers.get("total")
    if planned and planned != backend:
        return f"{backend} (planned {planned}: not accelerated)"
    if isinstance(offloaded, int) and isinstance(total, int) and 0 < offloaded < total:
        return f"{backend} (partial: {offloaded}/{total} layers)"
    return str(backend)


def format_sample(sample: dict[str, Any]) -> str:
    """A few lines for a person: activity, GPU or CPU figures, throughput."""
    when = time.strftime("%H:%M:%S", time.localtime(sample.get("time") or time.time()))
    activity = sample.get("activity", "?")
    colour = {"busy": "green", "idle": "cyan", "unavailable": "red", "stopped": "yellow"}.get(activity)
    head = f"{when}  {click.style(activity, fg=colour, bold=True)}"
    if sample.get("backend"):
        head += f"  {backend_label(sample)}  pid {sample.get('pid')}  ({sample.get('state')})"
    lines = [head]
    if activity == "stopped":
        lines.append("  no server is running; nothing is sampled")
        return "\n".join(lines)
    gpu = sample.get("gpu")
    if gpu:
        used, total = gpu.get("memory_used_mib"), gpu.get("memory_total_mib")
        vram_pct = None if not used or not total else 100 * used / total
        lines.append(
            f"  gpu     [{_bar(gpu.get('utilization_percent'))}] {_num(gpu.get('utilization_percent'), '%')}"
            f"   mem util {_num(gpu.get('memory_utilization_percent'), '%')}"
        )
        lines.append(
            f"  vram    [{_bar(vram_pct)}] {_num(used)}/{_num(total)} MiB"
            f"   server {_num(gpu.get('process_vram_mib'), ' MiB')}"
        )
        lines.append(
            f"  temp    {_num(gpu.get('temperature_c'), ' C')}   power {_num(gpu.get('power_w'), ' W', '{:.1f}')}"
        )
        if len(gpu.get("devices") or []) > 1:
            for dev in gpu["devices"]:
                lines.append(
                    f"    gpu{dev['index']} {dev.get('name') or ''}: {_num(dev.get('utilization_percent'), '%')}"
                    f" {_num(dev.get('memory_used_mib'))}/{_num(dev.get('memory_total_mib'))} MiB"
                )
    elif sample.get("gpu_error"):
        lines.append(f"  gpu     unavailable: {sample['gpu_error']}")
    process = sample.get("process")
    if process:
        cpu = process.get("cpu_percent")
        cores = process.get("cpu_count") or 1
        lines.append(
            f"  cpu     [{_bar(None if cpu is None else cpu / cores)}] {_num(cpu, '%', '{:.1f}')}"
            f" of {cores} core(s)   rss {_num(process.get('rss_mib'), ' MiB')}"
        )
    elif sample.get("process_error"):
        lines.append(f"  cpu     unreadable: {sample['process_error']}")
    engine = sample.get("engine")
    if engine:
        lines.append(
            f"  tokens  {_num(engine.get('tokens_per_s'), ' tok/s', '{:.1f}')} generating,"
            f" {_num(engine.get('prompt_tokens_per_s'), ' tok/s', '{:.1f}')} prompt;"
            f" {_num(engine.get('tokens_predicted_total'))} generated,"
            f" {_num(engine.get('requests_processing'))} in flight"
        )
    elif sample.get("engine_error"):
        lines.append(f"  tokens  unavailable: {sample['engine_error']}")
    return "\n".join(lines)


def _client(timeout: float = 10.0) -> ControlClient:
    from stoker.daemon.control.client import ControlClient

    return ControlClient(StokerPaths.from_env().socket_path, timeout=timeout)


@click.command()
@click.option("--watch", is_flag=True, help="Keep printing a new sample every 5 s (Ctrl-C ends).")
@json_option
def telemetry(watch: bool, as_json: bool) -> None:
    """GPU and memory utilisation, VRAM, temperature, power; CPU and RSS; tokens per second."""
    client = _client()
    with reported(as_json):
        reply = client.call("telemetry")
    if not watch:
        emit(as_json, reply, lambda r: format_sample(r["sample"]))
        return
    _print_watched(reply["sample"], as_json)
    try:
        # The daemon samples every 5 s while somebody subscribes; this stream is that somebody.
        with client.subscribe() as events:
            for event in events:
                if event.get("topic") == TOPIC:
                    _print_watched(event["sample"], as_json)
                elif str(event.get("topic", "")).startswith("machine.launch."):
                    _print_watched(client.call("telemetry")["sample"], as_json)
    except StokerError as err:
        fail(as_json, err)
    except KeyboardInterrupt:
        return


def _print_watched(sample: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(sample, sort_keys=True, default=str))  # one JSON document per line
    else:
        click.echo(format_sample(sample) + "\n")


def register(cli: click.Group) -> None:
    cli.add_command(telemetry)
