"""Control commands: one handler per method, each documenting its request and reply.

Handlers return plain JSON-ready data and raise StokerError for reason-coded failures; the
control server turns those into error replies. Rendering for humans lives in the CLI.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping

from daemon.core.errors import StokerError
from states import launch as L
from states.machine import IllegalTransition
from states.reasons import ReasonCode, message_for

if TYPE_CHECKING:
    from daemon.service import Daemon

Handler = Callable[["Daemon", Mapping[str, Any]], Awaitable[Any]]
HANDLERS: dict[str, Handler] = {}


def handler(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        return fn

    return register


def _no_params(params: Mapping[str, Any]) -> None:
    if params:
        raise StokerError(ReasonCode.BAD_REQUEST, f"This command takes no parameters, got {sorted(params)}.")


def _fire(daemon: "Daemon", event: object) -> None:
    try:
        daemon.supervisor.fire(event)
    except IllegalTransition as err:
        raise StokerError(
            ReasonCode.ILLEGAL_TRANSITION,
            f"Cannot {type(event).__name__.removesuffix('Requested').lower()} while the server is {err.state.value}.",
            {"state": err.state.value},
        ) from err


def _launch_status(daemon: "Daemon") -> dict[str, Any]:
    sup = daemon.supervisor
    data = sup.data
    plan = data.plan
    endpoint, api_key = sup.endpoint()
    ready = sup.ready_evidence or {}
    reason = data.reason
    out: dict[str, Any] = {
        "state": sup.state.value,
        "backend": plan.backend if plan else None,
        "variant": plan.variant if plan else None,
        "reason": str(reason) if reason else None,
        "message": message_for(reason) if reason else None,
        "evidence": data.evidence,
        "model": plan.model_path if plan else daemon.config.server.model,
        "endpoint": endpoint if sup.state is L.LaunchState.READY else None,
        "api_key": api_key if sup.state is L.LaunchState.READY else None,
        "pid": data.pid,
        "uptime_s": round(time.time() - sup.ready_at, 1) if sup.ready_at else None,
        "restarts": sup.restarts,
        "crashes": data.crashes,
        "layers": {
            "planned": plan.n_gpu_layers if plan and plan.backend != "cpu" else None,
            "offloaded": ready.get("offloaded_layers"),
            "total": ready.get("total_layers"),
        },
        "n_ctx": ready.get("n_ctx"),
        "snapshots": ready.get("snapshots"),  # KV snapshots: benefit, --swa-full cost, restored/refused
        "log_path": str(daemon.paths.logs_dir / "llama-server.log"),
        "config": {
            "path": str(daemon.paths.config_file),
            "valid": not daemon.config_problems,
            "problems": list(daemon.config_problems),
        },
        "daemon": {"pid": os.getpid(), "started_at": daemon.started_at, "socket": str(daemon.paths.socket_path)},
    }
    return out


def status_of(daemon: "Daemon") -> dict[str, Any]:
    """The status document with the backend really in use, the fallbacks and the layers' why."""
    out = _launch_status(daemon)
    extra = daemon.orchestrator.status(daemon.supervisor, daemon.config.backend.prefer)
    layers = {**(out.get("layers") or {}), **{k: v for k, v in extra.pop("layers").items() if v is not None}}
    out.update(extra)
    out["layers"] = layers
    if out.get("state") in ("failed", "stopped"):
        # Nothing serves: no backend is in use (the last plan stays in planned_backend).
        out["backend"] = None
        out["fallbacks"] = [] if out.get("state") == "stopped" else out["fallbacks"]
    specific = (out.get("evidence") or {}).get("message")
    if out.get("reason") and isinstance(specific, str) and specific:
        out["message"] = specific  # the plan's own sentence (forced backend, ...), not the generic one
    out["probes"] = {
        name: {"usable": v["usable"], "reason": v["reason"], "generation": v["generation"]}
        for name, v in daemon.probes.verdicts().items()
    }
    return out


@handler("status")
async def status(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> the status document: state, backend (the one really in use), planned_backend,
    reason, message, model, endpoint, api_key, layers {planned, offloaded, total, why,
    estimate}, preference {prefer, forced, candidates}, fallbacks [{backend, reason, message,
    evidence}], probes {backend: {usable, reason, generation}}, config, daemon."""
    _no_params(params)
    return status_of(daemon)


@handler("up")
async def up(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> status. Starts the server; a no-op while it is starting or running."""
    _no_params(params)
    if daemon.config_problems and daemon.config_loaded_invalid:
        raise StokerError(ReasonCode.CONFIG_INVALID, evidence={"problems": daemon.config_problems})
    _fire(daemon, L.UpRequested(daemon.launch_settings()))
    return status_of(daemon)


@handler("down")
async def down(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> status once the server has stopped (TERM, grace, KILL)."""
    _no_params(params)
    _fire(daemon, L.DownRequested())
    await daemon.wait_state({L.LaunchState.STOPPED, L.LaunchState.FAILED})
    return status_of(daemon)


@handler("restart")
async def restart(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> status. Stops the server if it runs, then plans and starts it again."""
    _no_params(params)
    _fire(daemon, L.RestartRequested())
    return status_of(daemon)


@handler("shutdown")
async def shutdown(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> {"stopping": true}. Stops the server, then the daemon."""
    _no_params(params)
    daemon.request_shutdown()
    return {"stopping": True}


@handler("history")
async def history(daemon: "Daemon", params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """{machine?, kind?, since?, until?, limit?} -> transitions, newest first."""
    allowed = {"machine", "kind", "since", "until", "limit"}
    unknown = set(params) - allowed
    if unknown:
        raise StokerError(ReasonCode.BAD_REQUEST, f"Unknown parameters {sorted(unknown)}.")
    limit = params.get("limit", 100)
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= 10_000:
        raise StokerError(ReasonCode.BAD_REQUEST, "limit must be an integer from 1 to 10000.")
    for key in ("since", "until"):
        value = params.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise StokerError(ReasonCode.BAD_REQUEST, f"{key} must be a unix time.")
    for key in ("machine", "kind"):
        value = params.get(key)
        if value is not None and not isinstance(value, str):
            raise StokerError(ReasonCode.BAD_REQUEST, f"{key} must be a string.")
    rows = daemon.store.history(
        machine=params.get("machine"),
        kind=params.get("kind"),
        since=params.get("since"),
        until=params.get("until"),
        limit=limit,
    )
    return [row.to_dict() for row in rows]


@handler("ping")
async def ping(daemon: "Daemon", params: Mapping[str, Any]) -> dict[str, Any]:
    """{} -> {"pong": true, "pid": N}: a liveness check that touches nothing."""
    return {"pong": True, "pid": os.getpid()}


from daemon.control.handlers import telemetry as handlers_telemetry  # noqa: E402,F401  (registers `telemetry`)
from daemon.control.handlers import snapshots as handlers_snapshots  # noqa: E402,F401  (registers `snapshot.*`)
from daemon.control.handlers import backends as handlers_backends  # noqa: E402,F401  (registers `probe`, `use`, `install`)
