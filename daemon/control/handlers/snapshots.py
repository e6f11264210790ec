"""Socket methods for KV slot snapshots: snapshot.list, snapshot.save, snapshot.restore, snapshot.rm.

Each acts on one model's snapshots (its server instance's: `model`, default the default model):
a snapshot belongs to the model that saved it, never to another, even one serving the same file.
"""

from __future__ import annotations

from typing import Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.params import Kind, Param, method
from stoker.daemon.control.replies import SnapshotListing, SnapshotRemoved, SnapshotRestored, SnapshotsSaved
from stoker.daemon.core.errors import StokerError
from stoker.daemon.fleet.member import Member
from stoker.daemon.launch.instance import ServerInstance
from stoker.states.launch import records as LR
from stoker.states.reasons import ReasonCode

# A slot's upper bound is the running server's slot count, known only to it: snapshot_bad_slot.
SLOT_DOC = "The server's slot (0 to its --parallel minus 1; else snapshot_bad_slot)."
ID = Param("id", Kind.INTEGER, "The snapshot's id, as snapshot.list shows it.", required=True)
MODEL = Param(
    "model",
    Kind.STRING,
    "The configured model whose snapshots these are (its [models.NAME], or any name a request may use for it); "
    "default: the default model.",
)
# list and rm also reach the snapshots a model removed from the config left behind.
# What a save from, or a restore into, a running server's slot can be refused with.
INTO_A_SLOT = (
    ReasonCode.MODEL_NOT_FOUND,
    ReasonCode.SNAPSHOTS_DISABLED,
    ReasonCode.SNAPSHOT_SERVER_NOT_READY,
    ReasonCode.SNAPSHOT_BAD_SLOT,
)
PAST_MODEL = Param("model", Kind.STRING, MODEL.doc + " Also the NAME of a model configured before.")


def _ready(daemon: ControlledDaemon, member: Member) -> None:
    if not daemon.config.snapshots.enabled:
        raise StokerError(ReasonCode.SNAPSHOTS_DISABLED)
    state = member.state
    if state is not LR.LaunchState.READY:
        raise StokerError(ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"state": state.value, "model": member.name})


def _instance(daemon: ControlledDaemon, model: str | None) -> str:
    """The instance `model` names: a configured model by any of its names, else the NAME of one
    configured before (its snapshots stay until retention or rm)."""
    found = daemon.fleet.lookup(model)
    if found is not None:
        return found.name
    try:
        return ServerInstance(str(model)).name
    except ValueError:
        return daemon.fleet.member(model).name  # model_not_found, naming the configured models


@method("snapshot.list", PAST_MODEL, errors=(ReasonCode.MODEL_NOT_FOUND,), result=SnapshotListing)
async def snapshot_list(daemon: ControlledDaemon, params: Mapping[str, Any]) -> SnapshotListing:
    """One model's catalogued snapshots, newest first, with whether each fits its running server.

    Reply: {model, snapshots: [record (with instance) + fits_server, why_not], total_bytes (this
    model's), all_bytes (every model's: what max_bytes counts), enabled, max_count, max_bytes,
    max_bytes_setting, dir, server, dropped}.
    """
    return daemon.snapshot_listing(_instance(daemon, params["model"]))


@method(
    "snapshot.save",
    Param("slot", Kind.INTEGER, "Only this slot. " + SLOT_DOC),
    MODEL,
    errors=(*INTO_A_SLOT, ReasonCode.SNAPSHOT_SAVE_FAILED, ReasonCode.SNAPSHOT_DISK_FULL, ReasonCode.SNAPSHOT_DROPPED),
    result=SnapshotsSaved,
)
async def snapshot_save(daemon: ControlledDaemon, params: Mapping[str, Any]) -> SnapshotsSaved:
    """Save a model's non-empty slots (or one) now, with cause "manual".

    Reply: {saved: [record]}.
    """
    member = daemon.fleet.member(params["model"])
    _ready(daemon, member)
    return SnapshotsSaved(tuple(await daemon.save_snapshots(member, params["slot"])))


@method(
    "snapshot.restore",
    ID,
    Param("slot", Kind.INTEGER, "Restore into this slot instead of the one it was saved from. " + SLOT_DOC),
    Param(
        "if_faster",
        Kind.BOOLEAN,
        "Leave the slot to a re-prefill where this machine's figures say re-prefilling the conversation is "
        "clearly faster than restoring it (the choice a restart's restore makes).",
        default=False,
    ),
    MODEL,
    errors=(
        *INTO_A_SLOT,
        ReasonCode.SNAPSHOT_NOT_FOUND,
        ReasonCode.SNAPSHOT_INSTANCE_MISMATCH,
        ReasonCode.SNAPSHOT_MODEL_MISMATCH,
        ReasonCode.SNAPSHOT_ENGINE_MISMATCH,
        ReasonCode.SNAPSHOT_LAYOUT_MISMATCH,
        ReasonCode.SNAPSHOT_CORRUPT,
        ReasonCode.SNAPSHOT_RESTORE_FAILED,
    ),
    result=SnapshotRestored,
)
async def snapshot_restore(daemon: ControlledDaemon, params: Mapping[str, Any]) -> SnapshotRestored:
    """Restore one of a model's snapshots into a slot of its running server; refused with a reason
    code if it does not fit, or if another model saved it (snapshot_instance_mismatch: a
    conversation never moves between models, even two serving the same file).

    Reply: {id, slot, n_tokens, restore_ms (the engine's), daemon_ms (the daemon's checks and the
    engine's restore), restored (false: left to a re-prefill, `if_faster`), decision (restore or
    reprefill, with both estimates), saved_on, restored_on, cross_backend, note? (a restore across
    backends says what it keeps)}.
    """
    member = daemon.fleet.member(params["model"])
    daemon.snapshot(params["id"], member.name)  # not_found and whose before not_ready: the id is checked first
    _ready(daemon, member)
    return await daemon.restore_snapshot(member, params["id"], params["slot"], params["if_faster"])


@method(
    "snapshot.rm",
    ID,
    PAST_MODEL,
    errors=(ReasonCode.MODEL_NOT_FOUND, ReasonCode.SNAPSHOT_NOT_FOUND, ReasonCode.SNAPSHOT_INSTANCE_MISMATCH),
    result=SnapshotRemoved,
)
async def snapshot_rm(daemon: ControlledDaemon, params: Mapping[str, Any]) -> SnapshotRemoved:
    """Remove one of a model's snapshots: its file and its row go together.

    Reply: {removed: id}.
    """
    daemon.remove_snapshot(daemon.snapshot(params["id"], _instance(daemon, params["model"])))
    return SnapshotRemoved(removed=params["id"])
