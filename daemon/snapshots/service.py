"""KV slot snapshots: save the server's non-empty slots before it goes away, restore them when a
compatible server is ready, on demand in between; retention; cleanup after a kill.

A save goes to a temporary name inside the slot-save dir, is checked (size against the
engine's own count, sha256), renamed into place, and only then catalogued: a full disk or a
kill leaves the previous snapshots as they were and never a half file in the catalogue.
A restore is checked against the catalogue (identity, file size and digest, slot id) before
the engine sees the file; if the engine still refuses it, the slot is erased and the server
keeps serving. docs/snapshots.md has the whole story.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Protocol

import attrs
import trio

from daemon.config.model import Config
from daemon.core.errors import StokerError
from daemon.engine.api import EngineClient, error_message
from daemon.models.facts import ModelFacts, model_facts
from daemon.core.digests import fsync_dir, sha256_file
from daemon.core.paths import StokerPaths
from daemon.snapshots.layout import (
    KVLog,
    check_identity,
    engine_build_of,
    identity_of_server,
    last_launch_lines,
    swa_report,
)
from states.launch_records import LaunchPlan, LaunchState
from states.reasons import ReasonCode
from store.snapshots import SnapshotCatalog, SnapshotRecord, retention_victims


log = logging.getLogger(__name__)

SLOT_TIMEOUT = 30.0  # one slot's save or restore (a busy slot makes the engine wait)
STOP_BUDGET = 20.0  # every save before a planned stop, together
PARTIAL_PREFIX = "partial-"
_FINAL_NAME = re.compile(r"^slot\d+-\d+-[0-9a-f]+\.bin$")
DISK_FULL_BYTES = 1 << 20  # a failed save with less free space than this is a full disk


def swa_full_wanted(config: Config, model_path: str | Path) -> bool:
    """Whether llama-server should run with --swa-full (snapshots.swa_full, "auto": SWA models)."""
    setting = config.snapshots.swa_full
    if setting != "auto":
        return bool(setting)
    if not config.snapshots.enabled:
        return False
    try:
        return model_facts(model_path).swa
    except (OSError, ValueError, KeyError) as exc:  # the engine reports a bad model itself
        log.info("no GGUF facts for %s: %s", model_path, exc)
        return False


def snapshot_server_args(paths: StokerPaths, config: Config, model_path: str | Path) -> tuple[Path, tuple[str, ...]]:
    """(--slot-save-path dir, extra flags) for a launch. The dir is always given, so that
    turning snapshots on (no relaunch) finds a server able to save."""
    paths.snapshots_dir.mkdir(parents=True, exist_ok=True)
    return paths.snapshots_dir, ("--swa-full",) if swa_full_wanted(config, model_path) else ()


def cross_backend_note(saved_on: str | None, restored_on: str | None) -> str:
    """What a restore across backends keeps and what it does not (measured on an H200, issue 7)."""
    return (
        f"saved on {saved_on}, restored on {restored_on}: the conversation resumes without re-processing, "
        f"but the next tokens are {restored_on}'s arithmetic on {saved_on}'s cache: where two candidates "
        f"are near-tied (common with quantized weights) greedy output can differ from what {saved_on} "
        f"would have produced; it is no less valid than a fresh run on {restored_on}"
    )


class ServedPlan(Protocol):
    """A server instance as the snapshot code needs it: where it answers (base URL and key),
    its pid, the plan it runs, its log, and the launch machine's state for the evidence. The
    launch supervisor is one; this package never imports daemon.launch."""

    @property
    def plan(self) -> LaunchPlan | None: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def log_path(self) -> Path: ...

    @property
    def state(self) -> LaunchState: ...

    def endpoint(self) -> tuple[str | None, str | None]: ...


@attrs.frozen
class LiveServer:
    """One ready server as the snapshot code sees it."""

    key: tuple[Any, ...]  # pid and base URL: a new server gets a new key
    base_url: str
    api_key: str | None
    identity: dict[str, Any]
    n_slots: int
    backend: str | None
    variant: str | None
    model_path: str
    swa: dict[str, Any]


def _seal(path: Path) -> tuple[int, str]:
    """fsync a finished file; its size and sha256."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    return path.stat().st_size, sha256_file(path)


def _file_state(path: Path) -> tuple[int, str] | None:
    try:
        return path.stat().st_size, sha256_file(path)
    except OSError:
        return None


