"""The text of `stoker status` and `stoker ps`, rendered from the status document.

One renderer for both places that print it: the CLI, when it has the document, and the daemon's
`status.text` method, which the CLI asks first so that `stoker status` and `stoker ps` print
without loading click, attrs or cattrs (daemon/cli/quick.py). Nothing here touches the terminal:
colours are ANSI codes, which `plain` takes out for a reader that is not a terminal.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from stoker.states.reasons import message_for

if TYPE_CHECKING:
    from stoker.daemon.control.status_records import ModelStatus, Status

_COLOURS = {"red": 31, "green": 32, "yellow": 33}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def style(text: str, fg: str | None = None, bold: bool = False) -> str:
    """`text` in colour `fg` (and bold), as ANSI codes a terminal draws and `plain` removes."""
    codes = ([f"\x1b[{_COLOURS[fg]}m"] if fg else []) + (["\x1b[1m"] if bold else [])
    return "".join(codes) + text + "\x1b[0m" if codes else text


def plain(text: str) -> str:
    """`text` without its colours."""
    return _ANSI.sub("", text)


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
    return (
        f"[{bar}] {frac * 100:3.0f}%  {_size(done)} / {_size(total)}  {_size(event.get('rate') or 0)}/s  {tail}"
    ).rstrip()


def _or_dash(value: object) -> str:
    return "-" if value is None else str(value)


def mib_text(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "?"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


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
    head = style(state, fg=colour, bold=True) if colour else state
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
        line = f"pid       {st['pid']}   uptime {shown}   restarts {st.get('restarts', 0)}"
        if st.get("n_ctx"):  # the context the engine allocated (all slots): a request's num_ctx may have raised it
            line += f"   context {st['n_ctx']}"
        lines.append(line)
    store = st.get("store") or {}
    if store.get("writable") is False:
        # The daemon keeps running on a full or read-only disk; say so, and what waits.
        lines.append(style(f"store     {store.get('reason')}: {store.get('message')}", fg="red"))
    cfg = st.get("config") or {}
    if cfg.get("problems"):
        lines.append(style("config    invalid, still running the previous config:", fg="yellow"))
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
            line = style(f"{line}{reason} {latest.get('error') or ''}".rstrip(), fg="yellow")
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


def memory_text(memory: dict[str, Any] | None) -> str:
    """What a model's server holds: `ram 812 MiB`, `+ vram 5.6 GiB` on an accelerator (the proof's
    reading at ready), `+ vram ?` where it could not be read; `-` without a process."""
    memory = memory or {}
    if memory.get("rss_mib") is None:
        return "-"
    text = f"ram {mib_text(memory['rss_mib'])}"
    if memory.get("on_accelerator"):
        text += f" + vram {mib_text(memory.get('vram_mib'))}"
    return text


def estimate_text(memory: dict[str, Any] | None) -> str:
    """Which estimate answered its plan, and its figures: `fit 27 MiB`, `fit 1 MiB + vram 5.6 GiB`,
    `stoker 24 MiB (partial)`; `-` without a plan."""
    estimate = (memory or {}).get("estimate")
    if not estimate:
        return "-"
    source = "fit" if estimate.get("source") == "llama-fit-params" else str(estimate.get("source"))
    text = f"{source} {mib_text(estimate.get('ram_mib'))}"
    if estimate.get("vram_mib"):
        text += f" + vram {mib_text(estimate['vram_mib'])}"
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
        f"{kind} {mib_text(limits[key])}"
        for kind, key in (("ram", "max_ram_mib"), ("vram", "max_vram_mib"))
        if limits.get(key)
    ]
    out = [
        f"models    at most {max_loaded} loaded at once"
        + (f", holding at most {' and '.join(capped)}" if capped else "")
    ]
    out += ["  " + "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    return out


# Every other state holds a server, or is on its way to or from one: what `ps` lists.
DOWN = ("stopped", "failed")


def _duration(value: float | None) -> str:
    if value is None:
        return "-"
    value = max(0.0, value)
    return f"{value:.0f}s" if value < 120 else f"{value / 60:.0f}m"


def _layers(m: ModelStatus) -> str:
    offloaded, total = m.layers.offloaded, m.layers.total
    if m.backend in (None, "cpu") or total is None:
        return "cpu" if m.backend == "cpu" else "-"
    return f"{offloaded if offloaded is not None else '?'}/{total}" + (" partial" if m.memory.partial else "")


def _memory(m: ModelStatus) -> str:
    text = mib_text(m.memory.rss_mib) if m.memory.rss_mib is not None else "-"
    if m.memory.on_accelerator:
        text += f" + vram {mib_text(m.memory.vram_mib)}"
    return text


def _unloads(m: ModelStatus) -> str:
    if m.pinned:
        return "pinned"
    if m.idle_ttl_s <= 0:
        return "never"
    if m.in_flight:
        return "in use"
    return f"in {_duration(m.idle_unload_in_s)}" if m.idle_unload_in_s is not None else "-"


def ps_rows(status: Status) -> list[tuple[str, ...]]:
    """One row per model that holds a server: name, state, backend, layers, context, memory, idle, unload."""
    rows: list[tuple[str, ...]] = [("NAME", "STATE", "BACKEND", "LAYERS", "CTX", "MEMORY", "IDLE", "UNLOADS")]
    for m in status.models:
        if m.state in DOWN:
            continue
        rows.append(
            (
                m.name,
                m.state,
                m.backend or m.planned_backend or "-",
                _layers(m),
                str(m.n_ctx) if m.n_ctx else "-",
                _memory(m),
                _duration(m.idle_s),
                _unloads(m),
            )
        )
    return rows


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def ps_text(status: Status) -> str:
    """`stoker ps`: the table of the models that hold a server, or a line saying none does."""
    rows = ps_rows(status)
    return table(rows) if len(rows) > 1 else f"no model is loaded ({len(status.models)} can load on demand)"
