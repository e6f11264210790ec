"""The install machine's table, driven directly."""

from __future__ import annotations

import pytest

from states.install import (
    INSTALL,
    CleanStaging,
    Download,
    Downloaded,
    InstallData,
    InstallFailed,
    InstallRequested,
    InstallState as S,
    Promote,
    Resolve,
    Resolved,
    Resumed,
    SmokePassed,
    SmokeTest,
    Unpack,
    Unpacked,
    Validated,
    ValidateBundle,
    Verified,
    VerifyArchive,
    machine_id,
)
from states.machine import IllegalTransition, step
from states.reasons import ReasonCode

HAPPY = [
    InstallRequested("cuda", "sm90"),
    Resolved("http://127.0.0.1:1/b.zip", "ab" * 32, 1000),
    Downloaded("/dl/b.zip.part", "ab" * 32, 1000),
    Verified(),
    Unpacked("/staging/b"),
    Validated({"version": "b11434"}),
    SmokePassed({"tokens": 8}),
]
STATES_ALONG = [S.RESOLVING, S.DOWNLOADING, S.VERIFYING, S.UNPACKING, S.VALIDATING, S.SMOKE_TESTING, S.INSTALLED]


def drive(*events, state=S.REQUESTED, data=None):
    data = InstallData() if data is None else data
    result = None
    for event in events:
        result = step(INSTALL, state, data, event)
        state, data = result.state, result.data
    return result


def test_happy_path_asks_for_each_step():
    effects = []
    for n, expected in enumerate(STATES_ALONG, start=1):
        s = drive(*HAPPY[:n])
        assert s.state is expected
        effects.append(s.effects)
    assert effects == [
        (Resolve("cuda", "sm90"),),
        (Download("http://127.0.0.1:1/b.zip", "ab" * 32, 1000),),
        (VerifyArchive("/dl/b.zip.part", "ab" * 32, 1000),),
        (CleanStaging(), Unpack("/dl/b.zip.part")),
        (ValidateBundle("/staging/b", "cuda", "sm90"),),
        (SmokeTest("/staging/b"),),
        (Promote("/staging/b", "cuda", "sm90"),),
    ]
    assert machine_id("cuda", "sm90") == "install:cuda-sm90"


@pytest.mark.parametrize("n", range(1, 7))
def test_failure_at_any_step_records_reason_and_cleans(n):
    s = drive(*HAPPY[:n], InstallFailed(ReasonCode.BUNDLE_DIGEST_MISMATCH, {"got": "00"}))
    assert s.state is S.FAILED and s.reason is ReasonCode.BUNDLE_DIGEST_MISMATCH
    assert s.evidence == {"got": "00", "step": STATES_ALONG[n - 1].value}
    assert s.effects == (CleanStaging(),)
    retry = drive(InstallRequested("cuda", "sm90"), state=s.state, data=s.data)
    assert retry.state is S.RESOLVING and retry.data.attempts == 2 and retry.data.reason is None


def test_resume_downloading_continues_with_range():
    s = drive(*HAPPY[:2], Resumed())
    assert s.state is S.DOWNLOADING
    assert s.effects == (Download("http://127.0.0.1:1/b.zip", "ab" * 32, 1000, resume=True),)
    assert s.data.resumes == 1


@pytest.mark.parametrize("n", [4, 5, 6])
def test_resume_after_unpack_starts_from_clean_staging(n):
    s = drive(*HAPPY[:n], Resumed())
    assert s.state is S.UNPACKING
    assert s.effects == (CleanStaging(), Unpack("/dl/b.zip.part"))
    assert s.data.staging is None


def test_resume_in_resolving_verifying_and_installed():
    assert drive(*HAPPY[:1], Resumed()).effects == (Resolve("cuda", "sm90"),)
    assert drive(*HAPPY[:3], Resumed()).effects == (VerifyArchive("/dl/b.zip.part", "ab" * 32, 1000),)
    assert drive(*HAPPY, Resumed()).effects == (Promote("/staging/b", "cuda", "sm90"),)


def test_out_of_order_events_are_illegal():
    with pytest.raises(IllegalTransition):
        drive(HAPPY[0], HAPPY[3])
    with pytest.raises(IllegalTransition):
        drive(Resumed())
    with pytest.raises(IllegalTransition):
        drive(*HAPPY, InstallFailed(ReasonCode.BUNDLE_VERIFY_FAILED))


def test_a_download_never_resolved_is_refused_rather_than_verified_against_itself():
    # Checking an archive against the digest streamed from it would pass any archive at all.
    unresolved = InstallData(backend="cuda", variant="sm90", url="http://127.0.0.1:1/b.zip")
    with pytest.raises(IllegalTransition):
        drive(Downloaded("/dl/b.zip.part", "ab" * 32, 1000), state=S.DOWNLOADING, data=unresolved)


def test_resume_of_a_download_without_its_digest_resolves_again():
    unresolved = InstallData(backend="cuda", variant="sm90", url="http://127.0.0.1:1/b.zip")
    s = drive(Resumed(), state=S.DOWNLOADING, data=unresolved)
    assert s.state is S.RESOLVING and s.effects == (Resolve("cuda", "sm90"),)
