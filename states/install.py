"""The install machine: one bundle (backend + variant) from request to installed.

    requested -> a source -> downloading -> verifying -> unpacking -> validating
              -> smoke_testing -> installed | failed(reason)

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

Resuming after a daemon kill (`Resumed`): a source's search (a build too) starts over, a
download continues with HTTP Range from the partial file, verifying re-checks the archive,
later steps start again from a clean staging directory. The bundle becomes visible to the
launcher only through `Promote`'s atomic rename (re-sent on resume: idempotent), so nothing
half-installed is ever launched. Download and build progress go to the event bus, not history.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from states.install_sources import (
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
from states.machine import STAY, Guarded, MachineSpec, Rule, Step, guarded
from states.reasons import ReasonCode


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
    INSTALLED = "installed"
    FAILED = "failed"


def _evidence(value: Any) -> dict[str, Any]:
    return dict(value or {})


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
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)
    sources: tuple[Source, ...] = attrs.field(default=(), converter=sources_of)  # this request's, in order
    source: Source | None = None  # the one being tried, then the one the installed bundle came from
    origin: str | None = None  # where in it: the manifest's URL, the cache entry, the file
    # one record per source tried for this request: {source, outcome, reason, cause, message, seconds}
    tried: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=tries_of, hash=False)


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
    size, and `origin`, where in the source (the manifest's URL, the cache entry)."""

    url: str
    sha256: str
    size: int
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)
    origin: str | None = None


@attrs.frozen
class SourceUnavailable:
    """The source being tried has nothing to offer: no manifest configured, unreadable or
    refused, it lists nothing that fits, a cache miss, no toolchain. `reason` is the backend's
    bundle_install_failed code, `cause` the precise one (also the evidence's); `seconds` the try's."""

    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)
    seconds: float | None = None
    cause: ReasonCode | None = None


@attrs.frozen
class ToolchainReady:
    """The builder can build this backend here (compiler, cmake, and what the backend needs)."""

    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class Downloaded:
    """The archive is complete on disk (streamed digest and size)."""

    archive: str
    sha256: str
    size: int


@attrs.frozen
class Verified:
    """The archive matches the resolved digest and size."""

    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class Unpacked:
    """The archive was unpacked safely into `staging`."""

    staging: str


@attrs.frozen
class Validated:
    """The staged bundle's metadata matches the manifest and the platform."""

    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class SmokePassed:
    """The staged engine passed `--version`, `--list-devices` and the smoke test."""

    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)
    seconds: float | None = None  # the successful source's attempt, from its first step


@attrs.frozen
class InstallFailed:
    """Any step failed; `reason` is its code (bundle_digest_mismatch, ...)."""

    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)
    seconds: float | None = None  # the failed source's attempt, from its first step


@attrs.frozen
class Resumed:
    """The daemon restarted and found this machine mid-way."""


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class Resolve:
    """Find the bundle for backend + variant in the manifest (or the file named); answer
    Resolved, or SourceUnavailable when the manifest is missing, refused or lists none that fits."""

    backend: str
    variant: str
    source: Source = Source.MIRROR


@attrs.frozen
class FindCachedBuild:
    """Look in the local build cache for a finished build that fits this backend, variant,
    platform and machine; answer Resolved (a hit) or SourceUnavailable (a miss, with what
    was there and why it did not fit)."""

    backend: str
    variant: str


@attrs.frozen
class CheckToolchain:
    """Ask the build plan whether this machine can build the backend (the compiler, cmake, a
    generator, the backend's own compiler); answer ToolchainReady or SourceUnavailable."""

    backend: str
    variant: str


@attrs.frozen
class BuildBundle:
    """Build the bundle from the pinned source (off the daemon's event loop, progress on the
    bus, killed with the daemon); answer Resolved with the built zip."""

    backend: str
    variant: str


@attrs.frozen
class Download:
    """Fetch `url`; `resume` continues the partial file with Range/If-Range."""

    url: str
    sha256: str
    size: int
    resume: bool = False


@attrs.frozen
class VerifyArchive:
    """Check the archive's sha256 and size; answer Verified."""

    archive: str
    sha256: str
    size: int


@attrs.frozen
class CleanStaging:
    """Remove the staging directory (never the installed bundle)."""


@attrs.frozen
class Unpack:
    """Unpack the archive safely into a fresh staging directory; answer Unpacked."""

    archive: str


@attrs.frozen
class ValidateBundle:
    """Check the staged bundle.json against the manifest; answer Validated."""

    staging: str
    backend: str
    variant: str


@attrs.frozen
class SmokeTest:
    """Run the staged engine's verification; answer SmokePassed."""

    staging: str


@attrs.frozen
class Promote:
    """Atomically rename staging into place, keeping the previous good bundle."""

    staging: str
    backend: str
    variant: str


