"""Layer planning: let the engine fit, and say why in words a user can check.

Stoker does not pick a layer count itself: a GPU plan runs with `-ngl auto` and the engine's
`--fit on` (the defaults), which shrink layers to the free VRAM minus a margin. What Stoker
adds is the explanation: from the GGUF header (model size, layers, KV geometry) it estimates
the model and the KV cache at the configured context, compares them with the free VRAM the
probe saw, and after the launch reads what the engine really did (`offloaded N/M layers`,
the `model`/`KV buffer size` lines). `status` shows `layers: {planned, offloaded, total, why}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs

from daemon.models.facts import read_header

MIB = 2**20
FIT_MARGIN_MIB = 1024  # llama-server's default -fitt per device
KV_BYTES_PER_ELEMENT = 2  # f16 K and V (the engine's default cache type)


@attrs.frozen
class LayerEstimate:
    """Model and KV sizes at the configured context, against the free VRAM seen."""

    n_layer: int | None
    model_mib: float
    kv_mib: float | None  # all layers, the whole context (upper bound for sliding-window models)
    ctx: int
    free_vram_mib: int | None
    device: str | None
    context_mib: int = 0  # the runtime's own VRAM, taken before the engine fits (Backend.runtime_reserve_mib)
    margin_mib: int = FIT_MARGIN_MIB  # what the engine keeps free: -fitt, from extra_args or its default
    n_devices: int = 1  # the engine splits layers over all of them; each pays the reserve and margin

    @property
    def fits(self) -> bool | None:
        if self.free_vram_mib is None or self.kv_mib is None:
            return None
        per_device = (self.context_mib + self.margin_mib) * max(1, self.n_devices)
        return self.model_mib + self.kv_mib + per_device <= self.free_vram_mib

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "fits": self.fits}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def estimate(
    model_path: str | Path,
    ctx: int,
    free_vram_mib: int | None = None,
    device: str | None = None,
    context_mib: int = 0,
    margin_mib: int = FIT_MARGIN_MIB,
    n_devices: int = 1,
) -> LayerEstimate:
    """Read the GGUF header (not the tensors) and estimate model + KV bytes at `ctx`."""
    path = Path(model_path)
    meta = read_header(path)
    arch = str(meta.get("general.architecture") or "")
    n_layer = _int(meta.get(f"{arch}.block_count"))
    heads = _int(meta.get(f"{arch}.attention.head_count"))
    heads_kv = _int(meta.get(f"{arch}.attention.head_count_kv")) or heads
    width = _int(meta.get(f"{arch}.embedding_length"))
    key_len = _int(meta.get(f"{arch}.attention.key_length")) or (width // heads if width and heads else None)
    value_len = _int(meta.get(f"{arch}.attention.value_length")) or key_len
    if ctx <= 0:
        ctx = _int(meta.get(f"{arch}.context_length")) or 4096
    kv_mib = None
    if n_layer and heads_kv and key_len and value_len:
        kv_mib = n_layer * ctx * heads_kv * (key_len + value_len) * KV_BYTES_PER_ELEMENT / MIB
    return LayerEstimate(
        n_layer, path.stat().st_size / MIB, kv_mib, ctx, free_vram_mib, device, context_mib, margin_mib, n_devices
    )


def fit_margin(extra_args: Iterable[str]) -> int:
    """The engine's fit margin per device in MiB: `-fitt N` in extra_args, else its default.
    (A list of margins, one per device, counts by its first.)"""
    args = list(extra_args)
    for flag, value in zip(args, args[1:]):
        if flag in ("-fitt", "--fit-target"):
            try:
                return int(value.split(",")[0])
            except ValueError:
                break
    return FIT_MARGIN_MIB


def free_vram(devices: Iterable[Mapping[str, Any]]) -> tuple[int | None, str | None, int]:
    """(free VRAM in MiB over every detected device, which devices, how many).

    A GPU plan passes no `--device`, so the engine splits layers over every visible device
    (`--split-mode layer`); each of them also pays the runtime's reserve and the fit margin."""
    known = [d for d in devices if isinstance(d.get("memory_free_mib"), int)]
    if not known:
        return None, None, 0
    names = ", ".join(f"{d.get('index')}: {d.get('name')}" for d in known)
    label = names if len(known) == 1 else f"{len(known)} GPUs ({names})"
    return sum(int(d["memory_free_mib"]) for d in known), label, len(known)


def _mib(value: float | None) -> str:
    if value is None:
        return "?"
    return f"{value / 1024:.1f} GiB" if value >= 1024 else f"{value:.0f} MiB"


def why_planned(backend: str, est: LayerEstimate | None, reason: str | None = None) -> str:
    """The sentence for `layers.why` before the engine has said anything."""
    if backend == "cpu":
        return "CPU plan: nothing is offloaded" + (f" ({reason})" if reason else "")
    if est is None:
        return "-ngl auto: the engine fits layers to free VRAM (model size unknown)"
    size = f"model {_mib(est.model_mib)} + KV {_mib(est.kv_mib)} at ctx {est.ctx}"
    if est.free_vram_mib is None:
        return f"-ngl auto: the engine fits layers to free VRAM; {size}"
    verdict = {
        True: "all layers should fit",
        False: "not everything fits: the engine offloads fewer layers (or shrinks the context, or offloads none)",
        None: "the engine decides",
    }[est.fits]
    times = f"{est.n_devices} x " if est.n_devices > 1 else ""
    context = f" + {times}{_mib(est.context_mib)} {backend.upper()} runtime" if est.context_mib else ""
    return (
        f"-ngl auto: {_mib(est.free_vram_mib)} free VRAM on {est.device} vs {size}{context} "
        f"+ {times}{_mib(est.margin_mib)} margin (-fitt); {verdict}"
    )


def why_actual(backend: str, planned_why: str, ready: Mapping[str, Any]) -> str:
    """After ready: the engine's own figures (offloaded N/M, KV and model buffers per device)."""
    offloaded, total = ready.get("offloaded_layers"), ready.get("total_layers")
    buffers = ready.get("buffers") or []
    kv = [b for b in buffers if b.get("kind") == "KV"]
    parts = [planned_why]
    if offloaded is not None:
        parts.append(f"engine offloaded {offloaded}/{total}")
    elif backend != "cpu":
        parts.append("the engine printed no offload line (no GPU device loaded)")
    if kv:
        parts.append("KV " + ", ".join(f"{b['device']} {b['mib']:.{0 if b['mib'] >= 10 else 1}f} MiB" for b in kv))
    if ready.get("n_ctx"):
        parts.append(f"n_ctx {ready['n_ctx']}")
    return "; ".join(parts)
