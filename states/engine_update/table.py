"""The engine update machine: one bundle slot (backend + variant) moved to a newer engine, gated,
with a way back.

    idle -> resolving -> staging -> comparing -> switching -> restarting -> updated
                 |           |          |            |             |
                 v           v          v            v             v
              current     rejected   rejected   rolling_back <- rolling_back -> rolled_back | failed

The gates, in order, and what a failure of each means (the `gate` in the evidence):
  fetch    the candidate could not be had (manifest, download, the named zip)    -> rejected
  verify   the staged bundle fails verification (digests, metadata, --version,
           --list-devices)                                                        -> rejected
  smoke    its greedy tokens differ from its own build-time reference             -> rejected
  tokens   the old and new engines' greedy tokens on the smoke model differ, both
           run on this machine                                                    -> rejected
  switch   the promote into the slot failed                                       -> rolling back
  start    a server that ran on the old engine does not get ready on the new one
           (it exits, times out, or comes up on another backend)                  -> rolling back
  layers   a server offloads no layers where it offloaded some on the old engine
           (its last good launch record)                                          -> rolling back
Everything before the switch leaves the slot untouched (`rejected`, engine_update_rejected);
after it the previous bundle is put back by itself (`rolled_back`, engine_update_rolled_back)
and the rejected bundle is discarded and remembered, so an automatic check does not offer it
again, and neither does a user's `stoker engine update` once it was rolled back (it would
restart every server on the slot to fail the same way): it rests `current` with reason
engine_update_rolled_back and says why; naming the zip tries it again. A rollback by hand (`RollbackRequested`) swaps the slot and its `.previous`, so another
one undoes it. Which candidate is an update at all (newer than the installed version, a bundle
the user named, one refused before) is decided here too (`update_verdict`).

Resuming after a daemon kill (`Resumed`): resolving and staging redo their step from a clean
staging directory (a download continues its part file); comparing restages (the staged tree is
cheap to rebuild, its tokens are not kept); switching re-sends Switch (promote is idempotent: a
kill between its two renames leaves the slot missing and `.previous` serving, and the promote
then completes); restarting cleans the staging directory (the kill may have come before the switch's
CleanStaging) and re-sends RestartServers; rolling back re-sends RollBack (idempotent:
the slot is checked for the bundle it must hold first).
"""

from __future__ import annotations

import enum
import re
from typing import Any

import attrs

from stoker.states.engine_update.records import (
    BundleFacts,
    Candidate,
    CleanStaging,
    CompareTokens,
    Effect,
    Gate,
    GateFailed,
    Outcome,
    Relaunch,
    Resolve,
    Resolved,
    RestartServers,
    Resumed,
    RollBack,
    RollbackFailed,
    RollbackRequested,
    RolledBack,
    ServerBaseline,
    ServersRestarted,
    ServerVerdict,
    Stage,
    Staged,
    Switch,
    Switched,
    TokensCompared,
    UpdateData,
    UpdateRequested,
    UpdateState,
)
from stoker.states.install.slot import Rejection
from stoker.states.launch.records import LaunchState
from stoker.states.machine import STAY, MachineSpec, Rule, Step, guarded, step_with_reason
from stoker.states.reasons import ReasonCode

# --- decisions ----------------------------------------------------------------------------

_PARTS = re.compile(r"(\d+)")


def version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    """A natural sort key: b11434 < b11500, b11434 < b11434-r1 (numbers compare as numbers)."""
    return tuple((1, int(part)) if part.isdigit() else (0, part) for part in _PARTS.split(version) if part)


