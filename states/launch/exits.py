"""The launch machine's exit policy: what an unasked llama-server exit means for the next try.

An exit (`ServerExited`) carries facts: the classified reason, the phase (before or after
ready) and the plan it ran. `judge_exit` turns them into a verdict, which the launch table
(states/launch/table.py) acts on: a reason in FATAL_EXITS fails at once; a reason in REPLAN_EXITS,
or any non-CPU plan that dies before it was ever ready, asks for a new plan (the fallback then
records `<backend>_startup_failed` and moves on); anything else is respawned with the same
plan after a backoff, until `max_restarts` makes it a crash loop.
"""

from __future__ import annotations

import enum

from stoker.states.launch.records import ExitPhase, LaunchPlan
from stoker.states.reasons import ReasonCode

# Exits that no retry can help: a missing or unparseable model, an option the engine
# rejects. They fail at once with the real reason instead of looping into crash_loop.
FATAL_EXITS = frozenset({ReasonCode.MODEL_MISSING, ReasonCode.MODEL_LOAD_FAILED, ReasonCode.SERVER_BAD_ARGUMENTS})
# Exits that the same plan would repeat: SIGILL says the CPU variant is wrong for this CPU; a
# lost RPC worker is named in the plan's --rpc (the new plan checks every worker again and goes
# on without the ones that are gone: states/fleet/rpc_placement.py).
REPLAN_EXITS = frozenset(
    {ReasonCode.CPU_ILLEGAL_INSTRUCTION, ReasonCode.RPC_WORKER_LOST, ReasonCode.RPC_VERSION_MISMATCH}
)


class ExitVerdict(enum.StrEnum):
    """What an unasked exit means for the next attempt."""

    FATAL = "fatal"  # fail now with the exit's reason
    REPLAN = "replan"  # back off, then ask for a new plan (MakePlan with the failure)
    RESPAWN = "respawn"  # back off, then spawn the same plan again


def judge_exit(reason: ReasonCode, phase: ExitPhase, plan: LaunchPlan | None) -> ExitVerdict:
    """The policy for an unasked exit, from its facts: the reason, the phase, the plan."""
    if reason in FATAL_EXITS:
        return ExitVerdict.FATAL
    if reason in REPLAN_EXITS:
        return ExitVerdict.REPLAN
    if phase is ExitPhase.NEVER_READY and plan is not None and not plan.on_cpu:
        # The same accelerated plan would die the same way: plan anew, and the fallback
        # records <backend>_startup_failed and tries the next backend.
        return ExitVerdict.REPLAN
    return ExitVerdict.RESPAWN


def judge_stall(hung: bool, plan: LaunchPlan | None) -> ExitVerdict:
    """A stall (before ready) or a hang (after): respawned like any crash (the plan worked, the
    engine stopped moving), except a stall of a plan that places layers on RPC workers: a worker
    busy with another head holds the engine before it reads the model, and the same `--rpc`
    would hold it again, so a new plan reads the workers again (a busy one is left out)."""
    if not hung and plan is not None and plan.rpc is not None and plan.rpc.used:
        return ExitVerdict.REPLAN
    return ExitVerdict.RESPAWN
