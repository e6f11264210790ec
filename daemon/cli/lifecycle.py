"""Service commands: daemon, status, up, down, restart, shutdown, history (`stoker chat` is chat.py)."""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, Any, Sequence, TypeVar

import click

from stoker.daemon.cli.output import emit, json_option, progress_line, reported
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import message_for

if TYPE_CHECKING:
    from stoker.daemon.control.client import ControlClient
    from stoker.daemon.control.status_records import Status
    from stoker.store.records import TransitionRecord

R = TypeVar("R")

READY_STATES = {"ready"}
SETTLED_FAILURES = {"failed", "stopped"}


def _client(timeout: float = 10.0) -> ControlClient:
    from stoker.daemon.control.client import ControlClient

    return ControlClient(StokerPaths.from_env().socket_path, timeout=timeout)


def call(method: str, as_json: bool, timeout: float = 10.0, returns: type | None = None, **params: Any) -> Any:
    """One request to the daemon (its reply as the record `returns` when given); a reason-coded
    failure, a daemon of another version that lacks what is needed included, exits the CLI with its code."""
    with reported(as_json):
        return _client(timeout).call(method, returns=returns, **params)


def ask(method: str, as_json: bool, returns: type[R], timeout: float = 10.0, **params: Any) -> tuple[Any, R]:
    """The daemon's reply as it was sent (what `--json` prints, so a script sees every field a
    newer daemon adds) and as the record `returns` (what the text reads). A daemon that lacks a
    field the record needs exits the CLI with daemon_version_skew, naming the field, either way."""
    from stoker.daemon.control.client import typed_reply

    reply = call(method, as_json, timeout, **params)
    with reported(as_json):
        return reply, typed_reply(method, reply, returns)


@click.command()
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning"]))
@click.option(
    "--no-default",
    is_flag=True,
    help="Load the default model at its first request, not at start (`stoker run NAME` starts it so).",
)
def daemon(log_level: str, no_default: bool) -> None:
    """Run the service in the foreground (systemd and launchd run it like this)."""
    from stoker.daemon.core.loading import keep_loaded, loading

    with loading():  # what the daemon imports, kept to its end (daemon/core/loading.py)
        from stoker.daemon.cli.foreground import run_foreground
    keep_loaded()
    code = run_foreground(StokerPaths.from_env(), log_level=log_level, load_default=not no_default)
    keep_loaded()  # and what the run left (all of it closed by now): the exit collects nothing
    sys.exit(code)


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def worker_lines(workers: dict[str, Any] | None) -> list[str]:
    """`stoker status`'s lines for the plan's RPC workers: where the layers are (the model MiB
    each holds, from the engine's lines) and the workers left out with their reasons."""
    if not workers:
        return []
    held = workers.get("workers_model_mib") or {}
    lines = []
    for used in workers.get("used") or []:
        mib = held.get(used["address"])
        where = f"{mib:g} MiB of the model" if mib else f"planned on {sum(used.get('free_mib') or [])} MiB free"
        lines.append(f"worker    {used['address']} ({', '.join(used.get('devices') or [])}): {where}")
    for out in workers.get("left_out") or []:
        error = (out.get("evidence") or {}).get("error")
        lines.append(f"worker    {out['address']}: left out, {out['reason']}" + (f" ({error})" if error else ""))
    if workers.get("used") and workers.get("confirmed") is False:
        lines.append(f"          not every worker holds layers: {', '.join(workers.get('missing') or [])}")
    return lines


