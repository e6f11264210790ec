"""Choosing a manifest entry by detected capability (recorded NVML answers of real GPUs)."""

from __future__ import annotations

import pytest

import backend_recordings as rec
from stoker.daemon.backends.cuda import CudaBackend
from stoker.daemon.backends.tools import recorded_runner
from stoker.daemon.bundles.metadata import BundleManifest
from stoker.daemon.core.errors import StokerError
from stoker.daemon.backends import load_backends
from stoker.daemon.install.manifest import choose_entry
from stoker.daemon.install.installer import install_failed_reason

PLATFORM = "linux-x86_64"


def entry(variant, archs, min_driver="580.65.06", version="b11434"):
    return {
        "url": f"https://example.invalid/cuda-{variant}.zip",
        "sha256": "a" * 64,
        "size": 10,
        "backend": "cuda",
        "variant": variant,
        "version": version,
        "platform": PLATFORM,
        "min_driver": min_driver,
        "cuda_archs": archs,
    }


def detect(gpus, driver="580.95.05", cuda_driver=13000):
    backend = CudaBackend(
        nvml=rec.FakeNvml(gpus, driver=driver, cuda_driver=cuda_driver),
        run=recorded_runner({}),
        sysfs_root="/nonexistent-sys",
    )
    return backend, backend.detect()


def manifest(*entries):
    return BundleManifest.from_dict({"schema_version": 1, "bundles": list(entries)})


def test_the_entry_built_for_this_gpu_wins():
    plugin, h200 = detect([rec.h200()])
    m = manifest(entry("cuda12", ["80-real"]), entry("cuda13", ["90-real"]))
    assert choose_entry(m, "cuda", detection=h200, plugin=plugin, platform=PLATFORM).variant == "cuda13"


def test_the_driver_floor_and_the_cuda_major_decide():
    plugin, old = detect([rec.h200()], driver="535.104.05", cuda_driver=12020)
    m = manifest(entry("cuda13", ["90-real"], min_driver="580.65.06"), entry("cuda12", ["90-real"], "525.60.13"))
    assert choose_entry(m, "cuda", detection=old, plugin=plugin, platform=PLATFORM).variant == "cuda12"


FAMILIES = {"turing-ampere": ["75-real", "80-real", "86-real"], "ada-hopper": ["89-real", "90-real"]}


def test_a_mirror_of_cuda_families_gives_each_gpu_its_own():
    """One release published as a bundle per architecture family (the turing one listed first):
    an H200 (9.0) gets ada-hopper, an A6000 (8.6) turing-ampere."""
    m = manifest(*(entry("avx2", archs) for archs in FAMILIES.values()))
    plugin, h200 = detect([rec.h200()])
    assert choose_entry(m, "cuda", detection=h200, plugin=plugin, platform=PLATFORM).cuda_archs == (
        "89-real",
        "90-real",
    )
    plugin, a6000 = detect([rec.a6000()])
    chosen = choose_entry(m, "cuda", detection=a6000, plugin=plugin, platform=PLATFORM)
    assert chosen.cuda_archs == tuple(FAMILIES["turing-ampere"])


def test_an_update_keeps_the_installed_family():
    """An update has no detection to hand: it takes the entry built for the installed bundle's
    architectures (the same family first, else one covering them), never another family."""
    wide = ["75-real", "80-real", "86-real", "89-real", "90-real", "100-real", "120-real", "120-virtual"]
    m = manifest(*(entry("avx2", archs, version="b11500") for archs in [*FAMILIES.values(), wide]))
    kept = ("89-real", "90-real")
    assert choose_entry(m, "cuda", platform=PLATFORM, keep_archs=kept).cuda_archs == kept
    only_wide = manifest(entry("avx2", FAMILIES["turing-ampere"]), entry("avx2", wide))
    assert choose_entry(only_wide, "cuda", platform=PLATFORM, keep_archs=kept).cuda_archs == tuple(wide)
    with pytest.raises(StokerError) as err:
        choose_entry(manifest(entry("avx2", FAMILIES["turing-ampere"])), "cuda", platform=PLATFORM, keep_archs=kept)
    assert err.value.reason == "bundle_missing" and err.value.evidence["installed_archs"] == list(kept)


def test_a_mirror_that_keeps_its_releases_offers_the_newest_that_fits():
    """Publishing appends: the older release is listed first, the newer one is chosen (for an
    install and for an update alike), and a newer one built for another GPU is not."""
    plugin, h200 = detect([rec.h200()])
    m = manifest(
        entry("avx2", ["89-real", "90-real"], version="b11434"),
        entry("avx2", ["89-real", "90-real"], version="b11500"),
        entry("avx2", ["75-real", "80-real", "86-real"], version="b11600"),
    )
    assert choose_entry(m, "cuda", detection=h200, plugin=plugin, platform=PLATFORM).version == "b11500"
    assert choose_entry(m, "cuda", platform=PLATFORM, keep_archs=("89-real", "90-real")).version == "b11500"


def test_nothing_fits_says_why_per_entry():
    plugin, a6000 = detect([rec.a6000()])  # compute capability 8.6
    m = manifest(entry("cuda13", ["90-real"]))
    with pytest.raises(StokerError) as err:
        choose_entry(m, "cuda", detection=a6000, plugin=plugin, platform=PLATFORM)
    refused = err.value.evidence["refused"]["cuda13 b11434"]
    assert refused["reason"] == "cuda_unavailable" and refused["compute_capability"] == ["8.6"]


def test_no_gpu_no_entry():
    plugin = CudaBackend(
        nvml=rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound),
        run=recorded_runner({}),
        sysfs_root="/nonexistent-sys",
    )
    with pytest.raises(StokerError) as err:
        choose_entry(
            manifest(entry("cuda13", ["90-real"])), "cuda", detection=plugin.detect(), plugin=plugin, platform=PLATFORM
        )
    assert "gpu_missing" in str(err.value.evidence["refused"])


def test_reason_per_backend():
    backends = load_backends()
    assert install_failed_reason(backends, "cuda") == "cuda_bundle_install_failed"
    assert install_failed_reason(backends, "cpu") == "cpu_bundle_install_failed"
    assert install_failed_reason(backends, "rpc") == "bundle_verify_failed"  # not loaded: no family to ask