def update_verdict(data: UpdateData, installed: BundleFacts | None, candidate: Candidate) -> str | None:
    """Why `candidate` is no update for the slot (a sentence), or None when it is one."""
    if data.bundle is not None:  # the user named this zip: anything but what is installed
        if installed is not None and candidate.ref == installed.digest:
            return f"the bundle named ({candidate.version}) is the one installed"
        return None
    if installed is not None and version_key(candidate.version) <= version_key(installed.version):
        return f"nothing newer than {installed.version} in the manifest (it offers {candidate.version})"
    if (rolled := rolled_back_before(data, candidate)) is not None:
        return held_back(candidate.version, rolled)
    if data.automatic and rejection_of(data, candidate.ref, candidate.sha256) is not None:
        return f"{candidate.version} was rejected here before; only `stoker engine update` offers it again"
    return None


def held_back(version: str, rolled: Rejection) -> str:
    """The sentence for a release not staged again because this slot rolled it back."""
    why = f"{rolled.gate} gate: {rolled.why}" if rolled.gate else (rolled.why or "by hand")
    return (
        f"{version} was rolled back here before ({why}); it is not staged again, which would "
        "restart every server on the slot to fail the same way. To try it anyway, name its zip: "
        "`stoker engine update --bundle ZIP`"
    )


def rolled_back_before(data: UpdateData, candidate: Candidate, digest: str | None = None) -> Rejection | None:
    """A channel's candidate this slot already rolled back (by itself or by hand), known by its
    zip or, once staged, by its `digest` (a zip the user named has only that): neither a user's
    `stoker engine update` nor the automatic check switches to it again; a named zip is tried."""
    if data.bundle is not None:
        return None
    rejection = rejection_of(data, candidate.ref, candidate.sha256, digest)
    if rejection is None or rejection.reason != ReasonCode.ENGINE_UPDATE_ROLLED_BACK.value:
        return None
    return rejection


def rejection_of(data: UpdateData, *ids: str | None) -> Rejection | None:
    """This slot's record of refusing the bundle known by any of `ids` (zip sha256, digest)."""
    return next((r for r in data.rejections if r.names(*ids)), None)


def automatic_check(data: UpdateData, installed: BundleFacts | None, candidate: Candidate) -> str | None:
    """Whether the automatic check starts an update (None) or finds nothing to do (why, a
    sentence). A check that starts nothing writes no history: the status says when it last ran."""
    if installed is None:
        return "no engine is installed in this slot"
    return update_verdict(attrs.evolve(data, automatic=True, bundle=None), installed, candidate)


def restart_wanted(launch_state: str) -> bool:
    """Whether an update restarts a server (after its switch, on resume, after a rollback): one
    that runs or is on its way, never one that is stopped (by the user, idle, evicted, a daemon
    restart): it starts on the slot's engine when it is next asked for (verdict `stopped`)."""
    return launch_state != LaunchState.STOPPED.value


def _rejected(data: UpdateData, gate: Gate, reason: ReasonCode, evidence: dict[str, Any]) -> tuple[Rejection, ...]:
    """`data.rejections` with the candidate added, known by every identity the update has seen."""
    candidate = data.candidate
    if candidate is None or gate is Gate.FETCH:
        return data.rejections
    refs = (candidate.ref, candidate.sha256, data.staged.digest if data.staged else None)
    known = tuple(dict.fromkeys(r for r in refs if r))
    kept = tuple(r for r in data.rejections if not r.names(*known))
    return (*kept, Rejection(candidate.version, reason.value, gate.value, known, _why(gate, evidence)))


def _why(gate: Gate, evidence: dict[str, Any]) -> str:
    """What the failing gate saw, in a few words, for the next request that meets the bundle."""
    server = evidence.get("server")
    if gate is Gate.START:
        said = evidence.get("server_reason") or evidence.get("cause")
        backend = evidence.get("backend")
        return (
            f"server {server} {evidence.get('outcome')}"
            + (f" ({said})" if said else "")
            + (f" on {backend}" if evidence.get("outcome") == Outcome.READY.value and backend else "")
        )
    if gate is Gate.LAYERS:
        return f"server {server} offloaded {evidence.get('offloaded_now') or 0} layers, {evidence.get('offloaded_before')} before"
    if gate is Gate.TOKENS and "first_difference" in evidence:
        return f"its greedy tokens differ from the old engine's at token {evidence['first_difference']}"
    return str(evidence.get("message") or evidence.get("cause") or gate.value)[:200]


