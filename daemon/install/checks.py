"""The install's checks of one bundle (blocking; the install service runs them in a thread and
answers its machine with their facts): the staged bundle against what it must be, and its smoke
test, or why it is skipped (the archive's own check is daemon/bundles/archive.check_digest)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.daemon.backends.base import Detection
from stoker.daemon.bundles.metadata import BundleMeta
from stoker.states.launch.records import CPU_BACKEND


def validate_staged(staging: Path, backend: str, variant: str, version: str | None) -> dict[str, Any]:
    """The staged bundle's files, metadata, `--version` and `--list-devices` (no smoke yet)."""
    from stoker.daemon.bundles.verify import verify_dir

    report = verify_dir(staging, expect_backend=backend, expect_variant=variant, expect_version=version, smoke=False)
    return {
        "steps": list(report.steps),
        "version_line": report.version_line,
        "devices": [d.strip() for d in report.devices or ()],
    }


def smoke_skip(enabled: bool, asked: bool | None, meta: BundleMeta, detection: Detection | None) -> str | None:
    """Why the smoke test does not run for this bundle here (None: it runs)."""
    if not enabled:
        return "smoke tests are off for this service"
    if asked is False:
        return "not asked for this local bundle (stoker bundle install --smoke asks)"
    if meta.smoke is None or meta.smoke.tokens is None:
        return "the bundle records no smoke reference"
    if meta.backend != CPU_BACKEND and (detection is None or not detection.usable):
        return f"no usable {meta.backend} device was detected to run it on"
    return None


def smoke_staged(staging: Path, meta: BundleMeta) -> dict[str, Any]:
    """Run the staged engine's smoke test (tokens equal to its recorded reference)."""
    from stoker.daemon.bundles.verify import check_smoke

    tokens = check_smoke(staging / meta.server, meta)
    return {"smoke": "passed", "tokens": len(tokens)}
