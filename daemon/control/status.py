"""The status document, built in one place from the daemon's sources.

`build_status` reads the launch machine, the fallback orchestrator's part, the probe verdicts
and the config through the narrow `ControlledDaemon` interface and returns a frozen `Status`
(daemon/control/replies.py, where the CLI and the TUI read it from without importing this
module's daemon side). Its top-level fields describe one model (the default, or the one asked
for), as they described the only one before several could run; `models` lists every configured
model. docs/protocol-methods.md lists the `status` reply.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Mapping

from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.control.status_records import (
    ConfigStatus,
    DaemonInfo,
    EngineSlot,
    Fallback,
    FrontDoorStatus,
    OllamaStatus,
    InstallStatus,
    Layers,
    ModelMemory,
    ModelStatus,
    Preference,
    ProbeVerdict,
    PullProgress,
    Status,
    StoreStatus,
)
from stoker.daemon.fallback.memory import estimate_json
from stoker.daemon.fleet.member import reason_message
from stoker.daemon.telemetry.sampler import process_rss_mib
from stoker.states.launch import records as LR
from stoker.states.convert import structure
from stoker.states.fleet.idle_unload import due_in
from stoker.states.reasons import ReasonCode, message_for

if TYPE_CHECKING:
    from stoker.daemon.fleet.member import Member

# States in which no server serves: no backend is in use (the last plan's stays in planned_backend).
_NOT_SERVING = (LR.LaunchState.FAILED, LR.LaunchState.STOPPED)


def frontdoor_url(bind: str) -> str:
    """The /v1 base URL a client on this machine uses for a bound URL (a wildcard bind is
    reached through loopback)."""
    for wildcard, loopback in (("//0.0.0.0:", "//127.0.0.1:"), ("//[::]:", "//[::1]:")):
        bind = bind.replace(wildcard, loopback)
    return bind.rstrip("/") + "/v1"


def frontdoor_status(daemon: ControlledDaemon) -> FrontDoorStatus:
    """Where clients reach the front door now, and whether it asks them for a key."""
    settings = daemon.config.frontdoor
    binds = daemon.frontdoor_binds
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return FrontDoorStatus(
        url=frontdoor_url(binds[0]) if binds else None,
        enabled=settings.enabled,
        address=f"{host}:{settings.port}",
        require_keys=settings.require_keys,
    )


def _ollama(daemon: ControlledDaemon) -> OllamaStatus:
    """Where Ollama's clients reach the server, or why they cannot (its port held by another program)."""
    settings, host = daemon.config.ollama, daemon.config.frontdoor.host
    address = f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"
    enabled = settings.enabled and daemon.config.frontdoor.enabled
    url = frontdoor_url(daemon.ollama_url).removesuffix("/v1") if daemon.ollama_url else None
    error = daemon.ollama_error
    reason = ReasonCode.OLLAMA_PORT_TAKEN if error is not None else None
    message = f"{address}: {error}. {message_for(reason)}" if reason is not None else None
    return OllamaStatus(url, enabled, address, reason.value if reason else None, message)


def _layers(layers: Mapping[str, Any]) -> Layers:
    return Layers(layers["planned"], layers["offloaded"], layers["total"], layers["why"], layers["estimate"])


def _memory(member: Member, backend: str | None) -> ModelMemory:
    """RSS read now from the live process; VRAM as the proof read it at ready."""
    pid = member.data.pid if member.state not in _NOT_SERVING else None
    on_accelerator = backend is not None and backend != LR.CPU_BACKEND
    vram = (member.supervisor.ready_evidence or {}).get("process_vram_mib") if on_accelerator else None
    vram_mib = float(vram) if isinstance(vram, (int, float)) else None
    plan = member.data.plan
    return ModelMemory(
        rss_mib=None if pid is None else process_rss_mib(pid),
        vram_mib=vram_mib,
        on_accelerator=on_accelerator,
        partial=on_accelerator and vram_mib is None,
        estimate=estimate_json(plan.memory) if plan is not None else None,
        placed=member.footprint().to_json() if member.occupies else None,
    )


def _pulls(daemon: ControlledDaemon) -> tuple[PullProgress, ...]:
    return tuple(
        PullProgress(
            name=str(p["name"]),
            spec=p.get("spec"),
            state=str(p["state"]),
            phase=p.get("phase"),
            bytes_done=p.get("bytes_done"),
            total=p.get("total"),
            rate=p.get("rate"),
            eta=p.get("eta"),
        )
        for p in daemon.pulls_under_way()
    )


