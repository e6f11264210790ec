"""The install machine's table, driven directly."""

from __future__ import annotations

import attrs
import pytest

from stoker.states.install.table import (
    INSTALL,
    Downloaded,
    InstallData,
    InstallFailed,
    InstallRequested,
    InstallState as S,
    Promoted,
    Resolved,
    Resumed,
    SlotChanged,
    SmokePassed,
    SourceUnavailable,
    ToolchainReady,
    Unpacked,
    Validated,
    Verified,
)
from stoker.states.install.effects import (
    BuildBundle,
    CheckToolchain,
    CleanStaging,
    Download,
    FindCachedBuild,
    Promote,
    Resolve,
    SmokeTest,
    Unpack,
    ValidateBundle,
    VerifyArchive,
)
from stoker.states.install.slot import Offer, Rejection, SlotBundle, SlotWriter, offer_verdict, writer_conflict
from stoker.states.install.sources import Source
from stoker.states.machine import IllegalTransition, step
from stoker.states.reasons import ReasonCode

HAPPY = [
    InstallRequested("cuda", "sm90"),
    Resolved("http://127.0.0.1:1/b.zip", "ab" * 32, 1000),
    Downloaded("/dl/b.zip.part", "ab" * 32, 1000),
    Verified(),
    Unpacked("/staging/b"),
    Validated({"version": "b11434"}),
    SmokePassed({"tokens": 8}),
    Promoted(SlotBundle("cd" * 32, "b11434"), SlotBundle("ef" * 32, "b11000")),
]
STATES_ALONG = [
    S.RESOLVING,
    S.DOWNLOADING,
    S.VERIFYING,
    S.UNPACKING,
    S.VALIDATING,
    S.SMOKE_TESTING,
    S.PROMOTING,
    S.INSTALLED,
]


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
        (),
    ]
    assert INSTALL.machine_id("cuda", "sm90") == "install:cuda-sm90"


@pytest.mark.parametrize("n", range(1, 8))
def test_failure_at_any_step_records_reason_and_cleans(n):
    s = drive(*HAPPY[:n], InstallFailed(ReasonCode.BUNDLE_DIGEST_MISMATCH, {"got": "00"}))
    assert s.state is S.FAILED and s.reason is ReasonCode.BUNDLE_DIGEST_MISMATCH
    tried = {"source": "mirror", "outcome": "failed", "step": STATES_ALONG[n - 1].value, "reason": None}
    assert s.evidence["got"] == "00" and s.evidence["step"] == STATES_ALONG[n - 1].value
    assert [{k: t[k] for k in tried} for t in s.evidence["tried"]] == [tried]  # a mirror's bundle: no next source
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
    assert drive(*HAPPY[:7], Resumed()).effects == (Promote("/staging/b", "cuda", "sm90"),)


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


# --- the sources, in order -----------------------------------------------------------------

R = ReasonCode.CPU_BUNDLE_INSTALL_FAILED


def unavailable(cause, seconds=0.5):
    return SourceUnavailable(R, {"cause": cause, "message": f"{cause} here"}, seconds)


def test_a_source_with_nothing_hands_the_install_to_the_next_one_in_order():
    s = drive(InstallRequested("cpu", "avx2"))
    assert (s.state, s.effects) == (S.RESOLVING, (Resolve("cpu", "avx2", Source.MIRROR),))
    s = drive(InstallRequested("cpu", "avx2"), unavailable("bundle_missing"))
    assert s.state is S.SEARCHING_CACHE and s.reason is None
    assert s.effects == (CleanStaging(), FindCachedBuild("cpu", "avx2"))
    assert s.evidence["next_source"] == "build-cache" and s.evidence["cause"] == "bundle_missing"
    s = drive(InstallRequested("cpu", "avx2"), unavailable("bundle_missing"), unavailable("bundle_missing"))
    assert (s.state, s.effects[-1]) == (S.CHECKING_TOOLCHAIN, CheckToolchain("cpu", "avx2"))
    s = drive(
        InstallRequested("cpu", "avx2"),
        unavailable("bundle_missing"),
        unavailable("bundle_missing"),
        ToolchainReady({"toolchain": {"cmake": "cmake version 3.25"}}),
    )
    assert (s.state, s.effects) == (S.BUILDING, (BuildBundle("cpu", "avx2"),))
    s = drive(
        InstallRequested("cpu", "avx2"),
        unavailable("bundle_missing"),
        unavailable("bundle_missing"),
        ToolchainReady(),
        Resolved("file:///cache/k/bundle.zip", "ab" * 32, 1000, {"cache_key": "k"}, origin="k"),
        Downloaded("/dl/b.zip", "ab" * 32, 1000),
        Verified(),
        Unpacked("/staging/b"),
        Validated(),
        SmokePassed({"smoke": "passed"}),
        Promoted(SlotBundle("cd" * 32, "b1"), seconds=42.0),
    )
    assert s.state is S.INSTALLED and s.data.source is Source.LOCAL_BUILD and s.data.origin == "k"
    assert [(t["source"], t["outcome"], t["reason"]) for t in s.data.tried] == [
        ("mirror", "unavailable", "bundle_missing"),
        ("build-cache", "unavailable", "bundle_missing"),
        ("local-build", "installed", None),
    ]
    assert s.evidence["source"] == "local-build" and s.evidence["seconds"] == 42.0


