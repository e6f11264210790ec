"""What the control handlers may see and do of the daemon: the narrow interface they type against.

The handlers never import the daemon itself (`daemon.runtime` sits above `daemon.control` in
the layers contract, and importing it back would be an import cycle). The root
nursery's `Daemon` satisfies these protocols structurally; a handler that needs something new
adds it here first, so this file stays the complete list of what a socket method can reach.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

import attrs

from stoker.daemon.core.paths import StokerPaths
from stoker.states.launch import records as LR

if TYPE_CHECKING:
    from stoker.daemon.backends.base import Detection
    from stoker.daemon.bundles.installed import InstalledBundle
    from stoker.daemon.config.model import Config
    from stoker.daemon.control.replies import (
        ApiKey,
        CreatedApiKey,
        ModelList,
        ModelRemoved,
        SnapshotListing,
        SnapshotRestored,
        TelemetryReading,
    )
    from stoker.daemon.fleet.fleet import Fleet
    from stoker.daemon.fleet.member import Member
    from stoker.daemon.install.update import EngineUpdateService
    from stoker.daemon.probes.verdicts import ProbeResult
    from stoker.store.database import StoreHealth
    from stoker.store.records import TransitionRecord
    from stoker.store.catalog import ModelRecord
    from stoker.store.snapshots import SnapshotRecord


@attrs.frozen
class HistoryQuery:
    """Which recorded transitions the `history` method asks for (None: any)."""

    machine: str | None
    kind: str | None
    since: float | None
    until: float | None
    limit: int
    machines: Sequence[str] | None = None  # only these machine ids


class LaunchControl(Protocol):
    """The launch machine as the handlers see it: its state and data, and events to fire."""

    @property
    def state(self) -> LR.LaunchState: ...

    @property
    def data(self) -> LR.LaunchData: ...

    @property
    def ready_evidence(self) -> Mapping[str, Any] | None:
        """What the server reported when it became ready (layers, n_ctx, snapshots)."""

    @property
    def ready_at(self) -> float | None:
        """Unix time the server became ready; None before (and after an adoption until proven)."""

    @property
    def restarts(self) -> int: ...

    def endpoint(self) -> tuple[str | None, str | None]:
        """The server's base URL and per-launch API key (None, None without a plan)."""

    def fire(self, event: Any) -> object:
        """Fire a launch event; raises IllegalTransition where the machine refuses it."""

    def offer(self, event: Any) -> object:
        """Fire a launch event where the machine takes it; ignore it where it does not."""

    async def wait_stopped(self) -> None:
        """Until the stop under way (if any) has completed: its process is gone."""


