"""What KV snapshots are worth, decided from measured figures: restore or re-prefill, whether a
stop saves at all and how much it may spend saving, how many bytes retention keeps, whether a
save can be kept at all.

Pure (STYLE.md, Rule 1): the snapshot service measures (the engine's prefill timings, its
restore and save timings, how much of a file is in the page cache, free disk) and asks here;
nothing in this module reads a file or the clock. The figures are moving averages kept in the
store (`store.snapshots`, table `snapshot_figures`); `fold` is how one more sample moves them.
docs/snapshots.md, "Restore or re-prefill" and "Budgets", says why each rule is what it is.
"""

from __future__ import annotations

import enum
from typing import Any, Literal

import attrs

from stoker.states.launch.records import AfterStop
from stoker.states.reasons import ReasonCode

GIB = 1 << 30
MB = 1_000_000

# fold: the first samples average, then each new one weighs a quarter (a machine's figures
# move when its load or its disk does; a quarter follows that within a few samples).
FOLD_WEIGHT = 0.25

# Prefill throughput depends on the prompt's length (small batches underuse the device, long
# ones pay for attention), so it is kept per length band: tokens up to each bound.
PREFILL_BANDS = (1024, 4096, 16384, 65536)
MIN_PREFILL_SAMPLE = 64  # shorter prompts measure the request's overhead, not the prefill

RESTORE_OVERHEAD_S = 0.005  # Stoker's checks and the HTTP round trip around the engine's restore
# Re-prefill only where it wins clearly: by 10 % of the restore and at least 10 ms. Within
# that, the two are a tie on this machine's noise, and a restore also spares the device the work.
REPREFILL_MARGIN = 0.10
REPREFILL_MARGIN_S = 0.010
CACHED = 0.9  # a restore of a file at least this resident measures the page-cache figure
UNCACHED = 0.1  # at most this resident: the disk figure

DEFAULT_MAX_BYTES = 2 * GIB
KEEP_FULL_SAVES = 2  # "auto" retention holds the newest full-context save of every slot and one before
DEFAULT_STOP_BUDGET_S = 20.0
STOP_BUDGET_BASE_S = 5.0
STOP_BUDGET_SAFETY = 2.0
MAX_AUTO_STOP_BUDGET_S = 600.0
ASSUMED_SAVE_MB_S = 100.0  # before a save was measured on this machine: a slow disk's figure


@attrs.frozen
class Figure:
    """A moving figure: its value and how many samples moved it."""

    value: float
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return {"value": round(self.value, 3), "samples": self.samples}


def fold(old: Figure | None, sample: float, weight: float = FOLD_WEIGHT) -> Figure:
    """The figure after one more sample: a plain mean while samples are few, then a moving average."""
    if old is None:
        return Figure(sample, 1)
    share = max(1.0 / (old.samples + 1), weight)
    return Figure(old.value + share * (sample - old.value), old.samples + 1)


def prefill_band(n_tokens: int) -> str:
    """The length band a prompt's throughput is kept under: "le1024" ... "gt65536"."""
    for bound in PREFILL_BANDS:
        if n_tokens <= bound:
            return f"le{bound}"
    return f"gt{PREFILL_BANDS[-1]}"


def prefill_rate(n_tokens: int, by_band: dict[str, Figure]) -> Figure | None:
    """The prefill tok/s to expect for a prompt of n_tokens: its band's figure, else the slowest
    band measured (an underestimate of the prefill's speed errs toward restoring, which is never
    worse than the engine's own restore); None when nothing was measured."""
    own = by_band.get(prefill_band(n_tokens))
    if own is not None:
        return own
    return min(by_band.values(), key=lambda f: f.value, default=None)


