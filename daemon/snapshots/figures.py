"""The measured figures that judge snapshots on this machine, and where each comes from.

- `prefill/<backend>/<model id>/<band>` tok/s: the engine's own per-request lines in the server
  log (`prompt eval time = X ms / N tokens`), read after the server ran, per length band;
  prompts under 64 tokens are left out (they measure the request, not the prefill).
- `restore/<backend>/cache|disk` MB/s: the engine's `restore_ms` for the bytes it read, by
  how much of the file was in the page cache just before (mincore).
- `restore_wall/<backend>/cache|disk/x|y|xx|xy`: what each whole restore took from the daemon's
  side (its checks, the HTTP round trip, the engine's read) against the file's MB, as the
  moments of a straight line (`policy.RestoreFit`: a fixed cost per restore plus a cost per MB);
  once measured, the restore estimate comes from these (the engine's MB/s leaves the fixed
  costs out, and underestimated a 4k-token restore on an H200 by a third).
- `save/<backend>` MB/s: the engine's `save_ms` for the bytes it wrote.

Each is a moving figure in the store (`SnapshotCatalog.fold_figure`); the decisions are pure
(`states.snapshots.policy`).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Literal

import attrs

from stoker.daemon.snapshots.layout import LAUNCH_MARKER
from stoker.daemon.snapshots.live import LiveServer
from stoker.states.reasons import ReasonedError
from stoker.states.snapshots.policy import (
    DEFAULT_MAX_BYTES,
    MB,
    MIN_PREFILL_SAMPLE,
    Figure,
    RestoreInputs,
    decide_restore,
    decide_save,
    prefill_band,
    fit_samples,
    prefill_rate,
    restore_fit,
    retention_bytes,
    snapshot_bytes,
    stop_budget,
)
from stoker.store.snapshots import SnapshotCatalog, SnapshotRecord

log = logging.getLogger(__name__)

_PROMPT_EVAL = re.compile(rb"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens")
_TAIL_BYTES = 8 << 20  # at most this much of a long-running server's log is read per harvest


def prefill_name(backend: str | None, model_id: str, band: str) -> str:
    return f"prefill/{backend or '?'}/{model_id}/{band}"


def restore_name(backend: str | None, where: str) -> str:
    return f"restore/{backend or '?'}/{where}"


def restore_wall_name(backend: str | None, where: str, moment: str = "") -> str:
    return f"restore_wall/{backend or '?'}/{where}/{moment}"


def save_name(backend: str | None) -> str:
    return f"save/{backend or '?'}"


@attrs.frozen
class LogCursor:
    """Where the last harvest of one server's log stopped."""

    path: Path
    offset: int


def prefill_samples(log_path: Path, cursor: LogCursor | None) -> tuple[list[tuple[int, float]], LogCursor]:
    """(tokens, seconds) of every prompt the current launch processed since `cursor` (blocking).
    Without a cursor: from the launch's marker, or the last 8 MiB of the log."""
    try:
        with open(log_path, "rb") as fh:
            end = fh.seek(0, 2)
            start = cursor.offset if cursor is not None and cursor.path == log_path else None
            if start is None or start > end:  # first harvest, or the log was rotated
                low = max(0, end - _TAIL_BYTES)
                fh.seek(low)
                data = fh.read(end - low)
                marker = data.rfind(LAUNCH_MARKER)
                data = data[marker:] if marker >= 0 else data
            else:
                start = max(start, end - _TAIL_BYTES)
                fh.seek(start)
                data = fh.read(end - start)
    except OSError:
        return [], LogCursor(log_path, 0)
    samples = [(int(n), float(ms) / 1000) for ms, n in _PROMPT_EVAL.findall(data) if float(ms) > 0]
    return samples, LogCursor(log_path, end)


def fold_sample(catalog: SnapshotCatalog, name: str, sample: float | None) -> None:
    """Move one figure; a figure the store cannot write now is not worth a failed save."""
    if sample is None:
        return
    try:
        catalog.fold_figure(name, sample)
    except ReasonedError as err:  # store_write_failed: a full or read-only disk
        log.info("figure %s not kept: %s", name, err.evidence)


def fold_restore_wall(
    catalog: SnapshotCatalog, backend: str | None, where: str, file_bytes: int, seconds: float
) -> None:
    """One measured restore (from the daemon's side) into its place's RestoreFit moments."""
    for moment, sample in fit_samples(file_bytes, seconds).items():
        fold_sample(catalog, restore_wall_name(backend, where, moment), sample)


def restore_fits(catalog: SnapshotCatalog, backend: str | None) -> dict[str, Any]:
    """The measured RestoreFit of each place ("cache", "disk"), where all its moments are kept."""
    fits = {}
    for where in ("cache", "disk"):
        prefix = restore_wall_name(backend, where)
        moments = {name[len(prefix) :]: fig for name, fig in catalog.figures(prefix).items()}
        fits[where] = restore_fit(moments)
    return fits


