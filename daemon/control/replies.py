"""The records every socket method replies with: what the daemon sends and the clients read.

A handler returns one of these (the method declares it: `@method(..., result=Record)`); the
control server writes it as JSON through states/convert.py's one converter, and a client reads
it back with `ControlClient.call(method, returns=Record)`, which ignores fields it does not know
and names the ones it needs and did not get (daemon_version_skew). The field names are the JSON
keys the CLI, the TUI and scripts read: rename one and every client breaks.

The CLI and the TUI import this module, so it imports records only: no trio, no daemon side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Mapping

import attrs

from stoker.daemon.backends.base import Device
from stoker.daemon.fleet.remote_status import RemoteStatus
from stoker.store.catalog import ModelRecord
from stoker.store.snapshots import SnapshotRecord

if TYPE_CHECKING:
    from stoker.store.keys import CreatedKey, KeyRecord


@attrs.frozen
class Pong:
    """`ping`: the daemon is alive, with its pid and the version it runs."""

    pong: bool
    pid: int
    version: str | None = None  # absent from daemons before it was added


@attrs.frozen
class ServedBy:
    """A configured model that serves a cataloged file, and its launch state."""

    name: str
    state: str


@attrs.frozen
class CatalogModel(ModelRecord):
    """A cataloged model as `model.list` shows it: the catalog row and who serves it now."""

    served_by: tuple[ServedBy, ...] | None = None  # None: no daemon said (the catalog was read without one)


@attrs.frozen
class PullState:
    """A pull machine's state and why it is there (unfinished pulls included)."""

    name: str | None
    state: str
    reason: str | None
    spec: str | None


@attrs.frozen
class ModelList:
    """`model.list`: the catalog and every pull machine."""

    models: tuple[CatalogModel, ...]
    pulls: tuple[PullState, ...]


# --- status, up, down, restart ------------------------------------------------------------


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
    enabled: bool  # `[frontdoor] enabled`; it, host and port take effect at the daemon's start
    address: str  # host:port, as the config says
    require_keys: bool


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
    engine: EngineSlot | None = None
    # Models served by an external endpoint ([models.NAME] endpoint): no server of Stoker's; the
    # endpoint's last check and last request, its key's variable (set or not, never its value).
    remotes: tuple[RemoteStatus, ...] = ()


@attrs.frozen
class Stopping:
    """`shutdown`: the daemon stops its servers, then itself, after this reply."""

    stopping: bool


# --- backends ------------------------------------------------------------------------------


@attrs.frozen
class ProbeReport:
    """One backend's probe verdict (a detection), its cache generation and age."""

    backend: str
    present: bool
    usable: bool
    reason: str | None
    message: str
    devices: tuple[Device, ...]
    evidence: dict[str, Any]
    generation: int
    cached: bool
    age_s: float


@attrs.frozen
class ProbeReply:
    """`probe`: every backend asked for, and how long the probes took."""

    backends: tuple[ProbeReport, ...]
    elapsed_s: float


@attrs.frozen
class PreferenceWritten:
    """`use`: the preference persisted, where, whether a server relaunches on it, the status now."""

    prefer: str
    forced: bool
    config_path: str
    relaunch: bool
    status: Status


@attrs.frozen
class BundleInfo:
    """An installed engine bundle: where it is, its server, and what it was built as."""

    root: str
    server: str
    backend: str
    variant: str
    version: str
    cache_key: str | None


@attrs.frozen
class Installed:
    """`install` and `bundle.install`: the bundle now installed."""

    installed: BundleInfo


# --- engine updates ------------------------------------------------------------------------


@attrs.frozen
class EngineStatus(EngineSlot):
    """`engine.status`: the slot's engine and its update machine's last steps, oldest first
    ({from, event, to, reason, at})."""

    history: tuple[dict[str, Any], ...] = ()


