"""Stoker's own upper bound on what a `-ngl auto` server holds with every layer on the GPU, and
when that bound places the plan without the engine's fitter (pure).

The fitter (daemon/engine/fit.py) is asked a `-ngl auto` plan's projection so that placement
has figures and so that a plan which does not fit whole is fitted first (fit_reuse.py
`fits_whole`). Each run initialises the GPU runtime (0.4-0.5 s with CUDA on an H200), and a
daemon started in a fresh home has no kept answer: that run sat between the daemon's start and
its engine's spawn. Where the model is small beside the free memory, its answer decides
nothing: the engine's own fit at start keeps every layer and the context, and placement needs
figures that do not under-count. This bound gives those from the GGUF header alone:

- model: the whole file on the GPU (the engine keeps the input layer, the token embeddings, on
  the host, and a tied output layer duplicates them on the GPU: the GPU holds at most the file);
- context: the KV cache at the plan's context with an f16 cache on every layer (a quantized
  cache or a sliding window holds less);
- compute: one layer's intermediates at the plan's micro-batch in f32 (the engine's graph
  allocator reuses them from layer to layer): the logits of a whole micro-batch (the fitter
  reserves them; the server fewer), the attention scores and their softmax at the whole
  context unless flash attention is on, the FFN's three matrices and the residual stream's
  eight, plus a floor for the runtime's own;
- on the host: the token embeddings and its own small buffers (inputs, masks, the outputs).

It places the plan (`bound_places`) only where the header gives every figure (the KV geometry,
no recurrent state, no experts), the plan's memory-shaping arguments are ones it models, and
even the bound with a quarter again (`CLEARANCE`) leaves every device the engine's margin and
its runtime's share. Near that boundary the fitter is asked as before.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import attrs

from stoker.states.fallback.fit_reuse import FitRoom

MIB = 2**20
F32 = 4

# The memory-shaping arguments whose effect the bound models (a context, a micro-batch, flash
# attention, a KV cache type: f16 bounds every type, the margin, the devices). Any other (-ot,
# -ts, --cpu-moe, -nkvo, -sm, --rpc...) moves tensors between the host and the devices in ways
# the header does not say: the fitter answers.
BOUNDED_FLAGS = frozenset(
    {
        *("-c", "--ctx-size", "-ngl", "--gpu-layers", "--n-gpu-layers", "-fa", "--flash-attn"),
        *("-ctk", "--cache-type-k", "-ctv", "--cache-type-v", "-b", "--batch-size", "-ub", "--ubatch-size"),
        *("-fitt", "--fit-target", "--swa-full", "-dev", "--device"),
    }
)

# The compute buffer's floor on each device and the host's (the runtime's own small tensors,
# the output buffer of a few slots' logits): the fitter printed 2-20 MiB for the host and
# 5-58 MiB of compute on an H200 beyond the terms the bound counts.
COMPUTE_FLOOR_MIB = 256
HOST_FLOOR_MIB = 64

# How far below the free memory the bound must stay, as a share of the bound itself: what it
# cannot see (an architecture's extra intermediates, the allocator's fragmentation) is covered
# by a quarter again. The 13.4 GiB bench model (8B-shaped F16, ctx 4096, flash attention left to
# the engine) bounds to 15 176 MiB (model 13 732, KV 528, compute 917): with the quarter, the
# 1024 MiB margin and CUDA's 524 MiB it needs 20 519 MiB free; an H200 has ~143 000, so the
# fitter is not asked. A model within a quarter of the free memory is.
CLEARANCE = 0.25


@attrs.frozen
class ModelShape:
    """What the bound reads from a model's GGUF header: the file's bytes, its token
    embeddings' bytes, one KV cell's bytes with an f16 cache (None: not stated), and the
    widths the compute buffer scales with (None where the header does not give them as one
    number); `recurrent` and `experts` name what the bound does not model."""

    file_bytes: int
    input_bytes: int
    kv_bytes_per_token_f16: int | None
    n_vocab: int | None
    n_embd: int | None
    n_head: int | None
    n_ff: int | None
    recurrent: bool = False
    experts: int = 0


@attrs.frozen
class WholeGpuBound:
    """Upper bounds in MiB on a server with every layer on `devices` GPU(s): the model and
    its KV cache (split over the devices: at most all of it on one), each device's compute
    buffer, and the host's model part (token embeddings) and buffers."""

    model_mib: float
    context_mib: float
    compute_mib: float
    host_model_mib: float
    host_compute_mib: float
    devices: int = 1

    @property
    def per_device_mib(self) -> float:
        """The most any one device can hold: everything split over the devices, and its own compute."""
        return self.model_mib + self.context_mib + self.compute_mib

    @property
    def vram_mib(self) -> float:
        """Over every device: the model and KV once, a compute buffer on each."""
        return self.model_mib + self.context_mib + self.compute_mib * self.devices

    @property
    def host_mib(self) -> float:
        return self.host_model_mib + self.host_compute_mib


