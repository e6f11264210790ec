"""Socket methods for the service itself: status, up, down, restart, shutdown, history, ping.

Each handler gets the daemon through the narrow `ControlledDaemon` interface and its
parameters already validated against its declaration (daemon.control.params). Handlers return
records or plain data and raise StokerError for reason-coded failures; the control server turns
those into replies. Rendering for humans lives in the CLI.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon, HistoryQuery
from stoker.daemon.control.params import Choices, Kind, Param, method
from stoker.daemon.control.replies import Pong, StatusText, Stopping
from stoker.daemon.control.status_records import Status
from stoker.daemon.control.status import build_status
from stoker.daemon.control.status_text import format_status, plain, ps_text
from stoker.daemon.core.version import stoker_version
from stoker.daemon.core.errors import StokerError
from stoker.daemon.fleet.member import Member
from stoker.daemon.launch.instance import ServerInstance
from stoker.states.fallback import table as F
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.machine import IllegalTransition
from stoker.states.fleet.placement import UNLOADED
from stoker.states.reasons import ReasonCode
from stoker.store.records import TransitionRecord

HISTORY_LIMIT = 10_000
MODEL = Param(
    "model",
    Kind.STRING,
    "The configured model (its [models.NAME], or any name a request may use for it); default: the default model.",
)
# What moving a model's server can be refused with (`fire`, the model's name), and loading it
# too (placement finds no room).
MOVE_ERRORS = (ReasonCode.ILLEGAL_TRANSITION, ReasonCode.MODEL_NOT_FOUND)
LOAD_ERRORS = (*MOVE_ERRORS, ReasonCode.PLACEMENT_NO_ROOM)


def fire(member: Member, event: object) -> None:
    """Fire a user's launch event on `member`; a refusal is illegal_transition naming the state."""
    try:
        member.supervisor.fire(event)
    except IllegalTransition as err:
        verb = type(event).__name__.removesuffix("Requested").lower()
        raise StokerError(
            ReasonCode.ILLEGAL_TRANSITION,
            f"Cannot {verb} {member.name} while its server is {err.state.value}.",
            {"state": err.state.value, "model": member.name},
        ) from err


def _start_allowed(daemon: ControlledDaemon) -> None:
    if daemon.config_problems and daemon.config_loaded_invalid:
        raise StokerError(ReasonCode.CONFIG_INVALID, evidence={"problems": list(daemon.config_problems)})