def format_status(st: dict[str, Any]) -> str:
    """The status document for a person: state, backend, why, layers, fallbacks."""
    lines = []
    state = st.get("state", "?")
    colour = {"ready": "green", "failed": "red", "crashed": "red", "backoff": "yellow"}.get(state)
    head = click.style(state, fg=colour, bold=True) if colour else state
    backend = st.get("backend") or "-"
    layers = st.get("layers") or {}
    details = [st["variant"]] if st.get("variant") else []
    if st.get("offload") == "partial":  # the engine put only some layers on the GPU
        details.append(f"partial: {layers.get('offloaded')}/{layers.get('total')} layers")
    if details:
        backend += f" ({'; '.join(details)})"
    lines.append(f"state     {head}")
    lines.append(f"backend   {backend}")
    engine = st.get("engine") or {}
    if engine.get("version"):  # the slot's engine, and whether a rollback has one to go back to
        kept = f"previous {engine['previous']} kept" if engine.get("previous") else "no previous kept"
        lines.append(f"version   {engine['version']} ({engine.get('slot')}; {kept})")
    if st.get("reason"):
        lines.append(f"reason    {st['reason']}: {st.get('message') or message_for(st['reason'])}")
    for key, value in (st.get("evidence") or {}).items():
        lines.append(f"          {key}: {value}")
    lines.append(f"model     {st.get('model') or '-'}")
    lines.append(f"endpoint  {st.get('endpoint') or '-'}")
    frontdoor = st.get("frontdoor")
    if isinstance(frontdoor, dict):  # where clients connect: the address that does not change
        shown = frontdoor.get("url") or ("off" if not frontdoor.get("enabled") else "not listening (`stoker logs`)")
        if frontdoor.get("url"):  # who can reach it (a bind beyond loopback always requires keys)
            shown += (
                ", key required (`stoker key create`)"
                if frontdoor.get("require_keys")
                else ", no key required: any local user can use it (`stoker key require` to ask for one)"
            )
        lines.append(f"frontdoor {shown}")
    ollama = st.get("ollama")
    if isinstance(ollama, dict):  # Ollama's API: where its clients connect, or why they cannot
        if ollama.get("url"):
            lines.append(f"ollama    {ollama['url']}")
        elif ollama.get("reason"):
            lines.append(f"ollama    not listening: {ollama['reason']}: {ollama.get('message') or ''}".rstrip())
        else:
            lines.append("ollama    off" if not ollama.get("enabled") else "ollama    not listening (`stoker logs`)")
    layers = st.get("layers") or {}
    if st.get("backend") == "cpu" and layers.get("offloaded") is None:
        lines.append(f"layers    none offloaded (CPU){': ' + layers['why'] if layers.get('why') else ''}")
    elif layers.get("offloaded") is not None or layers.get("planned") is not None:
        lines.append(
            f"layers    {_or_dash(layers.get('offloaded'))}/{_or_dash(layers.get('total'))} offloaded"
            f" (planned {_or_dash(layers.get('planned'))}){' - ' + layers['why'] if layers.get('why') else ''}"
        )

    lines.extend(worker_lines(st.get("workers")))
    if st.get("pid"):
        # uptime_s is null until the server is ready (loading, or adopted and not yet proven).
        uptime = st.get("uptime_s")
        shown = "-" if uptime is None else f"{uptime:.0f}s"
        lines.append(f"pid       {st['pid']}   uptime {shown}   restarts {st.get('restarts', 0)}")
    store = st.get("store") or {}
    if store.get("writable") is False:
        # The daemon keeps running on a full or read-only disk; say so, and what waits.
        lines.append(click.style(f"store     {store.get('reason')}: {store.get('message')}", fg="red"))
    cfg = st.get("config") or {}
    if cfg.get("problems"):
        lines.append(click.style("config    invalid, still running the previous config:", fg="yellow"))
        lines.extend(f"          - {p}" for p in cfg["problems"])
    for fb in st.get("fallbacks") or []:
        lines.append(f"fallback  {fb.get('backend')}: {fb.get('reason')} - {fb.get('message', '')}")
        if (fb.get("evidence") or {}).get("hint"):
            lines.append(f"          hint: {fb['evidence']['hint']}")
    models = st.get("models") or []
    if len(models) > 1 or any(m.get("name") != "default" for m in models):
        lines.extend(format_models(models, st.get("max_loaded"), st.get("name"), st.get("memory_caps")))
    lines.extend(format_remotes(st.get("remotes") or []))
    lines.extend(format_pulls(st.get("pulls") or []))
    lines.extend(format_installs(st.get("installs") or []))
    return "\n".join(lines)