def test_no_source_left_fails_with_the_backends_reason_and_every_attempt():
    s = drive(
        InstallRequested("cpu", "avx2"),
        unavailable("bundle_missing", 0.01),
        unavailable("bundle_missing", 0.2),
        unavailable("build_toolchain_missing", 0.3),
    )
    assert s.state is S.FAILED and s.reason is R and s.effects == (CleanStaging(),)
    assert s.evidence["cause"] == "build_toolchain_missing" and s.evidence["source"] == "local-build"
    assert [(t["source"], t["reason"], t["seconds"]) for t in s.evidence["tried"]] == [
        ("mirror", "bundle_missing", 0.01),
        ("build-cache", "bundle_missing", 0.2),
        ("local-build", "build_toolchain_missing", 0.3),
    ]
    retry = drive(InstallRequested("cpu", "avx2"), state=s.state, data=s.data)
    assert retry.state is S.RESOLVING and retry.data.tried == () and retry.data.attempts == 2


def test_a_mirror_bundle_that_fails_ends_the_install_but_a_cached_one_leaves_it_to_a_build():
    mirror = drive(*HAPPY[:3], InstallFailed(R, {"cause": "bundle_digest_mismatch"}))
    assert mirror.state is S.FAILED  # a configured mirror's bad bundle is shown, not papered over
    cached = drive(
        InstallRequested("cpu", "avx2"),
        unavailable("bundle_missing"),
        Resolved("file:///cache/k/bundle.zip", "ab" * 32, 1000),
        Downloaded("/dl/b.zip", "ab" * 32, 1000),
        Verified(),
        Unpacked("/staging/b"),
        InstallFailed(R, {"cause": "bundle_verify_failed"}),
    )
    assert cached.state is S.CHECKING_TOOLCHAIN and cached.data.staging is None and cached.data.url is None
    assert cached.effects == (CleanStaging(), CheckToolchain("cpu", "avx2"))
    assert cached.data.tried[-1]["outcome"] == "failed" and cached.data.tried[-1]["step"] == "validating"


def test_a_file_is_its_own_only_source_and_the_order_is_the_tables():
    s = drive(InstallRequested("cpu", "avx2", (Source.FILE,)), unavailable("bundle_missing"))
    assert s.state is S.FAILED
    backwards = drive(InstallRequested("cpu", "avx2", (Source.LOCAL_BUILD, Source.BUILD_CACHE)))
    assert backwards.state is S.SEARCHING_CACHE and backwards.data.sources == (Source.BUILD_CACHE, Source.LOCAL_BUILD)
    with pytest.raises(IllegalTransition):
        drive(InstallRequested("cpu", "avx2", ()))


@pytest.mark.parametrize("events", [1, 2, 3])
def test_a_restart_mid_source_starts_that_source_over(events):
    along = [
        InstallRequested("cpu", "avx2"),
        unavailable("bundle_missing"),
        unavailable("bundle_missing"),
        ToolchainReady(),
    ]
    s = drive(*along[: events + 1], Resumed())
    expected = {1: FindCachedBuild("cpu", "avx2"), 2: CheckToolchain("cpu", "avx2"), 3: CheckToolchain("cpu", "avx2")}
    assert s.effects == (expected[events],) and s.data.resumes == 1


