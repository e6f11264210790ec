"""The install machine's effects: what its table (states/install/table.py) asks the install service
(daemon/install/installer.py) to do, each answered with an event of the table."""

from __future__ import annotations

import attrs

from stoker.states.install.sources import Source


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
    """Remove the staging directory (never the installed bundle), and the downloaded `archive`
    when named (a bundle judged not to install once unpacked)."""

    archive: str | None = None


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
    """Atomically rename staging into place, keeping the previous good bundle; answer Promoted."""

    staging: str
    backend: str
    variant: str


Effect = (
    Resolve
    | FindCachedBuild
    | CheckToolchain
    | BuildBundle
    | Download
    | VerifyArchive
    | CleanStaging
    | Unpack
    | ValidateBundle
    | SmokeTest
    | Promote
)