@attrs.frozen
class RestoreFit:
    """What measured restores on one backend took, from the daemon's side (its checks, the HTTP
    round trip and the engine's read): moving means of the file's MB (x), the seconds (y), x*x
    and x*y, so that a straight line (a fixed cost per restore plus a cost per MB) fits them."""

    x: Figure
    y: Figure
    xx: Figure
    xy: Figure

    @property
    def samples(self) -> int:
        return min(self.x.samples, self.y.samples, self.xx.samples, self.xy.samples)

    def line(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per MB); None while nothing was measured. Files of one size
        only: no fixed cost can be told apart, so the seconds per MB of what was measured."""
        if self.samples < 1 or self.x.value <= 0 or self.y.value <= 0:
            return None
        var = self.xx.value - self.x.value**2
        if var > (FIT_SPREAD * self.x.value) ** 2:
            per_mb = (self.xy.value - self.x.value * self.y.value) / var
            if per_mb > 0:
                return self.y.value - per_mb * self.x.value, per_mb
        return 0.0, self.y.value / self.x.value

    def estimate(self, mb: float) -> float | None:
        """Seconds a restore of `mb` should take; never under half the measured mean rate's (a
        line fitted on big files can cross zero before the small ones)."""
        line = self.line()
        if line is None:
            return None
        fixed, per_mb = line
        return max(fixed + per_mb * mb, FIT_FLOOR * mb * self.y.value / self.x.value)


FIT_MOMENTS = ("x", "y", "xx", "xy")
FIT_SPREAD = 0.05  # sizes within 5 % of their mean are one size: no line through them
FIT_FLOOR = 0.5


def fit_samples(file_bytes: int, seconds: float) -> dict[str, float]:
    """The samples one measured restore adds to its RestoreFit's moments (by FIT_MOMENTS name)."""
    mb = file_bytes / MB
    return {"x": mb, "y": seconds, "xx": mb * mb, "xy": mb * seconds}


def restore_fit(moments: dict[str, Figure]) -> RestoreFit | None:
    """A RestoreFit from its stored moments; None unless all four were measured."""
    if not all(name in moments for name in FIT_MOMENTS):
        return None
    return RestoreFit(**{name: moments[name] for name in FIT_MOMENTS})


@attrs.frozen
class RestoreInputs:
    """What the decision for one conversation knows: its size, where its file is, the figures."""

    n_tokens: int
    file_bytes: int
    resident: float | None  # the file's fraction in the page cache; None: unknown
    prefill_tok_s: Figure | None  # for this model on this backend, at this length
    restore_cache_mb_s: Figure | None  # the engine's restore from the page cache, on this backend
    restore_disk_mb_s: Figure | None  # from the disk
    # What whole restores took here (checks, round trip, read), by where the file was: when
    # measured, these decide instead of the engine's MB/s (which leaves out the fixed costs).
    restore_cache_fit: RestoreFit | None = None
    restore_disk_fit: RestoreFit | None = None


def decision_dict(decision: Any) -> dict[str, Any]:
    """A decision as status shows it: its choice, why, and each estimate (`<name>_est`, rounded)."""
    shown = {"choice": decision.choice, "why": decision.why}
    for field in attrs.fields(type(decision)):
        if field.name.endswith("_s"):
            value = getattr(decision, field.name)
            shown[f"{field.name}_est"] = None if value is None else round(value, 4)
    return shown


class Shown:
    """A decision that status shows (`decision_dict`)."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return decision_dict(self)


@attrs.frozen
class RestoreDecision(Shown):
    """Restore the snapshot, or leave the slot empty and let the next request re-prefill."""

    choice: Literal["restore", "reprefill"]
    why: str
    restore_s: float | None  # the estimates that decided (None: not measured yet)
    prefill_s: float | None


def restore_estimate(inputs: RestoreInputs) -> float | None:
    """Seconds a restore should take. Where whole restores were measured here (RestoreFit),
    each part of the file its share of its place's line for the whole file; else the cached
    part at the engine's cache figure, the rest at its disk figure, plus RESTORE_OVERHEAD_S (an
    unknown residency counts as disk where that figure exists); None if a part that must be
    read has no figure yet."""
    resident = inputs.resident
    if resident is None:
        known_disk = inputs.restore_disk_mb_s is not None or inputs.restore_disk_fit is not None
        resident = 0.0 if known_disk else 1.0
    cached = inputs.file_bytes * resident
    uncached = inputs.file_bytes - cached
    fitted = _fitted_estimate(
        ((cached, inputs.restore_cache_fit), (uncached, inputs.restore_disk_fit)), inputs.file_bytes
    )
    if fitted is not None:
        return fitted
    seconds = RESTORE_OVERHEAD_S
    for part, rate in ((cached, inputs.restore_cache_mb_s), (uncached, inputs.restore_disk_mb_s)):
        if part < 1:
            continue
        if rate is None or rate.value <= 0:
            return None
        seconds += part / (rate.value * MB)
    return seconds


def _fitted_estimate(parts: tuple[tuple[float, RestoreFit | None], ...], file_bytes: int) -> float | None:
    """The fitted estimate: every part that must be read at its own line's cost per MB (its
    share of that line's estimate for the whole file), or None if one has no line yet."""
    seconds = 0.0
    for part, fit in parts:
        if part < 1:
            continue
        whole = None if fit is None else fit.estimate(file_bytes / MB)
        if whole is None:
            return None
        seconds += whole * part / file_bytes
    return seconds if file_bytes >= 1 else None


