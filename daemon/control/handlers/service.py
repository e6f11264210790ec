"""Socket methods for the service itself: status, up, down, restart, shutdown, history, ping.

Each handler gets the daemon through the narrow `ControlledDaemon` interface and its
parameters already validated against its declaration (daemon.control.params). Handlers return
records or plain data and raise StokerError for reason-coded failures; the control server turns
those into replies. Rendering for humans lives in the CLI.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from daemon.control.controlled import ControlledDaemon
from daemon.control.params import Kind, Param, method
from daemon.control.status import Status, build_status
from daemon.core.errors import StokerError
from states import launch_records as LR
from states.machine import IllegalTransition
from states.reasons import ReasonCode

HISTORY_LIMIT = 10_000


def fire(daemon: ControlledDaemon, event: object) -> None:
    """Fire a user's launch event; a refusal is illegal_transition naming the state."""
    try:
        daemon.supervisor.fire(event)
    except IllegalTransition as err:
        verb = type(event).__name__.removesuffix("Requested").lower()
        raise StokerError(
            ReasonCode.ILLEGAL_TRANSITION,
            f"Cannot {verb} while the server is {err.state.value}.",
            {"state": err.state.value},
        ) from err


@method("status")
async def status(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """The server's state and why, the backend really in use, and what was passed over.

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
    null when the front door is off or its port was taken), enabled, address, require_keys}}.
    """
    return build_status(daemon)


@method("up", errors=(ReasonCode.CONFIG_INVALID, ReasonCode.ILLEGAL_TRANSITION))
async def up(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """Start the server; a no-op while it is starting or running.

    Reply: the status document (as `status`), at once; poll `status` or subscribe to wait for ready.
    """
    if daemon.config_problems and daemon.config_loaded_invalid:
        raise StokerError(ReasonCode.CONFIG_INVALID, evidence={"problems": list(daemon.config_problems)})
    fire(daemon, LR.UpRequested(daemon.launch_settings()))
    return build_status(daemon)


@method("down", errors=(ReasonCode.ILLEGAL_TRANSITION,))
async def down(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """Stop the server (TERM, the grace period, then KILL); the daemon keeps running.

    Reply: the status document (as `status`) once the server has stopped (a later up or
    restart from another client may already be bringing the next one up).
    """
    fire(daemon, LR.DownRequested())
    await daemon.supervisor.wait_stopped()
    return build_status(daemon)


@method("restart", errors=(ReasonCode.ILLEGAL_TRANSITION,))
async def restart(daemon: ControlledDaemon, params: Mapping[str, Any]) -> Status:
    """Stop the server if it runs, then plan and start it again.

    Reply: the status document (as `status`), at once.
    """
    fire(daemon, LR.RestartRequested())
    return build_status(daemon)


@method("shutdown")
async def shutdown(daemon: ControlledDaemon, params: Mapping[str, Any]) -> dict[str, Any]:
    """Stop the server, then the daemon; the reply is sent before the daemon goes.

    Reply: {"stopping": true}.
    """
    daemon.request_shutdown()
    return {"stopping": True}


@method(
    "history",
    Param("machine", Kind.STRING, "Only this machine, by the id its rows carry (e.g. launch, probe:cuda)."),
    Param("kind", Kind.STRING, "Only machines of this kind (launch, config, fallback, probe, install)."),
    Param("since", Kind.NUMBER, "Only transitions at or after this Unix time."),
    Param("until", Kind.NUMBER, "Only transitions before this Unix time."),
    Param("limit", Kind.INTEGER, "At most this many rows.", default=100, low=1, high=HISTORY_LIMIT),
)
async def history(daemon: ControlledDaemon, params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Recorded transitions of every state machine, newest first.

    Reply: [{id, machine_id, kind, from_state, event, event_data, to_state, reason,
    evidence, at, seq}].
    """
    rows = daemon.history(
        machine=params["machine"],
        kind=params["kind"],
        since=params["since"],
        until=params["until"],
        limit=params["limit"],
    )
    return [row.to_dict() for row in rows]


@method("ping")
async def ping(daemon: ControlledDaemon, params: Mapping[str, Any]) -> dict[str, Any]:
    """A liveness check that touches nothing.

    Reply: {"pong": true, "pid": N}.
    """
    return {"pong": True, "pid": os.getpid()}
