"""The engine update machine's vocabulary: its states, data, events and effects (the table and
its decisions are states/engine_update/table.py, which says what each means).

Events carry facts (what a slot holds, a candidate's version, the tokens an engine generated, what
a restarted server did); effects are what the machine asks the daemon to do
(daemon/install/update.py carries them out).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.install.slot import Rejection
from stoker.states.machine import Observed, as_evidence, as_tuple, int_tuple
from stoker.states.reasons import ReasonCode


class UpdateState(enum.StrEnum):
    IDLE = "idle"
    RESOLVING = "resolving"
    STAGING = "staging"
    COMPARING = "comparing"
    SWITCHING = "switching"
    RESTARTING = "restarting"
    UPDATED = "updated"
    CURRENT = "current"
    REJECTED = "rejected"
    ROLLING_BACK = "rolling_back"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


class Gate(enum.StrEnum):
    """The checks an update passes, in order (the `gate` a failure names)."""

    FETCH = "fetch"
    VERIFY = "verify"
    SMOKE = "smoke"
    TOKENS = "tokens"
    SWITCH = "switch"
    START = "start"
    LAYERS = "layers"


class Outcome(enum.StrEnum):
    """What became of one server restarted on the new engine."""

    READY = "ready"
    EXITED = "exited"  # it died (crashed, backing off, failed) before ready
    TIMEOUT = "timeout"  # not ready within the wait
    STOPPED = "stopped"  # someone stopped it meanwhile: no verdict on the engine
    SKIPPED = "skipped"  # not waited for: another server's failure already decided


def _tokens(value: Any) -> tuple[int, ...] | None:
    return None if value is None else int_tuple(value)


@attrs.frozen
class BundleFacts:
    """One engine bundle as the update knows it: its version and its identity (the sha256 of its
    bundle.json, which lists every file's sha256: one per build)."""

    version: str
    digest: str


@attrs.frozen
class Candidate:
    """The bundle offered: its version, `ref` (what identifies it before download: the zip's
    sha256 for a manifest entry, the bundle.json digest for a named zip), where it is."""

    version: str
    ref: str
    url: str
    sha256: str | None = None
    size: int | None = None
    origin: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class ServerBaseline:
    """A server that ran on the old engine, and what its last good launch reported."""

    name: str
    offloaded_layers: int | None = None
    total_layers: int | None = None


@attrs.frozen
class ServerVerdict:
    """What one server did once restarted on the new engine (facts; the table judges them)."""

    name: str
    outcome: Outcome = attrs.field(converter=Outcome)
    backend: str | None = None  # the backend its new launch planned (a GPU server may fall back)
    offloaded_layers: int | None = None
    total_layers: int | None = None
    reason: str | None = None  # its launch machine's reason (an exit's classified reason)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class UpdateData:
    backend: str = ""
    variant: str = ""
    channel: str | None = None
    bundle: str | None = None  # the zip the user named; None: the channel's manifest
    automatic: bool = False  # asked by the periodic check, not a user
    installed: BundleFacts | None = None  # what the slot held before: the way back
    candidate: Candidate | None = None
    staged: BundleFacts | None = None  # the candidate as staged and verified
    staging: str | None = None
    new_tokens: tuple[int, ...] | None = attrs.field(default=None, converter=_tokens)
    servers: tuple[ServerBaseline, ...] = ()  # what ran on the old engine: restarted on the new
    verdicts: tuple[ServerVerdict, ...] = attrs.field(default=(), converter=as_tuple)
    # bundles refused or rolled back here: never offered again automatically, never installed again
    # unless named (states/install/slot.py); each with every identity known of it (zip, digest)
    rejections: tuple[Rejection, ...] = attrs.field(default=(), converter=as_tuple)
    gate: Gate | None = None  # the gate that failed
    by_hand: bool = False  # the rollback under way (or last done) was asked by a user
    attempts: int = 0
    resumes: int = 0
    reason: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)

    @property
    def slot(self) -> str:
        return f"{self.backend}-{self.variant}"


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class UpdateRequested:
    """Update the slot: from `channel`'s manifest, or to the zip `bundle` a user named."""

    backend: str
    variant: str
    channel: str | None = None
    bundle: str | None = None
    automatic: bool = False


