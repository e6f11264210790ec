"""A plan's memory, estimated when planning ends: the engine's fitter first, Stoker's own after.

Except where the fitter's answer would decide nothing: a `-ngl auto` GPU plan whose upper bound
from the GGUF header (states/fallback/memory_bound.py: the file, an f16 KV cache, one layer's
compute, the token embeddings on the host) clearly fits the free VRAM read for the plan is placed
by that bound, `source` "stoker-bound", complete, its `detail` saying it is an upper bound that no
fitter run checked and what free VRAM it was held against. No fitter runs for it (each run
initialises the GPU runtime: 0.4-0.5 s with CUDA on an H200, before a fresh daemon's spawn).

The complete plan (daemon/fallback/launch_plan.py) is handed to the bundle's llama-fit-params
(daemon/engine/fit.py) with the same model, context, slots' context, GPU layers, devices and
memory-shaping arguments the server will get, in the server's environment; its projection
(host and each device: model, context, compute) is recorded in the plan as `memory`, with
`source` "llama-fit-params" (its answers are kept and reused: states/fallback/fit_reuse.py). Where the bundle has no fitter (built before BUILDER_REVISION 2) or
it fails (exit status, timeout, output not read), Stoker estimates: the model file's size plus
the KV cache at that context from the GGUF header (`kv_bytes_per_token_f16`), `source`
"stoker", `partial` (it has no compute buffers), and `detail` says why the fitter did not
answer. states/fleet/placement.py then decides with those figures whether the server fits.

One correction: llama-fit-params reserves the compute buffers for the logits of a whole
micro-batch (its `n_outputs_max` is n_batch: 512 outputs at the default -ub), while llama-server
reserves them for its slots only (`server_output_limits`: one output per slot without a draft
model). With a large vocabulary that is most of the figure: Gemma 3 270M (262k tokens) projects
524 MiB of compute on the CPU where its server reports 26 MiB. Stoker takes
(512 - slots) x vocabulary x 4 bytes off the largest compute figure (the device that computes the
output layer), and `detail` says so; measured after that, Gemma 3 270M: 307 MiB projected against
347 MiB of buffers its server reported, SmolLM2-135M 192 against 201 (uncorrected: 820 and 288).

The context: the plan's `-c` when it sets one (the KV cells of every slot together, as the
server divides them); with `-c 0` the server sizes the KV for the trained context of each slot
(`llama_params_fit`, non-unified KV), so the fitter (which has no `-np`) gets `-c` = trained
context x slots.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import attrs
import trio

from stoker.daemon.bundles.installed import InstalledBundle
from stoker.daemon.engine.fit import FitFailed, memory_args, memory_items, project
from stoker.daemon.engine.process import ServerSpec, server_env
from stoker.daemon.models.facts import facts_from_header, model_facts, read_header, read_layout, vocab_size
from stoker.daemon.models.identity import model_identity
from stoker.states.fallback.fit_reuse import FitRoom
from stoker.states.fallback.memory_bound import ModelShape, WholeGpuBound, bound_detail, bound_places, whole_gpu_bound
from stoker.states.launch.records import FITTER, STOKER_BOUND, STOKER_ESTIMATE, LaunchPlan, MemoryEstimate

log = logging.getLogger(__name__)

MIB = 2**20
FIT_TOOL = "fit_params"  # the bundle.json `tools` role of llama-fit-params


def trained_context(model_path: str) -> int | None:
    """The context the model was trained on (the GGUF header's `context_length`; None: not
    stated). Blocking, but the header is cached."""
    meta = read_header(Path(model_path))
    arch = str(meta.get("general.architecture") or "")
    value = meta.get(f"{arch}.context_length")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def kv_context(plan: LaunchPlan) -> int | None:
    """The KV cells the server allocates for all its slots together (None: not known)."""
    if plan.ctx_size:
        return plan.ctx_size
    trained = trained_context(plan.model_path)
    return None if trained is None else trained * max(1, plan.parallel)


def fitter_args(plan: LaunchPlan, ctx: int | None) -> list[str]:
    """The plan's arguments the fitter gets: context, flash attention, the backend's (-ngl,
    devices, RPC) and the memory-shaping ones among the model's and the user's."""
    args = ["-c", str(ctx)] if ctx else []
    if plan.flash_attn:
        args += ["-fa", plan.flash_attn]
    return args + memory_args(plan.backend_args) + memory_args(plan.extra_args)


def _arg(args: tuple[str, ...], names: tuple[str, ...], default: int) -> int:
    value = default
    for i, item in enumerate(args):
        name, _, inline = item.partition("=")
        if name in names:
            raw = inline or (args[i + 1] if i + 1 < len(args) else "")
            value = int(raw) if raw.isdigit() else value
    return value


def server_outputs_correction(plan: LaunchPlan, parts: dict[str, dict[str, float]]) -> tuple[str, float] | None:
    """(device, MiB) to take off the fitter's compute figure: the logits it reserves for a whole
    micro-batch beyond the server's one per slot; None when there is nothing to take off."""
    n_vocab = vocab_size(plan.model_path)
    if not n_vocab or not parts:
        return None
    batch = _arg(plan.extra_args, ("-b", "--batch-size"), 2048)
    ubatch = min(batch, _arg(plan.extra_args, ("-ub", "--ubatch-size"), 512))
    extra = (ubatch - min(batch, max(1, plan.parallel))) * n_vocab * 4 / MIB
    device = max(parts, key=lambda name: parts[name].get("compute", 0.0))
    taken = min(extra, parts[device].get("compute", 0.0))
    return (device, round(taken, 1)) if taken >= 1 else None


