"""Choosing a manifest entry by detected capability (recorded NVML answers of real GPUs)."""

from __future__ import annotations

import pytest

import backend_recordings as rec
from daemon.backends.cuda import CudaBackend
from daemon.backends.tools import recorded_runner
from daemon.bundles.metadata import BundleManifest
from daemon.core.errors import StokerError
from daemon.backends import load_backends
from daemon.install.manifest import choose_entry
from daemon.install.service import install_failed_reason

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