class ControlledDaemon(Protocol):
    """Everything a socket method may read or ask of the daemon, and nothing else."""

    # --- where things are, and the config ------------------------------------------------

    @property
    def paths(self) -> StokerPaths:
        """Where the config file, the logs and the socket are."""

    @property
    def started_at(self) -> float: ...

    @property
    def config(self) -> Config: ...

    @property
    def config_problems(self) -> Sequence[str]:
        """Why the config file on disk was refused (empty: it is the one in use)."""

    @property
    def config_loaded_invalid(self) -> bool:
        """No valid config was ever read: `up` is refused until the file is fixed."""

    def on_config_change(self, new: Config) -> bool:
        """Apply a config read from the file (what the watcher does), relaunching if needed; False
        when the config machine refused it (its model cannot load: `config_problems` say why)."""

    # --- the launch machine --------------------------------------------------------------

    @property
    def supervisor(self) -> LaunchControl:
        """The default model's launch machine."""

    @property
    def fleet(self) -> Fleet:
        """Every configured model (daemon/fleet/): `member(name)` finds one, `load` starts one
        within [placement] max_loaded."""

    def launch_settings(self) -> LR.LaunchSettings:
        """The settings the default model's UpRequested carries, from the config in use."""

    async def wait_state(self, states: Iterable[LR.LaunchState]) -> None:
        """Return once the default model's launch machine is in one of `states`."""

    def request_shutdown(self) -> None:
        """Stop the server, then the daemon (after this request's reply has gone out)."""

    # --- what `status` is built from -----------------------------------------------------

    def fallback_status(self, member: Member | None = None) -> Mapping[str, Any]:
        """A model's fallback orchestrator's part (default: the default model's): effective
        backend, fallbacks, preference, layers."""

    def probe_verdicts(self) -> Mapping[str, Mapping[str, Any]]:
        """Each probed backend's last verdict."""

    def store_health(self) -> StoreHealth:
        """Whether transitions reach the state database, and how many wait in memory."""

    # --- history, probes, installs -------------------------------------------------------

    def history(self, query: HistoryQuery) -> Sequence[TransitionRecord]:
        """Recorded transitions, newest first."""

    @property
    def frontdoor_binds(self) -> Sequence[str] | None:
        """The front door's bound URLs ([] when off or its port was taken; None before it started)."""

    @property
    def ollama_url(self) -> str | None:
        """The URL Ollama's API listens on (None: off, not started yet, or its port was taken)."""

    @property
    def ollama_error(self) -> str | None:
        """Why Ollama's listener could not bind (the OS's words), None when it listens or is off."""

    @property
    def backend_names(self) -> Sequence[str]:
        """The loaded backend plugins, in the registry's order."""

    async def probe(self, backend: str) -> ProbeResult: ...

    async def probe_all(self, names: Sequence[str], *, fresh: bool) -> Mapping[str, ProbeResult]: ...

    async def install(self, backend: str, *, variant: str | None, detection: Detection) -> InstalledBundle: ...

    async def install_file(self, path: Path, *, smoke: bool, detection: Detection | None) -> InstalledBundle: ...

    def install_statistics(self) -> Sequence[Mapping[str, Any]]:
        """Every install machine: state, reason, the source of its bundle, sources tried, a build's progress."""

    @property
    def engine_updates(self) -> EngineUpdateService:
        """Engine updates and rollbacks, one machine per bundle slot (daemon/install/update.py)."""

    # --- KV slot snapshots ---------------------------------------------------------------

    def snapshot_status(self, member: Member | None = None) -> dict[str, Any] | None:
        """The `snapshots` part of status: a model's ready server's report and the latest drops."""

    def snapshot_listing(self, instance: str) -> SnapshotListing:
        """The snapshots of one instance (a model's NAME) with whether each fits its ready server."""

    def snapshot(self, snapshot_id: int, instance: str) -> SnapshotRecord:
        """One of `instance`'s snapshots; StokerError(snapshot_not_found) if there is none,
        (snapshot_instance_mismatch) if another instance saved it."""

    async def save_snapshots(self, member: Member, slot: int | None) -> Sequence[SnapshotRecord]:
        """Save the non-empty slots (or one) of `member`'s ready server now."""

    async def restore_snapshot(
        self, member: Member, snapshot_id: int, slot: int | None, if_faster: bool = False
    ) -> SnapshotRestored:
        """Restore one of `member`'s snapshots into its ready server (`if_faster`: unless its
        re-prefill is measured to be clearly faster)."""

    def remove_snapshot(self, record: SnapshotRecord) -> None: ...

    # --- telemetry -----------------------------------------------------------------------

    async def telemetry(self) -> TelemetryReading:
        """The telemetry service's reading: the (cached) sample and the short history."""

    # --- the user's API keys (store/keys.py) ---------------------------------------------

    def create_key(self, name: str | None) -> CreatedApiKey:
        """A new key's public fields and, this once, the key itself (`key`)."""

    def list_keys(self) -> Sequence[ApiKey]:
        """Every key's public fields (never the key nor its hash)."""

    def revoke_key(self, ident: str) -> ApiKey:
        """Revoke a key by id or prefix; StokerError(key_not_found) if none (or several) match."""

    # --- the model catalog and pulls (daemon/models/pull.py) -----------------------------

    async def pull_model(
        self, spec: str, *, name: str | None, hf_endpoint: str | None, hf_token: str | None, index_url: str | None
    ) -> ModelRecord:
        """Pull `spec` into the catalog; the cataloged model."""

    def list_models(self) -> ModelList:
        """{models: the catalog (each with the configured models that serve it), pulls: every
        pull machine's state and reason}."""

    def pulls_under_way(self) -> Sequence[Mapping[str, Any]]:
        """The pulls now working, with their last progress (name, spec, state, phase,
        bytes_done, total, rate, eta)."""

    async def remove_model(self, name: str) -> ModelRemoved:
        """Remove a model (refused while the running server serves it)."""