@method("status", MODEL, errors=(ReasonCode.MODEL_NOT_FOUND,), result=Status)
async def status(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """A model's state and why (the default model's, or `model`'s), the backend really in use,
    and what was passed over; `models` lists every configured model.

    Reply: {state, backend (in use; null unless a server serves), offload ("full", "partial",
    "none" or null: how much of the model that backend holds), variant, planned_backend,
    reason, message, evidence, model, endpoint, api_key (both only while ready), pid,
    uptime_s (null until ready), restarts, crashes, layers {planned ("auto" or a count),
    offloaded, total, why, estimate}, n_ctx, snapshots, log_path, preference {prefer, forced,
    candidates}, fallback_state, fallback_reason, fallbacks [{backend, reason, message,
    evidence}], probes {backend: {usable, reason, generation}}, backends [the loaded backend
    plugins], config {path, valid, problems}, store {writable, reason (store_write_failed while the
    state database refuses writes), message, error, since, pending (transitions held in memory)},
    daemon {pid, started_at, socket}, frontdoor {url (the OpenAI base URL clients use, .../v1;
    null when the front door is off or its port was taken), enabled, address, require_keys},
    name (the model the fields above describe), max_loaded, models [{name, model (as configured),
    path, default, pinned, state, loads_on_demand, down_cause (user, evicted, idle, shutdown, removed
    or null), backend (in use), planned_backend, reason, message, layers, pid, restarts, in_flight,
    waiting, idle_s (null unless ready), idle_ttl_s, idle_unload_in_s (seconds until its idle
    unload; null when none is due: no TTL, pinned, not ready, in use), slots_saved (slots its last
    stop saved, restored at its next load: read from its own snapshots, so a daemon restart keeps
    it; null when snapshots are off)}]}.
    """
    return build_status(daemon, daemon.fleet.member(params["model"]))


VIEW = Param(
    "view",
    Kind.STRING,
    "Which command's text: `status` (the model's details, then every model) or `ps` (the models loaded now).",
    default="status",
    choices=Choices("status or ps", lambda daemon: ("status", "ps")),
)
COLOUR = Param("colour", Kind.BOOLEAN, "Colour the text with ANSI codes (the reader is a terminal).", default=False)


@method("status.text", MODEL, VIEW, COLOUR, errors=(ReasonCode.MODEL_NOT_FOUND,), result=StatusText)
async def status_text(daemon: ControlledDaemon, params: Mapping[str, Any]) -> StatusText:
    """The text `stoker status` (`view` status, for the default model or `model`) or `stoker ps`
    (`view` ps) prints, rendered here from the same status document (daemon/control/status_text.py),
    so that the CLI prints it without building the document's records itself.

    Reply: {text, failed (the model described is in state failed)}.
    """
    from stoker.states.convert import unstructure

    status = build_status(daemon, daemon.fleet.member(params["model"]))
    if params["view"] == "ps":
        text = ps_text(status)
    else:
        text = format_status(unstructure(status))
    return StatusText(text if params["colour"] else plain(text), failed=status.state == "failed")


@method("up", MODEL, errors=(ReasonCode.CONFIG_INVALID, *LOAD_ERRORS), result=Status)
async def up(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """Start a model's server (the default model's, or `model`'s); a no-op while it is starting or
    running. With [placement] max_loaded models loaded, the least recently used idle one is
    stopped first (drained, snapshots saved); placement_no_room when every loaded one is pinned or busy.

    Reply: the status document (as `status`, for that model) once it is starting; poll `status` or
    subscribe to wait for ready.
    """
    _start_allowed(daemon)
    member = daemon.fleet.member(params["model"])
    await daemon.fleet.load(member, wait=False)
    return build_status(daemon, member)


@method("down", MODEL, errors=MOVE_ERRORS, result=Status)
async def down(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """Stop a model's server (the default model's, or `model`'s: TERM, the grace period, then
    KILL); the daemon and the other models keep running. It stays down until `up`: the front
    door answers its requests 503 frontdoor_server_down meanwhile.

    Reply: the status document (as `status`, for that model) once the server has stopped (a later
    up or restart from another client may already be bringing the next one up).
    """
    member = daemon.fleet.member(params["model"])
    fire(member, LR.DownRequested())
    await member.supervisor.wait_stopped()
    return build_status(daemon, member)


@method("restart", MODEL, errors=LOAD_ERRORS, result=Status)
async def restart(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """Stop a model's server if it runs (the default model's, or `model`'s), then plan and start
    it again; a model not loaded is loaded as `up` does (making room first).

    Reply: the status document (as `status`, for that model), at once.
    """
    member = daemon.fleet.member(params["model"])
    if member.state in UNLOADED:
        _start_allowed(daemon)
        await daemon.fleet.load(member, wait=False)
    else:
        fire(member, LR.RestartRequested())
    return build_status(daemon, member)


@method("shutdown", result=Stopping)
async def shutdown(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Stopping:
    """Stop every server, then the daemon; the reply is sent before the daemon goes.

    Reply: {"stopping": true}.
    """
    daemon.request_shutdown()
    return Stopping(stopping=True)


@method(
    "history",
    Param("machine", Kind.STRING, "Only this machine, by the id its rows carry (e.g. launch, probe:cuda)."),
    Param("kind", Kind.STRING, "Only machines of this kind (launch, config, fallback, probe, install)."),
    Param("since", Kind.NUMBER, "Only transitions at or after this Unix time."),
    Param("until", Kind.NUMBER, "Only transitions before this Unix time."),
    Param("limit", Kind.INTEGER, "At most this many rows.", default=100, low=1, high=HISTORY_LIMIT),
    Param(
        "model",
        Kind.STRING,
        "Only this model's launch and fallback machines (a configured model by any name a request may use, or "
        "the NAME of one configured before).",
    ),
    errors=(ReasonCode.MODEL_NOT_FOUND,),
    result=tuple[TransitionRecord, ...],
)
async def history(daemon: ControlledDaemon, params: Mapping[str, Any]) -> tuple[TransitionRecord, ...]:
    """Recorded transitions of every state machine, newest first.

    Reply: [{id, machine_id, kind, from_state, event, event_data, to_state, reason,
    evidence, at, seq}].
    """
    rows = daemon.history(
        HistoryQuery(
            machine=params["machine"],
            kind=params["kind"],
            since=params["since"],
            until=params["until"],
            limit=params["limit"],
            machines=None if params["model"] is None else model_machines(daemon, params["model"]),
        )
    )
    return tuple(rows)


def model_machines(daemon: ControlledDaemon, model: str) -> tuple[str, ...]:
    """A model's launch and fallback machine ids: a configured one's, else those its NAME had
    (a model removed from the config keeps its history)."""
    try:
        return daemon.fleet.member(model).machines
    except StokerError:
        try:
            instance = ServerInstance(model)
        except ValueError:
            raise StokerError(
                ReasonCode.MODEL_NOT_FOUND,
                f"{model!r} names no configured model and is no model name.",
                {"model": model, "models": [m.name for m in daemon.fleet.serving()]},
            ) from None
        return tuple(instance.machine_id(kind) for kind in (L.LAUNCH.name, F.FALLBACK.name))


@method("ping", result=Pong)
async def ping(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Pong:
    """A liveness check that touches nothing.

    Reply: {"pong": true, "pid": N, "version": the daemon's version}.
    """
    return Pong(pong=True, pid=os.getpid(), version=stoker_version())