@attrs.frozen
class EngineOutcome:
    """`engine.update` and `engine.rollback`: where the slot's update machine came to rest."""

    slot: str
    state: str  # updated, current (nothing newer), rolled_back
    installed: str | None
    candidate: str | None
    gate: str | None
    verdicts: tuple[dict[str, Any], ...]
    by_hand: bool
    engine: EngineSlot
    history: tuple[dict[str, Any], ...]  # {from, event, to, reason, at}, oldest first
    message: str | None = None  # why nothing was updated (state current)


# --- snapshots -----------------------------------------------------------------------------


@attrs.frozen
class ListedSnapshot(SnapshotRecord):
    """A snapshot as `snapshot.list` shows it: its row, and whether it fits the model's running
    server (both null while none runs)."""

    fits_server: bool | None = None
    why_not: str | None = None  # the reason code it does not fit


@attrs.frozen
class SnapshotListing:
    """`snapshot.list`: one model's snapshots, newest first, beside the budgets every model shares."""

    model: str
    snapshots: tuple[ListedSnapshot, ...]
    total_bytes: int  # this model's
    all_bytes: int  # every model's: what max_bytes counts
    enabled: bool
    max_count: int
    max_bytes: int
    max_bytes_setting: int | Literal["auto"]
    dir: str
    server: dict[str, Any] | None  # the running server's identity and --swa-full figures
    dropped: tuple[dict[str, Any], ...]  # the latest snapshots given up, and why


@attrs.frozen
class SnapshotsSaved:
    """`snapshot.save`: the snapshots just written."""

    saved: tuple[SnapshotRecord, ...]


@attrs.frozen
class SnapshotRestored:
    """`snapshot.restore`: the engine's figures for the restore."""

    id: int
    slot: int
    n_tokens: int
    restore_ms: float | None
    checked: str  # how the file was checked: stat+sample or full_sha256
    resident: float | None  # the share of the file in the page cache before
    saved_on: str | None
    restored_on: str | None
    cross_backend: bool
    note: str | None = None  # what a restore across backends keeps


@attrs.frozen
class SnapshotRemoved:
    """`snapshot.rm`: the snapshot id removed."""

    removed: int


# --- API keys ------------------------------------------------------------------------------


@attrs.frozen
class ApiKey:
    """An API key as clients see it: never the key nor its hash."""

    id: int
    name: str | None
    prefix: str  # how it is shown: sk-stoker-AbCdEfGh...
    created_at: float
    last_used_at: float | None
    revoked: bool
    revoked_at: float | None

    @classmethod
    def of(cls, record: KeyRecord) -> "ApiKey":
        """The public part of a stored key."""
        return cls(
            record.id,
            record.name,
            record.display,
            record.created_at,
            record.last_used_at,
            record.revoked,
            record.revoked_at,
        )


@attrs.frozen
class CreatedApiKey(ApiKey):
    """`key.create`: the new key's public part and, this once, the key itself."""

    key: str = attrs.field(repr=False)

    @classmethod
    def made(cls, created: CreatedKey) -> "CreatedApiKey":
        """A key just made, shown this once."""
        shown = ApiKey.of(created.record)
        return cls(
            shown.id,
            shown.name,
            shown.prefix,
            shown.created_at,
            shown.last_used_at,
            shown.revoked,
            shown.revoked_at,
            key=created.key,
        )


@attrs.frozen
class KeyList:
    """`key.list`: every key, revoked ones too."""

    keys: tuple[ApiKey, ...]


# --- models --------------------------------------------------------------------------------


@attrs.frozen
class Pulled:
    """`pull`: the cataloged model."""

    model: ModelRecord


@attrs.frozen
class ModelRemoved:
    """`model.rm`: the catalog name removed, the file deleted with it, or the user's file kept."""

    removed: str
    deleted: str | None
    kept: str | None = None


# --- telemetry -----------------------------------------------------------------------------


@attrs.frozen
class TelemetryReading:
    """`telemetry`: the (cached) sample, as `telemetry.sample` events carry it, and the short
    history for sparklines, oldest first."""

    sample: dict[str, Any]
    history: tuple[dict[str, Any], ...]
    ttl_s: float