def format_remotes(remotes: list[dict[str, Any]]) -> list[str]:
    """Each model served by an external endpoint: where, whether it answers (the latest of its
    check and its last request), the check's latency, its key's variable (never the key)."""
    out = []
    for r in remotes:
        check = r.get("check") or {}
        answers = {True: "reachable", False: "unreachable", None: "not checked yet"}[r.get("reachable")]
        line = f"remote    {r.get('name')}{'*' if r.get('default') else ''} -> {r.get('endpoint')}"
        line += f" ({r.get('remote_model')}): {answers}"
        if check.get("latency_ms") is not None:
            line += f", check {check['latency_ms']:.0f} ms"
        if r.get("api_key_env"):
            line += f", key ${r['api_key_env']} {'set' if r.get('key_set') else 'NOT SET'}"
        line += ", accelerated: unknown"
        readings = [x for x in (r.get("check"), r.get("last_request")) if x]
        latest: dict[str, Any] = max(readings, key=lambda x: x.get("at") or 0, default={})
        if r.get("reason") or latest.get("error"):
            reason = f" [{r['reason']}]" if r.get("reason") else ""
            line = click.style(f"{line}{reason} {latest.get('error') or ''}".rstrip(), fg="yellow")
        out.append(line)
    return out


def format_installs(installs: list[dict[str, Any]]) -> list[str]:
    """Each engine bundle's install: where it came from, or the source it is trying and a build's progress."""
    out = []
    for i in installs:
        done = i.get("state") == "installed"
        line = f"engine    {i.get('backend')}-{i.get('variant')}: {i.get('state')}"
        line += f" from {i.get('source')}" if done else f" ({i.get('source') or '-'})"
        if done and i.get("version"):  # what the slot holds, whoever put it there
            by = i.get("by")
            line += f" ({i['version']}" + (f", by {str(by).replace('_', ' ')})" if by not in (None, "install") else ")")
        progress = i.get("progress") or {}
        if i.get("state") == "building" and progress.get("percent") is not None:
            line += f" {progress.get('step')} {progress['percent']}%"
        elif i.get("state") == "building" and progress.get("line"):
            line += f" {progress['line'][:70]}"
        if i.get("reason"):
            line += f" [{i['reason']}]"
        out.append(line)
    return out


def format_pulls(pulls: list[dict[str, Any]]) -> list[str]:
    """The pulls under way, one line each: its state, then its last progress as `stoker pull` draws it."""
    width = max((len(str(p.get("name"))) for p in pulls), default=0)
    out = []
    for p in pulls:
        line = f"pull      {str(p.get('name')):<{width}}  {p.get('state')}"
        if p.get("bytes_done") is not None:
            line += f" ({p.get('phase')})  " + progress_line(p)
        out.append(line)
    return out


