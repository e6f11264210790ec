"""The fallback orchestrator end to end through the real daemon on this CPU-only machine.

The daemon probes every backend (out of process, or in-process where no driver or tool is
involved: metal off a Mac, rocm/vulkan without their tools), finds no GPU (cuda, rocm, vulkan, metal:
gpu_missing, each with the evidence that decided it), serves on the CPU and says why in
`status`. A forced `stoker use cuda` fails with the reason instead of falling back.
`stoker install` streams progress from a loopback server. Nothing here claims a GPU.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
import sys

import pytest

from stoker.daemon.bundles.variants import host_platform
from stoker.daemon.core.errors import StokerError
from tests.bundlekit import make_bundle_zip
from tests.httpfault import Fault
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.waits import wait_until

GPUS = ("cuda", "rocm", "vulkan", "metal")


def stoker(d: DaemonProcess, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=d.env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.engine
def test_no_gpu_serves_on_cpu_and_status_says_why(daemon, model):
    daemon.start()
    st = daemon.wait_state("ready", timeout=120)
    assert st["backend"] == "cpu" and st["planned_backend"] == "cpu"
    assert st["preference"] == {
        "prefer": "auto",
        "forced": False,
        "candidates": ["cuda", "rocm", "metal", "vulkan", "cpu"],
    }
    assert st["fallback_reason"] == "gpu_missing"
    why = {f["backend"]: f for f in st["fallbacks"]}
    assert set(why) == set(GPUS)
    for gpu in GPUS:
        assert why[gpu]["reason"] == "gpu_missing" and why[gpu]["message"]
        assert why[gpu]["evidence"]["present"] is False
    assert "nvml" in why["cuda"]["evidence"]  # what NVML said when it could not load
    assert st["layers"]["planned"] == 0 and st["layers"]["why"].startswith("CPU plan")
    assert st["layers"]["offloaded"] is None  # a CPU build prints no offload line: nothing claimed
    # Every verdict is a recorded transition; NVML is only ever touched out of process.
    for gpu in GPUS:
        rows = daemon.history(machine=f"probe:{gpu}")
        assert any(r["to_state"] == "unavailable" and r["reason"] == "gpu_missing" for r in rows)
    steps = [
        (r["from_state"], r["event"], r["to_state"], r["reason"]) for r in reversed(daemon.history(machine="fallback"))
    ]
    assert steps[0][1] == "PlanRequested"
    assert ("checking", "CheckFailed", "checking", "gpu_missing") in steps
    assert steps[-1][1:3] == ("LaunchSucceeded", "settled")
    # The human status names each fallback and why.
    out = stoker(daemon, "status")
    assert out.returncode == 0, out.stderr
    assert "fallback  cuda: gpu_missing" in out.stdout and "backend   cpu" in out.stdout
    # `stoker probe` answers from the cache, `--fresh` probes again (a new generation).
    cached = json.loads(stoker(daemon, "probe", "--json").stdout)
    assert {b["backend"]: b["cached"] for b in cached["backends"]}["cuda"] is True
    fresh = json.loads(stoker(daemon, "probe", "--fresh", "--json").stdout)
    by = {b["backend"]: b for b in fresh["backends"]}
    assert by["cuda"]["cached"] is False and by["cuda"]["generation"] > 1
    assert by["cuda"]["reason"] == "gpu_missing" and by["cpu"]["usable"] is True
    assert "probed" not in (by["cuda"].get("evidence") or {})  # NVML: a subprocess, always
    assert by["metal"]["evidence"]["probed"] == "in-process (quick_detect)"  # not a Mac: no driver needed
    human = stoker(daemon, "probe").stdout
    assert "cuda: absent [gpu_missing]" in human and "Usable backends: cpu" in human
    assert "metal: generation" in human and "in-process (no driver needed)" in human


@pytest.mark.engine
def test_forced_cuda_fails_loudly_then_auto_serves_again(daemon, model):
    daemon.start()
    first = daemon.wait_state("ready", timeout=120)
    out = stoker(daemon, "use", "cuda", "--json")
    reply = json.loads(out.stdout)
    assert reply["prefer"] == "cuda" and reply["forced"] is True
    assert 'prefer = "cuda"' in daemon.paths.config_file.read_text()
    st = daemon.wait_state("failed", timeout=60)
    assert st["reason"] == "gpu_missing" and "forced" in st["evidence"]["message"]
    assert "does not fall back" in st["message"] and st["backend"] is None
    assert st["evidence"]["forced"] is True
    assert st["endpoint"] is None and servers_for(model) == []  # no silent CPU server
    assert st["preference"]["forced"] is True and st["preference"]["candidates"] == ["cuda"]
    status = stoker(daemon, "status")
    assert status.returncode == 1 and "gpu_missing" in status.stdout
    back = stoker(daemon, "use", "auto")
    assert back.returncode in (0, 1), back.stderr
    st = daemon.wait_for(lambda s: s["state"] == "ready" and s["pid"] != first["pid"], 120, "ready on auto")
    assert st["backend"] == "cpu" and not st["preference"]["forced"]
    assert 'prefer = "auto"' in daemon.paths.config_file.read_text()


def test_install_streams_progress_lines(stoker_home, tmp_path, fault_server):
    """`stoker install cpu --json` through a daemon: progress lines, then the installed bundle."""
    data = make_bundle_zip(tmp_path, "compat.zip", variant="compat", smoke_tokens=None).read_bytes()
    import hashlib

    url = fault_server.add("/cpu-compat.zip", data, Fault(rate=max(len(data) // 2, 1000)))
    manifest = tmp_path / "manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "bundles": [
                    {
                        "url": url,
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "backend": "cpu",
                        "variant": "compat",
                        "version": "b11434",
                        "platform": host_platform(),
                    }
                ],
            }
        )
    )
    d = DaemonProcess(stoker_home)
    # A model that does not exist: the autostart fails at once (model_missing), before any
    # install, so the daemon sits idle while `stoker install` is exercised.
    write_config(d.paths, tiny_config(tmp_path / "absent.gguf") + f'[bundles]\nmanifest = "{manifest}"\n')
    d.start()
    try:
        st = d.wait_state("failed", timeout=60)
        assert st["reason"] == "model_missing"
        out = stoker(d, "install", "cpu", "--variant", "compat", "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
        progress = [line["progress"] for line in lines if "progress" in line]
        assert progress and progress[-1]["bytes_done"] == len(data)
        assert lines[-1]["ok"] is True and lines[-1]["installed"]["variant"] == "compat"
        assert (d.paths.bundles_dir / "cpu-compat" / "bundle.json").exists()
        # A newer bundle that cannot be fetched: exit 1 with the reason and the evidence.
        newer = make_bundle_zip(tmp_path, "newer.zip", variant="compat", smoke_tokens=None).read_bytes()
        _manifest_for(tmp_path, fault_server.url("/gone.zip"), newer, "compat")
        bad = stoker(d, "install", "cpu", "--variant", "compat", "--json")
        assert bad.returncode == 1
        error = json.loads(bad.stdout)["error"]
        assert error["reason"] == "cpu_bundle_install_failed" and error["evidence"]["status"] == 404
        assert (d.paths.bundles_dir / "cpu-compat" / "bundle.json").exists()  # the installed one stays
    finally:
        d.stop()


def test_use_refuses_an_unknown_backend(stoker_home, tmp_path):
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(tmp_path / "absent.gguf"))
    d.start()
    try:
        with pytest.raises(StokerError) as err:
            d.call("use", backend="tpu")
        assert err.value.reason == "bad_request"
    finally:
        d.stop()


def _manifest_for(tmp_path, url: str, data: bytes, variant: str) -> Path:
    import hashlib

    manifest = tmp_path / "manifest.json"
    manifest.write_text(
        json.dumps(
            {
                "schema_version": 1,
                "bundles": [
                    {
                        "url": url,
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "size": len(data),
                        "backend": "cpu",
                        "variant": variant,
                        "version": "b11434",
                        "platform": host_platform(),
                    }
                ],
            }
        )
    )
    return manifest


def _big_bundle_zip(tmp_path, size: int):
    """A fake CPU bundle padded with `size` random bytes (a download that takes a while)."""
    import hashlib
    import os

    import attrs

    from stoker.daemon.bundles.archive import pack_bundle
    from stoker.daemon.bundles.metadata import BundleMeta, FileEntry
    from tests.bundlekit import make_bundle_dir

    src = make_bundle_dir(tmp_path / "big.src", variant="compat", smoke_tokens=None)
    pad = src / "bin" / "libggml-pad.so"
    pad.write_bytes(os.urandom(size))
    os.chmod(pad, 0o644)
    meta = BundleMeta.read(src)
    entry = FileEntry("bin/libggml-pad.so", size, 0o644, hashlib.sha256(pad.read_bytes()).hexdigest())
    meta = attrs.evolve(meta, files=tuple(sorted(meta.files + (entry,), key=lambda f: f.path)))
    (src / "bundle.json").write_text(meta.to_json())
    return pack_bundle(src, tmp_path / "big.zip")


def test_daemon_killed_mid_download_resumes_after_restart(stoker_home, tmp_path, fault_server):
    import threading

    data = _big_bundle_zip(tmp_path, 4 * 2**20).read_bytes()
    url = fault_server.add("/slow.zip", data, Fault(rate=2**20))  # about 4 s
    manifest = _manifest_for(tmp_path, url, data, "compat")
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(tmp_path / "absent.gguf") + f'[bundles]\nmanifest = "{manifest}"\n')
    d.start()
    try:
        d.wait_state("failed", timeout=60)
        caller = threading.Thread(target=lambda: stoker(d, "install", "cpu", "--variant", "compat", "--json"))
        caller.start()
        downloads = d.paths.data_dir / "downloads"
        wait_until(
            lambda: any(p.stat().st_size >= 2**20 for p in downloads.glob("*.part")),
            timeout=30,
            what="a batch (1 MiB) of the bundle on disk",
        )
        d.kill9()  # mid-stream: the part file and its sidecar stay
        caller.join(30)
        assert list((d.paths.data_dir / "downloads").glob("*.part"))
        assert not (d.paths.bundles_dir / "cpu-compat").exists()
        fault_server.set_fault("/slow.zip", None)
        d.start()
        # The machine's last transition, not the promoted directory: that appears a step before it.
        wait_until(
            lambda: [r["to_state"] for r in d.history(machine="install:cpu-compat", limit=1)] == ["installed"],
            timeout=60,
            what="install:cpu-compat installed after the resumed download",
            detail=lambda: d.log_text()[-3000:],
        )
        assert (d.paths.bundles_dir / "cpu-compat" / "bundle.json").exists()
        rows = [(r["from_state"], r["event"], r["to_state"]) for r in reversed(d.history(machine="install:cpu-compat"))]
        assert ("downloading", "Resumed", "downloading") in rows and rows[-1][2] == "installed"
        last = fault_server.requests("/slow.zip")[-1]
        assert last.range is not None and last.status == 206  # continued, not restarted
    finally:
        d.stop()


@pytest.mark.engine
def test_missing_cpu_bundle_is_installed_on_demand_then_served(stoker_home, tmp_path, fault_server, cpu_bundle, model):
    """The install-then-retry path with a real engine: no bundle at all, a manifest with the
    real CPU bundle on the loopback server; the daemon installs it, re-checks and serves."""
    data = cpu_bundle.read_bytes()
    from stoker.daemon.bundles.metadata import BundleMeta
    from stoker.daemon.bundles.verify import verify_bundle  # noqa: F401  (the zip is the built one)
    import zipfile

    with zipfile.ZipFile(cpu_bundle) as zf:
        meta = BundleMeta.from_json(zf.read("bundle.json"))
    url = fault_server.add("/cpu.zip", data, Fault(cut_after=len(data) // 3))
    manifest = _manifest_for(tmp_path, url, data, meta.variant)
    d = DaemonProcess(stoker_home)
    write_config(d.paths, tiny_config(model) + f'[bundles]\nmanifest = "{manifest}"\n')
    d.start()
    try:
        st = d.wait_state("ready", timeout=300)
        assert st["backend"] == "cpu" and st["variant"] == meta.variant
        steps = [(r["event"], r["to_state"], r["reason"]) for r in reversed(d.history(machine="fallback"))]
        assert ("BundleMissing", "installing", "bundle_missing") in steps
        assert ("BundleInstalled", "checking", None) in steps
        assert steps[-1][:2] == ("LaunchSucceeded", "settled")
        install = [r["to_state"] for r in reversed(d.history(machine=f"install:cpu-{meta.variant}"))]
        assert install[-1] == "installed" and "smoke_testing" in install
        assert [r.range for r in fault_server.requests_when("/cpu.zip", 2)][1] is not None  # resumed after the cut
    finally:
        d.stop()
        for proc in servers_for(model):
            proc.kill()
