"""Socket methods for KV slot snapshots: snapshot.list, snapshot.save, snapshot.restore, snapshot.rm."""

from __future__ import annotations

from typing import Any, Mapping

from daemon.control.controlled import ControlledDaemon
from daemon.control.params import Kind, Param, method
from daemon.core.errors import StokerError
from states import launch_records as LR
from states.reasons import ReasonCode

# A slot's upper bound is the running server's slot count, known only to it: snapshot_bad_slot.
SLOT_DOC = "The server's slot (0 to its --parallel minus 1; else snapshot_bad_slot)."
ID = Param("id", Kind.INTEGER, "The snapshot's id, as snapshot.list shows it.", required=True)


def _ready(daemon: ControlledDaemon) -> None:
    if not daemon.config.snapshots.enabled:
        raise StokerError(ReasonCode.SNAPSHOTS_DISABLED)
    state = daemon.supervisor.state
    if state is not LR.LaunchState.READY:
        raise StokerError(ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"state": state.value})


@method("snapshot.list")
async def snapshot_list(daemon: ControlledDaemon, params: Mapping[str, Any]) -> dict[str, Any]:
    """Every catalogued snapshot, newest first, with whether it fits the running server.

    Reply: {snapshots: [record + fits_server, why_not], total_bytes, enabled, max_count,
    max_bytes, dir, server}.
    """
    return daemon.snapshot_listing()


@method(
    "snapshot.save",
    Param("slot", Kind.INTEGER, "Only this slot. " + SLOT_DOC),
    errors=(
        ReasonCode.SNAPSHOTS_DISABLED,
        ReasonCode.SNAPSHOT_SERVER_NOT_READY,
        ReasonCode.SNAPSHOT_BAD_SLOT,
        ReasonCode.SNAPSHOT_SAVE_FAILED,
        ReasonCode.SNAPSHOT_DISK_FULL,
        ReasonCode.SNAPSHOT_DROPPED,
    ),
)
async def snapshot_save(daemon: ControlledDaemon, params: Mapping[str, Any]) -> dict[str, Any]:
    """Save the non-empty slots (or one) now, with cause "manual".

    Reply: {saved: [record]}.
    """
    _ready(daemon)
    saved = await daemon.save_snapshots(params["slot"])
    return {"saved": [r.to_dict() for r in saved]}


@method(
    "snapshot.restore",
    ID,
    Param("slot", Kind.INTEGER, "Restore into this slot instead of the one it was saved from. " + SLOT_DOC),
    errors=(
        ReasonCode.SNAPSHOT_NOT_FOUND,
        ReasonCode.SNAPSHOTS_DISABLED,
        ReasonCode.SNAPSHOT_SERVER_NOT_READY,
        ReasonCode.SNAPSHOT_BAD_SLOT,
        ReasonCode.SNAPSHOT_MODEL_MISMATCH,
        ReasonCode.SNAPSHOT_ENGINE_MISMATCH,
        ReasonCode.SNAPSHOT_LAYOUT_MISMATCH,
        ReasonCode.SNAPSHOT_CORRUPT,
        ReasonCode.SNAPSHOT_RESTORE_FAILED,
    ),
)
async def snapshot_restore(daemon: ControlledDaemon, params: Mapping[str, Any]) -> dict[str, Any]:
    """Restore one snapshot into a slot of the running server; refused with a reason code if it does not fit.

    Reply: {id, slot, n_tokens, restore_ms, saved_on, restored_on, cross_backend, note?
    (a restore across backends says what it keeps)}.
    """
    daemon.snapshot(params["id"])  # not_found before not_ready: the id is checked first
    _ready(daemon)
    return await daemon.restore_snapshot(params["id"], params["slot"])


@method("snapshot.rm", ID, errors=(ReasonCode.SNAPSHOT_NOT_FOUND,))
async def snapshot_rm(daemon: ControlledDaemon, params: Mapping[str, Any]) -> dict[str, Any]:
    """Remove one snapshot: its file and its row go together.

    Reply: {removed: id}.
    """
    daemon.remove_snapshot(daemon.snapshot(params["id"]))
    return {"removed": params["id"]}
