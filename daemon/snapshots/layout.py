"""The live server's KV layout, as a snapshot identity, and whether snapshots can help it; the
snapshot flags a launch gets (--slot-save-path, --swa-full).

The engine restores any slot file whose tensor shapes happen to fit and never checks which
model it came from (docs/snapshots.md), so Stoker compares its own record of the snapshot
with the running server before the engine sees the file. The server's effective settings
(flash attention after `auto` resolved, KV cache types, cache sizes) come from its log.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Mapping

import attrs

from stoker.daemon.config.model import Config
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models.facts import ModelFacts, model_facts
from stoker.states.reasons import ReasonCode
from stoker.store.snapshots import INSTANCE_FIELD, LAYOUT_FIELDS, MODEL_FIELDS, same_model

log = logging.getLogger(__name__)

LAUNCH_MARKER = b"==== stoker: launch "
_LOG_CHUNK = 1 << 20
_LOAD_LINES_BYTES = 1 << 20  # a launch's load lines take ~16 KB at -lv 4

_FA_SET = re.compile(r"llama_context: flash_attn\s+= (\w+)")
_FA_RESOLVED = re.compile(r"Flash Attention (enabled|not supported)")
_KV_CACHE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,.*K \((\w+)\):.*V \((\w+)\)")
_SWA_CREATE = re.compile(r"creating\s+SWA KV cache, size = (\d+) cells")
_KV_BUFFER = re.compile(r"KV buffer size =\s*([\d.]+) MiB")
_INT_PARAM = re.compile(r"llama_context: (n_ubatch|n_seq_max|n_ctx|n_ctx_seq)\s+= (\d+)")
_UNIFIED = re.compile(r"llama_context: kv_unified\s+= (true|false)")


@attrs.frozen
class KVLog:
    """What one launch's log says about its KV cache."""

    flash_attn: str | None = None  # "on" | "off" once resolved
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    kv_mib: float | None = None  # every KV buffer together
    swa_cells: int | None = None
    swa_mib: float | None = None
    swa_full: bool = False
    n_ctx: int | None = None  # all slots together
    n_ctx_seq: int | None = None  # the KV cache's cells per sequence (slot)
    n_ubatch: int | None = None
    n_seq_max: int | None = None
    kv_unified: bool | None = None

    @classmethod
    def parse(cls, lines: list[str]) -> "KVLog":
        facts: dict[str, Any] = {}
        kv_mib = 0.0
        seen_buffer = False
        after_swa = False
        for line in lines:
            if m := _FA_SET.search(line):
                value = m.group(1)
                facts["flash_attn"] = {"enabled": "on", "disabled": "off"}.get(value)
            elif m := _FA_RESOLVED.search(line):
                facts["flash_attn"] = "on" if m.group(1) == "enabled" else "off"
            elif m := _SWA_CREATE.search(line):
                after_swa = True
            elif m := _KV_CACHE.search(line):
                facts["cache_type_k"], facts["cache_type_v"] = m.group(3), m.group(4)
                if after_swa:
                    facts["swa_mib"], facts["swa_cells"] = float(m.group(1)), int(m.group(2))
                    after_swa = False
            elif m := _KV_BUFFER.search(line):
                kv_mib += float(m.group(1))
                seen_buffer = True
            elif m := _INT_PARAM.search(line):
                facts[m.group(1)] = int(m.group(2))
            elif m := _UNIFIED.search(line):
                facts["kv_unified"] = m.group(1) == "true"
            elif "using full-size SWA cache" in line:
                facts["swa_full"] = True
        if seen_buffer:
            facts["kv_mib"] = round(kv_mib, 2)
        return cls(**facts)