def decide_restore(inputs: RestoreInputs) -> RestoreDecision:
    """Restore, unless re-prefilling this conversation is measured to be clearly faster here."""
    restore_s = restore_estimate(inputs)
    rate = inputs.prefill_tok_s
    if rate is None or rate.value <= 0:
        why = "no prefill figure for this model on this backend yet: restore (the engine's own speed)"
        return RestoreDecision("restore", why, restore_s, None)
    prefill_s = inputs.n_tokens / rate.value
    if restore_s is None:
        why = "no restore figure for this file's place (page cache or disk) yet: restore, which measures it"
        return RestoreDecision("restore", why, None, prefill_s)
    margin = max(REPREFILL_MARGIN * restore_s, REPREFILL_MARGIN_S)
    if prefill_s + margin < restore_s:
        why = (
            f"re-prefilling {inputs.n_tokens} tokens (~{prefill_s:.3f} s at {rate.value:.0f} tok/s) "
            f"beats restoring {inputs.file_bytes / MB:.1f} MB (~{restore_s:.3f} s)"
        )
        return RestoreDecision("reprefill", why, restore_s, prefill_s)
    why = f"restoring (~{restore_s:.3f} s) is not slower than re-prefilling (~{prefill_s:.3f} s)"
    return RestoreDecision("restore", why, restore_s, prefill_s)


@attrs.frozen
class SaveDecision(Shown):
    """Save a slot before a planned stop, or let its next request re-prefill it."""

    choice: Literal["save", "skip"]
    why: str
    save_s: float | None  # the estimates that decided (None: not measured yet)
    restore_s: float | None
    prefill_s: float | None


def decide_save(inputs: RestoreInputs, save_mb_s: Figure | None) -> SaveDecision:
    """Save before a planned stop, unless re-prefilling the conversation later is measured to be
    clearly faster than saving it now and restoring it then (the save delays the stop, the restore
    the next start; a re-prefill costs only the next request). Its restore reads a file just
    written, so from the page cache."""
    rate = inputs.prefill_tok_s
    if rate is None or rate.value <= 0:
        return SaveDecision("save", "no prefill figure for this model on this backend yet: save", None, None, None)
    prefill_s = inputs.n_tokens / rate.value
    if save_mb_s is None or save_mb_s.value <= 0:
        return SaveDecision(
            "save", "no save figure on this backend yet: save, which measures it", None, None, prefill_s
        )
    save_s = inputs.file_bytes / (save_mb_s.value * MB)
    restore_s = restore_estimate(attrs.evolve(inputs, resident=1.0))
    if restore_s is None:
        why = "no restore figure from the page cache on this backend yet: save"
        return SaveDecision("save", why, save_s, None, prefill_s)
    both = save_s + restore_s
    if prefill_s + max(REPREFILL_MARGIN * both, REPREFILL_MARGIN_S) < both:
        why = (
            f"re-prefilling {inputs.n_tokens} tokens later (~{prefill_s:.3f} s at {rate.value:.0f} tok/s) beats "
            f"saving {inputs.file_bytes / MB:.1f} MB now (~{save_s:.3f} s) and restoring it (~{restore_s:.3f} s)"
        )
        return SaveDecision("skip", why, save_s, restore_s, prefill_s)
    why = f"saving (~{save_s:.3f} s) and restoring (~{restore_s:.3f} s) is not slower than re-prefilling (~{prefill_s:.3f} s)"
    return SaveDecision("save", why, save_s, restore_s, prefill_s)


# How a snapshot given up reads in `stoker history`: the state it moves to, by reason code (a
# file the restore's checks refused is kept, since it may be put back; the rest are gone).
DROP_STATES: dict[ReasonCode, str] = {ReasonCode.SNAPSHOT_CORRUPT: "refused"}


def drop_state(reason: ReasonCode) -> str:
    """The history row's to-state for a drop with this reason code."""
    return DROP_STATES.get(reason, "dropped")


def restore_band(resident: float | None) -> Literal["cache", "disk"] | None:
    """Which restore figure a measured restore moves, by how resident its file was; None: mixed."""
    if resident is None:
        return None
    if resident >= CACHED:
        return "cache"
    if resident <= UNCACHED:
        return "disk"
    return None


# --- whether a stop saves ------------------------------------------------------------------