def _content_id(plan: LaunchPlan) -> str | None:
    """The model file's content id (the one snapshots use, cached; milliseconds), which keys
    the fitter's answers: a file touched without a change keeps them. None where unreadable."""
    try:
        return model_identity(plan.model_path).model_id
    except (OSError, ValueError):
        return None


def fitter_of(bundle: InstalledBundle) -> Path | None:
    """The bundle's llama-fit-params, or None when its bundle.json names none."""
    tool = bundle.meta.tools.get(FIT_TOOL)
    return bundle.root / tool if tool else None


def stoker_estimate(plan: LaunchPlan, detail: str | None) -> MemoryEstimate:
    """Stoker's own figures: the file's size and the f16 KV cache at the plan's context; on a
    GPU plan the layers' share of both on the GPU (all of it for -ngl auto: the engine may
    place fewer), the rest on the host. No compute buffers: partial."""
    started = time.monotonic()
    size = Path(plan.model_path).stat().st_size / MIB
    facts = model_facts(plan.model_path)
    ctx = kv_context(plan) or 0
    kv = (facts.kv_bytes_per_token_f16 or 0) * ctx / MIB
    share = 0.0
    if not plan.on_cpu:
        layers, total = plan.n_gpu_layers, (facts.block_count or 0) + 1
        share = 1.0 if layers == "auto" or not total else min(1.0, layers / total)
    parts: dict[str, dict[str, float]] = {"Host": {"model": size * (1 - share), "context": kv * (1 - share)}}
    devices: dict[str, float] = {}
    if share:
        parts[plan.backend] = {"model": size * share, "context": kv * share}
        devices[plan.backend] = (size + kv) * share
    why = [detail] if detail else []
    if not facts.kv_bytes_per_token_f16:
        why.append("the GGUF header does not give the KV geometry: no KV cache counted")
    return MemoryEstimate(
        STOKER_ESTIMATE,
        host_mib=round((size + kv) * (1 - share), 1),
        devices={k: round(v, 1) for k, v in devices.items()},
        parts={k: {n: round(x, 1) for n, x in p.items()} for k, p in parts.items()},
        partial=True,
        detail="; ".join(why) or None,
        seconds=round(time.monotonic() - started, 3),
    )


def fitted_short(plan: LaunchPlan, fitted: tuple[str, ...], ctx: int | None) -> bool:
    """Whether the fitter's arguments ("-c N -ngl N [-ts ...] [-ot ...]") leave something of
    the plan off the GPU: fewer layers than the model has (its blocks and the output layer), a
    smaller context than `ctx` asked, or tensors overridden to the host."""
    layers = model_facts(plan.model_path).block_count
    ngl = _arg(fitted, ("-ngl",), -1)
    fitted_ctx = _arg(fitted, ("-c",), 0)
    return (
        (layers is not None and 0 <= ngl < layers + 1)
        or bool(ctx and fitted_ctx and fitted_ctx < ctx)
        or any(a in ("-ot", "--override-tensor") for a in fitted)
    )