def last_launch_lines(log_path: Path) -> list[str]:
    """The first lines of the most recent launch in the log (the supervisor runs one server at a
    time): found by scanning back from the end, however long that server has been logging."""
    try:
        with open(log_path, "rb") as fh:
            end = fh.seek(0, 2)
            start = -1
            while end > 0 and start < 0:
                low = max(0, end - _LOG_CHUNK)
                fh.seek(low)
                chunk = fh.read(end - low + len(LAUNCH_MARKER))  # a marker may straddle chunks
                found = chunk.rfind(LAUNCH_MARKER)
                start = low + found if found >= 0 else -1
                end = low
            fh.seek(max(start, 0))
            data = fh.read(_LOAD_LINES_BYTES)
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def _pad(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def swa_report(facts: ModelFacts, kv: KVLog, swa_full: bool) -> dict[str, Any]:
    """Whether snapshots spare a re-prefill on this server, and the KV memory --swa-full costs."""
    out: dict[str, Any] = {
        "model": facts.to_dict(),
        "swa_full": swa_full,
        "kv_mib": kv.kv_mib,
        "benefit": True,
        "why": None,
    }
    if facts.recurrent:
        kind = "hybrid" if facts.hybrid else "recurrent"
        out.update(
            benefit=False,
            why=f"{kind} model ({facts.architecture}): the engine re-processes the whole "
            f"prompt after a restore (upstream limitation), with or without --swa-full",
        )
    elif facts.swa and not swa_full:
        out.update(
            benefit=False,
            why=f"sliding-window model ({facts.architecture}, window {facts.sliding_window}) "
            f'without --swa-full: set [snapshots] swa_full = "auto" or true',
        )
    window = facts.sliding_window
    if facts.swa and window and kv.kv_mib is not None and kv.swa_mib and kv.swa_cells and kv.n_ctx:
        # The engine sizes the SWA cache as pad256(min(n_ctx, window * seqs + n_ubatch)) cells;
        # with --swa-full it is n_ctx cells. Per-cell cost from the log's own figures.
        seqs = (kv.n_seq_max or 1) if kv.kv_unified else 1
        small = _pad(min(kv.n_ctx, window * seqs + (kv.n_ubatch or 512)), 256)
        per_cell = kv.swa_mib / kv.swa_cells
        rest = kv.kv_mib - kv.swa_mib
        with_full, without = rest + per_cell * kv.n_ctx, rest + per_cell * small
        out.update(
            kv_mib_with_swa_full=round(with_full, 2),
            kv_mib_without_swa_full=round(without, 2),
            swa_full_cost_mib=round(with_full - without, 2),
        )
    return out


def identity_of_server(
    *,
    instance: str,
    model_id: str,
    model_sha256: str | None,
    engine_build: str,
    props: Mapping[str, Any],
    kv: KVLog,
    config_flash_attn: str,
    swa_full: bool,
) -> dict[str, Any]:
    """The running server's identity, in the catalogue's terms (`model_sha256`: the full digest
    a daemon before model ids cached for this exact file, if any; it matches rows of that time)."""
    settings = props.get("default_generation_settings") or {}
    return {
        INSTANCE_FIELD: instance,
        "model_id": model_id,
        "model_sha256": model_sha256,
        "engine_build": engine_build,
        # The KV layout's cells per slot; /props may report less (capped at the model's
        # training context), which would hide a changed context size.
        "n_ctx": kv.n_ctx_seq or settings.get("n_ctx"),
        "n_slots": props.get("total_slots"),
        "flash_attn": kv.flash_attn or config_flash_attn,
        "cache_type_k": kv.cache_type_k or "f16",
        "cache_type_v": kv.cache_type_v or "f16",
        "swa_full": bool(swa_full),
        "kv_unified": kv.kv_unified,
    }


def _unknown_or_moot(field: str, snapshot: Mapping[str, Any], server: Mapping[str, Any]) -> bool:
    """kv_unified counts only when both sides know it and there are several slots: with one
    slot a unified and a per-slot cache hold the same cells (restored token-identical)."""
    if field != "kv_unified":
        return False
    return snapshot.get(field) is None or server.get(field) is None or (server.get("n_slots") or 1) <= 1


def check_instance(snapshot_id: int, saved_by: str | None, model: str | None) -> None:
    """StokerError(snapshot_instance_mismatch) unless the snapshot was saved by the instance `model`:
    a conversation belongs to the configured model that held it, never to another, even one
    serving the same file with the same layout (docs/snapshots.md, "Identity")."""
    if saved_by != model:
        raise StokerError(
            ReasonCode.SNAPSHOT_INSTANCE_MISMATCH,
            f"Snapshot {snapshot_id} holds a conversation of model {saved_by}, not of {model}; a conversation "
            f"never moves between models. `stoker snapshot list --model {saved_by}` lists it, and {saved_by}'s "
            "next load restores it.",
            {"snapshot_id": snapshot_id, "saved_by": saved_by, "model": model},
        )


def check_identity(snapshot: Mapping[str, Any], server: Mapping[str, Any], *, snapshot_id: int) -> None:
    """Raise a reason-coded StokerError if the snapshot does not fit the server: another
    instance's first, then another model, engine or layout."""
    check_instance(snapshot_id, snapshot.get(INSTANCE_FIELD), server.get(INSTANCE_FIELD))
    differ = {
        k: {"snapshot": snapshot.get(k), "server": server.get(k)}
        for k in LAYOUT_FIELDS
        if snapshot.get(k) != server.get(k) and not _unknown_or_moot(k, snapshot, server)
    }
    if not same_model(snapshot, server):
        field = MODEL_FIELDS[0] if snapshot.get(MODEL_FIELDS[0]) else MODEL_FIELDS[1]
        differ = {field: {"snapshot": snapshot.get(field), "server": server.get(field)}, **differ}
    if not differ:
        return
    if MODEL_FIELDS[0] in differ or MODEL_FIELDS[1] in differ:
        reason = ReasonCode.SNAPSHOT_MODEL_MISMATCH
    elif "engine_build" in differ:
        reason = ReasonCode.SNAPSHOT_ENGINE_MISMATCH
    else:
        reason = ReasonCode.SNAPSHOT_LAYOUT_MISMATCH
    raise StokerError(reason, evidence={"snapshot_id": snapshot_id, "differs": differ})


def engine_build_of(meta: Any) -> str:
    """The engine identity of a bundle: same source and stamp on every backend."""
    llama = dict(getattr(meta, "llama", {}) or {})
    source = str((getattr(meta, "source", {}) or {}).get("sha256", ""))[:16]
    return f"{llama.get('version', '?')} build {llama.get('build_number', '?')} commit {llama.get('commit', '?')} source {source}"


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
    """What a restore across backends keeps and what it does not (measured on an H200, CUDA to CPU)."""
    return (
        f"saved on {saved_on}, restored on {restored_on}: the conversation resumes without re-processing, "
        f"but the next tokens are {restored_on}'s arithmetic on {saved_on}'s cache: where two candidates "
        f"are near-tied (common with quantized weights) greedy output can differ from what {saved_on} "
        f"would have produced; it is no less valid than a fresh run on {restored_on}"
    )