@attrs.frozen
class Resolved:
    """What the slot holds now (None: nothing installed) and what is offered."""

    installed: BundleFacts | None
    candidate: Candidate


@attrs.frozen
class Staged:
    """The candidate is unpacked into `staging` and passed verification and its own smoke gate;
    `tokens` are the greedy tokens it generated here."""

    staged: BundleFacts
    staging: str
    tokens: tuple[int, ...] = attrs.field(converter=int_tuple)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class GateFailed:
    """A step failed: `gate` says which (fetch, verify, smoke, tokens: the engine could not run;
    switch), the evidence its cause (the precise reason code, the message, the figures)."""

    gate: Gate = attrs.field(converter=Gate)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class TokensCompared:
    """The old engine's greedy tokens on the candidate's smoke model, run here."""

    old: tuple[int, ...] = attrs.field(converter=int_tuple)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class Switched:
    """The slot holds the staged bundle, the old one is its `.previous`; `servers` ran on the old."""

    servers: tuple[ServerBaseline, ...] = ()
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class ServersRestarted:
    """Each restarted server's verdict (a failure may end the wait for the others: skipped)."""

    verdicts: tuple[ServerVerdict, ...] = attrs.field(converter=as_tuple)


@attrs.frozen
class RollbackRequested:
    """A user's `stoker engine rollback`: what the slot and its `.previous` hold now, and the
    servers running on the slot."""

    backend: str
    variant: str
    current: BundleFacts | None
    previous: BundleFacts | None
    servers: tuple[str, ...] = ()


@attrs.frozen
class RolledBack(Observed):
    """The slot holds the bundle it was asked to (the previous one) again."""


@attrs.frozen
class RollbackFailed(Observed):
    """The bundle to put back is not there (slot and `.previous` hold others)."""


@attrs.frozen
class Resumed:
    """The daemon restarted and found this machine mid-way."""


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class Resolve:
    """Read what the slot holds and find the candidate (the named zip, or the channel's manifest
    entry for this slot); answer Resolved or GateFailed(fetch)."""

    backend: str
    variant: str
    channel: str | None
    bundle: str | None


@attrs.frozen
class CleanStaging:
    """Remove the update's staging directory (never the slot nor its `.previous`)."""


@attrs.frozen
class Stage:
    """Fetch the candidate (download, resumable) and unpack it into a fresh hidden staging
    directory; verify it there and run its smoke gate; answer Staged or GateFailed."""

    candidate: Candidate
    backend: str
    variant: str


@attrs.frozen
class CompareTokens:
    """Run the slot's (old) engine on the staged bundle's smoke model here; answer TokensCompared
    or GateFailed(tokens)."""

    staging: str


@attrs.frozen
class Switch:
    """Promote the staged bundle into the slot (the old one becomes `.previous`); answer Switched
    with the servers that ran on the old engine, or GateFailed(switch)."""

    staging: str
    slot: str
    digest: str  # what the slot must hold afterwards


@attrs.frozen
class RestartServers:
    """Restart these servers and judge each; answer ServersRestarted."""

    names: tuple[str, ...]


@attrs.frozen
class RollBack:
    """Put the bundle `restore` (a digest) back into the slot from `.previous`, keeping the
    replaced one as `.previous` unless `discard` names it; answer RolledBack or RollbackFailed."""

    slot: str
    restore: str
    discard: str | None = None


@attrs.frozen
class Relaunch:
    """Restart these servers on what the slot holds now (nothing is waited for)."""

    names: tuple[str, ...]


Effect = Resolve | CleanStaging | Stage | CompareTokens | Switch | RestartServers | RollBack | Relaunch
