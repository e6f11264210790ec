"""The status document as a typed record, built in one place from the daemon's sources.

`build_status` reads the launch machine, the fallback orchestrator's part, the probe verdicts
and the config through the narrow `ControlledDaemon` interface and returns a frozen `Status`.
Its top-level fields describe one model (the default, or the one asked for), as they described
the only one before several could run; `models` lists every configured model.
The control reply turns it into JSON (daemon.control.protocol encodes attrs records field by
field), so the field names below are the JSON keys the CLI, the TUI and scripts read: rename
one and every client breaks. docs/protocol-methods.md lists the `status` reply.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Literal, Mapping

import attrs

from daemon.control.controlled import ControlledDaemon
from daemon.fallback.memory import estimate_json
from daemon.fleet.remote import RemoteStatus
from daemon.telemetry.sampler import process_rss_mib
from states import launch_records as LR
from states.idle_unload import due_in
from states.reasons import message_for

if TYPE_CHECKING:
    from daemon.fleet.member import Member

# States in which no server serves: no backend is in use (the last plan's stays in planned_backend).
_NOT_SERVING = (LR.LaunchState.FAILED, LR.LaunchState.STOPPED)


@attrs.frozen
class Layers:
    """Model layers on the GPU: as planned ("auto": the engine fits), as the engine reported."""

    planned: int | Literal["auto"] | None
    offloaded: int | None
    total: int | None
    why: str | None
    estimate: dict[str, Any] | None


@attrs.frozen
class Preference:
    """`[backend] prefer`, whether it is forced (no fallback), and the order tried."""

    prefer: str | None
    forced: bool
    candidates: tuple[str, ...]


@attrs.frozen
class Fallback:
    """A backend passed over, and the reason code that says why."""

    backend: str
    reason: str
    message: str
    evidence: dict[str, Any]


@attrs.frozen
class ProbeVerdict:
    """A backend's last probe verdict, as far as a glance needs it."""

    usable: bool
    reason: str | None
    generation: int


@attrs.frozen
class ConfigStatus:
    """The config file, and why it was refused (the previous config then stays in use)."""

    path: str
    valid: bool
    problems: tuple[str, ...]


@attrs.frozen
class StoreStatus:
    """Whether transitions reach the state database. While it refuses writes (a full or read-only
    disk) the daemon keeps running: `pending` transitions wait in memory, written in order once
    it can; `message` says what to do."""

    writable: bool
    reason: str | None  # store_write_failed while not writable
    message: str | None
    error: str | None  # SQLite's words: "database or disk is full"
    since: float | None
    pending: int


@attrs.frozen
class FrontDoorStatus:
    """Where clients reach the server: the front door (docs/frontdoor.md), its OpenAI base URL."""

    url: str | None  # http://host:port/v1 while it listens; null when off or its port was taken
    enabled: bool  # `[frontdoor] enabled`; it, host and port take effect at the daemon's start
    address: str  # host:port, as the config says
    require_keys: bool


def frontdoor_url(bind: str) -> str:
    """The /v1 base URL a client on this machine uses for a bound URL (a wildcard bind is
    reached through loopback)."""
    for wildcard, loopback in (("//0.0.0.0:", "//127.0.0.1:"), ("//[::]:", "//[::1]:")):
        bind = bind.replace(wildcard, loopback)
    return bind.rstrip("/") + "/v1"


def _frontdoor(daemon: ControlledDaemon) -> FrontDoorStatus:
    settings = daemon.config.frontdoor
    binds = daemon.frontdoor_binds
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return FrontDoorStatus(
        url=frontdoor_url(binds[0]) if binds else None,
        enabled=settings.enabled,
        address=f"{host}:{settings.port}",
        require_keys=settings.require_keys,
    )


@attrs.frozen
class ModelMemory:
    """What a model's server holds, as far as the daemon reads it. `partial`: it serves on an
    accelerator whose VRAM could not be read, so RSS alone is not all it holds."""

    rss_mib: (
        float | None
    )  # the server process's resident memory now (its mapped model pages included); null: no process
    # Its own VRAM as the proof of acceleration read it when it became ready (per process, through
    # its backend plugin); null: not on an accelerator, or not readable there. Live figures: `telemetry`.
    vram_mib: float | None
    on_accelerator: bool  # the backend really in use offloads (not the CPU)
    partial: bool
    # Its plan's memory estimate, which answered ("source": "llama-fit-params", or "stoker" where
    # the bundle has no fitter or it failed: "detail" says why) with its figures: ram_mib, vram_mib,
    # devices, parts (model/context/compute per device and Host), partial; null: no plan yet.
    estimate: dict[str, Any] | None = None
    # What placement counts for it now ([placement] max_ram_mib / max_vram_mib): ram_mib, vram_mib,
    # "reading" ("engine": the buffers its server reported as it loaded; else the estimate's
    # source), partial.
    placed: dict[str, Any] | None = None