def judge_servers(data: UpdateData, verdicts: tuple[ServerVerdict, ...]) -> tuple[Gate, dict[str, Any]] | None:
    """The gate the restarted servers fail (start, layers) with its evidence, or None."""
    baseline = {s.name: s for s in data.servers}
    for verdict in verdicts:
        if verdict.outcome in (Outcome.EXITED, Outcome.TIMEOUT) or (
            verdict.outcome is Outcome.READY and verdict.backend not in (None, data.backend)
        ):
            return Gate.START, {
                "server": verdict.name,
                "outcome": verdict.outcome.value,
                "backend": verdict.backend,
                "server_reason": verdict.reason,
                **verdict.evidence,
            }
        before = baseline.get(verdict.name)
        if verdict.outcome is Outcome.READY and before is not None and (before.offloaded_layers or 0) > 0:
            if not verdict.offloaded_layers:
                return Gate.LAYERS, {
                    "server": verdict.name,
                    "offloaded_before": before.offloaded_layers,
                    "offloaded_now": verdict.offloaded_layers,
                    "total_layers": verdict.total_layers or before.total_layers,
                }
    return None


# --- handlers -----------------------------------------------------------------------------

S = UpdateState
RESTING = (S.IDLE, S.CURRENT, S.UPDATED, S.REJECTED, S.ROLLED_BACK, S.FAILED)
WORKING = (S.RESOLVING, S.STAGING, S.COMPARING, S.SWITCHING, S.RESTARTING, S.ROLLING_BACK)


@guarded(S.RESOLVING)
def requested(state: S, data: UpdateData, event: UpdateRequested) -> Step:
    data = UpdateData(
        backend=event.backend,
        variant=event.variant,
        channel=event.channel,
        bundle=event.bundle,
        automatic=event.automatic,
        rejections=data.rejections if data.slot == f"{event.backend}-{event.variant}" else (),
        attempts=data.attempts + 1,
    )
    resolve = Resolve(event.backend, event.variant, event.channel, event.bundle)
    return Step(S.RESOLVING, data, (resolve,), evidence={"attempt": data.attempts, "automatic": event.automatic})


@guarded(S.STAGING, S.CURRENT, S.REJECTED)
def resolved(state: S, data: UpdateData, event: Resolved) -> Step:
    data = attrs.evolve(data, installed=event.installed, candidate=event.candidate)
    facts = {
        "installed": None if event.installed is None else event.installed.version,
        "candidate": event.candidate.version,
        "url": event.candidate.url,
        **({"manifest": event.candidate.origin} if event.candidate.origin else {}),
    }
    if event.installed is None:
        return _reject(data, Gate.FETCH, {**facts, "message": f"no {data.slot} engine is installed to update"})
    why_not = update_verdict(data, event.installed, event.candidate)
    if why_not is not None:
        rolled = rolled_back_before(data, event.candidate)
        if rolled is not None:  # not up to date: held back, and status and history say why
            held = {**facts, "message": why_not, "rolled_back": _rolled_facts(rolled)}
            return step_with_reason(S.CURRENT, data, (), ReasonCode.ENGINE_UPDATE_ROLLED_BACK, held)
        return Step(S.CURRENT, data, (), evidence={**facts, "message": why_not})
    stage = Stage(event.candidate, data.backend, data.variant)
    return Step(S.STAGING, data, (CleanStaging(), stage), evidence=facts)


