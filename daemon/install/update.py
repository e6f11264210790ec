"""The engine update service: one update machine per bundle slot (states/engine_update/table.py), its
effects carried out here, and the opt-in automatic check.

    resolve  what the slot holds (bundle.json's digest) and the candidate: a zip the user named,
             or the channel's manifest entry for the slot, read and trusted as installs read it
             (daemon/install/manifest.py with the install service's trust policy)
    stage    download (resumable, into the downloads dir) into `bundles/.update-<slot>/`,
             unpack safely, verify (digests, metadata, --version, --list-devices) and run the
             bundle's own smoke gate: the same steps and functions as an install
    compare  the slot's (old) engine on the staged bundle's smoke model, here
    switch   `promote`, the one way into a slot: the old bundle becomes `<slot>.previous`
    restart  the servers that ran on the old engine (daemon/fleet/engine_servers.py judges each)
    rollback `.previous` back into the slot through `bundles/.rollback-<slot>/` and `promote`:
             at every instant the slot or its `.previous` holds a launchable bundle
             (find_installed serves `.previous` while the slot is missing)

The table decides what every outcome means; this module reports facts (the blocking steps are
daemon/install/update_steps.py). The install machine is
not used for the update because it promotes at its end and the token gate must come first;
what it would do before its promote is done here with the same functions.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol
from urllib.parse import unquote, urlparse

import attrs
import trio

from stoker.daemon.bundles.installed import PREVIOUS, bundle_meta_of, find_installed, promote
from stoker.daemon.config.engine import EngineConfig
from stoker.daemon.core.download_records import DownloadError
from stoker.daemon.core.errors import StokerError, cause_of
from stoker.daemon.core.machines import EffectDriver, MachineRunner, MachineRunners, Publish
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.install.manifest import choose_entry, download_bundle, load_manifest
from stoker.daemon.install.installer import InstallService
from stoker.daemon.install.update_steps import (
    bundle_digest,
    bundle_facts,
    check_archive,
    installed_facts,
    installed_slots,
    old_tokens,
    put_back,
    stage_and_verify,
)
from stoker.states.engine_update import table as U
from stoker.states.engine_update import records as UR
from stoker.states.convert import structure
from stoker.states.install.slot import SlotBundle, SlotWriter
from stoker.states.reasons import ReasonCode, message_for
from stoker.store.database import Store

log = logging.getLogger(__name__)


class EngineServers(Protocol):
    """The servers of the fleet as an update sees them (daemon/fleet/engine_servers.py)."""

    def on_slot(self, backend: str, variant: str) -> tuple[UR.ServerBaseline, ...]:
        """The servers running on this slot's engine, each with its last good launch's layers."""

    async def restart_and_judge(self, name: str, timeout: float) -> UR.ServerVerdict:
        """Restart one server and report what its new launch did (ready, exited, timeout)."""

    def relaunch(self, name: str) -> None:
        """Restart one server on what its slot holds now; nothing is waited for."""


@attrs.define(eq=False)
class EngineUpdateService:
    """Update machines keyed by slot; `update()` and `rollback()` drive one to rest."""

    paths: StokerPaths
    store: Store
    installs: InstallService
    publish: Publish | None = None
    settings: Callable[[], EngineConfig] = EngineConfig
    ready_timeout: Callable[[], float] = lambda: 600.0
    servers: EngineServers | None = None  # the fleet's, set once it exists
    _machines: MachineRunners = attrs.field(init=False)
    _checks: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)  # slot -> the last automatic check
    _effects: EffectDriver[Awaitable[object | None]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._machines = MachineRunners(U.ENGINE_UPDATE, self.store, self.publish)
        self._effects = EffectDriver(
            U.ENGINE_UPDATE,
            {
                UR.Resolve: self._resolve,
                UR.CleanStaging: self._clean_staging,
                UR.Stage: self._stage,
                UR.CompareTokens: self._compare_tokens,
                UR.Switch: self._switch,
                UR.RestartServers: self._restart_servers,
                UR.RollBack: self._roll_back,
                UR.Relaunch: self._relaunch,
            },
            failed=lambda failure, runner: U.step_failed(failure.effect, dict(failure.cause)),
        )

    def runner(self, backend: str, variant: str) -> MachineRunner:
        return self._machines.runner(U.ENGINE_UPDATE.machine_id(backend, variant))

    def staging_root(self, slot: str) -> Path:
        return self.paths.bundles_dir / f".update-{slot}"

    # --- entry points ----------------------------------------------------------------------

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Resume every update a killed daemon left mid-way, then run the automatic check."""
        task_status.started()
        await self.resume_all()
        while True:
            settings = self.settings()
            await trio.sleep(settings.check_interval_s)
            if self.settings().auto_update:
                await self.check_all()

    async def resume_all(self) -> list[str]:
        """Drive every machine a previous daemon left mid-way to rest."""
        resumed = []
        for record in self.store.machines(kind=U.ENGINE_UPDATE.name):
            if UR.UpdateState(record.state) not in U.WORKING:
                continue
            data = structure(record.data, UR.UpdateData)
            runner = self.runner(data.backend, data.variant)
            async with self._machines.lock(runner.machine_id):
                if runner.state in U.WORKING:
                    log.info("resuming %s from %s", runner.machine_id, runner.state)
                    with self.installs.slots.claim(runner.data.slot, runner.machine_id):
                        await self._effects.drive(runner, runner.fire(UR.Resumed()).effects, runner)
            resumed.append(runner.machine_id)
        return resumed

    async def check_all(self) -> None:
        """The automatic check: each installed slot against its channel's manifest."""
        settings = self.settings()
        if not settings.manifest_for(None, self.installs.manifest_source()):
            log.info("engine auto-update: no manifest for channel %r; nothing checked", settings.channel)
            return
        slots = await trio.to_thread.run_sync(installed_slots, self.paths)
        for backend, variant in sorted(slots):
            try:
                await self.check(backend, variant)
            except Exception:  # a broken check must not end the daemon's checks
                log.exception("engine auto-update of %s-%s failed", backend, variant)

    async def check(self, backend: str, variant: str) -> dict[str, Any]:
        """One slot's automatic check. It starts an update only when the table says the channel
        offers one (states/engine_update/table.py `automatic_check`); a check that starts nothing (nothing
        newer, a candidate rejected here before, a manifest that cannot be read, the slot busy)
        writes no history: `status` shows it as the slot's `last_check`, and the log says a
        result once, when it changes."""
        slot, at = f"{backend}-{variant}", time.time()
        runner = self.runner(backend, variant)
        try:
            installed, candidate = await self._offer(backend, variant, None, None)
            why_not = U.automatic_check(runner.data, installed, candidate)
            if why_not is not None:
                return self._checked(slot, at, "current", why_not, None, installed, candidate)
            done = await self.update(backend, variant, automatic=True)
            return self._checked(slot, at, str(done["state"]), None, None, installed, candidate)
        except StokerError as err:
            return self._checked(slot, at, "failed", err.message, str(err.reason))

    def _checked(
        self,
        slot: str,
        at: float,
        result: str,
        message: str | None,
        reason: str | None,
        installed: UR.BundleFacts | None = None,
        candidate: UR.Candidate | None = None,
    ) -> dict[str, Any]:
        last = {
            "at": at,
            "result": result,
            "reason": reason,
            "message": message,
            "installed": None if installed is None else installed.version,
            "offered": None if candidate is None else candidate.version,
        }
        before = self._checks.get(slot) or {}
        if (before.get("result"), before.get("reason"), before.get("offered")) != (result, reason, last["offered"]):
            level = logging.WARNING if result == "failed" else logging.INFO
            log.log(level, "engine auto-update of %s: %s %s", slot, reason or result, message or "")
        self._checks[slot] = last
        return last

    async def update(
        self,
        backend: str,
        variant: str,
        *,
        channel: str | None = None,
        bundle: Path | None = None,
        automatic: bool = False,
    ) -> dict[str, Any]:
        """Drive the slot's update to rest; the outcome, or StokerError when it was refused,
        rolled back or could not roll back."""
        runner = self.runner(backend, variant)
        async with self._machines.lock(runner.machine_id):
            with self.installs.slots.claim(f"{backend}-{variant}", runner.machine_id):
                if runner.state in U.WORKING:  # left mid-way by a killed daemon, not resumed yet
                    await self._effects.drive(runner, runner.fire(UR.Resumed()).effects, runner)
                request = UR.UpdateRequested(
                    backend, variant, channel, None if bundle is None else str(bundle), automatic
                )
                await self._effects.drive(runner, runner.fire(request).effects, runner)
            return self._outcome(runner)

    async def rollback(self, backend: str, variant: str) -> dict[str, Any]:
        """Put the slot's `.previous` engine back by hand and restart what runs on the slot."""
        runner = self.runner(backend, variant)
        slot = f"{backend}-{variant}"
        async with self._machines.lock(runner.machine_id):
            with self.installs.slots.claim(slot, runner.machine_id):
                await self._roll_back_claimed(runner, backend, variant)
            return self._outcome(runner)

    async def _roll_back_claimed(self, runner: MachineRunner, backend: str, variant: str) -> None:
        slot = f"{backend}-{variant}"
        if runner.state in U.WORKING:
            await self._effects.drive(runner, runner.fire(UR.Resumed()).effects, runner)
        current = await trio.to_thread.run_sync(bundle_facts, self.paths.bundles_dir / slot)
        previous = await trio.to_thread.run_sync(bundle_facts, self.paths.bundles_dir / (slot + PREVIOUS))
        names = tuple(s.name for s in self.servers.on_slot(backend, variant)) if self.servers else ()
        step = runner.fire(UR.RollbackRequested(backend, variant, current, previous, names))
        if step.reason is not None:  # refused where it stands (nothing kept)
            raise StokerError(step.reason, step.evidence.get("message") or message_for(step.reason), step.evidence)
        await self._effects.drive(runner, step.effects, runner)

    def _outcome(self, runner: MachineRunner) -> dict[str, Any]:
        data: UR.UpdateData = runner.data
        state = UR.UpdateState(runner.state)
        outcome = {
            "slot": data.slot,
            "state": state.value,
            "installed": None if data.installed is None else data.installed.version,
            "candidate": None if data.candidate is None else data.candidate.version,
            "gate": None if data.gate is None else data.gate.value,
            "verdicts": [attrs.asdict(v) for v in data.verdicts],
            "by_hand": data.by_hand,
            "engine": self.slot_status(data.backend, data.variant),
            "history": self.steps(runner.machine_id),
        }
        if state in (UR.UpdateState.REJECTED, UR.UpdateState.FAILED) or (
            state is UR.UpdateState.ROLLED_BACK and not data.by_hand
        ):
            reason = data.reason or ReasonCode.ENGINE_UPDATE_REJECTED
            gate = data.evidence.get("gate")
            detail = data.evidence.get("message")
            text = f"{message_for(reason)}" + (f" Gate: {gate}." if gate else "") + (f" {detail}" if detail else "")
            raise StokerError(reason, text, {**data.evidence, "outcome": outcome})
        if state is UR.UpdateState.CURRENT:
            last = self.store.history(machine=runner.machine_id, limit=1)
            outcome["message"] = last[0].evidence.get("message") if last else None
            outcome["reason"] = last[0].reason if last else None  # engine_update_rolled_back: held back
        return outcome

    def steps(self, machine_id: str, limit: int = 12) -> list[dict[str, Any]]:
        """The machine's last transitions, oldest first: what `stoker engine update` prints."""
        rows = self.store.history(machine=machine_id, limit=limit)
        return [
            {"from": r.from_state, "event": r.event, "to": r.to_state, "reason": r.reason, "at": r.at}
            for r in reversed(rows)
        ]

    def slot_status(self, backend: str, variant: str) -> dict[str, Any]:
        """The slot's engine version, whether a previous one is kept, and its last update."""
        slot = f"{backend}-{variant}"
        current = bundle_facts(self.paths.bundles_dir / slot)
        previous = bundle_facts(self.paths.bundles_dir / (slot + PREVIOUS))
        record = self.store.machine(U.ENGINE_UPDATE.machine_id(backend, variant))
        return {
            "slot": slot,
            "version": None if current is None else current.version,
            "previous": None if previous is None else previous.version,
            "update_state": None if record is None else record.state,
            "update_reason": None if record is None else record.reason,
            "last_check": self._checks.get(slot),
        }

    # --- the machine's effects ---------------------------------------------------------------

    async def _resolve(self, effect: UR.Resolve, runner: MachineRunner) -> UR.Resolved | UR.GateFailed:
        try:
            installed, candidate = await self._offer(effect.backend, effect.variant, effect.channel, effect.bundle)
        except StokerError as err:
            return UR.GateFailed(UR.Gate.FETCH, {"channel": effect.channel, "bundle": effect.bundle, **cause_of(err)})
        return UR.Resolved(installed, candidate)

    async def _offer(
        self, backend: str, variant: str, channel: str | None, bundle: str | None
    ) -> tuple[UR.BundleFacts | None, UR.Candidate]:
        """What the slot holds and what is offered (the named zip, or the channel's manifest
        entry for the slot); StokerError when nothing can be offered."""
        slot = f"{backend}-{variant}"
        installed = await trio.to_thread.run_sync(installed_facts, self.paths, backend, variant)
        if bundle is not None:
            path = Path(bundle)
            meta = await trio.to_thread.run_sync(bundle_meta_of, path)
            if meta.slot != slot:
                raise StokerError(
                    ReasonCode.BUNDLE_METADATA_MISMATCH,
                    f"The bundle is for {meta.slot}, not {slot}.",
                    {"bundle": meta.slot, "slot": slot},
                )
            digest = await trio.to_thread.run_sync(bundle_digest, path)
            return installed, UR.Candidate(meta.version, digest or "", path.absolute().as_uri())
        source = self.settings().manifest_for(channel, self.installs.manifest_source())
        if source is None:
            raise StokerError(
                ReasonCode.BUNDLE_MISSING,
                f"The channel {channel!r} is not configured; add it to [engine.channels].",
                {"channel": channel, "channels": sorted(self.settings().channels)},
            )
        manifest = await load_manifest(source, self.installs.trust, channel or self.settings().channel)
        kept = await trio.to_thread.run_sync(find_installed, self.paths, backend, variant)
        entry = choose_entry(manifest, backend, variant=variant, keep_archs=kept.meta.cuda_archs if kept else None)
        return installed, UR.Candidate(entry.version, entry.sha256, entry.url, entry.sha256, entry.size, entry.origin)

    async def _clean_staging(self, effect: UR.CleanStaging, runner: MachineRunner) -> None:
        root = self.staging_root(runner.data.slot)
        await trio.to_thread.run_sync(lambda: shutil.rmtree(root, ignore_errors=True))

    def _archive(self, slot: str, candidate: UR.Candidate) -> Path:
        return self.installs.downloads_dir / f"update-{slot}-{(candidate.sha256 or candidate.ref)[:16]}.zip"

    async def _stage(self, effect: UR.Stage, runner: MachineRunner) -> UR.Staged | UR.GateFailed:
        slot = f"{effect.backend}-{effect.variant}"
        candidate = effect.candidate
        if candidate.url.startswith("file://") and candidate.sha256 is None:
            archive = Path(unquote(urlparse(candidate.url).path))  # the zip the user named
        else:
            try:
                if candidate.sha256 is None:
                    raise StokerError(ReasonCode.BUNDLE_METADATA_MISMATCH, "The candidate has no sha256.")
                archive = self._archive(slot, candidate)
                if candidate.url.startswith("file://"):  # a local mirror: its zip is read where it is
                    archive = Path(unquote(urlparse(candidate.url).path))
                    await trio.to_thread.run_sync(check_archive, archive, candidate.sha256, candidate.size)
                else:
                    archive = (await download_bundle(candidate.url, archive, candidate.sha256, candidate.size)).path
            except (StokerError, DownloadError) as err:
                return UR.GateFailed(UR.Gate.FETCH, {"url": candidate.url, **cause_of(err)})
        staging = self.staging_root(slot) / "bundle"
        return await trio.to_thread.run_sync(stage_and_verify, archive, staging, effect, candidate)

    async def _compare_tokens(
        self, effect: UR.CompareTokens, runner: MachineRunner
    ) -> UR.TokensCompared | UR.GateFailed:
        data: UR.UpdateData = runner.data
        return await trio.to_thread.run_sync(old_tokens, self.paths, data.backend, data.variant, Path(effect.staging))

    async def _switch(self, effect: UR.Switch, runner: MachineRunner) -> UR.Switched | UR.GateFailed:
        data: UR.UpdateData = runner.data
        bundles = self.paths.bundles_dir
        try:
            await trio.to_thread.run_sync(lambda: promote(Path(effect.staging), bundles, slot=effect.slot))
        except (StokerError, OSError) as err:
            return UR.GateFailed(UR.Gate.SWITCH, cause_of(err))
        now = await trio.to_thread.run_sync(bundle_digest, bundles / effect.slot)
        if now != effect.digest:
            return UR.GateFailed(UR.Gate.SWITCH, {"message": "the slot does not hold the staged bundle", "digest": now})
        if data.candidate is not None and data.candidate.sha256 is not None:
            self._archive(effect.slot, data.candidate).unlink(missing_ok=True)  # switched: the zip has done its job
        self.installs.slot_changed(data.backend, data.variant, SlotWriter.ENGINE_UPDATE, self._known(data, now))
        servers = self.servers.on_slot(data.backend, data.variant) if self.servers else ()
        previous = data.installed.version if data.installed else None
        return UR.Switched(servers, {"slot": effect.slot, "previous_kept": previous})

    async def _restart_servers(self, effect: UR.RestartServers, runner: MachineRunner) -> UR.ServersRestarted:
        data: UR.UpdateData = runner.data
        verdicts: dict[str, UR.ServerVerdict] = {}
        servers = self.servers
        if servers is None:
            return UR.ServersRestarted(())
        timeout = self.ready_timeout()

        async def one(name: str, cancel: trio.CancelScope) -> None:
            verdict = await servers.restart_and_judge(name, timeout)
            verdicts[name] = verdict
            if U.judge_servers(data, (verdict,)) is not None:
                cancel.cancel()  # the table rolls back on this one: the others need not be waited for

        async with trio.open_nursery() as nursery:
            for name in effect.names:
                nursery.start_soon(one, name, nursery.cancel_scope)
        return UR.ServersRestarted(
            tuple(verdicts.get(n) or UR.ServerVerdict(n, UR.Outcome.SKIPPED) for n in effect.names)
        )

    async def _roll_back(self, effect: UR.RollBack, runner: MachineRunner) -> UR.RolledBack | UR.RollbackFailed:
        done = await trio.to_thread.run_sync(put_back, self.paths.bundles_dir, effect)
        if isinstance(done, UR.RolledBack):  # the install machine's record follows the slot first
            data: UR.UpdateData = runner.data
            self.installs.slot_changed(data.backend, data.variant, SlotWriter.ENGINE_ROLLBACK)
        return done

    @staticmethod
    def _known(data: UR.UpdateData, digest: str | None) -> SlotBundle | None:
        """What the update knows of the bundle it switched in: its zip, where it came from."""
        candidate, staged = data.candidate, data.staged
        if candidate is None or staged is None or digest is None:
            return None
        source, origin = ("file", data.bundle) if data.bundle else ("mirror", candidate.url)
        return SlotBundle(digest, staged.version, candidate.sha256, source, origin)

    async def _relaunch(self, effect: UR.Relaunch, runner: MachineRunner) -> None:
        if self.servers is not None:
            for name in effect.names:
                self.servers.relaunch(name)
