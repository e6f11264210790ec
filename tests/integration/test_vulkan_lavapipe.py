"""The Vulkan engine end to end on Mesa's software Vulkan driver (lavapipe/llvmpipe).

Built by Stoker's builder (GGML_VULKAN=ON, Debian's headers and glslc) or found in the build
cache, verified and installed, and launched through the daemon with the opt-in
STOKER_VULKAN_ALLOW_SOFTWARE=1: the engine really runs its Vulkan backend (`using device
Vulkan0 (llvmpipe ...)`, `offloaded 3/3 layers to GPU`), its smoke tokens equal the CPU
build's, and status reports it as the CPU with `vulkan_software_device`: a rasteriser is no
accelerator. Skipped, with the reason printed, only where lavapipe or the Vulkan build tools
are not installed (`./dev test` installs them as root on Debian).

What this proves and what it does not: docs/backends.md, "Vulkan on lavapipe".
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import zipfile
from pathlib import Path

import httpx
import psutil
import pytest

from stoker.daemon.backends.vulkan import ALLOW_SOFTWARE, VISIBLE_DEVICES, VulkanBackend
from stoker.daemon.bundles.metadata import BundleMeta
from stoker.daemon.bundles.variants import host_platform, vulkan_toolkit
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.launch.table import LAUNCH
from stoker.states.machine import event_from_json
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config

OPT_IN = {ALLOW_SOFTWARE: "1"}


def _lavapipe_or_skip() -> None:
    why = None
    if shutil.which("vulkaninfo") is None:
        why = "vulkaninfo is not installed"
    else:
        detection = VulkanBackend(environ=OPT_IN).detect()
        if not detection.usable:
            why = f"no Vulkan device, not even lavapipe: {detection.message}"
    if why is None:
        try:
            vulkan_toolkit()
        except StokerError as err:
            why = err.message
    if why is not None:
        reason = (
            f"lavapipe Vulkan test skipped: {why} (apt-get install libvulkan-dev glslc spirv-headers "
            "mesa-vulkan-drivers vulkan-tools; ./dev test does it as root on Debian)"
        )
        print(reason, file=sys.stderr)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def vulkan_bundle() -> Path:
    """The Vulkan bundle zip, built by Stoker's builder or reused from the build cache (a cold
    build is ~the CPU build plus the shaders: see docs/bundles.md for the figure)."""
    _lavapipe_or_skip()
    from stoker.daemon.bundles.build import build_bundle

    result = build_bundle(
        StokerPaths.from_env(),
        backend="vulkan",
        progress=lambda line: print(f"[vulkan_bundle] {line}", file=sys.stderr),
    )
    return result.zip_path


def _meta(zip_path: Path) -> BundleMeta:
    with zipfile.ZipFile(zip_path) as zf:
        return BundleMeta.from_json(zf.read("bundle.json"))


@pytest.mark.engine
def test_lavapipe_runs_the_vulkan_engine_and_its_tokens_equal_the_cpus(vulkan_bundle, cpu_bundle, monkeypatch):
    from stoker.daemon.bundles.installed import install_bundle
    from stoker.daemon.bundles.verify import verify_bundle

    meta, cpu = _meta(vulkan_bundle), _meta(cpu_bundle)
    assert meta.backend == "vulkan" and "libvulkan.so.1" in meta.required_system_libs
    assert "bin/libggml-vulkan.so.0" in {f.path for f in meta.files}
    assert not any("cuda" in lib for lib in meta.required_system_libs)
    # Without the opt-in the engine sees no Vulkan device here: verification says so.
    monkeypatch.delenv(ALLOW_SOFTWARE, raising=False)
    monkeypatch.delenv(VISIBLE_DEVICES, raising=False)
    with pytest.raises(StokerError) as refused:
        verify_bundle(vulkan_bundle)
    assert refused.value.reason == "bundle_verify_failed" and refused.value.evidence["backend"] == "vulkan"
    # With it, the engine lists llvmpipe and generates on it.
    monkeypatch.setenv(ALLOW_SOFTWARE, "1")
    report = verify_bundle(vulkan_bundle, smoke=True)
    assert any("Vulkan0: llvmpipe" in d for d in report.devices), report.devices
    # The reference was recorded at build time by the engine's default choice (on this machine,
    # with no GPU, its CPU backend); lavapipe's greedy tokens equal it and the CPU bundle's.
    assert report.smoke_tokens == meta.smoke.tokens
    assert cpu.smoke is not None and meta.smoke.tokens == cpu.smoke.tokens
    installed = install_bundle(vulkan_bundle, StokerPaths.from_env())
    assert installed.meta.backend == "vulkan"


@pytest.mark.engine
def test_daemon_installs_and_serves_vulkan_on_lavapipe_and_says_it_is_the_cpu(
    stoker_home, tmp_path, vulkan_bundle, model
):
    """A forced `prefer = "vulkan"`, no Vulkan bundle installed, a local manifest with the
    built one: the daemon installs it (smoke included, on lavapipe), launches it on llvmpipe and
    reports the truth: Vulkan engine, 3/3 layers on the Vulkan device, backend cpu."""
    data = vulkan_bundle.read_bytes()
    meta = _meta(vulkan_bundle)
    manifest = tmp_path / "manifest.json"
    entry = {
        "url": vulkan_bundle.as_uri(),
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "backend": "vulkan",
        "variant": meta.variant,
        "version": meta.version,
        "platform": host_platform(),
    }
    manifest.write_text(json.dumps({"schema_version": 1, "bundles": [entry]}))
    d = DaemonProcess(stoker_home, env=OPT_IN)
    write_config(d.paths, tiny_config(model) + f'[backend]\nprefer = "vulkan"\n[bundles]\nmanifest = "{manifest}"\n')
    d.start()
    try:
        st = d.wait_state("ready", timeout=600)
        assert st["planned_backend"] == "vulkan" and st["variant"] == meta.variant
        # Not accelerated, and status says why in the evidence's words.
        assert st["backend"] == "cpu" and st["fallback_reason"] == "vulkan_software_device"
        (why,) = [f for f in st["fallbacks"] if f["backend"] == "vulkan"]
        assert why["reason"] == "vulkan_software_device"
        assert "llvmpipe" in why["message"] and "nothing is accelerated" in why["message"]
        assert why["evidence"]["software_devices"] and why["evidence"]["offloaded_layers"] == 3
        # The engine's own figures: every layer went to the Vulkan device.
        assert (st["layers"]["offloaded"], st["layers"]["total"]) == (3, 3)
        assert st["probes"]["vulkan"]["usable"] is True
        # The plan named the rasteriser for the engine (it never picks a CPU-type device itself).
        rows = [r for r in reversed(d.history(machine="launch", limit=500)) if r["event"] == "PlanReady"]
        plan = event_from_json(LAUNCH, rows[-1]["event"], rows[-1]["event_data"]).plan
        assert plan.backend == "vulkan" and plan.backend_env == ((VISIBLE_DEVICES, "0"),)
        assert Path(psutil.Process(st["pid"]).cmdline()[0]).parent.parent.name.startswith("vulkan-")
        # The install went through the machine: downloaded, verified, smoke-tested on lavapipe.
        install = [r["to_state"] for r in reversed(d.history(machine=f"install:vulkan-{meta.variant}"))]
        assert install[-1] == "installed" and "smoke_testing" in install
        steps = [(r["event"], r["reason"]) for r in reversed(d.history(machine="fallback"))]
        assert ("BundleMissing", "binary_missing_vulkan_detected") in steps
        # It serves.
        answer = httpx.post(
            f"{st['endpoint']}/completion",
            headers={"Authorization": f"Bearer {st['api_key']}"},
            json={"prompt": "Once upon a time", "n_predict": 4, "temperature": 0},
            timeout=60,
        )
        assert answer.status_code == 200 and answer.json()["tokens_predicted"] == 4
        log = Path(st["log_path"]).read_text(errors="replace")
        assert "using device Vulkan0 (llvmpipe" in log and "offloaded 3/3 layers to GPU" in log
    finally:
        d.stop()
        for proc in servers_for(model):
            proc.kill()