@guarded(S.COMPARING, S.CURRENT)
def staged(state: S, data: UpdateData, event: Staged) -> Step:
    evidence = {"version": event.staged.version, "digest": event.staged.digest, **event.evidence}
    candidate = data.candidate
    rolled = None if candidate is None else rolled_back_before(data, candidate, event.staged.digest)
    if candidate is not None and rolled is not None:
        # Known only by its digest until now (it was rolled back as a named zip): held back here,
        # before any server restarts, and known by its zip from now on (caught when resolved).
        zips = tuple(r for r in (candidate.ref, candidate.sha256) if r)
        learned = attrs.evolve(rolled, refs=tuple(dict.fromkeys((*rolled.refs, *zips))))
        data = attrs.evolve(data, rejections=tuple(learned if r is rolled else r for r in data.rejections))
        held = {**evidence, "message": held_back(candidate.version, rolled), "rolled_back": _rolled_facts(rolled)}
        return step_with_reason(S.CURRENT, data, (CleanStaging(),), ReasonCode.ENGINE_UPDATE_ROLLED_BACK, held)
    data = attrs.evolve(data, staged=event.staged, staging=event.staging, new_tokens=event.tokens)
    return Step(S.COMPARING, data, (CompareTokens(event.staging),), evidence=evidence)


def _rolled_facts(rolled: Rejection) -> dict[str, Any]:
    return {"version": rolled.version, "gate": rolled.gate, "why": rolled.why}


@guarded(S.SWITCHING, S.REJECTED)
def compared(state: S, data: UpdateData, event: TokensCompared) -> Step | None:
    if data.staging is None or data.staged is None or data.new_tokens is None:
        return None
    old, new = event.old, data.new_tokens
    if old != new:
        first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        evidence = {"old_tokens": list(old), "new_tokens": list(new), "first_difference": first, **event.evidence}
        return _reject(data, Gate.TOKENS, evidence)
    switch = Switch(data.staging, data.slot, data.staged.digest)
    return Step(S.SWITCHING, data, (switch,), evidence={"tokens": len(new), "identical": True, **event.evidence})


@guarded(S.REJECTED)
def gate_failed(state: S, data: UpdateData, event: GateFailed) -> Step:
    return _reject(data, event.gate, event.evidence)


def _reject(data: UpdateData, gate: Gate, evidence: dict[str, Any]) -> Step:
    """Refused before the switch: the slot is untouched; the candidate is remembered."""
    evidence = {"gate": gate.value, **evidence}
    rejections = _rejected(data, gate, ReasonCode.ENGINE_UPDATE_REJECTED, evidence)
    data = attrs.evolve(
        data, gate=gate, rejections=rejections, reason=ReasonCode.ENGINE_UPDATE_REJECTED, evidence=evidence
    )
    return Step(S.REJECTED, data, (CleanStaging(),), ReasonCode.ENGINE_UPDATE_REJECTED, evidence)


@guarded(S.RESTARTING, S.UPDATED)
def switched(state: S, data: UpdateData, event: Switched) -> Step:
    data = attrs.evolve(data, servers=event.servers, staging=None)
    names = tuple(s.name for s in event.servers)
    evidence = {"servers": list(names), **event.evidence}
    if not names:  # nothing ran on it: the next launch uses it; start and layers gates have no server
        return _updated(data, {**evidence, "gates_not_run": ["start", "layers"]})
    return Step(S.RESTARTING, data, (CleanStaging(), RestartServers(names)), evidence=evidence)


@guarded(S.ROLLING_BACK)
def switch_failed(state: S, data: UpdateData, event: GateFailed) -> Step | None:
    if data.installed is None or data.staged is None:
        return None
    return _roll_back(data, event.gate, event.evidence, ())


@guarded(S.UPDATED, S.ROLLING_BACK)
def servers_restarted(state: S, data: UpdateData, event: ServersRestarted) -> Step | None:
    if data.installed is None:
        return None
    data = attrs.evolve(data, verdicts=event.verdicts)
    failure = judge_servers(data, event.verdicts)
    if failure is not None:
        gate, evidence = failure
        return _roll_back(data, gate, evidence, tuple(s.name for s in data.servers))
    return _updated(data, {"verdicts": {v.name: v.outcome.value for v in event.verdicts}})


