"""The install machine: one bundle (backend + variant) from request to installed.

    requested -> resolving -> downloading -> verifying -> unpacking -> validating
              -> smoke_testing -> installed | failed(reason)

Resuming after a daemon kill (`Resumed`): resolving and downloading redo their step (the
download continues with HTTP Range from the partial file); verifying re-checks the archive;
unpacking, validating and smoke_testing start again from a clean staging directory. The
bundle becomes visible to the launcher only through `Promote`'s atomic rename, so nothing
half-installed is ever launched; `Promote` is re-sent on resume and must be idempotent.
Download progress goes to the event bus, not into history: only steps are transitions.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from states.machine import STAY, Guarded, MachineSpec, Rule, Step, guarded
from states.reasons import ReasonCode


class InstallState(enum.StrEnum):
    REQUESTED = "requested"
    RESOLVING = "resolving"
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


# --- events -----------------------------------------------------------------------------


@attrs.frozen
class InstallRequested:
    """Install (or reinstall, or retry) the bundle for backend + variant."""

    backend: str
    variant: str


@attrs.frozen
class Resolved:
    """The manifest names the bundle: where it is, its sha256 and size."""

    url: str
    sha256: str
    size: int
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


@attrs.frozen
class InstallFailed:
    """Any step failed; `reason` is its code (bundle_digest_mismatch, ...)."""

    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=_evidence, hash=False)


@attrs.frozen
class Resumed:
    """The daemon restarted and found this machine mid-way."""


# --- effects ----------------------------------------------------------------------------


@attrs.frozen
class Resolve:
    """Find the bundle for backend + variant in the manifest; answer Resolved."""

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
WORKING = (S.RESOLVING, S.DOWNLOADING, S.VERIFYING, S.UNPACKING, S.VALIDATING, S.SMOKE_TESTING)


@guarded(S.RESOLVING)
def requested(state: S, data: InstallData, event: InstallRequested) -> Step:
    data = InstallData(backend=event.backend, variant=event.variant, attempts=data.attempts + 1)
    return Step(S.RESOLVING, data, (Resolve(event.backend, event.variant),), evidence={"attempt": data.attempts})


@guarded(S.DOWNLOADING)
def resolved(state: S, data: InstallData, event: Resolved) -> Step:
    data = attrs.evolve(data, url=event.url, sha256=event.sha256, size=event.size)
    return Step(
        S.DOWNLOADING,
        data,
        (Download(event.url, event.sha256, event.size),),
        evidence={"url": event.url, "size": event.size, **event.evidence},
    )


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
    return Step(S.INSTALLED, attrs.evolve(data, reason=None, evidence={}), (promote,), evidence=event.evidence)


@guarded(S.FAILED)
def failed(state: S, data: InstallData, event: InstallFailed) -> Step:
    evidence = {**event.evidence, "step": state.value}
    data = attrs.evolve(data, reason=event.reason, evidence=evidence)
    return Step(S.FAILED, data, (CleanStaging(),), event.reason, evidence)


@guarded(STAY, S.RESOLVING, S.UNPACKING)
def resumed(state: S, data: InstallData, event: Resumed) -> Step | None:
    data = attrs.evolve(data, resumes=data.resumes + 1)
    evidence = {"resumed_from": state.value}
    if state is S.DOWNLOADING and data.url is not None and data.sha256 is not None and data.size is not None:
        return Step(S.DOWNLOADING, data, (Download(data.url, data.sha256, data.size, resume=True),), evidence=evidence)
    if state in (S.RESOLVING, S.DOWNLOADING):  # a download without a complete resolution starts over
        return Step(S.RESOLVING, data, (Resolve(data.backend, data.variant),), evidence=evidence)
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


TRANSITIONS: dict[enum.StrEnum, dict[type, Rule]] = {
    S.REQUESTED: {InstallRequested: requested},
    S.RESOLVING: _row(Resolved, resolved, STAY),
    S.DOWNLOADING: _row(Downloaded, downloaded, STAY, S.RESOLVING),
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
    description="One engine bundle: resolve, download, verify, unpack, validate, smoke-test, promote.",
    effect_types=(Resolve, Download, VerifyArchive, CleanStaging, Unpack, ValidateBundle, SmokeTest, Promote),
)


def machine_id(backend: str, variant: str) -> str:
    """The store id of the install machine for one bundle: `install:<backend>-<variant>`."""
    return f"install:{backend}-{variant}"
