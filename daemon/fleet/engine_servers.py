"""The fleet's servers as an engine update sees them (daemon/install/update.py's EngineServers):
which run on a bundle slot, what their last good launch offloaded, and what a restart on the new
engine did.

A member runs on a slot when its launch machine is starting, loading or ready with a plan of that
backend and variant. Its last good launch record is its ready server's evidence, or the newest
Ready in its launch history (a server on its way up). A restart's verdict is read from its launch
machine as it moves: ready again (after the restart was asked), crashed / backing off / failed,
stopped by someone else, or none of these within the wait. A server that is stopped when its
restart comes (a user's `stoker down` meanwhile, an idle unload, a daemon restarted mid-update)
is left stopped (`restart_wanted`), with the verdict `stopped`. Facts only: the update machine judges
them (states/engine_update/table.py `judge_servers`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import attrs
import trio

from stoker.daemon.fleet.fleet import Fleet
from stoker.daemon.fleet.member import Member
from stoker.states.engine_update import table as U
from stoker.states.engine_update import records as UR
from stoker.states.launch import table as L
from stoker.states.launch import records as LR
from stoker.states.convert import structure
from stoker.store.database import Store

_RUNNING = (LR.LaunchState.STARTING, LR.LaunchState.LOADING, LR.LaunchState.READY)
_DIED = (LR.LaunchState.CRASHED, LR.LaunchState.BACKOFF, LR.LaunchState.FAILED)


def _layers(evidence: Mapping[str, Any]) -> tuple[int | None, int | None]:
    return evidence.get("offloaded_layers"), evidence.get("total_layers")


@attrs.frozen
class FleetEngineServers:
    """EngineServers over the daemon's fleet (read through `fleet()`: a config reload keeps the
    fleet, but members come and go)."""

    fleet: Callable[[], Fleet]
    store: Store

    def on_slot(self, backend: str, variant: str) -> tuple[UR.ServerBaseline, ...]:
        out = []
        for member in self.fleet().serving():
            plan = member.data.plan
            if member.state in _RUNNING and plan is not None and (plan.backend, plan.variant) == (backend, variant):
                offloaded, total = _layers(self._last_good(member))
                out.append(UR.ServerBaseline(member.name, offloaded, total))
        return tuple(out)

    def _last_good(self, member: Member) -> Mapping[str, Any]:
        if member.supervisor.ready_evidence:
            return member.supervisor.ready_evidence
        machine = member.instance.machine_id(L.LAUNCH.name)
        for row in self.store.history(machine=machine, limit=200):
            if row.event == "Ready" and row.to_state == LR.LaunchState.READY.value:
                return structure(row.event_data, LR.Ready).evidence
        return {}

    async def restart_and_judge(self, name: str, timeout: float) -> UR.ServerVerdict:
        member = self.fleet().lookup(name)
        if member is None or member.name != name:
            return UR.ServerVerdict(name, UR.Outcome.STOPPED, evidence={"message": "no longer configured"})
        if not U.restart_wanted(member.state.value):  # stopped meanwhile (by the user...): left stopped
            cause = member.data.down_cause
            return UR.ServerVerdict(
                name, UR.Outcome.STOPPED, evidence={"down_cause": None if cause is None else cause.value}
            )
        asked = time.time()
        member.supervisor.offer(LR.RestartRequested())
        with trio.move_on_after(timeout):
            while True:
                sup, state = member.supervisor, member.state
                if state is LR.LaunchState.READY and (sup.ready_at or 0) >= asked:
                    plan = sup.data.plan
                    offloaded, total = _layers(sup.ready_evidence or {})
                    backend = plan.backend if plan else None
                    effective = member.effective_backend()
                    evidence = {"effective_backend": effective} if effective != backend else {}
                    return UR.ServerVerdict(name, UR.Outcome.READY, backend, offloaded, total, evidence=evidence)
                if state in _DIED:
                    data = sup.data
                    return UR.ServerVerdict(
                        name,
                        UR.Outcome.EXITED,
                        data.plan.backend if data.plan else None,
                        reason=None if data.reason is None else str(data.reason),
                        evidence={"state": state.value, **_exit_facts(data.evidence)},
                    )
                if state is LR.LaunchState.STOPPED:
                    return UR.ServerVerdict(name, UR.Outcome.STOPPED, evidence={"down_cause": str(sup.data.down_cause)})
                await member.change_signal.wait()
        return UR.ServerVerdict(name, UR.Outcome.TIMEOUT, evidence={"timeout_s": timeout, "state": member.state.value})

    def relaunch(self, name: str) -> None:
        member = self.fleet().lookup(name)
        if member is not None and member.name == name and U.restart_wanted(member.state.value):
            member.supervisor.offer(LR.RestartRequested())


def _exit_facts(evidence: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of an exit's evidence worth keeping in the update's history (not the whole log)."""
    keep = ("returncode", "signal", "line", "log_tail", "phase")
    facts = {k: evidence[k] for k in keep if k in evidence}
    if isinstance(facts.get("log_tail"), str):
        facts["log_tail"] = facts["log_tail"][-1500:]
    elif isinstance(facts.get("log_tail"), list):
        facts["log_tail"] = facts["log_tail"][-12:]
    return facts