def _updated(data: UpdateData, evidence: dict[str, Any]) -> Step:
    version = data.staged.version if data.staged else None
    data = attrs.evolve(data, gate=None, reason=None, evidence={})
    return Step(S.UPDATED, data, (), evidence={"version": version, **evidence})


def _roll_back(data: UpdateData, gate: Gate, evidence: dict[str, Any], names: tuple[str, ...]) -> Step | None:
    if data.installed is None:
        return None
    rejections = _rejected(data, gate, ReasonCode.ENGINE_UPDATE_ROLLED_BACK, evidence)
    restore = data.installed
    evidence = {"gate": gate.value, "restoring": restore.version, **evidence}
    data = attrs.evolve(data, gate=gate, rejections=rejections, by_hand=False, evidence=evidence)
    discard = data.staged.digest if data.staged is not None else None
    back = RollBack(data.slot, restore.digest, discard)
    return Step(S.ROLLING_BACK, data, (back,), evidence=evidence)


@guarded(STAY, S.ROLLING_BACK)
def rollback_requested(state: S, data: UpdateData, event: RollbackRequested) -> Step:
    slot = f"{event.backend}-{event.variant}"
    if event.previous is None:
        refused: dict[str, Any] = {
            "slot": slot,
            "current": None if event.current is None else event.current.version,
            "message": f"no previous {slot} engine is kept",
        }
        return Step(state, data, (), ReasonCode.ENGINE_ROLLBACK_UNAVAILABLE, refused)
    base = data if data.slot == slot else UpdateData(backend=event.backend, variant=event.variant)
    data = attrs.evolve(
        base,
        rejections=_rolled_back_by_hand(base, event.current, event.previous),
        installed=event.previous,
        staged=event.current,
        servers=tuple(ServerBaseline(n) for n in event.servers),
        verdicts=(),
        by_hand=True,
        gate=None,
        reason=None,
        evidence={},
    )
    evidence = {
        "by_hand": True,
        "from": None if event.current is None else event.current.version,
        "to": event.previous.version,
    }
    return Step(S.ROLLING_BACK, data, (RollBack(slot, event.previous.digest, None),), evidence=evidence)


def _rolled_back_by_hand(data: UpdateData, current: BundleFacts | None, back: BundleFacts) -> tuple[Rejection, ...]:
    """A user's rollback rejects the engine it leaves (no automatic check nor install brings it
    back) and lifts any rejection of the one it returns to (the user chose it)."""
    kept = tuple(r for r in data.rejections if not r.names(back.digest))
    if current is None:
        return kept
    refs: tuple[str | None, ...] = (current.digest,)
    if data.candidate is not None and data.staged is not None and data.staged.digest == current.digest:
        refs += (data.candidate.ref, data.candidate.sha256)
    known = tuple(dict.fromkeys(r for r in refs if r))
    reason = ReasonCode.ENGINE_UPDATE_ROLLED_BACK.value
    return (*(r for r in kept if not r.names(*known)), Rejection(current.version, reason, None, known, "by hand"))


@guarded(S.ROLLED_BACK)
def rolled_back(state: S, data: UpdateData, event: RolledBack) -> Step:
    names = tuple(s.name for s in data.servers)
    relaunch = (Relaunch(names),) if names else ()
    if data.by_hand:
        data = attrs.evolve(data, reason=None, evidence={})
        return Step(S.ROLLED_BACK, data, relaunch, evidence={"by_hand": True, **event.evidence})
    evidence = {**data.evidence, **event.evidence}
    return step_with_reason(S.ROLLED_BACK, data, relaunch, ReasonCode.ENGINE_UPDATE_ROLLED_BACK, evidence)


@guarded(S.FAILED)
def rollback_failed(state: S, data: UpdateData, event: RollbackFailed) -> Step:
    evidence = {**data.evidence, **event.evidence}
    return step_with_reason(S.FAILED, data, (), ReasonCode.ENGINE_ROLLBACK_FAILED, evidence)


