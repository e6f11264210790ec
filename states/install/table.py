"""The install machine: one bundle (backend + variant) from request to installed.

    requested -> a source -> downloading -> verifying -> unpacking -> validating
              -> smoke_testing -> promoting -> installed | failed(reason)

    sources, in this order (SOURCE_ORDER), each attempt recorded in `tried`: file (a zip the user
    named, alone) and mirror (the manifest) resolve; build-cache searches the local build cache;
    local-build checks the toolchain, then builds from the pinned source.

Which source comes next is decided here, from the facts the service reports: a source with
nothing to offer (`SourceUnavailable`: no manifest configured, the manifest refused or listing
nothing that fits, a cache miss, no toolchain or a backend the builder cannot build) passes the
install on to the next source. A bundle that a source *did* offer and that then failed a step
(`InstallFailed`) ends the install, except a cached build's: the cache is this machine's own
scratch (an older build, a half-written entry), so a local build may still replace it. A
configured mirror whose bundle fails its digest, archive or smoke check is a publishing bug or
an attack the user must see; the previous bundle stays and the failure says why.

What a source offers is judged against the slot first (states/install/slot.py): a bundle the slot
already holds is not fetched again, and one an engine update rejected or rolled back on this slot
is never installed unless the user named it (a file). The machine's record is the slot's
(`holds`, `previous`): its own promote (`Promoted`, once the rename is done: `installed` follows
the fact), an engine update's switch and a rollback (`SlotChanged`) all land in it.

Resuming after a daemon kill (`Resumed`): a source's search (a build too) starts over, a
download continues with HTTP Range from the partial file, verifying re-checks the archive,
later steps start again from a clean staging directory, promoting re-sends `Promote`
(idempotent: a rename already done is found done). Download and build progress go to the bus.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from stoker.states.install.effects import (
    BuildBundle,
    CheckToolchain,
    CleanStaging,
    Download,
    Effect,
    FindCachedBuild,
    Promote,
    Resolve,
    SmokeTest,
    Unpack,
    ValidateBundle,
    VerifyArchive,
)
from stoker.states.install.slot import Offer, Rejection, SlotBundle, SlotWriter, offer_facts, offer_verdict
from stoker.states.install.sources import (
    CHAIN,
    REFUSALS,
    RETRY_NEXT_ON_FAILURE,
    SOURCE_ORDER,
    Source,
    attempt_record,
    next_source,
    sources_of,
    tries_of,
)
from stoker.states.machine import (
    STAY,
    Failure,
    Guarded,
    MachineSpec,
    Observed,
    Rule,
    Step,
    as_evidence,
    guarded,
    step_with_reason,
)
from stoker.states.reasons import ReasonCode


class InstallState(enum.StrEnum):
    REQUESTED = "requested"
    RESOLVING = "resolving"
    SEARCHING_CACHE = "searching_cache"
    CHECKING_TOOLCHAIN = "checking_toolchain"
    BUILDING = "building"
    DOWNLOADING = "downloading"
    VERIFYING = "verifying"
    UNPACKING = "unpacking"
    VALIDATING = "validating"
    SMOKE_TESTING = "smoke_testing"
    PROMOTING = "promoting"
    INSTALLED = "installed"
    FAILED = "failed"


@attrs.frozen
class InstallData:
    backend: str = ""
    variant: str = ""
    url: str | None = None
    sha256: str | None = None
    size: int | None = None
    archive: str | None = None  # the downloaded (partial) file
    staging: str | None = None
    attempts: int = 0  # install requests so far (1 for the first)
    resumes: int = 0
    reason: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    sources: tuple[Source, ...] = attrs.field(default=(), converter=sources_of)  # this request's, in order
    source: Source | None = None  # the one being tried, then the one the installed bundle came from
    origin: str | None = None  # where in it: the manifest's URL, the cache entry, the file
    # one record per source tried for this request: {source, outcome, reason, cause, message, seconds}
    tried: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=tries_of, hash=False)
    holds: SlotBundle | None = None  # what the slot holds, once installed (or switched, rolled back)
    previous: SlotBundle | None = None  # what its `.previous` holds


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class InstallRequested:
    """Install (or reinstall, or retry) the bundle for backend + variant, from the sources the
    requester allows (a file alone, or the chain; tried in SOURCE_ORDER whatever the order given)."""

    backend: str
    variant: str
    sources: tuple[Source, ...] = attrs.field(default=CHAIN, converter=sources_of)


@attrs.frozen
class Resolved:
    """The source names the bundle: its `url` (file:// for a cached or a local build), sha256,
    size, and `origin`, where in the source (the manifest's URL, the cache entry); with what the
    slot holds `now`, the bundle's `digest` where its bundle.json is readable before download, and
    an engine update's `rejection` of it on this slot (then `reason`, the backend's
    bundle_install_failed code, is what the install fails with if no later source has one)."""

    url: str
    sha256: str
    size: int
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    origin: str | None = None
    now: SlotBundle | None = None
    digest: str | None = None
    rejection: Rejection | None = None
    reason: ReasonCode | None = None


@attrs.frozen
class SourceUnavailable:
    """The source being tried has nothing to offer: no manifest configured, unreadable or
    refused, it lists nothing that fits, a cache miss, no toolchain. `reason` is the backend's
    bundle_install_failed code, `cause` the precise one (also the evidence's); `seconds` the try's."""

    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    seconds: float | None = None
    cause: ReasonCode | None = None


@attrs.frozen
class ToolchainReady(Observed):
    """The builder can build this backend here (compiler, cmake, and what the backend needs)."""


@attrs.frozen
class Downloaded:
    """The archive is complete on disk (streamed digest and size)."""

    archive: str
    sha256: str
    size: int


@attrs.frozen
class Verified(Observed):
    """The archive matches the resolved digest and size."""


@attrs.frozen
class Unpacked:
    """The archive was unpacked safely into `staging`."""

    staging: str


@attrs.frozen
class Validated:
    """The staged bundle's metadata matches the manifest and the platform; its `digest`, what the
    slot holds `now` and an engine update's `rejection` of it (as for Resolved)."""

    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)
    now: SlotBundle | None = None
    digest: str | None = None
    rejection: Rejection | None = None
    reason: ReasonCode | None = None


@attrs.frozen
class SmokePassed(Observed):
    """The staged engine passed `--version`, `--list-devices` and the smoke test."""


@attrs.frozen
class Promoted:
    """The staged bundle was renamed into the slot: what the slot and its `.previous` hold now."""

    slot: SlotBundle
    previous: SlotBundle | None = None
    seconds: float | None = None  # the successful source's attempt, from its first step


@attrs.frozen
class SlotChanged:
    """An engine update switched the slot, or a rollback put `.previous` back (`slot.by` says
    which): what the slot and its `.previous` hold now."""

    slot: SlotBundle
    previous: SlotBundle | None = None


@attrs.frozen
class InstallFailed(Failure):
    """Any step failed; `reason` is its code (bundle_digest_mismatch, ...)."""

    seconds: float | None = None  # the failed source's attempt, from its first step


@attrs.frozen
class Resumed:
    """The daemon restarted and found this machine mid-way."""


S = InstallState
FINDING = (S.RESOLVING, S.SEARCHING_CACHE, S.CHECKING_TOOLCHAIN, S.BUILDING)  # a source finds its bundle
WORKING = (*FINDING, S.DOWNLOADING, S.VERIFYING, S.UNPACKING, S.VALIDATING, S.SMOKE_TESTING, S.PROMOTING)
STARTS = (S.RESOLVING, S.SEARCHING_CACHE, S.CHECKING_TOOLCHAIN)  # where each source begins


def _start(source: Source, data: InstallData) -> tuple[S, tuple[Any, ...]]:
    """The state a source begins in and what it asks first."""
    if source is Source.BUILD_CACHE:
        return S.SEARCHING_CACHE, (FindCachedBuild(data.backend, data.variant),)
    if source is Source.LOCAL_BUILD:
        return S.CHECKING_TOOLCHAIN, (CheckToolchain(data.backend, data.variant),)
    return S.RESOLVING, (Resolve(data.backend, data.variant, source),)


def _on(data: InstallData, source: Source) -> InstallData:
    """`data` about to try `source`: nothing of the previous source's bundle carried over."""
    return attrs.evolve(data, source=source, origin=None, url=None, sha256=None, size=None, archive=None, staging=None)


def _source_over(
    state: S, data: InstallData, reason: ReasonCode, evidence: dict[str, Any], seconds: float | None, outcome: str
) -> Step:
    """The source being tried gave nothing (`unavailable`), was refused (`refused`: a mirror
    whose manifest is not to be believed) or its bundle failed a step (`failed`): the next source in the request's chain where the policy allows, else failed
    with the backend's reason and every attempt in the evidence."""
    data = attrs.evolve(
        data, tried=data.tried + (attempt_record(state.value, data.source, data.origin, outcome, evidence, seconds),)
    )
    evidence = {**evidence, "step": state.value}
    if data.source is not None:
        evidence["source"] = data.source.value
    following = next_source(data.sources, data.source)
    moves_on = outcome in ("unavailable", "rejected") or data.source in RETRY_NEXT_ON_FAILURE
    if following is not None and moves_on:
        target, effects = _start(following, data)
        evidence = {**evidence, "next_source": following.value, "seconds": seconds}
        return Step(target, _on(data, following), (CleanStaging(), *effects), evidence=evidence)
    evidence = {**evidence, "tried": list(data.tried)}
    return step_with_reason(S.FAILED, data, (CleanStaging(),), reason, evidence)


@guarded(*STARTS)
def requested(state: S, data: InstallData, event: InstallRequested) -> Step | None:
    sources = tuple(s for s in SOURCE_ORDER if s in event.sources)
    if not sources:
        return None
    data = InstallData(
        backend=event.backend,
        variant=event.variant,
        attempts=data.attempts + 1,
        sources=sources,
        holds=data.holds,  # the slot's record outlives requests
        previous=data.previous,
    )
    target, effects = _start(sources[0], data)
    evidence = {"attempt": data.attempts, "sources": [s.value for s in sources]}
    return Step(target, _on(data, sources[0]), effects, evidence=evidence)


def _fetch(data: InstallData, url: str, sha256: str, size: int, origin: str | None, evidence: dict[str, Any]) -> Step:
    data = attrs.evolve(data, url=url, sha256=sha256, size=size, origin=origin or data.origin)
    evidence = {"url": url, "size": size, "source": None if data.source is None else data.source.value, **evidence}
    if origin:
        evidence["origin"] = origin
    return Step(S.DOWNLOADING, data, (Download(url, sha256, size),), evidence=evidence)


@guarded(S.DOWNLOADING, S.INSTALLED, S.FAILED, *STARTS)
def resolved(state: S, data: InstallData, event: Resolved) -> Step:
    named = data.source is Source.FILE
    verdict = offer_verdict(event.now, data.holds, event.sha256, event.digest, event.rejection, named)
    if verdict is Offer.INSTALL:
        return _fetch(data, event.url, event.sha256, event.size, event.origin, event.evidence)
    facts = {"offered": event.evidence.get("version"), "sha256": event.sha256, "digest": event.digest}
    return _judged(state, attrs.evolve(data, origin=event.origin), verdict, event, facts)


def _judged(state: S, data: InstallData, verdict: Offer, event: Resolved | Validated, facts: dict[str, Any]) -> Step:
    """An offer the slot does not take (current, kept) or that this source may not give (rejected)."""
    facts.update(offer_facts(verdict, event.rejection, event.now))
    if verdict is Offer.REJECTED:
        return _source_over(state, data, event.reason or ReasonCode.BUNDLE_VERIFY_FAILED, facts, None, "rejected")
    assert event.now is not None
    holds = event.now.known_as(data.holds, data.previous)
    if verdict is Offer.CURRENT and holds.sha256 is None and data.sha256 is not None:
        holds = attrs.evolve(holds, sha256=data.sha256)  # learnt: the zip this bundle came in
    attempt = attempt_record(state.value, data.source, data.origin, verdict.value, facts, None)
    data = attrs.evolve(data, holds=holds, tried=data.tried + (attempt,), reason=None, evidence={}, staging=None)
    evidence = {"outcome": verdict.value, "version": holds.version, **facts}
    effects = (CleanStaging(data.archive),) if state is S.VALIDATING else ()
    return Step(S.INSTALLED, data, effects, evidence=evidence)


@guarded(*STARTS, S.FAILED)
def unavailable(state: S, data: InstallData, event: SourceUnavailable) -> Step:
    outcome = "refused" if event.cause in REFUSALS else "unavailable"
    return _source_over(state, data, event.reason, event.evidence, event.seconds, outcome)


@guarded(S.BUILDING)
def toolchain_ready(state: S, data: InstallData, event: ToolchainReady) -> Step:
    return Step(S.BUILDING, data, (BuildBundle(data.backend, data.variant),), evidence=event.evidence)


@guarded(S.VERIFYING)
def downloaded(state: S, data: InstallData, event: Downloaded) -> Step | None:
    if data.sha256 is None or data.size is None:
        return None  # nothing resolved to verify against: the archive's own digest proves nothing
    verify = VerifyArchive(event.archive, data.sha256, data.size)
    return Step(
        S.VERIFYING,
        attrs.evolve(data, archive=event.archive),
        (verify,),
        evidence={"sha256": event.sha256, "size": event.size},
    )


@guarded(S.UNPACKING)
def verified(state: S, data: InstallData, event: Verified) -> Step | None:
    if data.archive is None:
        return None
    return Step(S.UNPACKING, data, (CleanStaging(), Unpack(data.archive)), evidence=event.evidence)


@guarded(S.VALIDATING)
def unpacked(state: S, data: InstallData, event: Unpacked) -> Step:
    data = attrs.evolve(data, staging=event.staging)
    return Step(S.VALIDATING, data, (ValidateBundle(event.staging, data.backend, data.variant),))


@guarded(S.SMOKE_TESTING, S.INSTALLED, S.FAILED, *STARTS)
def validated(state: S, data: InstallData, event: Validated) -> Step | None:
    if data.staging is None:
        return None
    # The staged bundle's digest is known now (a download's was not before): judged again.
    verdict = offer_verdict(event.now, data.holds, None, event.digest, event.rejection, data.source is Source.FILE)
    if verdict is not Offer.INSTALL:
        return _judged(state, data, verdict, event, {"digest": event.digest, **event.evidence})
    return Step(S.SMOKE_TESTING, data, (SmokeTest(data.staging),), evidence=event.evidence)


@guarded(S.PROMOTING)
def smoke_passed(state: S, data: InstallData, event: SmokePassed) -> Step | None:
    if data.staging is None:
        return None
    promote = Promote(data.staging, data.backend, data.variant)
    source = None if data.source is None else data.source.value
    evidence = {**event.evidence, "source": source, "origin": data.origin}
    return Step(S.PROMOTING, attrs.evolve(data, reason=None, evidence={}), (promote,), evidence=evidence)


@guarded(S.INSTALLED)
def promoted(state: S, data: InstallData, event: Promoted) -> Step:
    """The rename is done: the record says what the slot holds, then `installed` is true."""
    source = None if data.source is None else data.source.value
    mine = attrs.evolve(event.slot, sha256=data.sha256, source=source, origin=data.origin, by=SlotWriter.INSTALL)
    previous = None if event.previous is None else event.previous.known_as(data.holds, data.previous)
    attempt = attempt_record(S.PROMOTING.value, data.source, data.origin, "installed", {}, event.seconds)
    data = attrs.evolve(data, holds=mine, previous=previous, staging=None, tried=data.tried + (attempt,))
    evidence = {"version": mine.version, "digest": mine.digest, "source": source, "origin": data.origin}
    return Step(S.INSTALLED, data, evidence={**evidence, "seconds": event.seconds})


@guarded(S.INSTALLED)
def slot_changed(state: S, data: InstallData, event: SlotChanged) -> Step:
    """An engine update or a rollback changed the slot: the record follows it."""
    holds = event.slot.known_as(data.holds, data.previous)
    previous = None if event.previous is None else event.previous.known_as(data.holds, data.previous)
    data = attrs.evolve(data, holds=holds, previous=previous, reason=None, evidence={})
    by = None if holds.by is None else holds.by.value
    return Step(S.INSTALLED, data, evidence={"by": by, "version": holds.version, "digest": holds.digest})


@guarded(S.FAILED, *STARTS)
def failed(state: S, data: InstallData, event: InstallFailed) -> Step:
    return _source_over(state, data, event.reason, event.evidence, event.seconds, "failed")


@guarded(STAY, *STARTS, S.UNPACKING)
def resumed(state: S, data: InstallData, event: Resumed) -> Step | None:
    data = attrs.evolve(data, resumes=data.resumes + 1)
    evidence = {"resumed_from": state.value}
    if state is S.DOWNLOADING and data.url is not None and data.sha256 is not None and data.size is not None:
        return Step(S.DOWNLOADING, data, (Download(data.url, data.sha256, data.size, resume=True),), evidence=evidence)
    if state in FINDING or state is S.DOWNLOADING:  # a source's search (a build too) starts over
        source = data.source or Source.MIRROR
        target, effects = _start(source, data)
        return Step(target, _on(data, source), effects, evidence=evidence)
    if state is S.VERIFYING and data.archive is not None and data.sha256 is not None and data.size is not None:
        return Step(S.VERIFYING, data, (VerifyArchive(data.archive, data.sha256, data.size),), evidence=evidence)
    if state in (S.UNPACKING, S.VALIDATING, S.SMOKE_TESTING) and data.archive is not None:
        unpack = Unpack(data.archive)
        return Step(S.UNPACKING, attrs.evolve(data, staging=None), (CleanStaging(), unpack), evidence=evidence)
    if state in (S.PROMOTING, S.INSTALLED) and data.staging is not None:  # INSTALLED: a row from before promoting
        return Step(state, data, (Promote(data.staging, data.backend, data.variant),), evidence=evidence)
    return None


def _row(success: type, handler: Guarded, *resume_targets: Any) -> dict[type, Rule]:
    return {success: handler, InstallFailed: failed, Resumed: resumed.only(*resume_targets)}


def _finding(success: type, handler: Guarded, *resume_targets: Any) -> dict[type, Rule]:
    return {**_row(success, handler, *resume_targets), SourceUnavailable: unavailable}


TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.REQUESTED: {InstallRequested: requested, SlotChanged: slot_changed},
    S.RESOLVING: _finding(Resolved, resolved, STAY),
    S.SEARCHING_CACHE: _finding(Resolved, resolved, STAY),
    S.CHECKING_TOOLCHAIN: _finding(ToolchainReady, toolchain_ready, STAY),
    S.BUILDING: _row(Resolved, resolved, S.CHECKING_TOOLCHAIN),
    S.DOWNLOADING: _row(Downloaded, downloaded, STAY, *STARTS),
    S.VERIFYING: _row(Verified, verified, STAY),
    S.UNPACKING: _row(Unpacked, unpacked, STAY),
    S.VALIDATING: _row(Validated, validated, S.UNPACKING),
    S.SMOKE_TESTING: _row(SmokePassed, smoke_passed, S.UNPACKING),
    S.PROMOTING: _row(Promoted, promoted, STAY),
    S.INSTALLED: {InstallRequested: requested, Resumed: resumed.only(STAY), SlotChanged: slot_changed},
    S.FAILED: {InstallRequested: requested, SlotChanged: slot_changed},
}

INSTALL = MachineSpec(
    name="install",
    initial=S.REQUESTED,
    data_type=InstallData,
    transitions=TRANSITIONS,
    terminal={S.INSTALLED, S.FAILED},
    description=(
        "One engine bundle from the first source that has it (a file, the mirror, the build cache, a local "
        "build): resolve, download, verify, unpack, validate, smoke-test, promote; the slot's record, which "
        "engine updates and rollbacks change too."
    ),
    effect_types=Effect,
)