@attrs.frozen
class InstallStatus:
    """An engine bundle's install machine: where its bundle came from (or is being looked for),
    every source tried for its last request, and a local build's progress while it runs."""

    machine: str  # install:<backend>-<variant>
    backend: str | None
    variant: str | None
    state: str  # resolving, searching_cache, checking_toolchain, building, ..., installed, failed
    reason: str | None
    source: str | None  # "mirror <manifest URL>", "build-cache", "local-build", "file <path>"
    origin: str | None  # where in that source: the manifest's URL, the cache entry, the file
    tried: tuple[dict[str, Any], ...]  # {source, origin, outcome, reason, message, step, seconds}
    progress: dict[str, Any] | None  # while building: {phase, source, line, step, percent}
    version: str | None = None  # what the slot holds, by its record (install, update and rollback alike)
    by: str | None = None  # who put it there: install, engine_update, engine_rollback
    previous: str | None = None  # what its `.previous` holds

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "InstallStatus":
        """From the install service's `statistics()` row."""
        return cls(
            str(row["machine"]),
            row.get("backend"),
            row.get("variant"),
            str(row["state"]),
            row.get("reason"),
            row.get("source"),
            row.get("origin"),
            tuple(row.get("tried") or ()),
            row.get("progress"),
            row.get("version"),
            row.get("by"),
            row.get("previous"),
        )


@attrs.frozen
class PullProgress:
    """A pull under way (a `pull.progress` event's figures; null before its first)."""

    name: str
    spec: str | None
    state: str  # the pull machine's: resolving, downloading, inspecting
    phase: str | None  # downloading, hashing
    bytes_done: int | None
    total: int | None
    rate: float | None  # bytes per second
    eta: float | None  # seconds


@attrs.frozen
class ModelStatus:
    """One configured model at a glance (`stoker status` lists every one)."""

    name: str
    model: str  # as the config names it: a catalog name or a path
    path: str | None  # the file its server runs (or last ran)
    default: bool
    pinned: bool
    state: str
    loads_on_demand: bool  # stopped, and a request that names it loads it
    down_cause: str | None  # who stopped it: user, evicted, shutdown, removed (null: never, or up since)
    backend: str | None  # the backend really in use (null unless it serves)
    planned_backend: str | None
    reason: str | None
    message: str | None
    layers: Layers
    pid: int | None
    restarts: int
    in_flight: int  # requests sent to its engine, answer not over
    waiting: int  # requests held for it
    idle_s: float | None  # seconds since its last request (or since ready); null unless ready
    idle_ttl_s: float  # [models.NAME] idle_ttl_s (0: never unloaded for idleness)
    # Seconds until it is unloaded for idleness (null: no TTL, pinned, not ready, in use).
    idle_unload_in_s: float | None
    # Slots its last stop saved, restored at its next load: from its own snapshot rows (null: snapshots off).
    slots_saved: int | None
    machines: tuple[str, ...]  # its launch and fallback machines' ids (`stoker history --model NAME` reads them)
    memory: ModelMemory
    workers: dict[str, Any] | None = None  # where the layers are over RPC workers (None: no [[workers]])


@attrs.frozen
class DaemonInfo:
    pid: int
    started_at: float
    socket: str