@pytest.mark.parametrize(
    "cause",
    [ReasonCode.MANIFEST_UNTRUSTED, ReasonCode.MANIFEST_SIGNATURE_INVALID, ReasonCode.MANIFEST_EXPIRED]
    + [ReasonCode.MANIFEST_ROLLBACK, ReasonCode.BUNDLE_METADATA_MISMATCH],
)
def test_a_refused_mirror_ends_the_install_where_one_with_nothing_hands_it_on(cause):
    refused = drive(InstallRequested("cpu", "avx2"), SourceUnavailable(R, {"cause": str(cause)}, 0.1, cause))
    assert refused.state is S.FAILED and refused.reason is R and refused.evidence["cause"] == cause
    assert [(t["source"], t["outcome"]) for t in refused.evidence["tried"]] == [("mirror", "refused")]
    unreachable = SourceUnavailable(R, {"cause": "bundle_missing"}, 0.1, ReasonCode.BUNDLE_MISSING)
    assert drive(InstallRequested("cpu", "avx2"), unreachable).state is S.SEARCHING_CACHE


# --- the slot's record: installed follows the promote; offers judged against the slot ----------

OLD, NEW = SlotBundle("ef" * 32, "b11000"), SlotBundle("cd" * 32, "b11434")


def test_installed_is_recorded_only_once_the_promote_is_done_and_a_kill_between_resumes_it():
    promoting = drive(*HAPPY[:7])
    assert promoting.state is S.PROMOTING and promoting.effects == (Promote("/staging/b", "cuda", "sm90"),)
    again = drive(Resumed(), state=promoting.state, data=promoting.data)  # killed before Promoted
    assert again.state is S.PROMOTING and again.effects == promoting.effects
    done = drive(Promoted(NEW, OLD), state=again.state, data=again.data)
    assert done.state is S.INSTALLED and done.data.staging is None
    assert done.data.holds == SlotBundle(NEW.digest, "b11434", "ab" * 32, "mirror", None, SlotWriter.INSTALL)
    assert done.data.previous == OLD


def installed_with(holds, previous=None):
    return drive(*HAPPY).data.__class__(backend="cpu", variant="avx2", holds=holds, previous=previous)


def test_an_offer_the_slot_already_holds_fetches_nothing():
    data = installed_with(attrs.evolve(NEW, sha256="ab" * 32, source="mirror"))
    asked = drive(InstallRequested("cpu", "avx2"), state=S.INSTALLED, data=data)
    same_zip = drive(Resolved("http://m/b.zip", "ab" * 32, 10, now=NEW), state=asked.state, data=asked.data)
    assert same_zip.state is S.INSTALLED and same_zip.effects == () and same_zip.evidence["outcome"] == "current"
    assert same_zip.data.holds.sha256 == "ab" * 32 and same_zip.data.tried[-1]["outcome"] == "current"
    # The record names that zip but the slot holds another bundle now: the record is not believed.
    moved = drive(Resolved("http://m/b.zip", "ab" * 32, 10, now=OLD), state=asked.state, data=asked.data)
    assert moved.state is S.DOWNLOADING


def test_a_rejected_bundle_never_comes_back_unless_named():
    rolled = Rejection("b11500", "engine_update_rolled_back", "start", ("99" * 32,))
    data = installed_with(OLD)
    asked = drive(InstallRequested("cpu", "avx2"), state=S.INSTALLED, data=data)
    offer = Resolved("http://m/b.zip", "99" * 32, 10, {"version": "b11500"}, now=OLD, rejection=rolled, reason=R)
    kept = drive(offer, state=asked.state, data=asked.data)
    assert kept.state is S.INSTALLED and kept.effects == () and kept.data.holds.digest == OLD.digest
    assert kept.evidence["outcome"] == "kept" and kept.evidence["rejected"]["gate"] == "start"
    assert "b11500 was rolled back" in kept.evidence["message"] and "keeps b11000" in kept.evidence["message"]
    # An empty slot (the fallback needs an engine): the mirror has nothing acceptable, the next source is asked.
    empty = drive(InstallRequested("cpu", "avx2"), attrs.evolve(offer, now=None))
    assert empty.state is S.SEARCHING_CACHE and empty.data.tried[-1]["outcome"] == "rejected"
    assert empty.data.tried[-1]["reason"] == "engine_update_rolled_back"
    # Named by the user: installed.
    named = drive(InstallRequested("cpu", "avx2", (Source.FILE,)), attrs.evolve(offer, url="file:///b.zip"))
    assert named.state is S.DOWNLOADING


