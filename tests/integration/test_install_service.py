"""The install service over real HTTP from the loopback fault server.

Every case ends installed-and-verified, or failed with `<backend>_bundle_install_failed`
(the precise cause in the evidence) and the previous bundle intact. The bundles are
bundlekit's fake CPU engines (a shell script that answers --version and --list-devices like
the real one); one case installs the real CPU bundle and smoke-tests it (`engine` mark).
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import trio

from stoker.daemon.bundles.archive import pack_bundle
from stoker.daemon.bundles.installed import find_installed, install_bundle
from stoker.daemon.bundles.variants import host_platform
from stoker.daemon.core.errors import StokerError
from stoker.daemon.install.installer import PROGRESS_TOPIC, InstallService
from stoker.daemon.core.paths import StokerPaths
from stoker.states.install import table as I
from stoker.states.install.sources import Source
from tests.bundlekit import make_bundle_dir, make_bundle_zip
from tests.httpfault import Fault


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class Setup:
    """A STOKER_HOME with a previous good CPU bundle installed, a store, a manifest file."""

    def __init__(self, tmp: Path, server) -> None:
        self.tmp = tmp
        self.server = server
        self.paths = StokerPaths.from_env()
        self.paths.data_dir.mkdir(parents=True, exist_ok=True)
        from stoker.store import open_store

        self.store = open_store(self.paths.db_file)
        old = make_bundle_zip(tmp, "old.zip")
        self.previous = install_bundle(old, self.paths)
        self.previous_json = (self.previous.root / "bundle.json").read_bytes()
        self.new_zip = make_bundle_zip(tmp, "new.zip")
        self.data = self.new_zip.read_bytes()
        self.manifest = tmp / "manifest.json"
        self.events: list[dict] = []

    def publish(
        self,
        url: str,
        *,
        data: bytes | None = None,
        size: int | None = None,
        backend: str = "cpu",
        variant: str = "avx2",
    ) -> None:
        data = self.data if data is None else data
        entry = {
            "url": url,
            "sha256": _sha(data),
            "size": len(data) if size is None else size,
            "backend": backend,
            "variant": variant,
            "version": "b11434",
            "platform": host_platform(),
        }
        self.manifest.write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))

    def service(self, **kwargs) -> InstallService:
        return InstallService(
            self.paths,
            self.store,
            self.events.append,
            manifest_source=lambda: str(self.manifest),
            smoke=False,
            **kwargs,
        )

    def slot_json(self) -> bytes:
        return (self.paths.bundles_dir / "cpu-avx2" / "bundle.json").read_bytes()

    def assert_previous_intact(self) -> None:
        assert self.slot_json() == self.previous_json
        assert find_installed(self.paths, "cpu", "avx2").root == self.paths.bundles_dir / "cpu-avx2"
        assert not [p for p in self.paths.bundles_dir.iterdir() if p.name.startswith(".install-")]

    def assert_new_installed(self) -> None:
        bundle = find_installed(self.paths, "cpu", "avx2")
        assert bundle is not None and (bundle.root / "bundle.json").read_bytes() != self.previous_json
        assert (self.paths.bundles_dir / "cpu-avx2.previous" / "bundle.json").read_bytes() == self.previous_json
        assert not [p for p in self.paths.bundles_dir.iterdir() if p.name.startswith(".")]
        assert list((self.paths.data_dir / "downloads").iterdir()) == []  # the zip is gone
        runner = self.store.machine(I.INSTALL.machine_id("cpu", "avx2"))
        assert runner.state == "installed"


@pytest.fixture
def setup(tmp_path, fault_server):
    s = Setup(tmp_path, fault_server)
    yield s
    s.store.close()


async def _install_fails(service: InstallService, backend: str = "cpu") -> StokerError:
    with pytest.raises(StokerError) as err:
        with trio.fail_after(60):
            await service.install(backend, variant="avx2")
    return err.value


async def test_clean_install_publishes_progress_and_keeps_the_previous(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data))
    with trio.fail_after(60):
        bundle = await setup.service().install("cpu", variant="avx2")
    assert bundle.meta.backend == "cpu"
    setup.assert_new_installed()
    progress = [e for e in setup.events if e.get("topic") == PROGRESS_TOPIC]
    assert progress and progress[-1]["bytes_done"] == len(setup.data) == progress[-1]["total"]
    assert set(progress[-1]) >= {"backend", "variant", "bytes_done", "total", "rate", "eta"}
    path = [r.to_state for r in reversed(setup.store.history(machine="install:cpu-avx2"))]
    assert path == [
        "resolving",
        "downloading",
        "verifying",
        "unpacking",
        "validating",
        "smoke_testing",
        "promoting",
        "installed",
    ]


async def test_connection_cut_at_a_random_byte_resumes(setup):
    cut = random.Random(7).randrange(1, len(setup.data) - 1)
    setup.publish(setup.server.add("/cpu.zip", setup.data, Fault(cut_after=cut)))
    with trio.fail_after(60):
        await setup.service().install("cpu", variant="avx2")
    setup.assert_new_installed()
    asked = setup.server.requests("/cpu.zip")
    assert asked[0].range is None and asked[1].range == f"bytes={cut}-" and asked[1].status == 206


async def test_wrong_digest_fails_with_evidence(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data, Fault(corrupt=True)))
    err = await _install_fails(setup.service())
    assert err.reason == "cpu_bundle_install_failed"
    ev = err.evidence
    # The bytes are not the manifest's: the bundle's digest failing, whatever the transport said.
    assert ev["cause"] == "bundle_digest_mismatch" and ev["kind"] == "digest_mismatch" and ev["step"] == "downloading"
    assert ev["expected_sha256"] == _sha(setup.data) != ev["actual_sha256"]
    setup.assert_previous_intact()
    assert setup.store.machine("install:cpu-avx2").reason == "cpu_bundle_install_failed"


async def test_wrong_size_fails(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data), size=len(setup.data) + 10)
    err = await _install_fails(setup.service())
    assert err.reason == "cpu_bundle_install_failed" and err.evidence["kind"] == "size_mismatch"
    assert err.evidence["cause"] == "bundle_digest_mismatch" and err.evidence["expected_size"] == len(setup.data) + 10
    setup.assert_previous_intact()


async def test_404_fails(setup):
    setup.publish(setup.server.url("/missing.zip"))
    err = await _install_fails(setup.service())
    assert err.evidence["kind"] == "http_status" and err.evidence["status"] == 404
    setup.assert_previous_intact()


async def test_200_instead_of_206_restarts_cleanly(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data, Fault(cut_after=len(setup.data) // 3, ignore_range=True)))
    with trio.fail_after(60):
        await setup.service().install("cpu", variant="avx2")
    setup.assert_new_installed()
    asked = setup.server.requests_when("/cpu.zip", 2)
    assert asked[1].range is not None and asked[1].status == 200


async def test_etag_changed_between_attempts_fails_on_the_digest(setup):
    other = make_bundle_zip(setup.tmp, "other.zip").read_bytes()
    fault = Fault(cut_after=len(setup.data) // 2, change_after=1, changed_data=other)
    setup.publish(setup.server.add("/cpu.zip", setup.data, fault))
    err = await _install_fails(setup.service())
    assert err.reason == "cpu_bundle_install_failed"
    assert err.evidence["kind"] in ("digest_mismatch", "size_mismatch")
    asked = setup.server.requests_when("/cpu.zip", 2)
    assert asked[1].if_range is not None and asked[1].status == 200  # If-Range refused the old part
    setup.assert_previous_intact()


async def test_slow_server_reports_rate_and_eta(setup):
    rate = max(len(setup.data) // 2, 1000)  # about two seconds
    setup.publish(setup.server.add("/cpu.zip", setup.data, Fault(rate=rate)))
    with trio.fail_after(60):
        await setup.service().install("cpu", variant="avx2")
    setup.assert_new_installed()
    progress = [e for e in setup.events if e.get("topic") == PROGRESS_TOPIC]
    assert len(progress) >= 3
    mid = [p for p in progress if p["bytes_done"] < len(setup.data)]
    assert mid and any(p["rate"] > 0 and p["eta"] is not None for p in mid)


async def test_daemon_killed_mid_download_resumes_with_range(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data, Fault(rate=max(len(setup.data) // 4, 500))))
    first = setup.service()
    with trio.move_on_after(1.5):  # the "kill": cancelled mid-stream
        await first.install("cpu", variant="avx2")
    assert setup.store.machine("install:cpu-avx2").state == "downloading"
    setup.assert_previous_intact()
    setup.server.set_fault("/cpu.zip", None)
    again = setup.service()  # a new daemon on the same store
    with trio.fail_after(60):
        assert await again.resume_all() == ["install:cpu-avx2"]
    setup.assert_new_installed()
    resumed = setup.server.requests("/cpu.zip")[-1]
    assert resumed.range is not None and resumed.status == 206
    events = [r.event for r in reversed(setup.store.history(machine="install:cpu-avx2"))]
    assert "Resumed" in events


async def test_daemon_killed_while_validating_redoes_from_clean_staging(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data))

    class Stuck(InstallService):
        async def _validate_bundle(self, effect, runner):
            await trio.sleep_forever()

    with trio.move_on_after(5):
        stuck = Stuck(
            setup.paths, setup.store, setup.events.append, manifest_source=lambda: str(setup.manifest), smoke=False
        )
        await stuck.install("cpu", variant="avx2")
    assert setup.store.machine("install:cpu-avx2").state == "validating"
    # Half-way: the staging dir exists but the launcher still finds the previous bundle.
    assert (setup.paths.bundles_dir / ".install-cpu-avx2" / "bundle").is_dir()
    assert setup.slot_json() == setup.previous_json
    with trio.fail_after(60):
        await setup.service().resume_all()
    setup.assert_new_installed()
    rows = [(r.from_state, r.event, r.to_state) for r in reversed(setup.store.history(machine="install:cpu-avx2"))]
    assert ("validating", "Resumed", "unpacking") in rows


async def test_no_manifest_fails_with_the_reason(setup):
    service = InstallService(
        setup.paths, setup.store, setup.events.append, manifest_source=lambda: "", smoke=False, sources=(Source.MIRROR,)
    )
    err = await _install_fails(service)
    assert err.reason == "cpu_bundle_install_failed" and err.evidence["cause"] == "bundle_missing"
    setup.assert_previous_intact()


def _cache_entry(cache: Path, key: str, zip_path: Path) -> Path:
    """A build cache entry as the builder leaves it: builds/<key>/{bundle.zip, bundle.json}."""
    entry = cache / "builds" / key
    entry.mkdir(parents=True)
    shutil.copy(zip_path, entry / "bundle.zip")
    with zipfile.ZipFile(zip_path) as zf:
        (entry / "bundle.json").write_bytes(zf.read("bundle.json"))
    return entry


async def test_without_a_manifest_a_fitting_cached_build_is_installed(setup, monkeypatch):
    cache = setup.tmp / "cache"
    _cache_entry(cache, "k-compat", make_bundle_zip(setup.tmp, "compat.zip", variant="compat"))
    entry = _cache_entry(cache, "k-avx2", setup.new_zip)
    monkeypatch.setenv("STOKER_CACHE_DIR", str(cache))
    service = InstallService(
        StokerPaths.from_env(), setup.store, setup.events.append, manifest_source=lambda: "", smoke=False
    )
    with trio.fail_after(60):
        bundle = await service.install("cpu", variant="avx2")
    assert bundle.root == setup.paths.bundles_dir / "cpu-avx2"
    setup.assert_new_installed()
    row = next(r for r in service.statistics() if r["machine"] == "install:cpu-avx2")
    assert row["source"] == "build-cache" and row["origin"] == str(entry)
    assert [(t["source"], t["outcome"]) for t in row["tried"]] == [
        ("mirror", "unavailable"),
        ("build-cache", "installed"),
    ]
    assert (entry / "bundle.zip").is_file()  # the cache keeps its entry: the install copied it


async def test_a_cached_build_that_fails_its_check_is_left_for_a_local_build(setup, monkeypatch):
    src = make_bundle_dir(setup.tmp / "tampered.src")
    (src / "bin" / "libggml-fake.so").write_bytes(b"not what bundle.json says")
    cache = setup.tmp / "cache"
    _cache_entry(cache, "k-tampered", pack_bundle(src, setup.tmp / "tampered.zip"))
    monkeypatch.setenv("STOKER_CACHE_DIR", str(cache))
    monkeypatch.setenv("PATH", str(setup.tmp / "no-tools"))  # no compiler, no cmake
    service = InstallService(
        StokerPaths.from_env(), setup.store, setup.events.append, manifest_source=lambda: "", smoke=False
    )
    err = await _install_fails(service)
    assert err.reason == "cpu_bundle_install_failed" and err.evidence["cause"] == "build_toolchain_missing"
    assert [(t["source"], t["outcome"], t["reason"], t["step"]) for t in err.evidence["tried"]] == [
        ("mirror", "unavailable", "bundle_missing", "resolving"),
        ("build-cache", "failed", "bundle_digest_mismatch", "validating"),
        ("local-build", "unavailable", "build_toolchain_missing", "checking_toolchain"),
    ]
    assert "mirror: No bundle manifest is configured" in err.message and "build-cache: " in err.message
    assert "local-build: The build tool 'c++' is missing or broken" in err.message
    setup.assert_previous_intact()


async def test_cuda_entry_holding_a_cpu_bundle_is_refused(setup):
    # A "cuda" entry re-labelled onto a CPU bundle: bundle.json says cpu, the manifest cuda.
    setup.publish(setup.server.add("/cuda.zip", setup.data), backend="cuda")
    err = await _install_fails(setup.service(), backend="cuda")
    assert err.reason == "cuda_bundle_install_failed"
    assert err.evidence["cause"] == "bundle_metadata_mismatch" and err.evidence["step"] == "validating"
    assert not (setup.paths.bundles_dir / "cuda-avx2").exists()
    setup.assert_previous_intact()


async def test_file_url_mirror(setup):
    mirror = setup.tmp / "mirror.zip"
    shutil.copy(setup.new_zip, mirror)
    setup.publish(mirror.as_uri())
    with trio.fail_after(60):
        await setup.service().install("cpu", variant="avx2")
    setup.assert_new_installed()


@pytest.mark.engine
async def test_real_cpu_bundle_installs_verified_and_smoke_tested(setup, cpu_bundle):
    data = Path(cpu_bundle).read_bytes()
    setup.publish(setup.server.add("/real.zip", data, Fault(cut_after=len(data) // 2)), data=data)
    service = InstallService(
        setup.paths, setup.store, setup.events.append, manifest_source=lambda: str(setup.manifest), smoke=True
    )
    with trio.fail_after(300):
        bundle = await service.install("cpu", variant="avx2")
    assert bundle.meta.backend == "cpu" and bundle.server.is_file()
    smoke = [r for r in setup.store.history(machine="install:cpu-avx2") if r.event == "SmokePassed"]
    assert smoke[0].evidence["smoke"] == "passed"


async def test_installing_the_same_bundle_again_is_a_no_op(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data))
    with trio.fail_after(60):
        await setup.service().install("cpu", variant="avx2")
        before = len(setup.server.requests("/cpu.zip"))
        await setup.service().install("cpu", variant="avx2")
    assert len(setup.server.requests("/cpu.zip")) == before
    setup.assert_new_installed()


def test_the_cli_installs_a_local_bundle_through_the_running_daemon(stoker_home, tmp_path):
    """`stoker bundle install` with a daemon running goes to the daemon's install machine (the
    CLI cannot take the daemon's lock, so nothing else could have installed it): the same
    steps and history as a manifest install, and a second bundle then a first again each
    really installs (the machine knows which bundle the slot holds)."""
    import subprocess
    import sys

    from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config

    def bundle_install(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "bundle", "install", *args, "--json"],
            env=d.env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    first = make_bundle_zip(tmp_path, "first.zip", smoke_tokens=None)
    second = make_bundle_zip(tmp_path, "second.zip", smoke_tokens=None)
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(tmp_path / "absent.gguf"))  # model_missing: the daemon idles
    d.start()
    try:
        d.wait_state("failed", timeout=60)
        for zip_path in (first, second, first):
            out = bundle_install(str(zip_path))
            assert out.returncode == 0, out.stdout + out.stderr
            assert "through the daemon" in out.stderr and json.loads(out.stdout)["variant"] == "avx2"
            slot = d.paths.bundles_dir / "cpu-avx2" / "bin" / "libggml-fake.so"
            assert slot.read_bytes() == (tmp_path / f"{zip_path.name}.src" / "bin" / "libggml-fake.so").read_bytes()
        steps = [r["to_state"] for r in reversed(d.history(machine="install:cpu-avx2"))]
        assert steps.count("installed") == 3 and "validating" in steps
        relative = subprocess.run(
            [sys.executable, "-m", "stoker.daemon", "bundle", "install", "first.zip", "--json"],
            env=d.env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert relative.returncode == 0, relative.stdout + relative.stderr  # the CLI sends an absolute path
    finally:
        d.stop()


# --- the slot's record and its one writer (installs and updates tell one story) ----------------


async def test_installed_is_reported_only_once_the_slot_holds_the_bundle(setup):
    """Status and subscribers hear `installed` when the new bundle is in its slot, not before
    (the transition used to be written first, then the promote run)."""
    setup.publish(setup.server.add("/cpu.zip", setup.data))
    seen: list[bytes] = []

    def watch(event: dict) -> None:
        if event.get("topic") == "machine.install.installed":
            seen.append(setup.slot_json())

    service = InstallService(setup.paths, setup.store, watch, manifest_source=lambda: str(setup.manifest), smoke=False)
    with trio.fail_after(60):
        await service.install("cpu", variant="avx2")
    assert seen and all(json_bytes != setup.previous_json for json_bytes in seen)
    setup.assert_new_installed()


async def test_a_kill_between_the_promote_and_its_record_resumes_to_the_right_slot(setup):
    setup.publish(setup.server.add("/cpu.zip", setup.data))

    class KilledAfterRename(InstallService):
        async def _promote_staged(self, effect, runner):
            await trio.to_thread.run_sync(self._promote, runner, effect)
            await trio.sleep_forever()  # the daemon dies before the transition is written

    killed = KilledAfterRename(
        setup.paths, setup.store, setup.events.append, manifest_source=lambda: str(setup.manifest), smoke=False
    )
    with trio.move_on_after(10):
        await killed.install("cpu", variant="avx2")
    assert setup.store.machine("install:cpu-avx2").state == "promoting"  # never `installed` before the fact
    with trio.fail_after(60):
        await setup.service().resume_all()
    setup.assert_new_installed()  # the old bundle is the `.previous`, not the new one promoted twice
    data = setup.store.machine("install:cpu-avx2").data
    assert data["holds"]["digest"] == hashlib.sha256(setup.slot_json()).hexdigest()
    assert data["previous"]["digest"] == hashlib.sha256(setup.previous_json).hexdigest()


def _rolled_back_on(store, slot_variant: str, rejected_zip: Path, old_json: bytes, named: bool = False) -> None:
    """The slot's engine update machine as a real rollback leaves it: `rejected_zip` (from a
    manifest; or `named` to `stoker engine update --bundle`, known by its digest alone) switched
    in, its server died, the old engine put back."""
    from stoker.daemon.core.machines import MachineRunner
    from stoker.states.engine_update import table as U
    from stoker.states.engine_update import records as R

    with zipfile.ZipFile(rejected_zip) as zf:
        new_digest = _sha(zf.read("bundle.json"))
    sha = _sha(rejected_zip.read_bytes())
    old, new = R.BundleFacts("b11434", _sha(old_json)), R.BundleFacts("b11434", new_digest)
    runner = MachineRunner(U.ENGINE_UPDATE, U.ENGINE_UPDATE.machine_id("cpu", slot_variant), store)
    for event in (
        R.UpdateRequested("cpu", slot_variant, bundle=str(rejected_zip) if named else None),
        R.Resolved(
            old,
            R.Candidate("b11500", new_digest, rejected_zip.as_uri())
            if named
            else R.Candidate("b11500", sha, "http://mirror/cpu.zip", sha, rejected_zip.stat().st_size),
        ),
        R.Staged(new, "/staging", (1, 2, 3)),
        R.TokensCompared((1, 2, 3)),
        R.Switched((R.ServerBaseline("default"),)),
        R.ServersRestarted((R.ServerVerdict("default", "exited", "cpu", reason="server_crashed"),)),
        R.RolledBack({"restored": "b11434"}),
    ):
        runner.fire(event)
    assert runner.state is R.UpdateState.ROLLED_BACK


async def test_a_bundle_an_update_rolled_back_never_comes_back_through_install(setup):
    """After an automatic rollback, `stoker install cpu` with a manifest still listing the rolled
    back bundle keeps the slot (nothing fetched); with an empty slot the mirror has nothing
    acceptable; only the bundle named by hand installs it again."""
    _rolled_back_on(setup.store, "avx2", setup.new_zip, setup.previous_json)
    setup.publish(setup.server.add("/cpu.zip", setup.data))
    with trio.fail_after(60):
        bundle = await setup.service().install("cpu", variant="avx2")
    assert (bundle.root / "bundle.json").read_bytes() == setup.previous_json
    assert setup.server.requests("/cpu.zip") == []  # never fetched
    setup.assert_previous_intact()
    last = setup.store.history(machine="install:cpu-avx2", limit=1)[0]
    assert last.to_state == "installed" and last.evidence["outcome"] == "kept"
    assert last.evidence["rejected"] == {"version": "b11500", "reason": "engine_update_rolled_back", "gate": "start"}

    shutil.rmtree(setup.paths.bundles_dir / "cpu-avx2")  # an empty slot: the fallback needs an engine
    mirror_only = setup.service(sources=(Source.MIRROR,))
    err = await _install_fails(mirror_only)
    assert [(t["source"], t["outcome"], t["reason"]) for t in err.evidence["tried"]] == [
        ("mirror", "rejected", "engine_update_rolled_back")
    ]
    assert find_installed(setup.paths, "cpu", "avx2") is None and setup.server.requests("/cpu.zip") == []

    with trio.fail_after(60):
        named = await setup.service().install_file(setup.new_zip)  # the user names it: installed
    assert (named.root / "bundle.json").read_bytes() == zipfile.ZipFile(setup.new_zip).read("bundle.json")


async def test_an_install_and_an_update_of_one_slot_never_write_it_at_once(setup):
    from stoker.daemon.install.update import EngineUpdateService

    setup.publish(setup.server.add("/cpu.zip", setup.data))
    entered = trio.Event()

    class Slow(InstallService):
        async def _validate_bundle(self, effect, runner):
            entered.set()
            await trio.sleep(1.0)
            return await super()._validate_bundle(effect, runner)

    installs = Slow(
        setup.paths, setup.store, setup.events.append, manifest_source=lambda: str(setup.manifest), smoke=False
    )
    updates = EngineUpdateService(setup.paths, setup.store, installs)
    refused: list[StokerError] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: installs.install("cpu", variant="avx2"))
            await entered.wait()
            for attempt in (
                lambda: updates.update("cpu", "avx2", bundle=setup.new_zip),
                lambda: updates.rollback("cpu", "avx2"),
            ):
                with pytest.raises(StokerError) as busy:
                    await attempt()
                refused.append(busy.value)
    assert [e.reason for e in refused] == ["engine_slot_busy", "engine_slot_busy"]
    assert refused[0].evidence["writer"] == "install:cpu-avx2" and "stoker status" in refused[0].message
    assert setup.store.machine("engine_update:cpu-avx2") is None  # refused before its machine moved
    setup.assert_new_installed()
    # An update a killed daemon left mid-way holds the slot until it is resumed.
    from stoker.daemon.core.machines import MachineRunner
    from stoker.states.engine_update import table as U
    from stoker.states.engine_update import records as R

    MachineRunner(U.ENGINE_UPDATE, U.ENGINE_UPDATE.machine_id("cpu", "avx2"), setup.store).fire(
        R.UpdateRequested("cpu", "avx2")
    )
    err = await _install_fails(setup.service())
    assert err.reason == "engine_slot_busy" and err.evidence["writer"] == "engine_update:cpu-avx2"


async def test_an_automatic_check_that_finds_nothing_writes_no_history(setup):
    """The automatic engine check runs every check_interval_s: a check that starts no update (the
    manifest offers what is installed; the manifest cannot be read) writes no history row, and status
    shows when it last ran and what it found."""
    from stoker.daemon.config.engine import EngineConfig
    from stoker.daemon.install.update import EngineUpdateService

    setup.publish(setup.server.add("/cpu.zip", setup.data))  # the same version as the installed one
    updates = EngineUpdateService(setup.paths, setup.store, setup.service(), settings=lambda: EngineConfig())
    with trio.fail_after(30):
        for _ in range(3):
            last = await updates.check("cpu", "avx2")
    assert setup.store.history(machine="engine_update:cpu-avx2") == []
    assert last["result"] == "current" and last["offered"] == "b11434" and last["installed"] == "b11434"
    assert "nothing newer" in last["message"]
    assert updates.slot_status("cpu", "avx2")["last_check"] == last
    setup.manifest.write_text("{not json")
    with trio.fail_after(30):
        broken = await updates.check("cpu", "avx2")
    assert (
        broken["result"] == "failed"
        and broken["reason"]
        and setup.store.history(machine="engine_update:cpu-avx2") == []
    )
    setup.assert_previous_intact()


async def test_a_rejected_bundle_known_only_by_its_digest_is_caught_once_downloaded(setup):
    """A zip the user named to `stoker engine update` was rolled back: the update knows it by its
    bundle.json digest only. A remote mirror listing the same bundle (its zip's sha256 unknown to
    the update) is downloaded, then judged once unpacked: the slot keeps its bundle."""
    _rolled_back_on(setup.store, "avx2", setup.new_zip, setup.previous_json, named=True)
    setup.publish(setup.server.add("/cpu.zip", setup.data))
    with trio.fail_after(60):
        bundle = await setup.service().install("cpu", variant="avx2")
    assert (bundle.root / "bundle.json").read_bytes() == setup.previous_json
    assert len(setup.server.requests("/cpu.zip")) == 1  # fetched, then refused by its digest
    setup.assert_previous_intact()
    last = setup.store.history(machine="install:cpu-avx2", limit=1)[0]
    assert (last.from_state, last.to_state, last.evidence["outcome"]) == ("validating", "installed", "kept")
    assert list((setup.paths.data_dir / "downloads").iterdir()) == []  # nor its zip kept