def take_off(parts: dict[str, dict[str, float]], correction: tuple[str, float] | None) -> None:
    """Take `server_outputs_correction`'s MiB off its device's compute figure in `parts`."""
    if correction is not None and correction[0] in parts:
        device, taken = correction
        parts[device]["compute"] = round(max(0.0, parts[device].get("compute", 0.0) - taken), 1)


def whole_offload(
    tool: Path,
    model: str,
    args: list[str],
    env: dict[str, str],
    correction: tuple[str, float] | None,
    whole: dict[str, dict[str, float]] | None = None,
) -> dict[str, float]:
    """The devices' MiB with every layer on the GPU(s) for the plan's arguments `args`: `whole`,
    the projection the fit was asked after (no run), else the fitter's (kept like every
    projection); the same compute correction as the fitted one; empty when it does not answer."""
    if whole is not None:
        parts = {name: dict(part) for name, part in whole.items()}
    else:
        try:
            parts = project(tool, model, [*args, "-ngl", "999"], env).parts
        except (FitFailed, OSError, ValueError) as err:
            log.warning("llama-fit-params did not project every layer of %s on the GPU: %s", model, err)
            return {}
    take_off(parts, correction)
    return {name: round(sum(p.values()), 1) for name, p in parts.items() if name != "Host"}


