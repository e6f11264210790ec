"""`stoker probe [--fresh]` and `stoker use auto|BACKEND`.

The backend names are the daemon's (its loaded plugins, a third party's included): the CLI
passes the name on and the daemon refuses one it has not loaded, listing those it has.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import click

from stoker.daemon.cli.output import emit, json_option
from stoker.daemon.cli.lifecycle import ask, call
from stoker.daemon.control.status_text import format_status

if TYPE_CHECKING:
    from stoker.daemon.control.replies import ProbeReply


def format_probe_reply(reply: ProbeReply) -> str:
    """Each backend's verdict, reason, message, devices and evidence; where it came from."""
    from stoker.daemon.probes.report import format_probe

    text = format_probe(reply.backends).rstrip("\n")
    origin = []
    for b in reply.backends:
        how = f"cached, {b.age_s:.1f} s old" if b.cached else "probed now"
        if b.evidence.get("probed"):
            how += ", in-process (no driver needed)"
        origin.append(f"  {b.backend}: generation {b.generation}, {how}")
    return (
        text
        + "\n\nprobe results (fresh with --fresh):\n"
        + "\n".join(origin)
        + f"\nanswered in {reply.elapsed_s:.3f} s"
    )


@click.command()
@click.option("--fresh", is_flag=True, help="Probe now instead of answering from the 30 s cache.")
@json_option
def probe(fresh: bool, as_json: bool) -> None:
    """Capability per backend with reason codes and evidence."""
    from stoker.daemon.control.replies import ProbeReply

    reply, probes = ask("probe", as_json, ProbeReply, timeout=120.0, fresh=fresh)
    emit(as_json, reply, lambda _: format_probe_reply(probes))


def format_use(reply: dict) -> str:
    prefer = reply["prefer"]
    head = (
        f"backend preference: {prefer} (forced: no fallback; a failure is reported)"
        if reply.get("forced")
        else "backend preference: auto (the best backend this machine really has, CPU last)"
    )
    lines = [head, f"written to {reply['config_path']} ([backend] prefer)"]
    if reply.get("relaunch"):
        lines.append("relaunching the server")
    return "\n".join(lines) + "\n\n" + format_status(reply.get("status") or {})


@click.command()
@click.argument("backend", metavar="auto|BACKEND")
@json_option
def use(backend: str, as_json: bool) -> None:
    """Set the backend preference (anything but auto is forced) and relaunch.

    BACKEND is one `stoker probe` lists: cpu, cuda, rocm, vulkan, metal, or a plugin's."""
    reply = call("use", as_json, timeout=60.0, backend=backend)
    emit(as_json, reply, format_use)
    if (reply.get("status") or {}).get("state") == "failed":
        sys.exit(1)


def register(cli: click.Group) -> None:
    cli.add_command(probe)
    cli.add_command(use)