@attrs.frozen
class Status:
    """The reply of `status`, `up`, `down` and `restart` (and `use`'s `status`)."""

    state: str
    backend: str | None  # the backend really in use (after a late demotion: cpu)
    # How much of the model that backend holds: "full", "partial" (e.g. 15/33 layers, see
    # layers), "none" (demoted: cpu), or None (a CPU plan, or not ready yet).
    offload: str | None
    variant: str | None
    reason: str | None
    message: str | None  # the plan's own sentence where it has one, else the reason's
    evidence: dict[str, Any]
    model: str | None
    endpoint: str | None  # only while ready: a loading server's port is not yet an API (clients: frontdoor.url)
    api_key: str | None
    pid: int | None
    uptime_s: float | None  # None until ready (and after an adoption until it is proven)
    restarts: int
    crashes: int
    layers: Layers
    n_ctx: int | None
    snapshots: dict[str, Any] | None  # KV snapshots: benefit, --swa-full cost, restored/refused, decisions, drops
    log_path: str
    config: ConfigStatus
    store: StoreStatus
    daemon: DaemonInfo
    frontdoor: FrontDoorStatus
    planned_backend: str | None
    preference: Preference
    fallback_state: str
    fallback_reason: str | None
    fallbacks: tuple[Fallback, ...]
    probes: dict[str, ProbeVerdict]
    backends: tuple[str, ...]  # the loaded backend plugins: what a preference may name besides auto
    name: str  # the model the fields above describe (its NAME; "default" without [models])
    models: tuple[ModelStatus, ...]  # every configured model, in config order
    max_loaded: int  # how many models may be loaded at once ([placement] max_loaded, resolved)
    memory_caps: dict[str, int]  # [placement] max_ram_mib, max_vram_mib (0: no cap)
    pulls: tuple[PullProgress, ...]  # pulls under way, with their last progress
    installs: tuple[InstallStatus, ...] = ()  # every engine bundle's install: its source, a build's progress
    # The plan's RPC workers: used (address, devices, free MiB), left out (reason, evidence), the
    # tensor split, and after load the model MiB each holds by the engine's own lines (confirmed).
    workers: dict[str, Any] | None = None
    # The engine of the slot this model's plan runs on: {slot, version, previous (the version kept
    # for a rollback; null: none), update_state, update_reason} (daemon/install/update.py).
    engine: dict[str, Any] | None = None
    # Models served by an external endpoint ([models.NAME] endpoint): no server of Stoker's; the
    # endpoint's last check and last request, its key's variable (set or not, never its value).
    remotes: tuple[RemoteStatus, ...] = ()


def _message(data: LR.LaunchData) -> str | None:
    """The machine's own sentence where its evidence has one (forced backend, ...), else the reason's."""
    specific = data.evidence.get("message")
    if data.reason and isinstance(specific, str) and specific:
        return specific
    return message_for(data.reason) if data.reason else None


def _layers(layers: Mapping[str, Any]) -> Layers:
    return Layers(layers["planned"], layers["offloaded"], layers["total"], layers["why"], layers["estimate"])


def _memory(member: Member, backend: str | None) -> ModelMemory:
    """RSS read now from the live process; VRAM as the proof read it at ready."""
    pid = member.data.pid if member.state not in _NOT_SERVING else None
    on_accelerator = backend is not None and backend != LR.CPU_BACKEND
    vram = (member.supervisor.ready_evidence or {}).get("process_vram_mib") if on_accelerator else None
    vram_mib = float(vram) if isinstance(vram, (int, float)) else None
    plan = member.data.plan
    return ModelMemory(
        rss_mib=None if pid is None else process_rss_mib(pid),
        vram_mib=vram_mib,
        on_accelerator=on_accelerator,
        partial=on_accelerator and vram_mib is None,
        estimate=estimate_json(plan.memory) if plan is not None else None,
        placed=member.footprint().to_json() if member.occupies else None,
    )


def _pulls(daemon: ControlledDaemon) -> tuple[PullProgress, ...]:
    return tuple(
        PullProgress(
            name=str(p["name"]),
            spec=p.get("spec"),
            state=str(p["state"]),
            phase=p.get("phase"),
            bytes_done=p.get("bytes_done"),
            total=p.get("total"),
            rate=p.get("rate"),
            eta=p.get("eta"),
        )
        for p in daemon.pulls_under_way()
    )


def model_status(daemon: ControlledDaemon, member: Member) -> ModelStatus:
    """One model's line: state, the backend really in use, why, layers, use and idle time."""
    data, state = member.data, member.state
    fallback = daemon.fallback_status(member)
    serving = state not in _NOT_SERVING
    unload_in = due_in(member.idle_facts(), time.time())
    backend = fallback["backend"] if serving else None
    return ModelStatus(
        name=member.name,
        model=member.served.spec,
        path=data.plan.model_path if data.plan else None,
        default=member.served.default,
        pinned=member.served.pinned,
        state=state.value,
        loads_on_demand=member.loads_on_demand,
        down_cause=data.down_cause.value if data.down_cause else None,
        backend=backend,
        planned_backend=fallback["planned_backend"],
        reason=str(data.reason) if data.reason else None,
        message=_message(data),
        layers=_layers(fallback["layers"]),
        pid=data.pid,
        restarts=data.restarts,
        in_flight=member.usage.in_flight,
        waiting=member.usage.waiting,
        idle_s=round(member.idle_s(), 1) if state is LR.LaunchState.READY else None,
        idle_ttl_s=member.served.idle_ttl_s,
        idle_unload_in_s=None if unload_in is None else round(unload_in, 1),
        slots_saved=member.slots_saved,
        machines=member.machines,
        memory=_memory(member, backend),
        workers=fallback.get("workers"),
    )


