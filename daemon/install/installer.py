"""The install service: one install machine per backend-variant, from a source to atomic rename.

    a source (states/install/table.py tries them in order: a file named by the user; the manifest's
    entry for the detected hardware, daemon/install/manifest.py; the local build cache; a local
    build from the pinned source, daemon/install/sources.py) -> download or copy (resumable,
    into data/downloads) -> verify archive -> unpack into a hidden staging dir -> validate
    (bundle.json, --version, --list-devices) -> smoke (where the hardware allows and a reference
    exists) -> promote (rename into the slot, the old slot kept as `.previous`)

The table decides, which source included; this module does each step and answers with an event
(a source with nothing to offer: `SourceUnavailable`, with the facts). Every failure becomes
`InstallFailed(<backend>_bundle_install_failed)` whose evidence says what broke (`cause`: the
precise reason code, the download error `kind`, HTTP `status`, expected and actual digests).
Staging lives under `bundles/.install-<slot>/`: names with a dot are never launchable, so
nothing half-installed is ever launched; the slot changes only in Promote's rename. A daemon
killed mid-way resumes (`resume_all`): a download continues from its part file with
Range/If-Range, later steps redo from a clean staging directory."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any, Awaitable, Callable, Mapping, Sequence
from urllib.parse import unquote, urlparse

import attrs
import trio

from stoker.daemon.backends.base import Backend, Detection, ReasonKind
from stoker.daemon.backends.registry import family_reason, load_backends
from stoker.daemon.bundles.archive import check_digest, unpack_bundle
from stoker.daemon.bundles.build import cached_builds
from stoker.daemon.bundles.installed import InstalledBundle, find_installed, promote
from stoker.daemon.bundles.metadata import BundleMeta, ManifestEntry
from stoker.daemon.core.digests import sha256_file
from stoker.daemon.core.download_records import DownloadProgress
from stoker.daemon.core.errors import StokerError, cause_of
from stoker.daemon.core.machines import EffectDriver, Failure, MachineRunner, MachineRunners, Publish
from stoker.states.machine import IllegalTransition
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.install.checks import smoke_skip, smoke_staged, validate_staged
from stoker.daemon.install.manifest import MANIFEST_ENV, choose_entry, download_bundle, load_manifest
from stoker.daemon.install.sources import (
    failure_sentence,
    copy_file_url,
    BESIDE_BUILD_NICE,
    build_attempt,
    cache_attempt,
    check_toolchain,
    entry_for_zip,
    find_cached_build,
    install_row,
    toolchain_attempt,
    variant_to_make,
)
from stoker.daemon.install.slots import SlotWriters, rejection_for, serving, slot_pair
from stoker.daemon.install.trust import ManifestTrust
from stoker.daemon.install.update_steps import bundle_digest
from stoker.states.install import table as I
from stoker.states.install import effects as IE
from stoker.states.convert import structure
from stoker.states.install.slot import SlotBundle, SlotWriter
from stoker.states.install.sources import CHAIN, Source
from stoker.states.reasons import ReasonCode, stored_reason
from stoker.store.database import Store

log = logging.getLogger(__name__)

PROGRESS_TOPIC = "install.progress"
SOURCE_STARTS = (IE.Resolve, IE.FindCachedBuild, IE.CheckToolchain)  # each source's first effect
ATTEMPT_ENDS = (I.SourceUnavailable, I.InstallFailed, I.Promoted)  # events that end a source's try


def install_failed_reason(backends: Mapping[str, Backend], backend: str) -> ReasonCode:
    """The backend's own bundle_install_failed code (`cuda_bundle_install_failed`...), or
    bundle_verify_failed for a backend that declares none."""
    return family_reason(backends, backend, ReasonKind.BUNDLE_INSTALL_FAILED, ReasonCode.BUNDLE_VERIFY_FAILED)


# --- the service --------------------------------------------------------------------------


@attrs.define(eq=False)
class InstallService:
    """Install machines keyed by backend-variant; `install()` drives one to its end."""

    paths: StokerPaths
    store: Store
    publish: Publish | None = None
    manifest_source: Callable[[], str] = lambda: os.environ.get(MANIFEST_ENV, "")
    trusted_keys: Callable[[], Sequence[str]] = lambda: ()  # [bundles] trusted_keys (docs/mirror.md)
    backends: Mapping[str, Backend] = attrs.field(factory=load_backends)  # every registered one by default
    smoke: bool = True
    sources: tuple[Source, ...] = CHAIN  # where `install` may look, in the table's order
    _machines: MachineRunners = attrs.field(init=False)
    _entries: dict[str, ManifestEntry] = attrs.field(factory=dict, init=False)
    _detections: dict[str, Detection] = attrs.field(factory=dict, init=False)
    _local_smoke: dict[str, bool] = attrs.field(factory=dict, init=False)  # machine id -> smoke asked
    _refusals: dict[str, StokerError] = attrs.field(factory=dict, init=False)  # why the mirror has none
    _started: dict[str, float] = attrs.field(factory=dict, init=False)  # the attempt's trio clock at its start
    _progress: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)  # a build's last figures
    _beside: set[str] = attrs.field(factory=set, init=False)  # machine ids installing while another engine serves
    _effects: EffectDriver[Awaitable[object | None]] = attrs.field(init=False)
    slots: SlotWriters = attrs.field(init=False)  # one writer per slot, shared with engine updates

    def __attrs_post_init__(self) -> None:
        self._machines = MachineRunners(I.INSTALL, self.store, self.publish)
        self.slots = SlotWriters(self.store)
        handlers: dict[type, Callable[..., Awaitable[object | None]]] = {
            IE.Resolve: self._resolve,
            IE.FindCachedBuild: self._find_cached,
            IE.CheckToolchain: self._check_toolchain,
            IE.BuildBundle: self._build,
            IE.Download: self._download,
            IE.VerifyArchive: self._verify_archive,
            IE.CleanStaging: self._clean_staging,
            IE.Unpack: self._unpack,
            IE.ValidateBundle: self._validate_bundle,
            IE.SmokeTest: self._smoke_test,
            IE.Promote: self._promote_staged,
        }
        self._effects = EffectDriver(
            I.INSTALL, {kind: self._attempt(handler) for kind, handler in handlers.items()}, failed=self._failed
        )

    @property
    def downloads_dir(self) -> Path:
        return self.paths.data_dir / "downloads"

    @property
    def trust(self) -> ManifestTrust:
        """The manifest trust policy now: the configured keys, the store's accepted versions."""
        return ManifestTrust(tuple(self.trusted_keys()), self.store)

    def staging_root(self, backend: str, variant: str) -> Path:
        return self.paths.bundles_dir / f".install-{backend}-{variant}"

    def runner(self, backend: str, variant: str) -> MachineRunner:
        return self._machines.runner(I.INSTALL.machine_id(backend, variant))

    def _reason(self, backend: str) -> ReasonCode:
        return install_failed_reason(self.backends, backend)

    def _bus(self, event: dict[str, Any]) -> None:
        if self.publish is not None:
            self.publish(event)

    # --- entry points --------------------------------------------------------------------

    async def resume_all(self) -> list[str]:
        """Resume or clean up the installs a killed daemon left behind; the machine ids."""
        resumed = []
        for record in self.store.machines(kind=I.INSTALL.name):
            state = I.InstallState(record.state)
            data = structure(record.data, I.InstallData)
            staging, backend, variant = data.staging, data.backend, data.variant
            if state in I.WORKING or (state is I.InstallState.INSTALLED and staging and Path(staging).exists()):
                runner = self.runner(backend, variant)
                async with self._machines.lock(runner.machine_id):
                    try:
                        with self.slots.claim(f"{backend}-{variant}", runner.machine_id):
                            step = runner.fire(I.Resumed())
                            log.info("resuming %s from %s", runner.machine_id, record.state)
                            await self._effects.drive(runner, step.effects, runner)
                    except Exception as err:
                        log.warning("cannot resume %s: %s", runner.machine_id, err)
                        continue
                resumed.append(runner.machine_id)
        return resumed

    async def install(
        self, backend: str, *, variant: str | None = None, detection: Detection | None = None, beside: bool = False
    ) -> InstalledBundle:
        """Install the bundle for `backend` that fits `detection` from the first source that
        has one (the mirror, the build cache, a local build); StokerError with the backend's
        `*_bundle_install_failed` (each source's attempt in the evidence) if none can.
        `beside`: another engine serves meanwhile, so a local build yields the CPU to it
        (`BESIDE_BUILD_NICE`)."""
        entry, refusal = None, None
        if Source.MIRROR in self.sources:
            try:
                manifest = await load_manifest(self.manifest_source(), self.trust)
                entry = choose_entry(
                    manifest, backend, variant=variant, detection=detection, plugin=self.backends.get(backend)
                )
            except StokerError as err:  # reported as the mirror's attempt, then the next source
                refusal = err
        slot_variant = variant or (
            entry.variant
            if entry
            else await variant_to_make(self.paths, backend, self.backends.get(backend), detection)
        )
        mid = I.INSTALL.machine_id(backend, slot_variant)
        self._local_smoke.pop(mid, None)
        if beside:
            self._beside.add(mid)
        try:
            return await self._install(backend, slot_variant, self.sources, detection, entry, refusal)
        finally:
            self._beside.discard(mid)

    async def first_source(self, backend: str, detection: Detection | None = None) -> Source | None:
        """The source an install of `backend` would get its bundle from, looked at without
        installing: the mirror when its manifest lists one that fits, the build cache when it
        holds a fitting build, a local build when the toolchain is here; None: no source has
        one (an install fails at once). What the fallback machine weighs before it waits."""
        plugin = self.backends.get(backend)
        if Source.MIRROR in self.sources:
            try:
                manifest = await load_manifest(self.manifest_source(), self.trust)
                choose_entry(manifest, backend, detection=detection, plugin=plugin)
                return Source.MIRROR
            except StokerError:
                pass  # unconfigured, unreachable, refused or nothing that fits: the install goes on
        variant = await variant_to_make(self.paths, backend, plugin, detection)
        if Source.BUILD_CACHE in self.sources:
            cache = await trio.to_thread.run_sync(cached_builds, self.paths)
            found = find_cached_build(cache, self.paths.build_cache_dir, backend, variant, plugin, detection)
            if found.hit is not None:
                return Source.BUILD_CACHE
        if Source.LOCAL_BUILD in self.sources:
            builder = self._builder(backend, variant)
            report = await trio.to_thread.run_sync(check_toolchain, backend, variant, None, builder)
            if report.ready:
                return Source.LOCAL_BUILD
        return None

    async def install_file(
        self, path: Path, *, smoke: bool = False, detection: Detection | None = None
    ) -> InstalledBundle:
        """Install a local bundle zip through the same machine, steps and promote as a
        manifest bundle: the entry is the zip itself (a file:// URL, its sha256 and size, the
        backend, variant, version and platform its bundle.json states). What `bundle.install`,
        `stoker bundle install` and `stoker run` use. The smoke test runs only when asked
        (`stoker bundle install --smoke`, `stoker run`), as it did for a local install."""
        entry = await trio.to_thread.run_sync(entry_for_zip, Path(path).absolute())
        self._local_smoke[I.INSTALL.machine_id(entry.backend, entry.variant)] = smoke
        return await self._install(entry.backend, entry.variant, (Source.FILE,), detection, entry)

    async def _install(
        self,
        backend: str,
        variant: str,
        sources: tuple[Source, ...],
        detection: Detection | None,
        entry: ManifestEntry | None = None,
        refusal: StokerError | None = None,
    ) -> InstalledBundle:
        """Drive the slot's machine through its sources to installed: the first acceptable offer,
        or what the slot holds already (the table judges each offer against the slot)."""
        runner = self.runner(backend, variant)
        mid = runner.machine_id
        async with self._machines.lock(mid):
            with self.slots.claim(f"{backend}-{variant}", mid):
                await self._install_claimed(runner, backend, variant, sources, detection, entry, refusal)
        if runner.state is not I.InstallState.INSTALLED:
            raise self._failure(runner)
        bundle = find_installed(self.paths, backend, variant)
        if bundle is None:  # promoted, then removed under us
            raise StokerError(
                self._failure(runner).reason,
                "The bundle was installed but is no longer there.",
                {"slot": f"{backend}-{variant}"},
            )
        return bundle

    async def _install_claimed(
        self,
        runner: MachineRunner,
        backend: str,
        variant: str,
        sources: tuple[Source, ...],
        detection: Detection | None,
        entry: ManifestEntry | None,
        refusal: StokerError | None,
    ) -> None:
        mid = runner.machine_id
        if runner.state in I.WORKING:
            # Left mid-way by a killed daemon and not resumed yet: finish that first.
            await self._effects.drive(runner, runner.fire(I.Resumed()).effects, runner)
        self._entries.pop(mid, None)
        self._refusals.pop(mid, None)
        if entry is not None:
            self._entries[mid] = entry
        if refusal is not None:
            self._refusals[mid] = refusal
        if detection is not None:
            self._detections[mid] = detection
        try:
            await self._effects.drive(
                runner, runner.fire(I.InstallRequested(backend, variant, sources)).effects, runner
            )
        finally:
            self._progress.pop(mid, None)

    def slot_changed(self, backend: str, variant: str, by: SlotWriter, known: SlotBundle | None = None) -> None:
        """An engine update switched the slot or a rollback put its `.previous` back (the caller
        holds the slot's claim): the install machine's record follows what the slot now holds.
        `known`: what the writer knows of the new bundle (its zip's sha256, source, origin)."""
        runner = self.runner(backend, variant)
        now, previous = slot_pair(self.paths, f"{backend}-{variant}")
        if now is None:
            log.warning("%s: the slot holds no bundle after %s", runner.machine_id, by.value)
            return
        now = attrs.evolve(now, by=by).known_as(known)
        try:
            runner.fire(I.SlotChanged(now, previous))
        except IllegalTransition as err:  # an install left mid-way by a killed daemon: it resumes first
            log.warning("%s: %s", runner.machine_id, err)

    def _failure(self, runner: MachineRunner) -> StokerError:
        data: I.InstallData = runner.data
        reason = data.reason or install_failed_reason(self.backends, data.backend)
        return StokerError(reason, failure_sentence(data.backend, data.variant, data.evidence), dict(data.evidence))

    def statistics(self) -> list[dict[str, Any]]:
        """Every install machine's state, reason, the source its bundle came from (or the one
        being tried: `mirror <manifest>`, `build-cache`, ...) and, while it builds, its progress."""
        return [
            install_row(record, self._progress.get(record.id)) for record in self.store.machines(kind=I.INSTALL.name)
        ]

    # --- effects -------------------------------------------------------------------------

    def _attempt(
        self, handler: Callable[[Any, MachineRunner], Awaitable[object | None]]
    ) -> Callable[[Any, MachineRunner], Awaitable[object | None]]:
        """`handler` with the facts of the source's attempt added to its event: a source's first
        effect starts the attempt's clock, an offer is judged, an attempt's end is timed."""

        async def run(effect: Any, runner: MachineRunner) -> object | None:
            if isinstance(effect, SOURCE_STARTS):
                self._started[runner.machine_id] = trio.current_time()
            event = await handler(effect, runner)
            if isinstance(event, I.Resolved):
                event = await self._judged(runner, event)
            return self._timed(runner, event)

        return run

    def _failed(self, failure: Failure, runner: MachineRunner) -> object:
        """Every failure of a step is the machine's InstallFailed, with the step's precise cause."""
        return self._timed(
            runner, I.InstallFailed(install_failed_reason(self.backends, runner.data.backend), failure.cause)
        )

    def _timed(self, runner: MachineRunner, event: object | None) -> object | None:
        if isinstance(event, ATTEMPT_ENDS) and event.seconds is None:
            started = self._started.get(runner.machine_id)
            if started is not None:
                event = attrs.evolve(event, seconds=round(trio.current_time() - started, 3))
        return event

    async def _judged(self, runner: MachineRunner, event: I.Resolved) -> I.Resolved:
        """An offer with the facts the table judges it by: what the slot serves now, the bundle's
        digest where its zip is here to read, an engine update's rejection of it."""
        data: I.InstallData = runner.data
        local = Path(unquote(urlparse(event.url).path)) if event.url.startswith("file://") else None
        digest = None if local is None else await trio.to_thread.run_sync(bundle_digest, local)
        return attrs.evolve(
            event,
            now=await trio.to_thread.run_sync(serving, self.paths, data.backend, data.variant),
            digest=digest,
            rejection=rejection_for(self.store, data.backend, data.variant, event.sha256, digest),
            reason=self._reason(data.backend),
        )

    async def _entry(self, runner: MachineRunner) -> ManifestEntry:
        mid, data = runner.machine_id, runner.data
        if (entry := self._entries.get(mid)) is None:  # resumed after a restart: find it again in the manifest
            manifest = await load_manifest(self.manifest_source(), self.trust)
            plugin, detection = self.backends.get(data.backend), self._detections.get(mid)
            entry = self._entries[mid] = choose_entry(
                manifest, data.backend, variant=data.variant, detection=detection, plugin=plugin
            )
        return entry

    async def _resolve(self, effect: IE.Resolve, runner: MachineRunner) -> I.Resolved | I.SourceUnavailable:
        mid = runner.machine_id
        reason = install_failed_reason(self.backends, effect.backend)
        if effect.source is Source.FILE and mid not in self._entries:
            raise StokerError(
                ReasonCode.BUNDLE_MISSING,
                "A local bundle's install was interrupted by a daemon restart; install the file again.",
            )
        try:
            refusal = self._refusals.pop(mid, None)
            if refusal is not None:  # the manifest is missing, unreadable, refused, or lists none that fits
                raise refusal
            entry = await self._entry(runner)  # after a restart: the manifest read again
        except StokerError as err:
            manifest = self.manifest_source() or None
            return I.SourceUnavailable(reason, {**cause_of(err), "manifest": manifest}, cause=stored_reason(err.reason))
        origin = self.manifest_source() if effect.source is Source.MIRROR else unquote(urlparse(entry.url).path)
        return I.Resolved(
            entry.url,
            entry.sha256,
            entry.size,
            {
                "version": entry.version,
                "platform": entry.platform,
                "variant": entry.variant,
                "min_driver": entry.min_driver,
                "cuda_archs": list(entry.cuda_archs),
                **({"manifest": dict(entry.origin)} if entry.origin else {}),
            },
            origin=origin,
        )

    async def _find_cached(self, effect: IE.FindCachedBuild, runner: MachineRunner) -> object:
        plugin, detection = self.backends.get(effect.backend), self._detections.get(runner.machine_id)
        event, entry = await cache_attempt(self.paths, effect, plugin, detection, self._reason(effect.backend))
        if entry is not None:
            self._entries[runner.machine_id] = entry
        return event

    async def _check_toolchain(self, effect: IE.CheckToolchain, runner: MachineRunner) -> object:
        return await toolchain_attempt(
            effect, self._reason(effect.backend), self._builder(effect.backend, effect.variant)
        )

    def _builder(self, backend: str, variant: str) -> list[str] | None:
        """The backend plugin's own build, for a backend the builder does not build."""
        plugin = self.backends.get(backend)
        return plugin.build_argv(variant) if plugin is not None else None

    async def _build(self, effect: IE.BuildBundle, runner: MachineRunner) -> I.Resolved:
        """Build in a child process; its progress on the bus and in status (`statistics`)."""
        mid = runner.machine_id

        def progress(figures: dict[str, Any]) -> None:
            self._progress[mid] = figures
            self._bus({"topic": PROGRESS_TOPIC, "backend": effect.backend, "variant": effect.variant, **figures})

        plugin = self.backends.get(effect.backend)
        archs = plugin.build_archs(self._detections.get(mid)) if plugin is not None else ()
        builder = self._builder(effect.backend, effect.variant)
        nice = BESIDE_BUILD_NICE if mid in self._beside else 0
        event, self._entries[mid] = await build_attempt(effect, progress, archs, builder, nice)
        return event

    def archive_path(self, runner: MachineRunner, sha256: str) -> Path:
        data: I.InstallData = runner.data
        return self.downloads_dir / f"{data.backend}-{data.variant}-{sha256[:16]}.zip"

    async def _download(self, effect: IE.Download, runner: MachineRunner) -> I.Downloaded:
        dest = self.archive_path(runner, effect.sha256)
        data: I.InstallData = runner.data
        if dest.exists() and dest.stat().st_size == effect.size:
            digest = await trio.to_thread.run_sync(sha256_file, dest)
            if digest == effect.sha256:  # committed by a run killed before it said so
                return I.Downloaded(str(dest), digest, effect.size)
        reason = install_failed_reason(self.backends, data.backend)

        def progress(p: DownloadProgress) -> None:
            self._bus(
                {
                    "topic": PROGRESS_TOPIC,
                    "backend": data.backend,
                    "variant": data.variant,
                    "bytes_done": p.bytes_done,
                    "total": p.total,
                    "rate": round(p.rate, 1),
                    "eta": None if p.eta is None else round(p.eta, 2),
                }
            )

        if effect.url.startswith("file://"):
            result = await trio.to_thread.run_sync(copy_file_url, effect.url, dest, effect.sha256, effect.size, reason)
            progress(DownloadProgress(effect.size, effect.size, 0.0, 0.0))
            return I.Downloaded(str(dest), result, effect.size)
        done = await download_bundle(
            effect.url, dest, effect.sha256, effect.size, progress=progress, failure_reason=reason
        )
        return I.Downloaded(str(done.path), done.sha256, done.size)

    async def _clean_staging(self, effect: IE.CleanStaging, runner: MachineRunner) -> None:
        root = self.staging_root(runner.data.backend, runner.data.variant)
        await trio.to_thread.run_sync(lambda: shutil.rmtree(root, ignore_errors=True))
        if effect.archive:  # judged not to install once unpacked: the zip has done its job
            Path(effect.archive).unlink(missing_ok=True)

    async def _unpack(self, effect: IE.Unpack, runner: MachineRunner) -> I.Unpacked:
        data: I.InstallData = runner.data
        staging = self.staging_root(data.backend, data.variant) / "bundle"
        await trio.to_thread.run_sync(unpack_bundle, Path(effect.archive), staging)
        return I.Unpacked(str(staging))

    async def _verify_archive(self, effect: IE.VerifyArchive, runner: MachineRunner) -> I.Verified:
        archive = Path(effect.archive)
        figures = await trio.to_thread.run_sync(lambda: check_digest(archive, effect.sha256, effect.size, discard=True))
        return I.Verified(figures)

    async def _validate_bundle(self, effect: IE.ValidateBundle, runner: MachineRunner) -> I.Validated:
        data: I.InstallData = runner.data
        # A mirror's entry states the version; a cached or local build is checked against what
        # its own source resolved (the archive's sha256), and its backend and variant here.
        local = data.source not in (None, Source.MIRROR) and runner.machine_id not in self._entries
        version = None if local else (await self._entry(runner)).version
        staging = Path(effect.staging)
        report = await trio.to_thread.run_sync(validate_staged, staging, effect.backend, effect.variant, version)
        digest = await trio.to_thread.run_sync(bundle_digest, staging)
        now = await trio.to_thread.run_sync(serving, self.paths, data.backend, data.variant)
        rejection = rejection_for(self.store, data.backend, data.variant, digest)
        return I.Validated(report, now, digest, rejection, self._reason(data.backend))

    async def _smoke_test(self, effect: IE.SmokeTest, runner: MachineRunner) -> I.SmokePassed:
        meta = BundleMeta.read(Path(effect.staging))
        mid = runner.machine_id
        why_not = smoke_skip(self.smoke, self._local_smoke.get(mid), meta, self._detections.get(mid))
        if why_not:
            return I.SmokePassed({"smoke": f"skipped: {why_not}"})
        return I.SmokePassed(await trio.to_thread.run_sync(smoke_staged, Path(effect.staging), meta))

    async def _promote_staged(self, effect: IE.Promote, runner: MachineRunner) -> I.Promoted:
        await trio.to_thread.run_sync(self._promote, runner, effect)
        now, previous = await trio.to_thread.run_sync(slot_pair, self.paths, f"{effect.backend}-{effect.variant}")
        if now is None:
            raise StokerError(ReasonCode.BUNDLE_MISSING, "The slot holds no bundle after the promote.")
        return I.Promoted(now, previous)

    def _promote(self, runner: MachineRunner, effect: IE.Promote) -> None:
        # The one promote (bundles.installed), as `install_bundle` uses it: idempotent on resume.
        staging = Path(effect.staging)
        promote(staging, self.paths.bundles_dir, slot=f"{effect.backend}-{effect.variant}")
        shutil.rmtree(staging.parent, ignore_errors=True)
        data: I.InstallData = runner.data
        if data.archive:
            Path(data.archive).unlink(missing_ok=True)  # installed: the zip has done its job
