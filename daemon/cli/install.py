"""`stoker install BACKEND`: fetch, verify and install an engine bundle, with a progress bar.

Progress comes from the daemon's event stream (`install.progress`), read in a thread while
the `install` call blocks; `--json` prints each progress event as one JSON line, then the
result (or the error) as the last line.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import click

from daemon.cli.output import emit, fail, json_option
from daemon.core.errors import StokerError

PROGRESS_TOPIC = "install.progress"
BAR_WIDTH = 30


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def progress_line(event: dict[str, Any]) -> str:
    """`[#####.....]  42%  12.3 MiB / 29.0 MiB  5.1 MiB/s  eta 3 s` for one progress event."""
    done, total = event.get("bytes_done") or 0, event.get("total")
    frac = min(1.0, done / total) if total else 0.0
    filled = int(frac * BAR_WIDTH)
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    eta = event.get("eta")
    tail = f"eta {eta:.0f} s" if isinstance(eta, (int, float)) else ""
    return (f"[{bar}] {frac * 100:3.0f}%  {_size(done)} / {_size(total)}  "
            f"{_size(event.get('rate') or 0)}/s  {tail}").rstrip()


def _watch(stream: Any, backend: str, as_json: bool, stop: threading.Event) -> None:
    for event in stream:
        if stop.is_set():
            break
        if event.get("topic") != PROGRESS_TOPIC or event.get("backend") != backend:
            continue
        if as_json:
            click.echo(json.dumps({"progress": {k: event.get(k) for k in
                                                ("backend", "variant", "bytes_done", "total", "rate", "eta")}}))
        else:
            click.echo("\r" + progress_line(event), nl=False, err=True)


@click.command()
@click.argument("backend")
@click.option("--variant", default=None, help="A variant from the manifest (default: what fits this machine).")
@json_option
def install(backend: str, variant: str | None, as_json: bool) -> None:
    """Fetch + verify + install a bundle from the manifest, with a progress bar."""
    from daemon.cli.service import _client

    params: dict[str, Any] = {"backend": backend}
    if variant:
        params["variant"] = variant
    stop = threading.Event()
    stream = None
    try:
        stream = _client().subscribe()
    except StokerError as err:
        fail(as_json, err)
    watcher = threading.Thread(target=_watch, args=(stream, backend, as_json, stop), daemon=True)
    watcher.start()
    try:
        result = _client(timeout=3600.0).call("install", **params)
    except StokerError as err:
        if not as_json:
            click.echo("", err=True)
        fail(as_json, err)
    finally:
        stop.set()
        stream.close()
        watcher.join(timeout=2)
    if not as_json:
        click.echo("", err=True)
    installed = result["installed"]
    if as_json:
        click.echo(json.dumps({"ok": True, **result}, sort_keys=True))
    else:
        emit(False, installed, lambda b: f"installed {b['backend']}-{b['variant']} ({b.get('version')}) at {b['root']}")
    sys.exit(0)


def register(cli: click.Group) -> None:
    cli.add_command(install)