@attrs.define(eq=False)
class SnapshotService:
    """Saves, restores, lists and removes KV slot snapshots for the supervisor's server."""

    paths: StokerPaths
    catalog: SnapshotCatalog
    get_config: Callable[[], Config]
    publish: Callable[[dict[str, Any]], Any] | None = None  # the event bus: topics snapshot.*
    live: LiveServer | None = None
    last_report: dict[str, Any] | None = None
    _inflight: set[str] = attrs.field(factory=set)
    _lock: trio.Lock = attrs.field(factory=trio.Lock)

    @property
    def dir(self) -> Path:
        return self.paths.snapshots_dir

    # --- hooks the supervisor runs ------------------------------------------------------

    async def on_ready(self, supervisor: ServedPlan, evidence: dict[str, Any]) -> dict[str, Any] | None:
        """ready_hook: inspect the server, then restore the newest compatible snapshot per slot."""
        config = self.get_config().snapshots
        if not config.enabled:
            self.last_report = {"enabled": False}
            return {"snapshots": self.last_report}
        self.cleanup_files()
        self.cleanup_rows()
        live = await self.inspect(supervisor)
        report: dict[str, Any] = {"enabled": True, **live.swa, "restored": [], "refused": []}
        if evidence.get("adopted"):
            report["skipped"] = "adopted server: its slots are still in memory"
        elif not live.swa["benefit"]:
            report["skipped"] = str(ReasonCode.SNAPSHOT_NO_BENEFIT)
        else:
            for slot in range(live.n_slots):
                candidates = self.catalog.list(model_sha256=live.identity["model_sha256"], slot_id=slot)
                if not candidates:
                    continue
                # The newest that fits this server; if none fits, the newest says why.
                rec = next((c for c in candidates if c.identity() == live.identity), candidates[0])
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
        """before_stop: save every non-empty slot while the server still serves."""
        if not self.get_config().snapshots.enabled:
            return
        with trio.move_on_after(STOP_BUDGET):
            try:
                # Inspected at ready, or now if snapshots were turned on since (no relaunch).
                if not (await self.inspect(supervisor)).swa["benefit"]:
                    return
                saved = await self.save(supervisor, cause, timeout=STOP_BUDGET / 2)
            except StokerError as err:  # the server stops anyway; the previous snapshots stay
                log.warning("no snapshot before %s: %s %s", cause, err.reason, err.evidence)
                return
            log.info("saved %d slot snapshot(s) before %s", len(saved), cause)

    # --- the live server ----------------------------------------------------------------

    async def inspect(self, supervisor: ServedPlan) -> LiveServer:
        """The ready server's identity (cached per server: it cannot change while it runs)."""
        base_url, api_key = supervisor.endpoint()
        plan = supervisor.plan
        if base_url is None or plan is None:
            raise StokerError(ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"state": supervisor.state.value})
        key = (supervisor.pid, base_url)
        if self.live is not None and self.live.key == key:
            return self.live
        resp = None
        async with EngineClient.open(base_url, api_key, timeout=None) as engine:
            with trio.move_on_after(SLOT_TIMEOUT):
                resp = await engine.props()
        if resp is None or resp.status_code != 200:
            raise StokerError(
                ReasonCode.SNAPSHOT_SERVER_NOT_READY, evidence={"props": None if resp is None else resp.status_code}
            )
        props = resp.json()
        digest = await self.model_digest(Path(plan.model_path))
        build, kv, facts = await trio.to_thread.run_sync(self._read_facts, plan, supervisor.log_path)
        swa_full = kv.swa_full if facts.swa else False
        # The flash attention the server was given: the plan's (what ran), not today's config.
        flash_attn = plan.flash_attn or self.get_config().server.flash_attn
        identity = identity_of_server(
            model_sha256=digest, engine_build=build, props=props, kv=kv, config_flash_attn=flash_attn, swa_full=swa_full
        )
        self.live = LiveServer(
            key,
            base_url,
            api_key,
            identity,
            int(props.get("total_slots") or 1),
            plan.backend,
            plan.variant,
            plan.model_path,
            swa_report(facts, kv, swa_full),
        )
        return self.live

    def _read_facts(self, plan: LaunchPlan, log_path: Path) -> tuple[str, KVLog, ModelFacts]:
        from daemon.bundles.metadata import BundleMeta

        try:
            engine = engine_build_of(BundleMeta.read(Path(plan.bundle_root)))
        except StokerError:
            engine = f"unknown engine at {plan.server_path}"
        kv = KVLog.parse(last_launch_lines(log_path))
        return engine, kv, model_facts(plan.model_path)

    async def model_digest(self, path: Path) -> str:
        """The model's sha256, computed once per (path, size, mtime) and kept in the store."""
        st = path.stat()
        cached = self.catalog.cached_digest(str(path), st.st_size, st.st_mtime_ns)
        if cached:
            return cached
        digest = await trio.to_thread.run_sync(sha256_file, path)
        self.catalog.remember_digest(str(path), st.st_size, st.st_mtime_ns, digest)
        return digest

    # --- save ---------------------------------------------------------------------------

    async def save(
        self, supervisor: ServedPlan, cause: str, *, slot: int | None = None, timeout: float = SLOT_TIMEOUT
    ) -> list[SnapshotRecord]:
        """Save the non-empty slots (or one slot); newest catalogued records."""
        live = await self.inspect(supervisor)
        if slot is not None:
            self._check_slot(live, slot)
        async with self._lock:
            self.cleanup_files()
            async with EngineClient.open(live.base_url, live.api_key, timeout=None) as engine:
                resp = None
                with trio.move_on_after(timeout):
                    resp = await engine.slots()
                if resp is None or resp.status_code != 200:
                    raise StokerError(
                        ReasonCode.SNAPSHOT_SAVE_FAILED,
                        "The server did not list its slots.",
                        {"status": None if resp is None else resp.status_code},
                    )
                slots = resp.json()
                todo = [
                    (s["id"], s.get("n_prompt_tokens") or 0)
                    for s in slots
                    if (slot is None or s["id"] == slot) and (s.get("n_prompt_tokens") or 0) > 0
                ]
                saved, errors = [], []
                for sid, _ in todo:
                    try:
                        saved.append(await self._save_slot(engine, live, sid, cause, timeout))
                    except StokerError as err:  # one slot's failure does not cost the others
                        log.warning("slot %d not saved: %s %s", sid, err.reason, err.evidence)
                        errors.append(err)
            self._apply_retention()
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
        self._inflight.add(tmp)
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
            size, sha = await trio.to_thread.run_sync(_seal, path)
            if size != body.get("n_written"):
                raise self._save_error(slot, {"n_written": body.get("n_written"), "file_size": size})
            created = time.time()
            final = f"slot{slot}-{int(created * 1000)}-{secrets.token_hex(4)}.bin"
            os.replace(path, self.dir / final)
            await trio.to_thread.run_sync(fsync_dir, self.dir)
            return self.catalog.add(
                {
                    "filename": final,
                    "slot_id": slot,
                    "model_path": live.model_path,
                    "backend": live.backend,
                    "variant": live.variant,
                    **live.identity,
                    "n_tokens": body.get("n_saved", 0),
                    "file_size": size,
                    "file_sha256": sha,
                    "cause": cause,
                    "save_ms": (body.get("timings") or {}).get("save_ms"),
                    "created_at": created,
                }
            )
        except OSError as exc:
            raise self._save_error(slot, {"error": str(exc)}) from exc
        finally:
            self._inflight.discard(tmp)
            path.unlink(missing_ok=True)

    def _save_error(self, slot: int, evidence: dict[str, Any]) -> StokerError:
        try:
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = None
        full = free is not None and free < DISK_FULL_BYTES
        reason = ReasonCode.SNAPSHOT_DISK_FULL if full else ReasonCode.SNAPSHOT_SAVE_FAILED
        return StokerError(reason, evidence={"slot": slot, "free_bytes": free, "dir": str(self.dir), **evidence})

    # --- restore ------------------------------------------------------------------------

    async def restore(self, supervisor: ServedPlan, snapshot_id: int, slot: int | None = None) -> dict[str, Any]:
        """Restore one catalogued snapshot into its slot (or `slot`); the engine's figures."""
        rec = self.get(snapshot_id)
        live = await self.inspect(supervisor)
        result = await self._restore(live, rec, rec.slot_id if slot is None else slot)
        self._event("snapshot.restored", **result)
        return result

    def _check_slot(self, live: LiveServer, slot: Any) -> None:
        # The engine takes id % n_slots: an out-of-range id would land in another slot.
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < live.n_slots:
            raise StokerError(ReasonCode.SNAPSHOT_BAD_SLOT, evidence={"slot": slot, "n_slots": live.n_slots})

    async def _restore(self, live: LiveServer, rec: SnapshotRecord, slot: int) -> dict[str, Any]:
        self._check_slot(live, slot)
        check_identity(rec.identity(), live.identity, snapshot_id=rec.id)
        found = await trio.to_thread.run_sync(_file_state, self.dir / rec.filename)
        if found != (rec.file_size, rec.file_sha256):
            raise StokerError(
                ReasonCode.SNAPSHOT_CORRUPT,
                evidence={
                    "snapshot_id": rec.id,
                    "file": rec.filename,
                    "expected_size": rec.file_size,
                    "found_size": found[0] if found else None,
                    "digest_matches": bool(found and found[1] == rec.file_sha256),
                },
            )
        async with self._lock, EngineClient.open(live.base_url, live.api_key, timeout=None) as engine:
            resp = None
            with trio.move_on_after(SLOT_TIMEOUT):
                resp = await engine.restore_slot(slot, rec.filename)
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
        result = {
            "id": rec.id,
            "slot": slot,
            "n_tokens": body["n_restored"],
            "restore_ms": (body.get("timings") or {}).get("restore_ms"),
            "saved_on": rec.backend,
            "restored_on": live.backend,
            "cross_backend": bool(rec.backend and live.backend and rec.backend != live.backend),
        }
        if result["cross_backend"]:
            result["note"] = cross_backend_note(rec.backend, live.backend)
        return result

    # --- catalogue ----------------------------------------------------------------------

    def get(self, snapshot_id: Any) -> SnapshotRecord:
        rec = (
            self.catalog.get(snapshot_id)
            if isinstance(snapshot_id, int) and not isinstance(snapshot_id, bool)
            else None
        )
        if rec is None:
            raise StokerError(ReasonCode.SNAPSHOT_NOT_FOUND, evidence={"id": snapshot_id})
        return rec

    def remove(self, records: list[SnapshotRecord]) -> None:
        """Files first, then rows: a kill in between leaves rows without files (cleaned up)."""
        for rec in records:
            (self.dir / rec.filename).unlink(missing_ok=True)
        self.catalog.remove(r.id for r in records)
        if records:
            self._event("snapshot.removed", ids=[r.id for r in records])

    def _event(self, topic: str, **fields: Any) -> None:
        if self.publish is not None:
            self.publish({"topic": topic, **fields})

    def _apply_retention(self) -> list[SnapshotRecord]:
        config = self.get_config().snapshots
        victims = retention_victims(self.catalog.list(), config.max_count, config.max_bytes)
        self.remove(victims)
        return victims

    def cleanup_files(self) -> list[str]:
        """Remove what a kill left behind: partial files and uncatalogued snapshot files."""
        if not self.dir.is_dir():
            return []
        known = self.catalog.filenames()
        removed = []
        for entry in self.dir.iterdir():
            name = entry.name
            stray = name.startswith(PARTIAL_PREFIX) and name not in self._inflight
            if stray or (_FINAL_NAME.match(name) and name not in known):
                entry.unlink(missing_ok=True)
                removed.append(name)
        if removed:
            log.info("removed leftover snapshot files: %s", removed)
        return removed

    def cleanup_rows(self) -> None:
        """Drop rows whose file is gone (removed by hand, or a kill between unlink and delete)."""
        self.catalog.remove(r.id for r in self.catalog.list() if not (self.dir / r.filename).is_file())

    def listing(self, *, ready: bool) -> dict[str, Any]:
        """Every snapshot, newest first, with whether it fits the running server."""
        config = self.get_config().snapshots
        live = self.live if ready else None
        rows = []
        for rec in self.catalog.list():
            row = rec.to_dict()
            if live is not None:
                try:
                    check_identity(rec.identity(), live.identity, snapshot_id=rec.id)
                    row["fits_server"], row["why_not"] = True, None
                except StokerError as err:
                    row["fits_server"], row["why_not"] = False, str(err.reason)
            rows.append(row)
        return {
            "snapshots": rows,
            "total_bytes": sum(r["file_size"] for r in rows),
            "enabled": config.enabled,
            "max_count": config.max_count,
            "max_bytes": config.max_bytes,
            "dir": str(self.dir),
            "server": None if live is None else {"identity": live.identity, **live.swa},
        }