def model_status(daemon: ControlledDaemon, member: Member) -> ModelStatus:
    """One model's line: state, the backend really in use, why, layers, use and idle time."""
    data, state = member.data, member.state
    fallback = daemon.fallback_status(member)
    serving = state not in _NOT_SERVING
    unload_in = due_in(member.idle_facts(), time.time())
    backend = fallback["backend"] if serving else None
    return ModelStatus(
        name=member.name,
        model=member.served.spec,
        path=data.plan.model_path if data.plan else None,
        default=member.served.default,
        pinned=member.served.pinned,
        state=state.value,
        loads_on_demand=member.loads_on_demand,
        down_cause=data.down_cause.value if data.down_cause else None,
        backend=backend,
        planned_backend=fallback["planned_backend"],
        reason=str(data.reason) if data.reason else None,
        message=reason_message(data),
        layers=_layers(fallback["layers"]),
        pid=data.pid,
        restarts=data.restarts,
        in_flight=member.usage.in_flight,
        waiting=member.usage.waiting,
        idle_s=round(member.idle_s(), 1) if state is LR.LaunchState.READY else None,
        idle_ttl_s=member.served.idle_ttl_s,
        idle_unload_in_s=None if unload_in is None else round(unload_in, 1),
        slots_saved=member.slots_saved,
        machines=member.machines,
        memory=_memory(member, backend),
        workers=fallback.get("workers"),
        n_ctx=(member.supervisor.ready_evidence or {}).get("n_ctx"),
    )


def build_status(daemon: ControlledDaemon, member: Member | None = None) -> Status:
    """The status document now: `member`'s (default: the default model's) launch machine, its
    fallbacks and layers' why, the probes, and a line per configured model."""
    member = member or daemon.fleet.default
    sup = member.supervisor
    data = sup.data
    plan = data.plan
    state = sup.state
    ready = dict(sup.ready_evidence or {})
    endpoint, api_key = sup.endpoint()
    serving = state is LR.LaunchState.READY
    fallback = daemon.fallback_status(member)
    reason = str(data.reason) if data.reason else None
    fallbacks = tuple(
        Fallback(f["backend"], f["reason"], f["message"], dict(f["evidence"])) for f in fallback["fallbacks"]
    )
    preference = fallback["preference"]
    model = plan.model_path if plan else member.served.spec
    return Status(
        state=state.value,
        backend=None if state in _NOT_SERVING else fallback["backend"],
        offload=None if state in _NOT_SERVING else fallback.get("offload"),
        variant=plan.variant if plan else None,
        reason=reason,
        message=reason_message(data),
        evidence=dict(data.evidence),
        model=None if model is None else os.fspath(model),
        endpoint=endpoint if serving else None,
        api_key=api_key if serving else None,
        pid=data.pid,
        uptime_s=round(time.time() - sup.ready_at, 1) if sup.ready_at else None,
        restarts=sup.restarts,
        crashes=data.crashes,
        layers=_layers(fallback["layers"]),
        n_ctx=ready.get("n_ctx"),
        snapshots=daemon.snapshot_status(member),
        log_path=str(member.supervisor.log_path),
        config=ConfigStatus(str(daemon.paths.config_file), not daemon.config_problems, tuple(daemon.config_problems)),
        store=_store_status(daemon),
        daemon=DaemonInfo(os.getpid(), daemon.started_at, str(daemon.paths.socket_path)),
        frontdoor=frontdoor_status(daemon),
        ollama=_ollama(daemon),
        planned_backend=fallback["planned_backend"],
        preference=Preference(preference["prefer"], bool(preference["forced"]), tuple(preference["candidates"])),
        fallback_state=fallback["fallback_state"],
        fallback_reason=fallback["fallback_reason"],
        fallbacks=() if state is LR.LaunchState.STOPPED else fallbacks,
        probes={name: _verdict(v) for name, v in daemon.probe_verdicts().items()},
        backends=tuple(daemon.backend_names),
        name=member.name,
        models=tuple(model_status(daemon, m) for m in daemon.fleet.serving()),
        max_loaded=daemon.fleet.max_loaded(),
        memory_caps={
            "max_ram_mib": daemon.config.placement.max_ram_mib,
            "max_vram_mib": daemon.config.placement.max_vram_mib,
        },
        pulls=_pulls(daemon),
        installs=tuple(InstallStatus.from_row(row) for row in daemon.install_statistics()),
        workers=fallback.get("workers"),
        engine=None
        if plan is None
        else structure(daemon.engine_updates.slot_status(plan.backend, plan.variant), EngineSlot),
        remotes=tuple(r.status() for r in daemon.fleet.remotes.serving()),
    )


def _store_status(daemon: ControlledDaemon) -> StoreStatus:
    health = daemon.store_health()
    if health.writable:
        return StoreStatus(True, None, None, None, None, health.pending)
    message = (
        f"The state database {daemon.paths.db_file} cannot be written ({health.error}); the daemon keeps running "
        f"and {health.pending} transition(s) wait in memory, written in order once it can. Free space on its disk "
        f"or fix its permissions."
    )
    return StoreStatus(False, health.reason, message, health.error, health.since, health.pending)


def _verdict(verdict: Mapping[str, Any]) -> ProbeVerdict:
    return ProbeVerdict(bool(verdict["usable"]), verdict["reason"], verdict["generation"])
