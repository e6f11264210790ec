"""Socket methods for engine updates: engine.update, engine.rollback, engine.status.

The update machine (states/engine_update/table.py) is driven by daemon/install/update.py; these
handlers only say which slot (backend + variant) a request means: the bundle's own slot for a
named zip, the installed variant of a named backend, else the slot the default model's server
runs on, else the only installed slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import trio

from stoker.daemon.bundles.installed import bundle_meta_of, find_installed, list_installed
from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.handlers.backends import BACKENDS
from stoker.daemon.control.params import Kind, Param, method
from stoker.daemon.control.replies import EngineOutcome, EngineStatus
from stoker.daemon.core.errors import StokerError
from stoker.states.convert import structure
from stoker.states.engine_update.table import ENGINE_UPDATE
from stoker.states.reasons import ReasonCode

BACKEND = Param(
    "backend", Kind.STRING, "The backend whose engine (default: the one the default model runs on).", choices=BACKENDS
)
VARIANT = Param("variant", Kind.STRING, "Its variant (default: the installed one that fits this machine).")
# Besides bad_request, what naming the slot can fail with (`_slot`: no engine of that backend),
# and what changing its engine can (the slot's update machine, which runs one change at a time).
SLOT_ERRORS = (ReasonCode.BUNDLE_MISSING,)
CHANGE_ERRORS = (ReasonCode.ENGINE_ROLLBACK_FAILED, ReasonCode.ENGINE_SLOT_BUSY, *SLOT_ERRORS)


async def _slot(daemon: ControlledDaemon, backend: str | None, variant: str | None) -> tuple[str, str]:
    if backend is not None:
        if variant is not None:
            return backend, variant
        found = await trio.to_thread.run_sync(lambda: find_installed(daemon.paths, backend))
        if found is None:
            raise StokerError(ReasonCode.BUNDLE_MISSING, f"No {backend} engine is installed.", {"backend": backend})
        return backend, found.meta.variant
    plan = daemon.fleet.default.data.plan
    if plan is not None:
        return plan.backend, variant or plan.variant
    installed = await trio.to_thread.run_sync(list_installed, daemon.paths)
    slots = sorted({(b.meta.backend, b.meta.variant) for b in installed})
    if len(slots) == 1:
        return slots[0]
    raise StokerError(
        ReasonCode.BAD_REQUEST,
        "Name the engine's backend (--backend): no model has run yet and "
        + ("several engines are installed." if slots else "none is installed."),
        {"installed": [f"{b}-{v}" for b, v in slots]},
    )


@method(
    "engine.update",
    BACKEND,
    VARIANT,
    Param("channel", Kind.STRING, "The update channel (default: [engine] channel; `stable` is [bundles] manifest)."),
    Param("bundle", Kind.STRING, "Update to this bundle zip instead (an absolute path the daemon can read)."),
    errors=(ReasonCode.ENGINE_UPDATE_REJECTED, ReasonCode.ENGINE_UPDATE_ROLLED_BACK, *CHANGE_ERRORS),
    result=EngineOutcome,
)
async def engine_update(daemon: ControlledDaemon, params: Mapping[str, Any]) -> EngineOutcome:
    """Stage a newer engine, gate it (verify, smoke, tokens identical to the serving engine's), switch,
    restart what ran on it, and roll back by itself if a server does not get ready on it or offloads
    no layers where it did. Progress: machine.engine_update.* events on the subscribe stream.

    Reply: {slot, state (updated, current: nothing newer), installed, candidate, gate, verdicts, by_hand,
    engine {slot, version, previous, update_state, update_reason}, history [{from, event, to, reason, at}],
    message, reason (state current: engine_update_rolled_back when the channel's release was rolled
    back here before and is not staged again)}. Refused before the switch: engine_update_rejected (evidence: gate, cause; the engine is
    untouched); rolled back: engine_update_rolled_back (evidence: gate, server, the figures).
    """
    bundle = params["bundle"]
    backend, variant = params["backend"], params["variant"]
    if bundle is not None:
        path = Path(bundle)
        if not path.is_absolute():
            raise StokerError(ReasonCode.BAD_REQUEST, "The bundle path must be absolute.", {"path": bundle})
        meta = await trio.to_thread.run_sync(bundle_meta_of, path)
        backend, variant = backend or meta.backend, variant or meta.variant
    backend, variant = await _slot(daemon, backend, variant)
    outcome = await daemon.engine_updates.update(
        backend, variant, channel=params["channel"], bundle=None if bundle is None else Path(bundle)
    )
    return structure(outcome, EngineOutcome)


@method(
    "engine.rollback",
    BACKEND,
    VARIANT,
    errors=(ReasonCode.ENGINE_ROLLBACK_UNAVAILABLE, *CHANGE_ERRORS),
    result=EngineOutcome,
)
async def engine_rollback(daemon: ControlledDaemon, params: Mapping[str, Any]) -> EngineOutcome:
    """Put the engine kept as the slot's previous back and restart what runs on it; the replaced
    engine becomes the previous one (another rollback undoes this one).

    Reply: as engine.update's, state rolled_back and by_hand true.
    """
    backend, variant = await _slot(daemon, params["backend"], params["variant"])
    return structure(await daemon.engine_updates.rollback(backend, variant), EngineOutcome)


@method("engine.status", BACKEND, VARIANT, errors=SLOT_ERRORS, result=EngineStatus)
async def engine_status(daemon: ControlledDaemon, params: Mapping[str, Any]) -> EngineStatus:
    """The slot's engine version, the previous one kept (null: none), its update machine's state and
    reason, and its last steps.

    Reply: {slot, version, previous, update_state, update_reason, history [{from, event, to, reason, at}]}.
    """
    backend, variant = await _slot(daemon, params["backend"], params["variant"])
    updates = daemon.engine_updates
    slot = updates.slot_status(backend, variant)
    return structure({**slot, "history": updates.steps(ENGINE_UPDATE.machine_id(backend, variant))}, EngineStatus)