def fold_prefills(
    catalog: SnapshotCatalog, backend: str | None, model_id: str, samples: list[tuple[int, float]]
) -> None:
    """One sample per length band: the band's tokens over its seconds."""
    bands: dict[str, list[float]] = {}
    for n, seconds in samples:
        if n >= MIN_PREFILL_SAMPLE:
            tokens_seconds = bands.setdefault(prefill_band(n), [0.0, 0.0])
            tokens_seconds[0] += n
            tokens_seconds[1] += seconds
    for band, (tokens, seconds) in bands.items():
        if seconds > 0:
            fold_sample(catalog, prefill_name(backend, model_id, band), tokens / seconds)


def restore_inputs(
    catalog: SnapshotCatalog,
    *,
    backend: str | None,
    model_id: str,
    n_tokens: int,
    file_bytes: int,
    resident: float | None,
) -> tuple[RestoreInputs, dict[str, Any]]:
    """The decision's inputs for one conversation, and the figures as status shows them."""
    prefix = prefill_name(backend, model_id, "")
    by_band = {name[len(prefix) :]: fig for name, fig in catalog.figures(prefix).items()}
    restores = catalog.figures(restore_name(backend, ""))
    fits = restore_fits(catalog, backend)
    inputs = RestoreInputs(
        n_tokens=n_tokens,
        file_bytes=file_bytes,
        resident=resident,
        prefill_tok_s=prefill_rate(n_tokens, by_band),
        restore_cache_mb_s=restores.get(restore_name(backend, "cache")),
        restore_disk_mb_s=restores.get(restore_name(backend, "disk")),
        restore_cache_fit=fits["cache"],
        restore_disk_fit=fits["disk"],
    )
    shown = {
        "prefill_tok_s": {band: fig.to_dict() for band, fig in sorted(by_band.items())},
        "prefill_band": prefill_band(n_tokens),
        "restore_mb_s": {name.rsplit("/", 1)[1]: fig.to_dict() for name, fig in restores.items()},
        "restore_line": {where: _line(fit) for where, fit in fits.items() if fit is not None},
    }
    return inputs, shown


def _line(fit: Any) -> dict[str, Any]:
    line = fit.line()
    shown: dict[str, Any] = {"samples": fit.samples}
    if line is not None:
        shown.update(fixed_ms=round(line[0] * 1000, 2), ms_per_mb=round(line[1] * 1000, 4))
    return shown


def restore_decision(
    catalog: SnapshotCatalog, live: LiveServer, rec: SnapshotRecord, resident: float | None
) -> dict[str, Any]:
    """states.snapshots.policy.decide_restore on this machine's figures, as status shows it."""
    inputs, figures = restore_inputs(
        catalog,
        backend=live.backend,
        model_id=live.identity["model_id"],
        n_tokens=rec.n_tokens,
        file_bytes=rec.file_size,
        resident=resident,
    )
    return {
        "n_tokens": rec.n_tokens,
        "file_bytes": rec.file_size,
        "resident": None if resident is None else round(resident, 3),
        **decide_restore(inputs).to_dict(),
        "figures": figures,
    }


def save_figure(catalog: SnapshotCatalog, backend: str | None) -> Figure | None:
    """This machine's save MB/s on this backend, if one was measured."""
    return catalog.figures(save_name(backend)).get(save_name(backend))


def max_bytes_for(setting: int | Literal["auto"], live: LiveServer | None) -> int:
    """Retention's byte budget: the setting, or "auto" scaled with the live server's KV."""
    if live is None:
        return DEFAULT_MAX_BYTES if setting == "auto" else setting
    return retention_bytes(setting, bytes_per_token=live.kv_bytes_per_token, n_ctx=live.n_ctx_seq, n_slots=live.n_slots)


def stop_budget_for(
    setting: float | Literal["auto"], catalog: SnapshotCatalog, live: LiveServer, n_tokens: int
) -> float:
    """Seconds saving n_tokens of the live server's KV may take before a stop."""
    expected = snapshot_bytes(n_tokens, live.kv_bytes_per_token)
    return stop_budget(setting, expected_bytes=expected, save_mb_s=save_figure(catalog, live.backend))


def throughput_mb_s(n_bytes: Any, milliseconds: Any) -> float | None:
    """MB/s of an engine save or restore from its own figures; None if they are missing."""
    if not isinstance(n_bytes, (int, float)) or not isinstance(milliseconds, (int, float)) or milliseconds <= 0:
        return None
    return n_bytes / MB / (milliseconds / 1000)


def save_decision(catalog: SnapshotCatalog, live: LiveServer, n_tokens: int) -> dict[str, Any]:
    """states.snapshots.policy.decide_save for one slot of the live server, on this machine's figures."""
    expected = snapshot_bytes(n_tokens, live.kv_bytes_per_token)
    inputs, figures = restore_inputs(
        catalog,
        backend=live.backend,
        model_id=live.identity["model_id"],
        n_tokens=n_tokens,
        file_bytes=expected or 0,
        resident=1.0,
    )
    save = save_figure(catalog, live.backend)
    decision = decide_save(inputs, save if expected else None)
    return {
        "n_tokens": n_tokens,
        "file_bytes": expected,
        **decision.to_dict(),
        "figures": {**figures, "save_mb_s": None if save is None else save.to_dict()},
    }