def _number(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def model_shape(model_path: str) -> ModelShape:
    """What Stoker's own bound reads from the model's GGUF header (cached: no tensor is read)."""
    path = Path(model_path)
    layout = read_layout(path)
    meta = layout.meta
    arch = str(meta.get("general.architecture") or "")
    facts = facts_from_header(meta)
    return ModelShape(
        file_bytes=path.stat().st_size,
        input_bytes=layout.input_bytes,
        kv_bytes_per_token_f16=facts.kv_bytes_per_token_f16,
        n_vocab=layout.array_lengths.get("tokenizer.ggml.tokens"),
        n_embd=_number(meta, f"{arch}.embedding_length"),
        n_head=_number(meta, f"{arch}.attention.head_count"),
        n_ff=_number(meta, f"{arch}.feed_forward_length"),
        recurrent=facts.recurrent,
        experts=_number(meta, f"{arch}.expert_count") or 0,
    )


def plan_bound(plan: LaunchPlan, room: FitRoom) -> WholeGpuBound | None:
    """Stoker's upper bound (states/fallback/memory_bound.py) on the plan with every layer on the
    GPUs of `room`; None where the header does not give it."""
    batch = _arg(plan.extra_args, ("-b", "--batch-size"), 2048)
    ubatch = min(batch, _arg(plan.extra_args, ("-ub", "--ubatch-size"), 512))
    # The last -c is the one the server takes: the user's extra_args come after the plan's.
    ctx = _arg(plan.extra_args, ("-c", "--ctx-size"), kv_context(plan) or 0)
    try:
        shape = model_shape(plan.model_path)
    except (OSError, ValueError) as err:
        log.info("no upper bound on %s's memory: %s", plan.model_path, err)
        return None
    return whole_gpu_bound(shape, ctx, ubatch, plan.flash_attn == "on", len(room.free_mib))


def bound_estimate(plan: LaunchPlan, bound: WholeGpuBound, room: FitRoom, seconds: float) -> MemoryEstimate:
    """The plan's memory as the bound placed it: labelled as Stoker's bound ("stoker-bound"), complete (it
    counts compute buffers), its detail saying it is an upper bound and what it was held against."""
    parts = {
        "Host": {"model": bound.host_model_mib, "context": 0.0, "compute": bound.host_compute_mib},
        plan.backend: {
            "model": bound.model_mib,
            "context": bound.context_mib,
            "compute": bound.compute_mib * bound.devices,
        },
    }
    return MemoryEstimate(
        STOKER_BOUND,
        host_mib=round(bound.host_mib, 1),
        devices={plan.backend: round(bound.vram_mib, 1)},
        parts={k: {n: round(x, 1) for n, x in p.items()} for k, p in parts.items()},
        partial=False,
        detail=bound_detail(bound, room),
        seconds=round(seconds, 3),
    )


def estimate_memory(plan: LaunchPlan, bundle: InstalledBundle, room: FitRoom | None = None) -> MemoryEstimate:
    """The plan's memory: for a `-ngl auto` plan whose upper bound clearly fits the free memory
    of `room` (the reading for the plan, the engine's margin and the runtime's share), that
    bound, with no fitter run; else the fitter's projection (`room` lets a plan that fits whole
    skip the fit), else Stoker's estimate saying why. Blocking (may run a program, reads the
    header): call it in a thread."""
    if not plan.on_cpu and plan.n_gpu_layers == "auto" and room is not None:
        started = time.monotonic()
        bound = plan_bound(plan, room)
        if bound is not None and bound_places(bound, room, memory_items(fitter_args(plan, kv_context(plan)))):
            return bound_estimate(plan, bound, room, time.monotonic() - started)
    tool = fitter_of(bundle)
    if tool is None:
        detail = f"the {bundle.meta.backend} bundle {bundle.meta.version} has no llama-fit-params"
    else:
        env = server_env(ServerSpec(plan.server_path, plan.model_path, env=dict(plan.backend_env)))
        fit_first = not plan.on_cpu and plan.n_gpu_layers == "auto"
        ctx = kv_context(plan)
        args = fitter_args(plan, ctx)
        try:
            found = project(
                tool, plan.model_path, args, env, fit_first=fit_first, room=room, model_id=_content_id(plan)
            )
        except (FitFailed, OSError, ValueError) as err:
            detail = f"llama-fit-params did not answer: {err}"
            log.warning("%s; Stoker estimates %s's memory itself", detail, plan.model_path)
        else:
            parts = found.parts
            said = [f"fitted: {' '.join(found.fitted_args)}"] if found.fitted_args else []
            correction = server_outputs_correction(plan, parts)
            if correction is not None:
                device, taken = correction
                take_off(parts, correction)
                said.append(
                    f"{taken:g} MiB taken off {device}'s compute: the logits of one output per slot, as llama-server "
                    f"reserves them, not of a whole micro-batch"
                )
            host = sum(parts.get("Host", {}).values())
            devices = {name: sum(p.values()) for name, p in parts.items() if name != "Host"}
            whole: dict[str, float] = {}
            if found.fitted_args and fitted_short(plan, found.fitted_args, ctx):
                whole = whole_offload(tool, plan.model_path, args, env, correction, found.whole)
                if whole:
                    said.append(f"every layer at the context asked would take {sum(whole.values()):.0f} MiB of VRAM")
            return MemoryEstimate(
                FITTER,
                host_mib=round(host, 1),
                devices={k: round(v, 1) for k, v in devices.items()},
                parts=parts,
                detail="; ".join(said) or None,
                seconds=found.seconds,
                whole=whole,
            )
    return stoker_estimate(plan, detail)


async def with_memory(plan: LaunchPlan, room: FitRoom | None = None) -> LaunchPlan:
    """`plan` with its `memory` estimated (in a thread); unchanged when even Stoker's estimate
    cannot be made (no estimate is no reason to refuse a launch)."""
    try:
        bundle = await trio.to_thread.run_sync(InstalledBundle.from_dir, Path(plan.bundle_root))
        return attrs.evolve(plan, memory=await trio.to_thread.run_sync(estimate_memory, plan, bundle, room))
    except Exception:
        log.exception("estimating the memory of %s failed", plan.model_path)
        return plan


def estimate_json(memory: MemoryEstimate | None) -> dict[str, Any] | None:
    """A plan's memory estimate for status: which estimate answered and its figures."""
    if memory is None:
        return None
    return {
        "source": memory.source,
        "ram_mib": memory.host_mib,
        "vram_mib": memory.vram_mib,
        "devices": dict(memory.devices),
        "parts": {k: dict(v) for k, v in memory.parts.items()},
        "partial": memory.partial,
        "detail": memory.detail,
        "seconds": memory.seconds,
        # Fitted short of every layer: what every layer would take (0: nothing short).
        "whole_vram_mib": memory.whole_vram_mib,
    }
