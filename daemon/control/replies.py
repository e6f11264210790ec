"""The records every socket method replies with: what the daemon sends and the clients read.

A handler returns one of these (the method declares it: `@method(..., result=Record)`); the
control server writes it as JSON through states/convert.py's one converter, and a client reads
it back with `ControlClient.call(method, returns=Record)`, which ignores fields it does not know
and names the ones it needs and did not get (daemon_version_skew). The field names are the JSON
keys the CLI, the TUI and scripts read: rename one and every client breaks.

The CLI and the TUI import this module, so it imports records only: no trio, no daemon side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import attrs

from stoker.daemon.control.snapshot_replies import SnapshotRestored as SnapshotRestored
from stoker.daemon.control.status_records import EngineSlot, FrontDoorStatus, Status
from stoker.daemon.backends.base import Device
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
class StatusText:
    """`status.text`: what `stoker status` or `stoker ps` prints, rendered by the daemon, and
    whether the model described has failed (`stoker status` then exits 1)."""

    text: str
    failed: bool


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
class KeyRequirement:
    """`key.require`: whether the front door now asks every client for a key, whether this call
    changed it, the config file it was written to, and the front door as status shows it."""

    require_keys: bool
    changed: bool
    config_path: str
    frontdoor: FrontDoorStatus


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
    # state current with a newer release offered but held back (engine_update_rolled_back: it was
    # rolled back here before); None when nothing newer is offered
    reason: str | None = None


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
    """`model.rm`: the catalog name removed, and the file deleted with it or kept (`why` says
    why it was kept: another name uses it, it is the user's own file, it lies outside Stoker's
    models directory)."""

    removed: str
    deleted: str | None
    kept: str | None = None
    why: str | None = None


# --- telemetry -----------------------------------------------------------------------------


@attrs.frozen
class TelemetryReading:
    """`telemetry`: the (cached) sample, as `telemetry.sample` events carry it, and the short
    history for sparklines, oldest first."""

    sample: dict[str, Any]
    history: tuple[dict[str, Any], ...]
    ttl_s: float
