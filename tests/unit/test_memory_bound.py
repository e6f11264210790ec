"""A `-ngl auto` plan whose model is small beside the free memory is placed by Stoker's own upper
bound, with no fitter run (states/fallback/memory_bound.py, daemon/fallback/memory.py): a daemon
started in a fresh home spawns its engine without initialising the GPU runtime once before it.
Near the boundary, with arguments the bound does not model, or where the header does not give
a figure, the fitter answers as before.

The fitter here is a script that logs each run and answers as llama-fit-params does (the real
one needs a GPU for a GPU plan: tests/gpu/ runs it there)."""

from __future__ import annotations

import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import gguf
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.daemon.bundles.tinymodel import write_tiny_model
from stoker.daemon.control.status_text import estimate_text
from stoker.daemon.engine import fit
from stoker.daemon.engine.fit import memory_items
from stoker.daemon.fallback import memory
from stoker.daemon.models.facts import read_layout
from stoker.states.fallback.fit_reuse import FitRoom, fits_whole
from stoker.states.fallback.memory_bound import (
    CLEARANCE,
    ModelShape,
    WholeGpuBound,
    bound_need_mib,
    bound_places,
    bounded,
    whole_gpu_bound,
)
from stoker.states.launch.records import FITTER, STOKER_BOUND, LaunchPlan

# The tiny model's projection with every layer (66 MiB on the GPU), its fit, and that projection.
FAKE = """#!/bin/sh
echo "$@" >> "{log}"
case "$*" in
  *-ngl\\ 1*--fit-print*) echo "CUDA0 1 2 30"; echo "Host 1 2 2" ;;
  *--fit-print*) echo "CUDA0 2 4 60"; echo "Host 0 0 2" ;;
  *) echo "-c 2048 -ngl 1" ;;
esac
"""

H200 = FitRoom({0: 143_000}, margin_mib=1024, reserve_mib=524)
# An 8B-shaped header (the bench model's widths) over a 13.4 GiB file.
BENCH = ModelShape(14_398_000_000, 2_637_824, 33 * 8 * 256 * 2, 322, 4096, 32, 14336)


@pytest.fixture
def fresh(tmp_path: Path):
    """A fresh home's fitter: nothing kept, and a bundle whose llama-fit-params logs each run."""
    log = tmp_path / "runs.log"
    tool = tmp_path / "bin" / "llama-fit-params"
    tool.parent.mkdir()
    tool.write_text(FAKE.format(log=log))
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    bundle: Any = SimpleNamespace(
        root=tmp_path,
        meta=SimpleNamespace(tools={memory.FIT_TOOL: "bin/llama-fit-params"}, backend="cuda", version="b1"),
    )
    model = write_tiny_model(tmp_path / "tiny.gguf", n_layer=2, n_embd=128, n_head=2)
    fit.keep_answers_in(tmp_path / fit.CACHE_FILE)
    yield bundle, model, log
    fit.keep_answers_in(None)