S = InstallState
FINDING = (S.RESOLVING, S.SEARCHING_CACHE, S.CHECKING_TOOLCHAIN, S.BUILDING)  # a source finds its bundle
WORKING = (*FINDING, S.DOWNLOADING, S.VERIFYING, S.UNPACKING, S.VALIDATING, S.SMOKE_TESTING)
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
    moves_on = outcome == "unavailable" or data.source in RETRY_NEXT_ON_FAILURE
    if following is not None and moves_on:
        target, effects = _start(following, data)
        evidence = {**evidence, "next_source": following.value, "seconds": seconds}
        return Step(target, _on(data, following), (CleanStaging(), *effects), evidence=evidence)
    evidence = {**evidence, "tried": list(data.tried)}
    data = attrs.evolve(data, reason=reason, evidence=evidence)
    return Step(S.FAILED, data, (CleanStaging(),), reason, evidence)


@guarded(*STARTS)
def requested(state: S, data: InstallData, event: InstallRequested) -> Step | None:
    sources = tuple(s for s in SOURCE_ORDER if s in event.sources)
    if not sources:
        return None
    data = InstallData(backend=event.backend, variant=event.variant, attempts=data.attempts + 1, sources=sources)
    target, effects = _start(sources[0], data)
    evidence = {"attempt": data.attempts, "sources": [s.value for s in sources]}
    return Step(target, _on(data, sources[0]), effects, evidence=evidence)


def _fetch(data: InstallData, url: str, sha256: str, size: int, origin: str | None, evidence: dict[str, Any]) -> Step:
    data = attrs.evolve(data, url=url, sha256=sha256, size=size, origin=origin or data.origin)
    evidence = {"url": url, "size": size, "source": None if data.source is None else data.source.value, **evidence}
    if origin:
        evidence["origin"] = origin
    return Step(S.DOWNLOADING, data, (Download(url, sha256, size),), evidence=evidence)


@guarded(S.DOWNLOADING)
def resolved(state: S, data: InstallData, event: Resolved) -> Step:
    return _fetch(data, event.url, event.sha256, event.size, event.origin, event.evidence)


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


@guarded(S.SMOKE_TESTING)
def validated(state: S, data: InstallData, event: Validated) -> Step | None:
    if data.staging is None:
        return None
    return Step(S.SMOKE_TESTING, data, (SmokeTest(data.staging),), evidence=event.evidence)


@guarded(S.INSTALLED)
def smoke_passed(state: S, data: InstallData, event: SmokePassed) -> Step | None:
    if data.staging is None:
        return None
    promote = Promote(data.staging, data.backend, data.variant)
    data = attrs.evolve(
        data,
        tried=data.tried + (attempt_record(state.value, data.source, data.origin, "installed", {}, event.seconds),),
    )
    evidence = {**event.evidence, **{k: v for k, v in data.tried[-1].items() if k in ("source", "origin", "seconds")}}
    return Step(S.INSTALLED, attrs.evolve(data, reason=None, evidence={}), (promote,), evidence=evidence)


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
    if state is S.INSTALLED and data.staging is not None:
        return Step(S.INSTALLED, data, (Promote(data.staging, data.backend, data.variant),), evidence=evidence)
    return None


def _row(success: type, handler: Guarded, *resume_targets: Any) -> dict[type, Rule]:
    return {success: handler, InstallFailed: failed, Resumed: resumed.only(*resume_targets)}


def _finding(success: type, handler: Guarded, *resume_targets: Any) -> dict[type, Rule]:
    return {**_row(success, handler, *resume_targets), SourceUnavailable: unavailable}


TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.REQUESTED: {InstallRequested: requested},
    S.RESOLVING: _finding(Resolved, resolved, STAY),
    S.SEARCHING_CACHE: _finding(Resolved, resolved, STAY),
    S.CHECKING_TOOLCHAIN: _finding(ToolchainReady, toolchain_ready, STAY),
    S.BUILDING: _row(Resolved, resolved, S.CHECKING_TOOLCHAIN),
    S.DOWNLOADING: _row(Downloaded, downloaded, STAY, *STARTS),
    S.VERIFYING: _row(Verified, verified, STAY),
    S.UNPACKING: _row(Unpacked, unpacked, STAY),
    S.VALIDATING: _row(Validated, validated, S.UNPACKING),
    S.SMOKE_TESTING: _row(SmokePassed, smoke_passed, S.UNPACKING),
    S.INSTALLED: {InstallRequested: requested, Resumed: resumed.only(STAY)},
    S.FAILED: {InstallRequested: requested},
}

INSTALL = MachineSpec(
    name="install",
    states=InstallState,
    initial=S.REQUESTED,
    data_type=InstallData,
    transitions=TRANSITIONS,
    terminal={S.INSTALLED, S.FAILED},
    description=(
        "One engine bundle from the first source that has it (a file, the mirror, the build cache, a local "
        "build): resolve, download, verify, unpack, validate, smoke-test, promote."
    ),
    effect_types=(
        Resolve,
        FindCachedBuild,
        CheckToolchain,
        BuildBundle,
        Download,
        VerifyArchive,
        CleanStaging,
        Unpack,
        ValidateBundle,
        SmokeTest,
        Promote,
    ),
)


def machine_id(backend: str, variant: str) -> str:
    """The store id of the install machine for one bundle: `install:<backend>-<variant>`."""
    return f"install:{backend}-{variant}"