class StopSave(enum.StrEnum):
    """Whether the slots are saved before a server is stopped, and within what."""

    SAVE = "save"  # within the stop budget (`stop_budget`)
    WITHIN_GRACE = "within_grace"  # a hung engine may answer nothing: the stop's grace, no more
    SKIP = "skip"  # nothing worth saving: a stall is a server that never got ready


# By where the stop leads (the launch machine's `after_stop`).
SAVE_BEFORE_STOP: dict[AfterStop, StopSave] = {
    AfterStop.STOP: StopSave.SAVE,
    AfterStop.RESTART: StopSave.SAVE,
    AfterStop.FAIL: StopSave.SAVE,
    AfterStop.HUNG: StopSave.WITHIN_GRACE,
    AfterStop.CRASH: StopSave.SKIP,
}


def save_before_stop(after_stop: AfterStop, grace_s: float) -> float | None:
    """Seconds the snapshots before this stop may take (inf: the snapshot service's own stop
    budget bounds them), or None: no save."""
    match SAVE_BEFORE_STOP[after_stop]:
        case StopSave.SKIP:
            return None
        case StopSave.WITHIN_GRACE:
            return grace_s
    return float("inf")


# --- budgets that scale with the model ------------------------------------------------------


def kv_bytes_per_token(
    *, kv_bytes: float | None = None, kv_cells: int | None = None, model_bytes_per_token: int | None = None
) -> int | None:
    """A KV cell's bytes: the server's own KV buffers over its cells where its log said them,
    else the model's facts (layers x KV heads x (key + value length) x the cache type's size)."""
    if kv_bytes and kv_cells:
        return max(1, round(kv_bytes / kv_cells))
    return model_bytes_per_token


def snapshot_bytes(n_tokens: int, bytes_per_token: int | None) -> int | None:
    """The expected size of a slot file holding n_tokens (the token ids are 4 bytes each)."""
    return None if bytes_per_token is None else n_tokens * (bytes_per_token + 4)


def retention_bytes(setting: int | Literal["auto"], *, bytes_per_token: int | None, n_ctx: int, n_slots: int) -> int:
    """`[snapshots] max_bytes`: a number is the user's; "auto" holds KEEP_FULL_SAVES full-context
    saves of every slot, and never less than 2 GiB (the former fixed default)."""
    if setting != "auto":
        return setting
    full = snapshot_bytes(n_ctx, bytes_per_token)
    if full is None:
        return DEFAULT_MAX_BYTES
    return max(DEFAULT_MAX_BYTES, KEEP_FULL_SAVES * max(1, n_slots) * full)


def stop_budget(setting: float | Literal["auto"], *, expected_bytes: int | None, save_mb_s: Figure | None) -> float:
    """Seconds every save before a stop may take together: a number is the user's; "auto" is
    twice the expected write at this machine's save figure (a slow disk's 100 MB/s before one
    was measured) plus 5 s, at least 20 s and at most 10 minutes."""
    if setting != "auto":
        return float(setting)
    return transfer_budget(expected_bytes, save_mb_s)


def transfer_budget(n_bytes: int | None, rate: Figure | None) -> float:
    """Seconds to allow for moving n_bytes at a measured rate (a slow disk's 100 MB/s before
    one was measured): twice that plus 5 s, at least 20 s and at most 10 minutes."""
    if not n_bytes:
        return DEFAULT_STOP_BUDGET_S
    per_s = rate.value if rate is not None and rate.value > 0 else ASSUMED_SAVE_MB_S
    need = STOP_BUDGET_BASE_S + STOP_BUDGET_SAFETY * n_bytes / (per_s * MB)
    return min(MAX_AUTO_STOP_BUDGET_S, max(DEFAULT_STOP_BUDGET_S, need))


@attrs.frozen
class SaveVerdict:
    """Whether a slot's save can be kept: None, or why not (`too_big`, `no_space`) with figures."""

    why: Literal["too_big", "no_space"] | None
    figures: dict[str, Any] = attrs.field(factory=dict)


def save_verdict(*, expected_bytes: int | None, max_bytes: int, free_bytes: int | None) -> SaveVerdict:
    """Refuse a save before paying for it when its file could not be kept: bigger than the
    retention budget (retention would delete it at once), or than the free disk space."""
    if expected_bytes is None:
        return SaveVerdict(None)
    figures = {"expected_bytes": expected_bytes, "max_bytes": max_bytes, "free_bytes": free_bytes}
    if expected_bytes > max_bytes:
        return SaveVerdict("too_big", figures)
    if free_bytes is not None and expected_bytes > free_bytes:
        return SaveVerdict("no_space", figures)
    return SaveVerdict(None)
