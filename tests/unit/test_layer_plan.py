"""Layer planning's why: GGUF header estimate against the free VRAM of the reading that
decided, GPU by GPU, then the engine's own lines."""

from __future__ import annotations

from stoker.daemon.backends.cuda import CudaBackend
from stoker.daemon.bundles.tinymodel import write_tiny_model
from stoker.daemon.fallback.layers import MIB, estimate, fit_margin, offload_kind, why_actual, why_planned
from stoker.states.fallback.vram import PROBE, FreeVram, devices_for_plan, layer_room, vram_full
from stoker.states.reasons import ReasonCode as R

RESERVE = CudaBackend.runtime_reserve_mib


def gpus(*free: int, name: str = "NVIDIA H200") -> FreeVram:
    return FreeVram({i: mib for i, mib in enumerate(free)}, {i: name for i in range(len(free))})


def test_kv_estimate_from_the_header(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=2)
    est = estimate(model, 4096, gpus(1500, name="GPU"))
    # 2 layers x 4096 tokens x 2 KV heads x (64 + 64) dims x 2 bytes (f16)
    assert est.n_layer == 2 and est.kv_mib == 2 * 4096 * 2 * 128 * 2 / MIB
    assert abs(est.model_mib - model.stat().st_size / MIB) < 1e-9
    assert est.fits is True  # ~1.6 MiB model + 4 MiB KV + 1024 MiB margin <= 1500 MiB free
    assert estimate(model, 4096, gpus(1000)).fits is False  # the margin alone does not fit
    assert estimate(model, 4096, None).fits is None  # no VRAM figure: the engine decides


