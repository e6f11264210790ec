"""Control commands for KV slot snapshots: snapshot.list, snapshot.save, snapshot.restore, snapshot.rm."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from daemon.core.errors import StokerError
from daemon.control.handlers.service import handler
from states import launch as L
from states.reasons import ReasonCode

if TYPE_CHECKING:
    from daemon.service import Daemon


def _params(params: Mapping[str, Any], allowed: set[str], required: set[str] = frozenset()) -> None:
    unknown = set(params) - allowed
    if unknown:
        raise StokerError(ReasonCode.BAD_REQUEST, f"Unknown parameters {sorted(unknown)}.")
    missing = required - set(params)
    if missing:
        raise StokerError(ReasonCode.BAD_REQUEST, f"Missing parameters {sorted(missing)}.")


def _ready(daemon: "Daemon") -> None:
    if not daemon.config.snapshots.enabled:
        raise StokerError(ReasonCode.SNAPSHOTS_DISABLED)
    if daemon.supervisor.state is not L.LaunchState.READY:
        raise StokerError(ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"state": daemon.supervisor.state.value})


@handler("snapshot.list")
async def snapshot_list(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> {snapshots: [record + fits_server, why_not], total_bytes, enabled, max_count, max_bytes, dir, server}."""
    _params(params, set())
    return daemon.snapshots.listing(ready=daemon.supervisor.state is L.LaunchState.READY)


@handler("snapshot.save")
async def snapshot_save(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{slot?} -> {saved: [record]}: the non-empty slots (or one) saved now, cause "manual"."""
    _params(params, {"slot"})
    _ready(daemon)
    saved = await daemon.snapshots.save(daemon.supervisor, "manual", slot=params.get("slot"))
    return {"saved": [r.to_dict() for r in saved]}


@handler("snapshot.restore")
async def snapshot_restore(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{id, slot?} -> {id, slot, n_tokens, restore_ms}; refused with a reason code if it does not fit."""
    _params(params, {"id", "slot"}, {"id"})
    daemon.snapshots.get(params["id"])  # not_found before not_ready: the id is checked first
    _ready(daemon)
    return await daemon.snapshots.restore(daemon.supervisor, params["id"], params.get("slot"))


@handler("snapshot.rm")
async def snapshot_rm(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{id} -> {removed: id}: the file and its row go together."""
    _params(params, {"id"}, {"id"})
    daemon.snapshots.remove([daemon.snapshots.get(params["id"])])
    return {"removed": params["id"]}