def build_status(daemon: ControlledDaemon, member: Member | None = None) -> Status:
    """The status document now: `member`'s (default: the default model's) launch machine, its
    fallbacks and layers' why, the probes, and a line per configured model."""
    member = member or daemon.fleet.default
    sup = member.supervisor
    data = sup.data
    plan = data.plan
    state = sup.state
    ready = dict(sup.ready_evidence or {})
    endpoint, api_key = sup.endpoint()
    serving = state is LR.LaunchState.READY
    fallback = daemon.fallback_status(member)
    reason = str(data.reason) if data.reason else None
    fallbacks = tuple(
        Fallback(f["backend"], f["reason"], f["message"], dict(f["evidence"])) for f in fallback["fallbacks"]
    )
    preference = fallback["preference"]
    model = plan.model_path if plan else member.served.spec
    return Status(
        state=state.value,
        backend=None if state in _NOT_SERVING else fallback["backend"],
        offload=None if state in _NOT_SERVING else fallback.get("offload"),
        variant=plan.variant if plan else None,
        reason=reason,
        message=_message(data),
        evidence=dict(data.evidence),
        model=None if model is None else os.fspath(model),
        endpoint=endpoint if serving else None,
        api_key=api_key if serving else None,
        pid=data.pid,
        uptime_s=round(time.time() - sup.ready_at, 1) if sup.ready_at else None,
        restarts=sup.restarts,
        crashes=data.crashes,
        layers=_layers(fallback["layers"]),
        n_ctx=ready.get("n_ctx"),
        snapshots=daemon.snapshot_status(member),
        log_path=str(member.supervisor.log_path),
        config=ConfigStatus(str(daemon.paths.config_file), not daemon.config_problems, tuple(daemon.config_problems)),
        store=_store_status(daemon),
        daemon=DaemonInfo(os.getpid(), daemon.started_at, str(daemon.paths.socket_path)),
        frontdoor=_frontdoor(daemon),
        planned_backend=fallback["planned_backend"],
        preference=Preference(preference["prefer"], bool(preference["forced"]), tuple(preference["candidates"])),
        fallback_state=fallback["fallback_state"],
        fallback_reason=fallback["fallback_reason"],
        fallbacks=() if state is LR.LaunchState.STOPPED else fallbacks,
        probes={name: _verdict(v) for name, v in daemon.probe_verdicts().items()},
        backends=tuple(daemon.backend_names),
        name=member.name,
        models=tuple(model_status(daemon, m) for m in daemon.fleet.serving()),
        max_loaded=daemon.fleet.max_loaded(),
        memory_caps={
            "max_ram_mib": daemon.config.placement.max_ram_mib,
            "max_vram_mib": daemon.config.placement.max_vram_mib,
        },
        pulls=_pulls(daemon),
        installs=tuple(InstallStatus.from_row(row) for row in daemon.install_statistics()),
        workers=fallback.get("workers"),
        engine=None if plan is None else daemon.engine_updates.slot_status(plan.backend, plan.variant),
        remotes=tuple(r.status() for r in daemon.fleet.remotes.serving()),
    )


def _store_status(daemon: ControlledDaemon) -> StoreStatus:
    health = daemon.store_health()
    if health.writable:
        return StoreStatus(True, None, None, None, None, health.pending)
    message = (
        f"The state database {daemon.paths.db_file} cannot be written ({health.error}); the daemon keeps running "
        f"and {health.pending} transition(s) wait in memory, written in order once it can. Free space on its disk "
        f"or fix its permissions."
    )
    return StoreStatus(False, health.reason, message, health.error, health.since, health.pending)


def _verdict(verdict: Mapping[str, Any]) -> ProbeVerdict:
    return ProbeVerdict(bool(verdict["usable"]), verdict["reason"], verdict["generation"])