def test_why_sentences(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf")
    est = estimate(model, 2048, gpus(143150))
    text = why_planned("cuda", est)
    assert text.startswith("-ngl auto: free VRAM (read now) 0: NVIDIA H200 139.8 GiB vs model")
    assert "KV 2 MiB at ctx 2048" in text and "all layers should fit" in text
    assert "not everything fits" in why_planned("cuda", estimate(model, 2048, gpus(1000, name="small")))
    assert why_planned("cpu", None, "gpu_missing") == "CPU plan: nothing is offloaded (gpu_missing)"
    # The probe's figures, where the reading failed, say so.
    assert "free VRAM (probe) 0: NVIDIA H200" in why_planned(
        "cuda", estimate(model, 2048, FreeVram({0: 900}, {0: "NVIDIA H200"}, PROBE))
    )
    after = why_actual(
        "cuda",
        text,
        {
            "offloaded_layers": 3,
            "total_layers": 3,
            "n_ctx": 2048,
            "buffers": [{"kind": "KV", "device": "CUDA0", "mib": 2.0}],
            "device_free_mib": {"CUDA0": 142629},
        },
    )
    assert after.endswith("engine saw CUDA0 139.3 GiB free; engine offloaded 3/3; KV CUDA0 2.0 MiB; n_ctx 2048")


def test_a_fixed_layer_count_is_said_as_it_is(tmp_path):
    """-ngl 4 is not '-ngl auto', and the engine does not fit it: no margin is quoted."""
    model = write_tiny_model(tmp_path / "m.gguf")
    text = why_planned("cuda", estimate(model, 2048, gpus(143150), context_mib=RESERVE, gpu_layers=4))
    assert text.startswith("-ngl 4: free VRAM (read now) 0: NVIDIA H200 139.8 GiB")
    assert "the engine offloads 4 layers as configured, without fitting them" in text
    assert "auto" not in text and "-fitt" not in text
    assert why_planned("cuda", None, layers=4) == (
        "-ngl 4: the engine offloads 4 layers as configured, without fitting them (model size unknown)"
    )


def test_several_gpus_are_quoted_one_by_one_and_each_pays_its_reserve(tmp_path):
    """No device is kept from the engine, so it splits layers over every visible GPU: their
    free VRAM adds up for the verdict, each is quoted on its own, and each pays the runtime's
    reserve and the fit margin (said once, "on each GPU")."""
    model = write_tiny_model(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=2)
    two = gpus(1200, 1200)
    one = estimate(model, 4096, gpus(1200), context_mib=RESERVE)
    both = estimate(model, 4096, two, context_mib=RESERVE)
    assert both.free_vram_mib == 2400 and both.n_devices == 2
    assert both.device == "0: NVIDIA H200, 1: NVIDIA H200"
    assert one.fits is False  # 1.6 + 4 + 524 + 1024 > 1200
    assert both.fits is False  # 1.6 + 4 + 2 x (524 + 1024) > 2400: the reserves do not vanish
    assert estimate(model, 4096, gpus(1600, 1600), context_mib=RESERVE).fits is True
    text = why_planned("cuda", both)
    assert "free VRAM (read now) 0: NVIDIA H200 1200 MiB, 1: NVIDIA H200 1200 MiB vs" in text
    assert "+ 524 MiB CUDA runtime + 1024 MiB margin (-fitt) on each GPU" in text and "2400" not in text


def test_gpus_kept_from_the_server_are_named_and_left_out_of_the_figures(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf")
    free = gpus(300, 143150)
    assert devices_for_plan(free, 1024, RESERVE, "auto") == (1,)
    est = estimate(model, 2048, free, (1,), RESERVE)
    assert est.free_vram_mib == 143150 and est.n_devices == 1 and est.left_out == {"0: NVIDIA H200": 300}
    text = why_planned("cuda", est)
    assert "free VRAM (read now) 1: NVIDIA H200 139.8 GiB vs" in text and "on each GPU" not in text
    assert "left out: 0: NVIDIA H200 300 MiB" in text
    # A respawned plan quotes no reading: the one it was made on is as old as the plan.
    stale = why_planned("cuda", est.without_reading())
    assert "139.8" not in stale and "300" not in stale and "on 1: NVIDIA H200" in stale


def test_room_for_a_layer_is_the_runtimes_share_plus_the_margin():
    """Measured on an H200: NVML said 1499 MiB free, the engine saw 975 after its CUDA context,
    kept its 1024 MiB margin and offloaded 0 of Gemma's layers: no room. 1600 MiB has room."""
    assert layer_room(gpus(1499), 1024, RESERVE) == ()
    assert layer_room(gpus(1499, 1600), 1024, RESERVE) == (1,)
    assert layer_room(gpus(1499), 256, RESERVE) == (0,)  # the hint applied: -fitt 256
    assert layer_room(gpus(1100), 1024, 0) == (0,)  # a backend whose runtime takes nothing measured
    # Which GPUs the server gets: all (nothing passed) unless only some have room.
    assert devices_for_plan(gpus(1600, 1600), 1024, RESERVE, "auto") == ()
    assert devices_for_plan(gpus(1499, 1499), 1024, RESERVE, "auto") == ()  # none: vram_full decides
    assert devices_for_plan(gpus(300, 143150), 1024, RESERVE, 4) == ()  # a fixed count is not fitted
    assert devices_for_plan(None, 1024, RESERVE, "auto") == ()
    full = vram_full("cuda", R.CUDA_VRAM_FULL, gpus(1499, 1331), 1024, RESERVE, "auto")
    assert full is not None and full[0] is R.CUDA_VRAM_FULL
    assert full[1]["free_vram_mib"] == {"0": 1499, "1": 1331} and full[1]["free_vram_source"] == "read now"
    assert "0: NVIDIA H200 1499 MiB, 1: NVIDIA H200 1331 MiB" in full[1]["message"]
    assert "serving on the CPU" not in full[1]["message"]
    assert vram_full("cuda", R.CUDA_VRAM_FULL, gpus(1499, 1600), 1024, RESERVE, "auto") is None
    # The hint names a margin that really leaves room (the H200 run with 699 MiB free: 175 MiB
    # after the runtime, where the hint used to say no margin would help), and says when none does.
    assert '["-fitt", "256"]' in full[1]["hint"]
    small = vram_full("cuda", R.CUDA_VRAM_FULL, gpus(699), 1024, RESERVE, "auto")
    assert small is not None and '["-fitt", "87"]' in small[1]["hint"] and "below 175 MiB" in small[1]["hint"]
    none = vram_full("cuda", R.CUDA_VRAM_FULL, gpus(500), 1024, RESERVE, "auto")
    assert none is not None and "-fitt" not in none[1]["hint"] and "no margin leaves room" in none[1]["hint"]
    assert vram_full("cuda", R.CUDA_VRAM_FULL, gpus(699), 1024, RESERVE, 4) is None
    assert vram_full("cuda", None, gpus(699), 1024, RESERVE, "auto") is None


def test_the_estimate_counts_the_runtime_and_the_margin(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=2)
    assert estimate(model, 4096, gpus(1500)).fits is True  # runtime ignored
    est = estimate(model, 4096, gpus(1500), context_mib=RESERVE)
    assert est.fits is False and est.to_dict()["context_mib"] == 524
    text = why_planned("cuda", est)
    assert "+ 524 MiB CUDA runtime + 1024 MiB margin (-fitt)" in text and "offloads none" in text
    assert "runtime" not in why_planned("cuda", estimate(model, 4096, gpus(1500)))
    # The hint applied (extra_args = ["-fitt", "256"]): the same GPU now fits, as it did there
    assert fit_margin(["-fitt", "256"]) == 256 and fit_margin(["--fit-target", "128,512"]) == 128
    assert fit_margin([]) == fit_margin(["-fitt"]) == fit_margin(["-fitt", "x"]) == 1024
    est = estimate(model, 4096, gpus(1500), context_mib=RESERVE, margin_mib=fit_margin(["-fitt", "256"]))
    assert est.fits is True and "+ 256 MiB margin (-fitt); all layers should fit" in why_planned("cuda", est)


def test_offload_kind():
    assert offload_kind({"offloaded_layers": 15, "total_layers": 33}) == "partial"
    assert offload_kind({"offloaded_layers": 33, "total_layers": 33}) == "full"
    assert offload_kind({"offloaded_layers": 0, "total_layers": 33}) == "none"
    assert offload_kind({}) is None


def test_the_engines_own_free_vram_is_read_from_its_device_lines(tmp_path):
    """`using device CUDA0 (...) - N MiB free`: what the engine saw as it loaded, the figure a
    zero-layer verdict quotes (not the plan's reading, which may be a respawn's old one)."""
    import trio

    from stoker.daemon.engine.ready import ServerLog

    log_path = tmp_path / "server.log"
    log_path.write_text(
        "0.00.100.000 I llama_prepare_model_devices: using device CUDA0 (NVIDIA H200) (0000:00:06.0) - 807 MiB free\n"
        "0.00.100.100 I llama_prepare_model_devices: using device CUDA1 (NVIDIA H200) (0000:00:07.0) - 805 MiB free\n"
        "0.00.900.000 I load_tensors: offloaded 0/33 layers to GPU\n"
    )

    async def read() -> ServerLog:
        log = ServerLog(log_path, 0)
        log.poll(final=True)
        return log

    log = trio.run(read)
    assert log.device_free_mib == {"CUDA0": 807, "CUDA1": 805}
    assert log.devices == ["CUDA0 (NVIDIA H200)", "CUDA1 (NVIDIA H200)"]
    ready = {"offloaded_layers": 0, "total_layers": 33, "device_free_mib": log.device_free_mib}
    assert "engine saw CUDA0 807 MiB, CUDA1 805 MiB free; engine offloaded 0/33" in why_actual(
        "cuda", "-ngl auto", ready
    )
