"""`stoker install BACKEND`: fetch, verify and install an engine bundle, with a progress bar;
and `install_file`, how every CLI command installs a local bundle.

Progress comes from the daemon's event stream (`install.progress`), read in a thread while
the `install` call blocks; `--json` prints each progress event as one JSON line, then the
result (or the error) as the last line.

Every install runs through the install service (daemon.install.installer): its machine, its
steps, its promote, its history. A local bundle (`stoker bundle install`, `stoker run`'s
build) goes to the running daemon's service (the `bundle.install` socket method); with no
daemon, this process takes the daemon's lock (so that none starts and resumes the same
machine meanwhile) and runs the same service on the same store itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import click
import trio

from stoker.daemon.cli.daemon_or_here import through_daemon_or_here
from stoker.daemon.cli.output import emit, fail, json_option, reported
from stoker.daemon.control.status_text import progress_line
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

PROGRESS_TOPIC = "install.progress"
INSTALL_TIMEOUT_S = 3600.0


def _watch(stream: Any, backend: str, as_json: bool, stop: threading.Event) -> None:
    for event in stream:
        if stop.is_set():
            break
        if event.get("topic") != PROGRESS_TOPIC or event.get("backend") != backend:
            continue
        if as_json:
            click.echo(
                json.dumps(
                    {
                        "progress": {
                            k: event.get(k) for k in ("backend", "variant", "bytes_done", "total", "rate", "eta")
                        }
                    }
                )
            )
        else:
            click.echo("\r" + progress_line(event), nl=False, err=True)


@click.command()
@click.argument("backend")
@click.option("--variant", default=None, help="A variant from the manifest (default: what fits this machine).")
@json_option
def install(backend: str, variant: str | None, as_json: bool) -> None:
    """Fetch + verify + install a bundle from the manifest, with a progress bar."""
    from stoker.daemon.cli.lifecycle import _client

    params: dict[str, Any] = {"backend": backend}
    if variant:
        params["variant"] = variant
    stop = threading.Event()
    stream = None
    with reported(as_json):
        stream = _client().subscribe()
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


def install_file(
    paths: StokerPaths, path: Path, *, smoke: bool = False, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Install a local bundle (zip or directory) through the install service; its `to_dict()`.

    Through the running daemon when there is one; else in this process, holding the daemon's
    lock. A directory is packed into a temporary zip first (after refusing links and special
    files, which a zip could not carry for verification to refuse).
    """
    from stoker.daemon.control.client import ControlClient

    with _as_zip(Path(path)) as zip_path:

        def here() -> dict[str, Any]:
            progress(f"no daemon runs: installing {zip_path} here")
            return trio.run(_install_here, paths, zip_path, smoke).to_dict()

        def through_daemon() -> dict[str, Any]:
            with ControlClient(paths.socket_path, timeout=INSTALL_TIMEOUT_S) as client:
                progress(f"installing {zip_path} through the daemon")
                return dict(client.call("bundle.install", path=str(zip_path), smoke=smoke)["installed"])

        return through_daemon_or_here(paths, here=here, through_daemon=through_daemon)


async def _install_here(paths: StokerPaths, zip_path: Path, smoke: bool) -> Any:
    from stoker.daemon.install.installer import InstallService
    from stoker.store.database import open_store

    store = open_store(paths.db_file)
    try:
        return await InstallService(paths, store).install_file(zip_path, smoke=smoke)
    finally:
        store.close()


@contextlib.contextmanager
def _as_zip(path: Path) -> Iterator[Path]:
    """`path` if it is a file; a directory packed into a temporary zip beside nothing else."""
    if not path.is_dir():
        yield path.absolute()
        return
    from stoker.daemon.bundles.archive import pack_bundle

    for dirpath, dirnames, filenames in os.walk(path):
        for name in dirnames + filenames:
            entry = Path(dirpath, name)
            if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
                raise StokerError(
                    ReasonCode.BUNDLE_UNSAFE_ARCHIVE,
                    "The bundle holds a link or special file.",
                    {"path": entry.relative_to(path).as_posix()},
                )
    with tempfile.TemporaryDirectory(prefix="stoker-bundle-") as scratch:
        yield pack_bundle(path, Path(scratch) / "bundle.zip")


def register(cli: click.Group) -> None:
    cli.add_command(install)
