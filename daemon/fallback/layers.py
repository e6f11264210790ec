"""Layer planning: let the engine fit, and say why in words a user can check.

Stoker does not pick a layer count itself: a GPU plan runs with `-ngl auto` and the engine's
`--fit on` (the defaults), which shrink layers to the free VRAM minus a margin, or with the
count the config fixes (`-ngl N`: the engine loads that many, without fitting). What Stoker
adds is the explanation: from the GGUF header (model size, layers, KV geometry) it estimates
the model and the KV cache at the configured context and compares them with the free VRAM of
the reading that decided the plan (daemon/fallback/vram.py: read at planning, the probe's
only when that fails), GPU by GPU; after the launch it reads what the engine really did
(`offloaded N/M layers`, the free VRAM it saw on each device, the `KV buffer size` lines).
`status` shows `layers: {planned, offloaded, total, why}`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping

import attrs

from stoker.daemon.models.facts import read_header
from stoker.states.fallback.vram import FreeVram, mib_text
from stoker.states.launch.records import GpuLayers

MIB = 2**20
FIT_MARGIN_MIB = 1024  # llama-server's default -fitt per device
KV_BYTES_PER_ELEMENT = 2  # f16 K and V (the engine's default cache type)


def _mib_map(value: Mapping[str, int] | None) -> dict[str, int]:
    return dict(value or {})


@attrs.frozen
class LayerEstimate:
    """Model and KV sizes at the configured context, against the free VRAM of the GPUs the
    plan gives the server, as one reading saw it."""

    n_layer: int | None
    model_mib: float
    kv_mib: float | None  # all layers, the whole context (upper bound for sliding-window models)
    ctx: int
    free_vram_mib: int | None  # summed over the GPUs given to the server (None: no reading)
    device: str | None  # those GPUs: "0: NVIDIA H200, 1: NVIDIA H200"
    context_mib: int = 0  # the runtime's own VRAM per GPU, taken before the engine fits (Backend.runtime_reserve_mib)
    margin_mib: int = FIT_MARGIN_MIB  # what the engine keeps free per GPU: -fitt, from extra_args or its default
    n_devices: int = 1  # the engine splits layers over all of them; each pays the reserve and margin
    gpu_layers: GpuLayers = "auto"  # the plan's -ngl
    free_by_device: dict[str, int] = attrs.field(factory=dict, converter=_mib_map, hash=False)  # label -> MiB
    left_out: dict[str, int] = attrs.field(factory=dict, converter=_mib_map, hash=False)  # GPUs not given: no room
    source: str | None = None  # which reading: "read now" (at planning) or "probe"

    @property
    def fits(self) -> bool | None:
        if self.free_vram_mib is None or self.kv_mib is None:
            return None
        margin = self.margin_mib if self.gpu_layers == "auto" else 0  # a fixed count is not fitted
        per_device = (self.context_mib + margin) * max(1, self.n_devices)
        return self.model_mib + self.kv_mib + per_device <= self.free_vram_mib

    def without_reading(self) -> "LayerEstimate":
        """The same estimate with no free-VRAM figures: for a server respawned with its plan,
        whose reading is as old as the plan (the engine's own figures say what it saw)."""
        return attrs.evolve(self, free_vram_mib=None, free_by_device={}, left_out={}, source=None)

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "fits": self.fits}


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def estimate(
    model_path: str | Path,
    ctx: int,
    free: FreeVram | None = None,
    devices: tuple[int, ...] = (),
    context_mib: int = 0,
    margin_mib: int = FIT_MARGIN_MIB,
    gpu_layers: GpuLayers = "auto",
) -> LayerEstimate:
    """Read the GGUF header (not the tensors) and estimate model + KV bytes at `ctx`, against
    the free VRAM of `devices` (the GPUs given to the server; empty: all of them) in `free`."""
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
    given = devices or (free.indices if free else ())
    by_device = free.by_label(given) if free else {}
    return LayerEstimate(
        n_layer,
        path.stat().st_size / MIB,
        kv_mib,
        ctx,
        sum(by_device.values()) if by_device else None,
        ", ".join(by_device) or None,
        context_mib,
        margin_mib,
        max(1, len(by_device)),
        gpu_layers,
        by_device,
        free.by_label(i for i in free.indices if i not in given) if free else {},
        free.source if free else None,
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


def why_planned(backend: str, est: LayerEstimate | None, reason: str | None = None, layers: GpuLayers = "auto") -> str:
    """The sentence for `layers.why` before the engine has said anything."""
    if backend == "cpu":
        return "CPU plan: nothing is offloaded" + (f" ({reason})" if reason else "")
    layers = est.gpu_layers if est is not None else layers
    ngl = f"-ngl {layers}"
    how = (
        "the engine fits layers to free VRAM"
        if layers == "auto"
        else f"the engine offloads {layers} layers as configured, without fitting them"
    )
    if est is None:
        return f"{ngl}: {how} (model size unknown)"
    size = f"model {mib_text(est.model_mib)} + KV {mib_text(est.kv_mib)} at ctx {est.ctx}"
    each = " on each GPU" if est.n_devices > 1 else ""
    if est.free_vram_mib is None:
        where = f" on {est.device}" if est.device else ""
        return f"{ngl}: {how}{where}; {size}"
    listed = ", ".join(f"{label} {mib_text(mib)}" for label, mib in est.free_by_device.items())
    costs = f" + {mib_text(est.context_mib)} {backend.upper()} runtime" if est.context_mib else ""
    if layers == "auto":
        costs += f" + {mib_text(est.margin_mib)} margin (-fitt)"
        verdict = {
            True: "all layers should fit",
            False: "not everything fits: the engine offloads fewer layers (or shrinks the context, or offloads none)",
            None: "the engine decides",
        }[est.fits]
    else:
        verdict = {True: "they should fit", False: "they may not fit", None: "the engine loads them"}[est.fits]
        verdict = f"{how}; {verdict}"
    text = f"{ngl}: free VRAM ({est.source}) {listed} vs {size}{costs}{each if costs else ''}; {verdict}"
    if est.left_out:
        out = ", ".join(f"{label} {mib_text(mib)}" for label, mib in est.left_out.items())
        text += f"; left out: {out} (less free than the runtime's share and the margin: no layer could go there)"
    return text


def why_with_workers(why: str, workers: int) -> str:
    """A plan whose layers go to RPC workers: the local backend's sentence would say a CPU head
    offloads nothing, while every layer is on the workers' devices."""
    head = why.replace("CPU plan: nothing is offloaded", "CPU head: nothing on this machine's devices")
    return f"{head}; layers on {workers} RPC worker{'s' if workers != 1 else ''}, split by their free memory"


def why_actual(backend: str, planned_why: str, ready: Mapping[str, Any]) -> str:
    """After ready: the engine's own figures (offloaded N/M, the free VRAM it saw on each
    device, KV and model buffers per device)."""
    offloaded, total = ready.get("offloaded_layers"), ready.get("total_layers")
    buffers = ready.get("buffers") or []
    kv = [b for b in buffers if b.get("kind") == "KV"]
    parts = [planned_why]
    seen = engine_free(ready)
    if seen:
        parts.append(f"engine saw {seen} free")
    if offloaded is not None:
        parts.append(f"engine offloaded {offloaded}/{total}")
    elif backend != "cpu":
        parts.append("the engine printed no offload line (no GPU device loaded)")
    if kv:
        parts.append("KV " + ", ".join(f"{b['device']} {b['mib']:.{0 if b['mib'] >= 10 else 1}f} MiB" for b in kv))
    if ready.get("n_ctx"):
        parts.append(f"n_ctx {ready['n_ctx']}")
    return "; ".join(parts)


def engine_free(ready: Mapping[str, Any]) -> str:
    """'CUDA0 807 MiB, CUDA1 805 MiB': the free VRAM the engine reported per device as it
    loaded (its `using device ... MiB free` lines), or '' where it printed none."""
    seen = ready.get("device_free_mib") or {}
    return ", ".join(f"{device} {mib_text(mib)}" for device, mib in seen.items())


def offload_kind(ready: Mapping[str, Any]) -> str | None:
    """How much of the model the engine put on the GPU: "full", "partial" (15/33 layers),
    "none", or None where it printed no offload line (not ready, or no GPU device)."""
    offloaded, total = ready.get("offloaded_layers"), ready.get("total_layers")
    if not isinstance(offloaded, int) or not isinstance(total, int) or total <= 0:
        return None
    if offloaded <= 0:
        return "none"
    return "full" if offloaded >= total else "partial"
