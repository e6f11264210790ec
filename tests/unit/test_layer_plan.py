"""Layer planning's why: GGUF header estimate against free VRAM, then the engine's own lines."""

from __future__ import annotations

from daemon.bundles.tinymodel import write_tiny_model
from daemon.fallback.layers import MIB, estimate, free_vram, why_actual, why_planned


def test_kv_estimate_from_the_header(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=2)
    est = estimate(model, 4096, free_vram_mib=1500, device="0: GPU")
    # 2 layers x 4096 tokens x 2 KV heads x (64 + 64) dims x 2 bytes (f16)
    assert est.n_layer == 2 and est.kv_mib == 2 * 4096 * 2 * 128 * 2 / MIB
    assert abs(est.model_mib - model.stat().st_size / MIB) < 1e-9
    assert est.fits is True  # ~1.6 MiB model + 4 MiB KV + 1024 MiB margin <= 1500 MiB free
    assert estimate(model, 4096, 1000).fits is False  # the margin alone does not fit
    assert estimate(model, 4096, None).fits is None  # no VRAM figure: the engine decides


def test_why_sentences(tmp_path):
    model = write_tiny_model(tmp_path / "m.gguf")
    est = estimate(model, 2048, 143150, "0: NVIDIA H200")
    text = why_planned("cuda", est)
    assert "139.8 GiB free VRAM on 0: NVIDIA H200" in text and "KV 2 MiB at ctx 2048" in text
    assert "all layers should fit" in text
    tight = estimate(model, 2048, 1000, "0: small")
    assert "not everything fits" in why_planned("cuda", tight)
    assert why_planned("cpu", None, "gpu_missing") == "CPU plan: nothing is offloaded (gpu_missing)"
    after = why_actual(
        "cuda",
        text,
        {
            "offloaded_layers": 3,
            "total_layers": 3,
            "n_ctx": 2048,
            "buffers": [{"kind": "KV", "device": "CUDA0", "mib": 2.0}],
        },
    )
    assert after.endswith("engine offloaded 3/3; KV CUDA0 2.0 MiB; n_ctx 2048")
    assert free_vram([{"index": 0, "name": "a", "memory_free_mib": 10}]) == (10, "0: a", 1)
    assert free_vram([{"index": 1, "name": "b", "memory_free_mib": None}]) == (None, None, 0)


def test_several_gpus_share_the_layers_and_each_pays_its_reserve(tmp_path):
    """No --device is passed, so the engine splits layers over every visible GPU: their free
    VRAM adds up, and each one pays the runtime's reserve and the fit margin."""
    from daemon.backends.cuda import CudaBackend

    two = [
        {"index": 0, "name": "NVIDIA H200", "memory_free_mib": 1200},
        {"index": 1, "name": "NVIDIA H200", "memory_free_mib": 1200},
        {"index": 2, "name": "lost", "memory_free_mib": None},
    ]
    free, label, n = free_vram(two)
    assert (free, n) == (2400, 2) and label == "2 GPUs (0: NVIDIA H200, 1: NVIDIA H200)"
    model = write_tiny_model(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=2)
    one = estimate(model, 4096, 1200, "0: NVIDIA H200", CudaBackend.runtime_reserve_mib)
    both = estimate(model, 4096, free, label, CudaBackend.runtime_reserve_mib, n_devices=n)
    assert one.fits is False  # 1.6 + 4 + 524 + 1024 > 1200
    assert both.fits is False  # 1.6 + 4 + 2 x (524 + 1024) > 2400: the reserves do not vanish
    assert estimate(model, 4096, 3200, label, CudaBackend.runtime_reserve_mib, n_devices=2).fits is True
    text = why_planned("cuda", both)
    assert "2.3 GiB free VRAM on 2 GPUs (0: NVIDIA H200, 1: NVIDIA H200)" in text
    assert "+ 2 x 524 MiB CUDA runtime + 2 x 1.0 GiB margin (-fitt)" in text


def test_the_cuda_runtime_counts_against_free_vram(tmp_path):
    """Measured on an H200: NVML said 1499 MiB free, the engine saw 975 after its CUDA context,
    kept its 1024 MiB margin and offloaded 0 of Gemma's layers. The estimate must say so too."""
    from daemon.backends.cuda import CudaBackend

    model = write_tiny_model(tmp_path / "m.gguf", n_layer=2, n_embd=128, n_head=2)
    assert estimate(model, 4096, 1500, "0: NVIDIA H200").fits is True  # runtime ignored
    est = estimate(model, 4096, 1500, "0: NVIDIA H200", CudaBackend.runtime_reserve_mib)
    assert est.fits is False and est.to_dict()["context_mib"] == 524
    text = why_planned("cuda", est)
    assert "+ 524 MiB CUDA runtime + 1.0 GiB margin (-fitt)" in text and "offloads none" in text
    assert "runtime" not in why_planned("cuda", estimate(model, 4096, 1500, "0: NVIDIA H200"))

    # The hint applied (extra_args = ["-fitt", "256"]): the same GPU now fits, as it did there
    from daemon.fallback.layers import fit_margin

    assert fit_margin(["-fitt", "256"]) == 256 and fit_margin(["--fit-target", "128,512"]) == 128
    assert fit_margin([]) == fit_margin(["-fitt"]) == fit_margin(["-fitt", "x"]) == 1024
    est = estimate(model, 4096, 1500, "0: NVIDIA H200", CudaBackend.runtime_reserve_mib, fit_margin(["-fitt", "256"]))
    assert est.fits is True and "+ 256 MiB margin (-fitt); all layers should fit" in why_planned("cuda", est)