def test_an_update_or_a_rollback_moves_the_record_with_the_slot():
    data = installed_with(attrs.evolve(OLD, sha256="aa" * 32, source="mirror"))
    update = SlotBundle(NEW.digest, NEW.version, "bb" * 32, "mirror", "http://m/n.zip", SlotWriter.ENGINE_UPDATE)
    switched = drive(SlotChanged(update, OLD), state=S.INSTALLED, data=data)
    assert switched.state is S.INSTALLED and switched.data.holds == update
    assert switched.data.previous.sha256 == "aa" * 32  # what the record knew of the old bundle stays with it
    back = drive(
        SlotChanged(attrs.evolve(OLD, by=SlotWriter.ENGINE_ROLLBACK), None), state=S.INSTALLED, data=switched.data
    )
    assert back.data.holds.sha256 == "aa" * 32 and back.data.holds.by is SlotWriter.ENGINE_ROLLBACK
    assert back.data.previous is None and back.evidence["by"] == "engine_rollback"
    fresh = drive(SlotChanged(update, None))  # a slot no install machine had a row for
    assert fresh.state is S.INSTALLED and fresh.data.holds == update
    with pytest.raises(IllegalTransition):  # never under an install at work
        drive(SlotChanged(update), state=S.DOWNLOADING, data=data)


def test_offer_verdicts_and_one_writer_per_slot():
    assert offer_verdict(None, None, "aa", None, None, False) is Offer.INSTALL
    assert offer_verdict(NEW, None, "aa", NEW.digest, None, False) is Offer.CURRENT
    assert offer_verdict(NEW, None, "aa", None, None, False) is Offer.INSTALL  # nothing says it is the same
    assert writer_conflict("cpu-avx2", "install:cpu-avx2", None, None) is None
    assert writer_conflict("cpu-avx2", "install:cpu-avx2", "install:cpu-avx2", None) is None
    busy = writer_conflict("cpu-avx2", "install:cpu-avx2", "engine_update:cpu-avx2", None)
    assert busy is not None and busy["writer"] == "engine_update:cpu-avx2"
    left = writer_conflict("cpu-avx2", "engine_update:cpu-avx2", None, "install:cpu-avx2")
    assert left is not None and left["writer"] == "install:cpu-avx2"


def test_a_downloaded_bundle_is_judged_again_once_its_digest_is_known():
    """A remote mirror's zip says nothing of its bundle before download: a bundle rejected by its
    digest alone (a zip the user named to `engine update`) is caught once unpacked."""
    rejected = Rejection("b11500", "engine_update_rolled_back", "start", (NEW.digest,))
    data = installed_with(OLD)
    validating = drive(*HAPPY[:5], state=S.REQUESTED, data=data)
    assert validating.state is S.VALIDATING and validating.data.holds == OLD
    kept = drive(Validated({}, OLD, NEW.digest, rejected, R), state=validating.state, data=validating.data)
    assert kept.state is S.INSTALLED and kept.effects == (CleanStaging("/dl/b.zip.part"),) and kept.data.holds == OLD
    assert kept.evidence["outcome"] == "kept" and kept.data.staging is None
    same = drive(Validated({}, NEW, NEW.digest), state=validating.state, data=validating.data)
    assert same.state is S.INSTALLED and same.evidence["outcome"] == "current"
    assert same.data.holds.sha256 == "ab" * 32  # learnt: the zip it came in
    empty = drive(Validated({}, None, NEW.digest, rejected, R), state=validating.state, data=validating.data)
    assert empty.state is S.SEARCHING_CACHE and empty.data.tried[-1]["outcome"] == "rejected"
    fine = drive(Validated({}, OLD, NEW.digest), state=validating.state, data=validating.data)
    assert fine.state is S.SMOKE_TESTING