def _mib(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "?"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def memory_text(memory: dict[str, Any] | None) -> str:
    """What a model's server holds: `ram 812 MiB`, `+ vram 5.6 GiB` on an accelerator (the proof's
    reading at ready), `+ vram ?` where it could not be read; `-` without a process."""
    memory = memory or {}
    if memory.get("rss_mib") is None:
        return "-"
    text = f"ram {_mib(memory['rss_mib'])}"
    if memory.get("on_accelerator"):
        text += f" + vram {_mib(memory.get('vram_mib'))}"
    return text


def estimate_text(memory: dict[str, Any] | None) -> str:
    """Which estimate answered its plan, and its figures: `fit 27 MiB`, `fit 1 MiB + vram 5.6 GiB`,
    `stoker 24 MiB (partial)`; `-` without a plan."""
    estimate = (memory or {}).get("estimate")
    if not estimate:
        return "-"
    source = "fit" if estimate.get("source") == "llama-fit-params" else str(estimate.get("source"))
    text = f"{source} {_mib(estimate.get('ram_mib'))}"
    if estimate.get("vram_mib"):
        text += f" + vram {_mib(estimate['vram_mib'])}"
    return text + (" (partial)" if estimate.get("partial") else "")


def _seconds(value: object) -> str:
    return "-" if not isinstance(value, (int, float)) else f"{value:.0f}s"


def format_models(
    models: list[dict[str, Any]], max_loaded: object, shown: object, caps: dict[str, Any] | None = None
) -> list[str]:
    """Every configured model on one line: state, the backend really in use, why (a model unloaded
    for idleness: the slots saved to restore), layers, idle seconds against its
    TTL, pinned and default, and the countdown to its idle unload; `>` marks the one described above."""
    rows = [("", "MODEL", "STATE", "BACKEND", "LAYERS", "MEMORY", "ESTIMATE", "IDLE/TTL", "WHY", "")]
    for m in models:
        layers = m.get("layers") or {}
        offloaded, total = layers.get("offloaded"), layers.get("total")
        ttl = m.get("idle_ttl_s")
        flags = [f for f, on in (("default", m.get("default")), ("pinned", m.get("pinned"))) if on]
        if m.get("in_flight"):
            flags.append(f"{m['in_flight']} in flight")
        why = m.get("reason") or m.get("down_cause") or ("loads on demand" if m.get("loads_on_demand") else "-")
        if m.get("state") == "stopped" and m.get("down_cause") == "idle":
            saved = m.get("slots_saved")
            why = "unloaded (idle)" + ("" if saved is None else f", {saved} slots saved")
        elif m.get("idle_unload_in_s") is not None:
            flags.append(f"unloads in {_seconds(m['idle_unload_in_s'])}")
        rows.append(
            (
                ">" if m.get("name") == shown else " ",
                str(m.get("name")),
                str(m.get("state")),
                m.get("backend") or "-",
                "-" if offloaded is None and total is None else f"{_or_dash(offloaded)}/{_or_dash(total)}",
                memory_text(m.get("memory")),
                estimate_text(m.get("memory")),
                f"{_seconds(m.get('idle_s'))}/{_seconds(ttl) if ttl else 'never'}",
                str(why),
                ", ".join(flags),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    limits = caps or {}
    capped = [
        f"{kind} {_mib(limits[key])}"
        for kind, key in (("ram", "max_ram_mib"), ("vram", "max_vram_mib"))
        if limits.get(key)
    ]
    out = [
        f"models    at most {max_loaded} loaded at once"
        + (f", holding at most {' and '.join(capped)}" if capped else "")
    ]
    out += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    return out


MODEL = click.argument("model", required=False)


def _named(model: str | None) -> dict[str, Any]:
    """The `model` parameter, only when one is named (a daemon from before several models knows none)."""
    return {} if model is None else {"model": model}


@click.command()
@MODEL
@json_option
def status(model: str | None, as_json: bool) -> None:
    """State, backend, reason and message, model, endpoint, layers; then every configured model.

    The details are the default model's, or MODEL's (its [models.NAME]); `--json` has them at the
    top level and every model in `models`.
    """
    from stoker.daemon.control.status_records import Status

    reply, st = ask("status", as_json, Status, **_named(model))
    emit(as_json, reply, format_status)
    if st.state == "failed":
        sys.exit(1)


def wait_for_settled(as_json: bool, timeout: float, model: str | None = None) -> tuple[Any, Status]:
    """Until the model's server is ready or has settled in failure (or time is up): the last
    status reply as sent, and as its record. It subscribes to the daemon's events first, then
    asks status, and asks again only when a launch machine moves (`machine.launch.*`), so ready
    is seen as the daemon publishes it, with no polling in between (only a stream the daemon
    dropped, its reader having fallen behind, leaves the rest of the time to polling)."""
    import threading

    from stoker.daemon.control.status_records import Status

    deadline = time.monotonic() + timeout
    with reported(as_json):
        events = _client(timeout=10.0).subscribe()
    # The stream blocks until the next event: time up closes it, and the last status stands.
    timer = threading.Timer(max(0.0, timeout), events.close)
    timer.daemon = True
    timer.start()
    try:
        reply, st = ask("status", as_json, Status, **_named(model))
        if st.state in READY_STATES | SETTLED_FAILURES:
            return reply, st
        for event in events:
            topic = str(event.get("topic", ""))
            if topic.startswith("machine.launch.") or topic == "dropped":
                reply, st = ask("status", as_json, Status, **_named(model))
                if st.state in READY_STATES | SETTLED_FAILURES:
                    return reply, st
    finally:
        timer.cancel()
        events.close()
    # The stream ended before time was up (it fell behind and was dropped): poll what is left.
    while True:
        reply, st = ask("status", as_json, Status, **_named(model))
        if st.state in READY_STATES | SETTLED_FAILURES or time.monotonic() > deadline:
            return reply, st
        time.sleep(0.2)


def _finish(as_json: bool, reply: Any, st: Status, want: str) -> None:
    emit(as_json, reply, format_status)
    if st.state != want:
        sys.exit(1)


# `up` and `restart` may first stop the least recently used model to make room: drained (its
# answers finish, up to 30 s), its snapshots saved, then TERM.
START_CALL_TIMEOUT = 120.0


@click.command()
@MODEL
@click.option("--wait/--no-wait", default=True, help="Wait until the server is ready (default).")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for ready.")
@json_option
def up(model: str | None, wait: bool, timeout: float, as_json: bool) -> None:
    """Start the default model's server, or MODEL's (making room first when max_loaded are loaded)."""
    _start("up", as_json, wait, timeout, model)


def _start(method: str, as_json: bool, wait: bool, timeout: float, model: str | None = None) -> None:
    """up or restart, then wait until ready (exit 1 if it settles otherwise), or print at once."""
    reply = call(method, as_json, START_CALL_TIMEOUT, **_named(model))
    if wait:
        reply, st = wait_for_settled(as_json, timeout, model)
        _finish(as_json, reply, st, "ready")
    else:
        emit(as_json, reply, format_status)


@click.command()
@MODEL
@json_option
def down(model: str | None, as_json: bool) -> None:
    """Stop the default model's server, or MODEL's (the daemon and the other models keep running).

    It stays down until `stoker up [MODEL]`: requests for it are answered 503 meanwhile.
    """
    from stoker.daemon.control.status_records import Status

    reply, st = ask("down", as_json, Status, 120.0, **_named(model))
    _finish(as_json, reply, st, "stopped")


@click.command()
@MODEL
@click.option("--wait/--no-wait", default=True)
@click.option("--timeout", default=900.0, show_default=True)
@json_option
def restart(model: str | None, wait: bool, timeout: float, as_json: bool) -> None:
    """Restart the default model's server, or MODEL's."""
    _start("restart", as_json, wait, timeout, model)


@click.command()
@json_option
def shutdown(as_json: bool) -> None:
    """Stop every server and the daemon."""
    result = call("shutdown", as_json, timeout=120.0)
    emit(as_json, result, lambda r: "daemon stopping")


def format_history(rows: Sequence[TransitionRecord]) -> str:
    """One line per transition: when, which machine, from --event--> to, and the reason."""
    if not rows:
        return "no transitions recorded"
    out = []
    for row in rows:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(row.at))
        line = f"{at}  {row.machine_id:<14} {row.from_state:>12} --{row.event}--> {row.to_state}"
        if row.reason:
            line += f"  [{row.reason}]"
        out.append(line)
    return "\n".join(out)


@click.command()
@click.option("--machine", "machine", default=None, help="Only this machine (e.g. launch, install:cuda).")
@click.option(
    "--model", "model", default=None, help="Only this model's launch and fallback machines (its [models.NAME])."
)
@click.option("--limit", default=50, show_default=True)
@click.option("--since", default=None, type=float, help="Only transitions after this unix time.")
@json_option
def history(machine: str | None, model: str | None, limit: int, since: float | None, as_json: bool) -> None:
    """Transitions of every machine, newest first."""
    from stoker.store.records import TransitionRecord

    params: dict[str, Any] = {"machine": machine, "limit": limit, "since": since, **_named(model)}
    reply, rows = ask("history", as_json, tuple[TransitionRecord, ...], **params)
    emit(as_json, reply, lambda _: format_history(rows))


def register(cli: click.Group) -> None:
    for command in (daemon, status, up, down, restart, shutdown, history):
        cli.add_command(command)
