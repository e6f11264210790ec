"""KV slot snapshots: save the server's non-empty slots before it goes away, restore them when a
compatible server is ready (or leave them to a re-prefill where that is measured to be faster),
on demand in between; retention; cleanup after a kill.

A save goes to a temporary name inside the slot-save dir, is checked (size against the
engine's own count), renamed into place and catalogued with its stat facts and a digest of its
head and tail; its fsync and full sha256 follow in the background, so a stop waits for the
engine's write and nothing else. A restore checks the catalogue (identity, slot id) and the
file's size, inode, mtime and sampled digest (files.py) before the engine sees it; if the
engine still refuses it, the slot is erased and the server keeps serving. Whatever is given up
is said (drops.py). docs/snapshots.md has the whole story.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from pathlib import Path
from typing import Any, Callable

import attrs
import trio

from stoker.daemon.config.model import Config
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.engine.api import EngineClient, error_message
from stoker.daemon.snapshots.drops import DropLog
from stoker.daemon.snapshots.files import FileFacts, check_file, free_bytes, resident_fraction, sample_digest
from stoker.daemon.snapshots.figures import (
    LogCursor,
    fold_prefills,
    fold_restore_wall,
    max_bytes_for,
    save_figure,
    stop_budget_for,
    fold_sample,
    prefill_samples,
    restore_decision,
    save_decision,
    restore_name,
    save_name,
    throughput_mb_s,
)
from stoker.daemon.snapshots.layout import check_identity, check_instance, cross_backend_note
from stoker.daemon.snapshots.listing import listing_of
from stoker.daemon.snapshots.live import LiveServer, ServedPlan, inspect_server
from stoker.daemon.snapshots.upkeep import PARTIAL_PREFIX, SnapshotUpkeep
from stoker.states.snapshots import policy
from stoker.states.reasons import ReasonCode
from stoker.store.snapshots import SnapshotCatalog, SnapshotRecord, same_model

log = logging.getLogger(__name__)

SLOT_TIMEOUT = 30.0  # a restore, or the least a save may take (a busy slot makes the engine wait)
DISK_FULL_BYTES = 1 << 20  # a failed save with less free space than this is a full disk


@attrs.define(eq=False)
class SnapshotService:
    """Saves, restores, lists and removes KV slot snapshots for each instance's server (keyed by model identity)."""

    paths: StokerPaths
    catalog: SnapshotCatalog
    get_config: Callable[[], Config]
    publish: Callable[[dict[str, Any]], Any] | None = None  # the event bus: topics snapshot.*
    # Each instance's ready server, by its log (one per instance): several models run at once.
    _live: dict[Path, LiveServer] = attrs.field(factory=dict)
    last_report: dict[str, Any] | None = None
    drops: DropLog = attrs.field(init=False)
    upkeep: SnapshotUpkeep = attrs.field(init=False)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)
    _cursors: dict[Path, LogCursor | None] = attrs.field(factory=dict)  # where each server log's harvest stopped

    def __attrs_post_init__(self) -> None:
        self.drops = DropLog(self.publish, self.catalog.store)
        self.upkeep = SnapshotUpkeep(self.paths.snapshots_dir, self.catalog, self.drops, self.publish)

    @property
    def dir(self) -> Path:
        return self.paths.snapshots_dir

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The background work after saves (fsync, full digest), started in the root nursery."""
        await self.upkeep.run(task_status=task_status)

    # --- hooks the supervisor runs ------------------------------------------------------

    async def on_ready(self, supervisor: ServedPlan, evidence: dict[str, Any]) -> dict[str, Any] | None:
        """ready_hook: inspect the server, then per slot restore the newest compatible snapshot,
        or leave it to the next request's prefill where that is measured to be faster."""
        config = self.get_config().snapshots
        if not config.enabled:
            self.last_report = {"enabled": False}
            return {"snapshots": self.last_report}
        self.upkeep.cleanup_files()
        self.upkeep.cleanup_rows()
        live = await self.inspect(supervisor)
        report: dict[str, Any] = {
            "enabled": True,
            **live.swa,
            "budgets": self.budgets(live),
            "restored": [],
            "refused": [],
            "restore_decisions": [],
        }
        if evidence.get("adopted"):
            report["skipped"] = "adopted server: its slots are still in memory"
        elif not live.swa["benefit"]:
            report["skipped"] = str(ReasonCode.SNAPSHOT_NO_BENEFIT)
        else:
            for slot in range(live.n_slots):
                # This instance's own, never another's (even one serving the same file): same_model too.
                mine = self.catalog.list(slot_id=slot, instance=live.instance)
                candidates = [c for c in mine if same_model(c.identity(), live.identity)]
                if not candidates:
                    continue
                # The newest that fits this server; if none fits, the newest says why.
                rec = next((c for c in candidates if self._fits(c, live)), candidates[0])
                if self._fits(rec, live):
                    decision = await self.decide(live, rec, slot)
                    report["restore_decisions"].append(decision)
                    if decision["choice"] == "reprefill":
                        log.info("slot %d: %s", slot, decision["why"])
                        continue
                try:
                    report["restored"].append(await self._restore(live, rec, slot))
                except StokerError as err:
                    log.warning("snapshot %d not restored: %s %s", rec.id, err.reason, err.evidence)
                    report["refused"].append(
                        {"id": rec.id, "slot": slot, "reason": str(err.reason), "evidence": err.evidence}
                    )
        self.last_report = report
        return {"snapshots": report}

    async def before_stop(self, supervisor: ServedPlan, cause: str) -> None:
        """before_stop: save every non-empty slot while the server still serves, within a budget
        that scales with the KV to save; a save cut by it is reported, never silent."""
        config = self.get_config().snapshots
        if not config.enabled:
            return
        started = trio.current_time()
        # Listing the slots is bounded by the budget too where it is a number (a hung engine).
        budget = SLOT_TIMEOUT if config.stop_budget_s == "auto" else config.stop_budget_s
        phase, todo, live = "listing", [], self._live.get(supervisor.log_path)
        try:
            with trio.move_on_after(budget) as listing:
                # Inspected at ready, or now if snapshots were turned on since (no relaunch).
                live = await self.inspect(supervisor)
                if live.swa["benefit"]:
                    todo = await self._slots_to_save(live, None)
            if listing.cancelled_caught:
                self._save_timeout(live, todo, budget, trio.current_time() - started, cause, phase)
                return
            if live is None or not live.swa["benefit"] or not todo:
                return
            todo = await self._worth_saving(live, supervisor, todo, cause)
            if not todo:
                return
            phase, budget = "saving", self.stop_budget(live, todo)
            with trio.move_on_after(budget - (trio.current_time() - started)) as saving:
                saved = await self.save(supervisor, cause, timeout=budget, todo=todo)
            if saving.cancelled_caught:
                self._save_timeout(live, todo, budget, trio.current_time() - started, cause, phase)
                return
        except StokerError as err:  # the server stops anyway; the previous snapshots stay
            log.warning("no snapshot before %s: %s %s", cause, err.reason, err.evidence)
            if err.reason == ReasonCode.SNAPSHOT_SAVE_FAILED:  # refusals were recorded by save()
                self.drops.record(err.reason, cause=cause, **err.evidence)
            return
        except trio.Cancelled:  # the daemon's own stop bound ran out first: say so, then go
            self._save_timeout(live, todo, budget, trio.current_time() - started, cause, phase)
            raise
        log.info("saved %d slot snapshot(s) before %s", len(saved), cause)

    async def _worth_saving(
        self, live: LiveServer, supervisor: ServedPlan, todo: list[tuple[int, int]], cause: str
    ) -> list[tuple[int, int]]:
        """The slots worth saving before this stop: a slot whose re-prefill is measured to beat its
        save and restore is left to its next request, and the stop says so (never silent)."""
        await self._harvest_prefills(live, supervisor.log_path)
        kept = []
        for slot, n_tokens in todo:
            decision = save_decision(self.catalog, live, n_tokens)
            if decision["choice"] == "skip":
                self.drops.record(ReasonCode.SNAPSHOT_SAVE_SKIPPED, quiet=True, slot=slot, cause=cause, **decision)
            else:
                kept.append((slot, n_tokens))
        return kept

    def _save_timeout(
        self,
        live: LiveServer | None,
        todo: list[tuple[int, int]],
        budget: float,
        elapsed: float,
        cause: str,
        phase: str,
    ) -> None:
        n_tokens = sum(n for _, n in todo)
        fig = None if live is None else save_figure(self.catalog, live.backend)
        self.drops.record(
            ReasonCode.SNAPSHOT_SAVE_TIMEOUT,
            cause=cause,
            phase=phase,  # "listing": the engine did not list its slots in time; "saving": not all were saved
            slots=[sid for sid, _ in todo],
            n_tokens=n_tokens,
            expected_bytes=None if live is None else policy.snapshot_bytes(n_tokens, live.kv_bytes_per_token),
            budget_s=round(budget, 3),
            elapsed_s=round(elapsed, 3),
            save_mb_s=None if fig is None else fig.to_dict(),
            stop_budget_setting=self.get_config().snapshots.stop_budget_s,
        )

    # --- the live server and its budgets ------------------------------------------------

    async def inspect(self, supervisor: ServedPlan) -> LiveServer:
        """The ready server's identity (cached per server: it cannot change while it runs)."""
        key = (supervisor.pid, supervisor.endpoint()[0])
        live = self._live.get(supervisor.log_path)
        if live is not None and live.key == key:
            return live
        live = self._live[supervisor.log_path] = await inspect_server(supervisor, self.catalog, self.get_config())
        self._cursors[supervisor.log_path] = None
        return live

    def _fits(self, rec: SnapshotRecord, live: LiveServer) -> bool:
        try:
            check_identity(rec.identity(), live.identity, snapshot_id=rec.id)
        except StokerError:
            return False
        return True

    def max_bytes(self, live: LiveServer | None) -> int:
        """Retention's byte budget: the setting, or "auto" scaled with the live server's KV."""
        return max_bytes_for(self.get_config().snapshots.max_bytes, live)

    def stop_budget(self, live: LiveServer, todo: list[tuple[int, int]]) -> float:
        """Seconds the saves before a stop may take: the setting, or "auto" for this KV."""
        return stop_budget_for(self.get_config().snapshots.stop_budget_s, self.catalog, live, sum(n for _, n in todo))

    def stop_budget_bound(self) -> float:
        """The most a stop's saves may take on any live server (every slot full): the daemon's
        own stop waits at least this long (its servers stop at once, each saving its own)."""
        return max((self._full_budget(live) for live in self._live.values()), default=self._full_budget(None))

    def _full_budget(self, live: LiveServer | None) -> float:
        if live is None or not self.get_config().snapshots.enabled:
            return policy.DEFAULT_STOP_BUDGET_S
        return self.stop_budget(live, [(slot, live.n_ctx_seq) for slot in range(live.n_slots)])

    def budgets(self, live: LiveServer) -> dict[str, Any]:
        config = self.get_config().snapshots
        return {
            "kv_bytes_per_token": live.kv_bytes_per_token,
            "max_bytes": self.max_bytes(live),
            "max_bytes_setting": config.max_bytes,
            "max_count": config.max_count,
            "stop_budget_s_full": round(self._full_budget(live), 1),
            "stop_budget_setting": config.stop_budget_s,
        }

    def status(self, ready_evidence: dict[str, Any] | None) -> dict[str, Any] | None:
        """The `snapshots` part of status: the ready server's report (restores, decisions,
        budgets) and the latest drops."""
        report = dict((ready_evidence or {}).get("snapshots") or {})
        dropped = self.drops.latest()
        if dropped:
            report["dropped"] = dropped
        return report or None

    # --- figures ------------------------------------------------------------------------

    async def _harvest_prefills(self, live: LiveServer, log_path: Path) -> None:
        samples, self._cursors[log_path] = await trio.to_thread.run_sync(
            prefill_samples, log_path, self._cursors.get(log_path)
        )
        fold_prefills(self.catalog, live.backend, live.identity["model_id"], samples)

    async def decide(self, live: LiveServer, rec: SnapshotRecord, slot: int) -> dict[str, Any]:
        """Restore or re-prefill, from the figures measured here (states.snapshots.policy)."""
        resident = await trio.to_thread.run_sync(resident_fraction, self.dir / rec.filename)
        return {"slot": slot, "snapshot_id": rec.id, **restore_decision(self.catalog, live, rec, resident)}

    # --- save ---------------------------------------------------------------------------

    async def _slots_to_save(self, live: LiveServer, slot: int | None) -> list[tuple[int, int]]:
        async with EngineClient.open(live.base_url, live.api_key, timeout=None) as engine:
            resp = None
            with trio.move_on_after(SLOT_TIMEOUT):
                resp = await engine.slots()
        if resp is None or resp.status_code != 200:
            raise StokerError(
                ReasonCode.SNAPSHOT_SAVE_FAILED,
                "The server did not list its slots.",
                {"status": None if resp is None else resp.status_code},
            )
        return [
            (s["id"], s.get("n_prompt_tokens") or 0)
            for s in resp.json()
            if (slot is None or s["id"] == slot) and (s.get("n_prompt_tokens") or 0) > 0
        ]

    async def save(
        self,
        supervisor: ServedPlan,
        cause: str,
        *,
        slot: int | None = None,
        timeout: float | None = None,
        todo: list[tuple[int, int]] | None = None,
    ) -> list[SnapshotRecord]:
        """Save the non-empty slots (or one slot); newest catalogued records. A save that could
        not be kept (bigger than the retention budget, or the free disk) is not attempted."""
        live = await self.inspect(supervisor)
        if slot is not None:
            self._check_slot(live, slot)
        async with self._lock:
            self.upkeep.cleanup_files()
            if todo is None:
                todo = await self._slots_to_save(live, slot)
            await self._harvest_prefills(live, supervisor.log_path)
            max_bytes = self.max_bytes(live)
            saved, errors = [], []
            async with EngineClient.open(live.base_url, live.api_key, timeout=None) as engine:
                for sid, n_tokens in todo:
                    expected = policy.snapshot_bytes(n_tokens, live.kv_bytes_per_token)
                    verdict = policy.save_verdict(
                        expected_bytes=expected, max_bytes=max_bytes, free_bytes=free_bytes(self.dir)
                    )
                    if verdict.why is not None:  # not paid for: it could not be kept
                        figures = {"slot": sid, "n_tokens": n_tokens, **verdict.figures}
                        self.drops.record(ReasonCode.SNAPSHOT_DROPPED, why=verdict.why, **figures)
                        full = verdict.why == "no_space"
                        reason = ReasonCode.SNAPSHOT_DISK_FULL if full else ReasonCode.SNAPSHOT_DROPPED
                        errors.append(StokerError(reason, evidence={"why": verdict.why, **figures}))
                        continue
                    slot_timeout = timeout or max(SLOT_TIMEOUT, self.stop_budget(live, [(sid, n_tokens)]))
                    try:
                        saved.append(await self._save_slot(engine, live, sid, cause, slot_timeout))
                    except StokerError as err:  # one slot's failure does not cost the others
                        log.warning("slot %d not saved: %s %s", sid, err.reason, err.evidence)
                        errors.append(err)
            self.upkeep.apply_retention(self.get_config().snapshots.max_count, self.max_bytes(live))
        if saved:
            self._event("snapshot.saved", ids=[r.id for r in saved], cause=cause)
        if errors and not saved:
            raise errors[0]
        return saved

    async def _save_slot(
        self, engine: EngineClient, live: LiveServer, slot: int, cause: str, timeout: float
    ) -> SnapshotRecord:
        tmp = f"{PARTIAL_PREFIX}{secrets.token_hex(8)}.bin"
        path = self.dir / tmp
        self.upkeep.inflight.add(tmp)
        try:
            resp = None
            with trio.move_on_after(timeout):
                resp = await engine.save_slot(slot, tmp)
            if resp is None:
                raise StokerError(
                    ReasonCode.SNAPSHOT_SAVE_FAILED,
                    f"Saving slot {slot} took longer than {timeout:g} s.",
                    {"slot": slot, "timeout_s": timeout},
                )
            if resp.status_code != 200:
                raise self._save_error(slot, {"status": resp.status_code, "engine": error_message(resp)})
            body = resp.json()
            size = path.stat().st_size
            if size != body.get("n_written"):
                raise self._save_error(slot, {"n_written": body.get("n_written"), "file_size": size})
            created = time.time()
            final = self.dir / f"slot{slot}-{int(created * 1000)}-{secrets.token_hex(4)}.bin"
            os.replace(path, final)
            facts = FileFacts.of(final)
            sample = await trio.to_thread.run_sync(sample_digest, final, size)
            save_ms = (body.get("timings") or {}).get("save_ms")
            rec = self.catalog.add(
                {
                    "filename": final.name,
                    "slot_id": slot,
                    "model_path": live.model_path,
                    "backend": live.backend,
                    "variant": live.variant,
                    **live.identity,
                    "n_tokens": body.get("n_saved", 0),
                    "file_size": size,
                    "file_sha256": None,
                    "file_mtime_ns": facts.mtime_ns,
                    "file_inode": facts.inode,
                    "file_sample_sha256": sample,
                    "boot_id": self.upkeep.boot,
                    "cause": cause,
                    "save_ms": save_ms,
                    "created_at": created,
                }
            )
        except OSError as exc:
            raise self._save_error(slot, {"error": str(exc)}) from exc
        finally:
            self.upkeep.inflight.discard(tmp)
            path.unlink(missing_ok=True)
        fold_sample(self.catalog, save_name(live.backend), throughput_mb_s(size, save_ms))
        await self.upkeep.after_save(rec)
        return rec

    def _save_error(self, slot: int, evidence: dict[str, Any]) -> StokerError:
        free = free_bytes(self.dir)
        full = free is not None and free < DISK_FULL_BYTES
        reason = ReasonCode.SNAPSHOT_DISK_FULL if full else ReasonCode.SNAPSHOT_SAVE_FAILED
        return StokerError(reason, evidence={"slot": slot, "free_bytes": free, "dir": str(self.dir), **evidence})

    # --- restore ------------------------------------------------------------------------

    async def restore(
        self, supervisor: ServedPlan, snapshot_id: int, slot: int | None = None, *, if_faster: bool = False
    ) -> dict[str, Any]:
        """Restore one of this instance's snapshots into its slot (or `slot`); the engine's and
        the daemon's figures, and what the restore-or-re-prefill decision says of it. `if_faster`:
        where that decision is re-prefill, the slot is left to the next request's prefill."""
        rec = self.get(snapshot_id, supervisor.instance.name)
        live = await self.inspect(supervisor)
        target = rec.slot_id if slot is None else slot
        self._check_slot(live, target)
        decision = await self.decide(live, rec, target)
        if if_faster and decision["choice"] == "reprefill" and self._fits(rec, live):
            log.info("snapshot %d left to a re-prefill: %s", rec.id, decision["why"])
            return {
                "id": rec.id,
                "slot": target,
                "n_tokens": rec.n_tokens,
                "restore_ms": None,
                "checked": "none",
                "resident": decision.get("resident"),
                "saved_on": rec.backend,
                "restored_on": live.backend,
                "cross_backend": False,
                "restored": False,
                "decision": decision,
            }
        result = {**await self._restore(live, rec, target), "decision": decision}
        self._event("snapshot.restored", **result)
        return result

    def _check_slot(self, live: LiveServer, slot: Any) -> None:
        # The engine takes id % n_slots: an out-of-range id would land in another slot.
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < live.n_slots:
            raise StokerError(ReasonCode.SNAPSHOT_BAD_SLOT, evidence={"slot": slot, "n_slots": live.n_slots})

    async def _restore(self, live: LiveServer, rec: SnapshotRecord, slot: int) -> dict[str, Any]:
        began = time.perf_counter()  # what the restore takes on the daemon's side (a lock wait left out)
        self._check_slot(live, slot)
        check_identity(rec.identity(), live.identity, snapshot_id=rec.id)
        path = self.dir / rec.filename
        resident = await trio.to_thread.run_sync(resident_fraction, path)
        check = await trio.to_thread.run_sync(check_file, path, rec)
        if not check.ok:
            evidence = {"checked": check.checked, **check.evidence}
            # Kept (it may be put back), but never silent: in the log, status and history.
            self.drops.record(
                ReasonCode.SNAPSHOT_CORRUPT, **{"snapshot_id": rec.id, "slot": slot, **evidence, "why": "file_check"}
            )
            raise StokerError(ReasonCode.SNAPSHOT_CORRUPT, evidence=evidence)
        if check.revouched is not None:  # moved or copied, and the full digest vouched for it
            self.catalog.update(rec.id, file_mtime_ns=check.revouched.mtime_ns, file_inode=check.revouched.inode)
        checked_s = time.perf_counter() - began
        async with self._lock, EngineClient.open(live.base_url, live.api_key, timeout=None) as engine:
            began = time.perf_counter()
            resp = None
            # A big file from a slow disk takes a while: at least 30 s, more as its size asks.
            disk = self.catalog.figures(restore_name(live.backend, "disk")).get(restore_name(live.backend, "disk"))
            with trio.move_on_after(max(SLOT_TIMEOUT, policy.transfer_budget(rec.file_size, disk))):
                resp = await engine.restore_slot(slot, rec.filename)
            daemon_s = checked_s + time.perf_counter() - began
            body = resp.json() if resp is not None and resp.status_code == 200 else {}
            if body.get("n_restored") != rec.n_tokens:
                # The engine clears the slot after a failed restore; erase makes sure of it.
                with trio.move_on_after(SLOT_TIMEOUT):
                    await engine.erase_slot(slot)
                raise StokerError(
                    ReasonCode.SNAPSHOT_RESTORE_FAILED,
                    evidence={
                        "snapshot_id": rec.id,
                        "slot": slot,
                        "status": None if resp is None else resp.status_code,
                        "engine": None if resp is None else error_message(resp),
                    },
                )
        restore_ms = (body.get("timings") or {}).get("restore_ms")
        band = policy.restore_band(resident)
        if band is not None:
            fold_sample(self.catalog, restore_name(live.backend, band), throughput_mb_s(rec.file_size, restore_ms))
            fold_restore_wall(self.catalog, live.backend, band, rec.file_size, daemon_s)
        result = {
            "id": rec.id,
            "slot": slot,
            "n_tokens": body["n_restored"],
            "restore_ms": restore_ms,
            "daemon_ms": round(daemon_s * 1000, 1),
            "checked": check.checked,
            "resident": None if resident is None else round(resident, 3),
            "saved_on": rec.backend,
            "restored_on": live.backend,
            "cross_backend": bool(rec.backend and live.backend and rec.backend != live.backend),
        }
        if result["cross_backend"]:
            result["note"] = cross_backend_note(rec.backend, live.backend)
        return result

    # --- catalogue ----------------------------------------------------------------------

    def get(self, snapshot_id: Any, instance: str | None = None) -> SnapshotRecord:
        """A catalogued snapshot (saved by `instance` where one is named: else snapshot_instance_mismatch)."""
        rec = self.upkeep.get(snapshot_id)
        if instance is not None:
            check_instance(rec.id, rec.instance, instance)
        return rec

    def remove(self, records: list[SnapshotRecord]) -> None:
        """Remove on request (`stoker snapshot rm`): each one is a drop, in history too."""
        self.upkeep.remove(records)
        for rec in records:
            self.drops.removed(rec, "rm", file_size=rec.file_size, instance=rec.instance)

    def slots_saved(self, instance: str) -> int | None:
        """The slots `instance`'s next load restores, from its rows (None: snapshots are off)."""
        return self.catalog.slots_saved(instance) if self.get_config().snapshots.enabled else None

    def _event(self, topic: str, **fields: Any) -> None:
        if self.publish is not None:
            self.publish({"topic": topic, **fields})

    def listing(self, instance: str, server: ServedPlan | None) -> dict[str, Any]:
        """`instance`'s snapshots, newest first, with whether each fits `server` (its ready one; None: no fit said)."""
        live = None if server is None else self._live.get(server.log_path)
        records, config = self.catalog.list(), self.get_config().snapshots
        drops = self.drops.latest()
        return listing_of(
            instance, records, live, config, max_bytes=self.max_bytes(live), snapshots_dir=self.dir, dropped=drops
        )
