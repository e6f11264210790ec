"""The status document: the records of the `status` reply (and `up`, `down`, `restart`).

Its top-level fields describe one model (the default, or the one asked for); `models` lists
every configured model. Built in one place, daemon/control/status.py; read by the CLI and the
TUI through states/convert.py's converter (daemon/control/replies.py says how).
"""

# No `from __future__ import annotations`: the field types are real types when the class is made,
# so the converter need not compile every annotation from its string at its first `status` (~25 ms
# of each `stoker status` and `stoker ps`).

from typing import Any, Literal, Mapping

import attrs

from stoker.daemon.fleet.remote_status import RemoteStatus


@attrs.frozen
class EngineSlot:
    """The engine of a bundle slot: its version, the one kept for a rollback (null: none), and
    its update machine's state (daemon/install/update.py)."""

    slot: str
    version: str | None
    previous: str | None
    update_state: str | None
    update_reason: str | None
    last_check: dict[str, Any] | None = None  # the last automatic update check, if one ran


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
    enabled: bool  # `[frontdoor] enabled`; it, host and port take effect at once (a reload rebinds)
    address: str  # host:port, as the config says (`url`: what is bound)
    require_keys: bool


@attrs.frozen
class OllamaStatus:
    """Ollama's API on the front door's listener of its own ([ollama], docs/ollama.md)."""

    url: str | None  # http://host:port while it listens; null when off or its port was taken
    enabled: bool  # `[ollama] enabled` (and `[frontdoor] enabled`); read at the daemon's start
    address: str  # host:port, as the config says
    reason: str | None  # ollama_port_taken while another program holds the port
    message: str | None  # what to do, with the bind's own error


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
    # Its plan's memory estimate, which answered ("source": "llama-fit-params"; "stoker-bound" where a
    # GPU plan clearly fits and no fitter ran; or "stoker" where the bundle has no fitter or it
    # failed: "detail" says why or what the bound was held against) with its figures: ram_mib, vram_mib,
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
    # The context its server allocated, all slots together, as the engine reported it once ready
    # (a request's larger num_ctx included); null unless it has been ready.
    n_ctx: int | None = None


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
    engine: EngineSlot | None = None
    # Models served by an external endpoint ([models.NAME] endpoint): no server of Stoker's; the
    # endpoint's last check and last request, its key's variable (set or not, never its value).
    remotes: tuple[RemoteStatus, ...] = ()
    ollama: OllamaStatus | None = None  # Ollama's API ([ollama]); null from a daemon that has none