def runs(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def gpu_plan(model: Path, **kw: Any) -> LaunchPlan:
    return LaunchPlan("cuda", "avx2", "/b", "/b/llama-server", str(model), n_gpu_layers="auto", **kw)


def test_a_model_that_clearly_fits_runs_no_fitter_and_says_the_bound_placed_it(fresh):
    bundle, model, log = fresh
    found = memory.estimate_memory(gpu_plan(model), bundle, H200)
    assert runs(log) == [] and fit.answers().runs == 0
    assert found.source == STOKER_BOUND and not found.partial and found.whole == {}
    assert found.detail is not None and "upper bound, not llama-fit-params (not run)" in found.detail
    assert "the least free GPU had 143000 MiB" in found.detail
    # Its figures bound what the engine holds: the whole file and its KV on the GPU, compute
    # counted; the token embeddings and the host's buffers in RAM.
    layout = read_layout(model)
    assert found.parts["cuda"]["model"] == round(model.stat().st_size / 2**20, 1)
    assert found.parts["cuda"]["compute"] > 0 and found.vram_mib > model.stat().st_size / 2**20
    assert found.parts["Host"]["model"] == round(layout.input_bytes / 2**20, 1) and found.host_mib > 0
    # `stoker status` names it as the bound, with its own figures.
    shown = estimate_text({"estimate": memory.estimate_json(found)})
    assert shown == f"stoker-bound {found.host_mib:.0f} MiB + vram {found.vram_mib:.0f} MiB", shown


def test_near_the_boundary_the_fitter_answers_as_before(fresh):
    bundle, model, log = fresh
    plan = gpu_plan(model)
    bound = memory.plan_bound(plan, H200)
    assert bound is not None
    need = bound_need_mib(bound, H200)
    # A MiB short of the bound's need: the projection is asked, and fits whole (one run, no fit).
    near = FitRoom({0: int(need) - 1}, 1024, 524)
    found = memory.estimate_memory(plan, bundle, near)
    assert found.source == FITTER and len(runs(log)) == 1 and "--fit-print" in runs(log)[0]
    # Less free than the projection needs: the fit runs, then its projection, as before.
    small = FitRoom({0: 1_000}, 1024, 524)
    fitted = memory.estimate_memory(plan, bundle, small)
    assert fitted.source == FITTER and fitted.detail is not None and "fitted: -c 2048 -ngl 1" in fitted.detail
    assert len(runs(log)) == 3


@pytest.mark.parametrize(
    "change",
    [
        {"extra_args": ("-ot", "exps=CPU")},  # tensors moved to the host: the header does not say which
        {"backend_args": ("-ngl", "0")},  # a backend that offloads nothing: the model is on the host
        {"extra_args": ("-ngl", "8")},  # the user's fixed count after the backend's: not the bound's shape
    ],
)
def test_what_the_bound_does_not_model_asks_the_fitter(fresh, change):
    bundle, model, log = fresh
    found = memory.estimate_memory(gpu_plan(model, **change), bundle, H200)
    assert found.source == FITTER and len(runs(log)) >= 1


def test_no_reading_of_free_memory_asks_the_fitter(fresh):
    bundle, model, log = fresh
    assert memory.estimate_memory(gpu_plan(model), bundle, None).source == FITTER
    assert len(runs(log)) == 3  # the fit, its projection, every layer's: as before


def test_the_token_embeddings_bytes_from_the_header(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf")
    embd = [t for t in gguf.GGUFReader(model).tensors if t.name == "token_embd.weight"]
    assert read_layout(model).input_bytes == int(embd[0].n_bytes)


def test_the_bench_model_on_an_h200_is_placed_by_the_bound():
    bound = whole_gpu_bound(BENCH, ctx=4096, ubatch=512, flash_attn_on=False)
    assert bound is not None and 15_000 < bound.per_device_mib < 15_500
    assert bound_places(bound, H200, [("-c", "4096"), ("-ngl", "auto")])
    # A GPU with a fifth of its memory free is near enough that the fitter answers.
    assert not bound_places(bound, FitRoom({0: 20_000}, 1024, 524), [("-c", "4096"), ("-ngl", "auto")])


def test_a_header_without_a_figure_the_bound_needs_gives_none():
    for shape in (
        attrs.evolve(BENCH, kv_bytes_per_token_f16=None),  # per-layer head counts
        attrs.evolve(BENCH, n_ff=None),
        attrs.evolve(BENCH, recurrent=True),  # recurrent state not modelled
        attrs.evolve(BENCH, experts=8),  # experts' buffers not modelled
    ):
        assert whole_gpu_bound(shape, 4096, 512, False) is None
    assert not bound_places(None, H200, [])


def test_which_arguments_the_bound_models():
    assert bounded(memory_items(["-c", "8192", "-fa", "on", "-ngl", "auto", "-ctk", "q8_0", "--fit-target=2048"]))
    assert not bounded(memory_items(["-ngl", "auto", "--cpu-moe"]))
    assert not bounded(memory_items(["-ngl", "auto", "-ts", "1,1"]))
    assert not bounded(memory_items(["-ngl", "auto", "-nkvo"]))  # the KV cache on the host
    assert not bounded(memory_items(["-ngl", "auto", "--n-gpu-layers=12"]))
    assert not bounded(memory_items(["-ngl", "auto", "-ctv", "f32"]))  # twice the f16 cache counted


def test_the_users_context_after_the_plans_is_the_one_bounded(fresh):
    _, model, _ = fresh
    plain = memory.plan_bound(gpu_plan(model, ctx_size=4096), H200)
    larger = memory.plan_bound(gpu_plan(model, ctx_size=4096, extra_args=("-c", "65536")), H200)
    assert plain is not None and larger is not None and larger.context_mib == 16 * plain.context_mib


def test_several_gpus_each_pay_a_compute_buffer():
    one = whole_gpu_bound(BENCH, 4096, 512, True, devices=1)
    two = whole_gpu_bound(BENCH, 4096, 512, True, devices=2)
    assert one is not None and two is not None
    assert two.per_device_mib == one.per_device_mib and two.vram_mib == one.vram_mib + one.compute_mib


mib = st.floats(min_value=0, max_value=200_000, allow_nan=False)


@given(
    model=mib,
    context=mib,
    compute=mib,
    shares=st.lists(st.floats(min_value=0, max_value=1), min_size=1, max_size=4),
    free=st.lists(st.integers(min_value=0, max_value=300_000), min_size=1, max_size=4),
    margin=st.integers(min_value=0, max_value=4096),
    reserve=st.integers(min_value=0, max_value=1024),
)
def test_where_the_bound_places_a_plan_the_fitters_projection_would_fit_whole(
    model, context, compute, shares, free, margin, reserve
):
    """Whatever the fitter projects within the bound (any split of it over the devices), the
    bound places a plan only where the projection would have fitted whole: the engine's own
    fit at start has nothing to fit away, so skipping the fitter changes no placement."""
    room = FitRoom(dict(enumerate(free)), margin, reserve)
    bound = WholeGpuBound(model, context, compute, 0.0, 0.0, devices=len(free))
    projected = {f"CUDA{i}": share * bound.per_device_mib for i, share in enumerate(shares[: len(free)])}
    if bound_places(bound, room, [("-ngl", "auto")]):
        assert fits_whole(projected, room)
        assert min(free) >= bound.per_device_mib * (1 + CLEARANCE) + margin + reserve
