"""Counters that survive a daemon restart, read from the store's history (docs/frontdoor.md, "Metrics").

Fallbacks, restarts, crashes, crash loops and install outcomes are transitions the machines
recorded; counting them from history (rather than in memory) keeps them across daemon
restarts, and counts what the CLI's own installs wrote too. `HistoryTally` keeps its place
(the last transition id it read), so each scrape reads only what was written since: the whole
history once, at the first scrape of a daemon's life, then a few rows.

Each count but the installs' is kept by model: the model whose launch or fallback machine
recorded it (`launch:<NAME>`; the instance `default`'s are `launch` and `fallback`).
What each transition means is read from the machines' own vocabulary (states/):
- a fallback: the fallback machine passed over a backend (`checking` with the next candidate
  in its evidence), settled on another backend than the planned one (a GPU server that
  offloaded nothing: the proof's demotion), or gave up on the last one (`failed`: to "none");
- a restart: a running server (starting, loading, ready) relaunched by `stoker restart`
  (cause "requested") or by a config change (cause "config"), or a server that died unasked
  or stopped moving and is respawned after a backoff (`crashed`: cause "crash");
- a crash: every exit the launch machine counted (`crashed`, or `failed` at once for a fatal
  one, or as a crash loop), by its reason (a crash loop's last crash by that crash's reason);
- an install outcome: the install machine reached `installed` (promoted into its slot) or
  `failed`, by backend and reason.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable

import attrs

from stoker.daemon.launch.instance import ServerInstance
from stoker.states.fallback import table as F
from stoker.states.install import table as I
from stoker.states.launch import records as LR
from stoker.states.launch.table import LAUNCH
from stoker.states.reasons import ReasonCode
from stoker.store.records import TransitionRecord

# The machine kinds whose history the tally reads.
KINDS = (F.FALLBACK.name, I.INSTALL.name, LAUNCH.name)
NONE = "none"  # a fallback's `to` when no backend was left
RUNNING = frozenset({LR.LaunchState.STARTING, LR.LaunchState.LOADING, LR.LaunchState.READY})
RESTART_CAUSES = {LR.RestartRequested.__name__: "requested", LR.ConfigChanged.__name__: "config"}


def model_of(record: TransitionRecord) -> str:
    """The model whose launch or fallback machine wrote `record` (its instance's NAME)."""
    instance = ServerInstance.of_machine(record.kind, record.machine_id)
    return instance.name if instance is not None else record.machine_id


@attrs.define(eq=False)
class HistoryTally:
    """Running counts over the history read so far, and where reading stopped."""

    after_id: int = 0
    fallbacks: Counter[tuple[str, str, str, str]] = attrs.field(factory=Counter)  # (model, from, to, reason)
    restarts: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # (model, cause)
    crashes: Counter[tuple[str, str]] = attrs.field(factory=Counter)  # (model, reason)
    crash_loops: Counter[str] = attrs.field(factory=Counter)  # model
    installs: Counter[tuple[str, str, str]] = attrs.field(factory=Counter)  # (backend, result, reason)
    _install_backends: dict[str, str] = attrs.field(factory=dict)  # install machine id -> backend

    def read(self, records: Iterable[TransitionRecord]) -> None:
        """Count `records` (written after `after_id`, in write order) and move past them."""
        for record in records:
            if record.id is None or record.id <= self.after_id:
                continue
            self.after_id = record.id
            if record.kind == F.FALLBACK.name:
                self._fallback(record)
            elif record.kind == LAUNCH.name:
                self._launch(record)
            elif record.kind == I.INSTALL.name:
                self._install(record)

    def _fallback(self, r: TransitionRecord) -> None:
        model = model_of(r)
        reason = r.reason or ""
        evidence = r.evidence
        if r.to_state == F.FallbackState.CHECKING and "next" in evidence and "backend" in evidence:
            self.fallbacks[(model, str(evidence["backend"]), str(evidence["next"]), reason)] += 1
        elif r.to_state == F.FallbackState.SETTLED and r.event == F.LaunchSucceeded.__name__:
            planned, effective = evidence.get("backend"), evidence.get("effective_backend")
            if planned and effective and planned != effective:
                self.fallbacks[(model, str(planned), str(effective), reason)] += 1
        elif r.to_state == F.FallbackState.FAILED and r.from_state != F.FallbackState.FAILED:
            skipped = evidence.get("skipped") or []
            last = skipped[-1].get("backend") if skipped and isinstance(skipped[-1], dict) else None
            if last:
                self.fallbacks[(model, str(last), NONE, reason)] += 1

    def _launch(self, r: TransitionRecord) -> None:
        model = model_of(r)
        if r.to_state == LR.LaunchState.CRASHED:
            self.restarts[(model, "crash")] += 1
            self.crashes[(model, r.reason or "")] += 1
        elif r.to_state == LR.LaunchState.FAILED and "crashes" in r.evidence:
            # A counted exit that ends the server: fatal at once, or one crash too many.
            if r.reason == ReasonCode.CRASH_LOOP:
                self.crash_loops[model] += 1
                self.crashes[(model, str(r.evidence.get("last_reason") or r.reason))] += 1
            else:
                self.crashes[(model, r.reason or "")] += 1
        elif r.event in RESTART_CAUSES and r.from_state in RUNNING and r.to_state == LR.LaunchState.STOPPING:
            self.restarts[(model, RESTART_CAUSES[r.event])] += 1

    def _install(self, r: TransitionRecord) -> None:
        if r.event == I.InstallRequested.__name__ and r.event_data.get("backend"):
            self._install_backends[r.machine_id] = str(r.event_data["backend"])
            return
        promoted = r.event == I.Promoted.__name__  # (SmokePassed: rows from before `promoting` was a state)
        if (promoted or r.event == I.SmokePassed.__name__) and r.to_state == I.InstallState.INSTALLED:
            result = "installed"
        elif r.to_state == I.InstallState.FAILED:  # a step failed, or no source had a bundle
            result = "failed"
        else:
            return
        self.installs[(self._backend_of(r.machine_id), result, r.reason or "")] += 1

    def _backend_of(self, machine_id: str) -> str:
        # `install:<backend>-<variant>`: the request's own backend when it was read.
        known = self._install_backends.get(machine_id)
        return known or machine_id.removeprefix("install:").split("-", 1)[0]