def whole_gpu_bound(
    shape: ModelShape, ctx: int, ubatch: int, flash_attn_on: bool, devices: int = 1
) -> WholeGpuBound | None:
    """The bound for `shape` at `ctx` KV cells (every slot's together) and micro-batch
    `ubatch`; None where the header leaves out a figure it needs, or the model has recurrent
    state or experts (their buffers are not modelled)."""
    widths = (shape.kv_bytes_per_token_f16, shape.n_vocab, shape.n_embd, shape.n_head, shape.n_ff)
    if shape.recurrent or shape.experts or ctx <= 0 or ubatch <= 0 or any(not w or w <= 0 for w in widths):
        return None
    assert shape.kv_bytes_per_token_f16 and shape.n_vocab and shape.n_embd and shape.n_head and shape.n_ff
    logits = ubatch * shape.n_vocab * F32
    scores = 0 if flash_attn_on else 2 * ubatch * ctx * shape.n_head * F32
    ffn = 3 * ubatch * shape.n_ff * F32
    residual = 8 * ubatch * shape.n_embd * F32
    host = 2 * ubatch * (shape.n_embd + ctx) * F32  # the embedded inputs and the mask
    return WholeGpuBound(
        model_mib=shape.file_bytes / MIB,
        context_mib=shape.kv_bytes_per_token_f16 * ctx / MIB,
        compute_mib=(logits + scores + ffn + residual) / MIB + COMPUTE_FLOOR_MIB,
        host_model_mib=shape.input_bytes / MIB,
        host_compute_mib=host / MIB + HOST_FLOOR_MIB,
        devices=max(1, devices),
    )


def bound_need_mib(bound: WholeGpuBound, room: FitRoom) -> float:
    """What the least free device must have for the bound to place the plan: the bound on one
    device with its clearance, the engine's margin and the runtime's share."""
    return bound.per_device_mib * (1 + CLEARANCE) + room.margin_mib + room.reserve_mib


_LAYERS = ("-ngl", "--gpu-layers", "--n-gpu-layers")
_CACHE_TYPES = ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v")


def bounded(args: Iterable[Sequence[str]]) -> bool:
    """Whether the bound models a plan's memory-shaping arguments (each flag with its values, as
    the server gets them): only BOUNDED_FLAGS, every -ngl `auto` (a backend that offloads
    nothing says `-ngl 0`: its model is on the host, not where the bound puts it), and no f32
    KV cache (twice the f16 the bound counts)."""
    for flag, *values in args:
        name, _, inline = flag.partition("=")
        value = inline or (values or [""])[0]
        if name not in BOUNDED_FLAGS:
            return False
        if name in _LAYERS and value != "auto":
            return False
        if name in _CACHE_TYPES and value == "f32":
            return False
    return True


def bound_places(bound: WholeGpuBound | None, room: FitRoom | None, args: Iterable[Sequence[str]]) -> bool:
    """Whether Stoker's bound places a `-ngl auto` plan without the fitter: every figure known,
    only memory-shaping `args` it models (`bounded`: the plan's, each flag with its values), and
    room for the bound with its clearance on the least free device of the reading that decided
    the plan."""
    if bound is None or room is None or not room.free_mib or not bounded(args):
        return False
    return bound_need_mib(bound, room) <= min(room.free_mib.values())


def bound_detail(bound: WholeGpuBound, room: FitRoom) -> str:
    """The sentence a plan placed by the bound records: what it bounded and against which reading."""
    need = bound_need_mib(bound, room)
    least = min(room.free_mib.values())
    each = f" on each of {bound.devices} GPUs" if bound.devices > 1 else ""
    runtime = f", the runtime's {room.reserve_mib} MiB" if room.reserve_mib else ""
    return (
        f"Stoker's upper bound, not llama-fit-params (not run): every layer on the GPU at most "
        f"{bound.per_device_mib:.0f} MiB{each} (model {bound.model_mib:.0f}, KV {bound.context_mib:.0f}, "
        f"compute {bound.compute_mib:.0f}); with a quarter again{runtime} and the {room.margin_mib} MiB margin "
        f"it needs {need:.0f} MiB, and the least free GPU had {least} MiB: the engine's own fit keeps every layer"
    )