@guarded(S.RESOLVING, S.STAGING, S.SWITCHING, S.RESTARTING, S.ROLLING_BACK)
def resumed(state: S, data: UpdateData, event: Resumed) -> Step | None:
    data = attrs.evolve(data, resumes=data.resumes + 1)
    evidence = {"resumed_from": state.value}
    if state is S.RESOLVING or (state in (S.STAGING, S.COMPARING) and data.candidate is None):
        resolve = Resolve(data.backend, data.variant, data.channel, data.bundle)
        return Step(S.RESOLVING, data, (CleanStaging(), resolve), evidence=evidence)
    if state in (S.STAGING, S.COMPARING) and data.candidate is not None:
        stage = Stage(data.candidate, data.backend, data.variant)
        return Step(S.STAGING, attrs.evolve(data, staging=None), (CleanStaging(), stage), evidence=evidence)
    if state is S.SWITCHING and data.staging is not None and data.staged is not None:
        return Step(S.SWITCHING, data, (Switch(data.staging, data.slot, data.staged.digest),), evidence=evidence)
    if state is S.RESTARTING:  # killed before the switch's CleanStaging ran, the staging dir is left
        restart = RestartServers(tuple(s.name for s in data.servers))
        return Step(S.RESTARTING, data, (CleanStaging(), restart), evidence=evidence)
    if state is S.ROLLING_BACK and data.installed is not None:
        discard = None if data.by_hand or data.staged is None else data.staged.digest
        return Step(S.ROLLING_BACK, data, (RollBack(data.slot, data.installed.digest, discard),), evidence=evidence)
    return None


# The gate a step that raised stands for: its failure is that gate failing, so no machine is
# left mid-way.
FAILED_GATE: dict[type, Gate] = {
    Resolve: Gate.FETCH,
    Stage: Gate.VERIFY,
    CompareTokens: Gate.TOKENS,
    Switch: Gate.SWITCH,
}


def step_failed(effect: Effect, cause: dict[str, Any]) -> GateFailed | RollbackFailed | ServersRestarted | None:
    """The event a step that raised (its `cause`: the precise code, the sentence) stands for;
    None where the machine need not hear it (cleaning the staging, asking for relaunches)."""
    if type(effect) in FAILED_GATE:
        return GateFailed(FAILED_GATE[type(effect)], cause)
    if isinstance(effect, RollBack):
        return RollbackFailed(cause)
    if isinstance(effect, RestartServers):
        return ServersRestarted(tuple(ServerVerdict(n, Outcome.TIMEOUT, evidence=cause) for n in effect.names))
    return None


TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    **{s: {UpdateRequested: requested, RollbackRequested: rollback_requested} for s in RESTING},
    S.RESOLVING: {Resolved: resolved, GateFailed: gate_failed, Resumed: resumed.only(S.RESOLVING)},
    S.STAGING: {Staged: staged, GateFailed: gate_failed, Resumed: resumed.only(S.RESOLVING, S.STAGING)},
    S.COMPARING: {TokensCompared: compared, GateFailed: gate_failed, Resumed: resumed.only(S.RESOLVING, S.STAGING)},
    S.SWITCHING: {Switched: switched, GateFailed: switch_failed, Resumed: resumed.only(S.SWITCHING)},
    S.RESTARTING: {ServersRestarted: servers_restarted, Resumed: resumed.only(S.RESTARTING)},
    S.ROLLING_BACK: {RolledBack: rolled_back, RollbackFailed: rollback_failed, Resumed: resumed.only(S.ROLLING_BACK)},
}

ENGINE_UPDATE = MachineSpec(
    name="engine_update",
    initial=S.IDLE,
    data_type=UpdateData,
    transitions=TRANSITIONS,
    terminal=set(RESTING),
    description=(
        "One engine bundle slot moved to a newer engine: resolve, stage and verify (smoke gate), compare the old and "
        "new engines' tokens here, switch, restart what ran on it; roll back by itself when a server does not get "
        "ready or offloads nothing where it did, or by hand."
    ),
    effect_types=Effect,
)
