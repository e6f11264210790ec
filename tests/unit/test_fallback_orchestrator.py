"""The fallback orchestrator with recorded hardware answers (NVML of an H200, no GPU at all).

Bundles are bundlekit's fake engines on disk: the orchestrator only reads their metadata
here; nothing is launched. The CUDA detections come from the real CudaBackend fed with
recorded NVML answers, so the driver floor and architecture checks are the real ones.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from types import SimpleNamespace

import attrs
import pytest
import trio

import backend_recordings as rec
from stoker.daemon.backends.cpu import CpuBackend
from stoker.daemon.backends.cuda import CudaBackend
from stoker.daemon.backends.tools import recorded_runner
from stoker.daemon.backends.vulkan import VulkanBackend
from stoker.daemon.bundles.tinymodel import write_tiny_model
from stoker.daemon.config.model import BackendConfig, Config, ServerConfig
from stoker.daemon.core.errors import StokerError
from stoker.daemon.engine.process import server_argv
from stoker.daemon.backends.registry import candidates_for
from stoker.daemon.fallback.orchestrator import FallbackOrchestrator
from stoker.daemon.launch.supervisor import server_spec
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.probes.verdicts import ProbeService
from stoker.states.fallback import table as F
from stoker.states.install.sources import Source
from stoker.states.launch import records as LR
from stoker.states.reasons import ReasonCode as R
from stoker.store import open_store
from bundlekit import make_bundle_dir

PID = 4242


def cuda_backend(nvml) -> CudaBackend:
    return CudaBackend(nvml=nvml, run=recorded_runner({}), sysfs_root="/nonexistent-sys")


def no_gpu_cuda() -> CudaBackend:
    return cuda_backend(rec.FakeNvml(init_error=rec.NVMLError_LibraryNotFound))


class FakeInstalls:
    """Stands in for InstallService: writes a (fake) CUDA bundle, or fails like the real one."""

    def __init__(self, paths: StokerPaths, *, fail: bool = False, min_driver: str | None = "580.65.06"):
        self.paths, self.fail, self.min_driver, self.calls = paths, fail, min_driver, []

    async def install(self, backend, *, variant=None, detection=None, beside=False):
        self.calls.append((backend, detection))
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise StokerError(
                R.CUDA_BUNDLE_INSTALL_FAILED,
                "download failed",
                {"cause": "download_failed", "kind": "http_status", "status": 404, "step": "downloading"},
            )
        install_cuda_bundle(self.paths, min_driver=self.min_driver)


def install_cuda_bundle(paths: StokerPaths, *, min_driver="580.65.06", archs=("90-real",)) -> None:
    make_bundle_dir(
        paths.bundles_dir / "cuda-avx2", backend="cuda", variant="avx2", cuda_archs=archs, min_driver=min_driver
    )


@pytest.fixture
def paths(stoker_home):
    p = StokerPaths.from_env()
    make_bundle_dir(p.bundles_dir / "cpu-avx2", backend="cpu", variant="avx2")
    return p


@pytest.fixture
def config(tmp_path):
    model = write_tiny_model(tmp_path / "tiny.gguf")
    return Config(server=ServerConfig(model=str(model), ctx_size=2048))


@asynccontextmanager
async def orchestrator(paths, cuda, installs=None, store=None):
    store = store or open_store(":memory:")
    backends = {"cpu": CpuBackend(tester=lambda flags: {f: "usable" for f in flags}), "cuda": cuda}

    async def run_probe(name, *, timeout):
        await trio.lowlevel.checkpoint()  # a probe yields, as a real one waiting on its subprocess does
        return backends[name].detect()

    probes = ProbeService(store, tuple(backends), run_probe=run_probe)
    orch = FallbackOrchestrator(paths, store, probes, installs or FakeInstalls(paths), backends)
    async with trio.open_nursery() as nursery:
        await nursery.start(probes.serve)
        yield orch
        nursery.cancel_scope.cancel()


def supervisor_for(plan, ready=None):
    return SimpleNamespace(plan=plan, ready_evidence=ready)


def died_before_ready(plan, **evidence):
    """The launch machine's MakePlan after `plan`'s server died before it was ever ready."""
    return LR.MakePlan(previous=plan, failure=LR.PlanFailure(R.SERVER_CRASHED, LR.ExitPhase.NEVER_READY, evidence))


def ready_evidence(offloaded, total=3):
    return {
        "pid": PID,
        "offloaded_layers": offloaded,
        "total_layers": total,
        "n_ctx": 2048,
        "buffers": [{"kind": "KV", "device": "CUDA0", "mib": 16.0}],
        "evidence_lines": {"offloaded": f"load_tensors: offloaded {offloaded}/{total} layers to GPU"},
    }


def transitions(orch):
    return [(r.from_state, r.event, r.to_state, r.reason) for r in reversed(orch.store.history(machine="fallback"))]


def test_candidates():
    # Auto mode asks each loaded backend where it goes (auto_rank): a plugin after the GPUs, CPU last.
    loaded = {
        "cpu": CpuBackend(),
        "vulkan": VulkanBackend(),
        "cuda": CudaBackend(),
        "rpc": SimpleNamespace(auto_rank=100),
    }
    assert candidates_for("auto", loaded) == (("cuda", "vulkan", "rpc", "cpu"), False)
    assert candidates_for("cuda", loaded) == (("cuda",), True)


async def test_missing_bundle_on_present_gpu_is_installed_then_launched(paths, config):
    nvml = rec.FakeNvml([rec.h200(processes=[(PID, 900 * rec.MIB)])])
    installs = FakeInstalls(paths)
    async with orchestrator(paths, cuda_backend(nvml), installs) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda" and plan.n_gpu_layers == "auto" and plan.server_path.endswith("llama-server")
        assert installs.calls and installs.calls[0][1].usable  # installed for the detected H200
        steps = transitions(orch)
        assert ("checking", "BundleMissing", "installing", "binary_missing_nvidia_detected") in steps
        assert ("installing", "BundleInstalled", "checking", None) in steps
        extra = await orch.on_ready(supervisor_for(plan), ready_evidence(3))
        assert extra["effective_backend"] == "cuda"
        assert orch.runner.state is F.FallbackState.SETTLED and orch.data.chosen == "cuda"
        st = orch.status(supervisor_for(plan, ready_evidence(3)))
        assert st["backend"] == "cuda" and st["fallbacks"] == []
        assert st["layers"]["planned"] == "auto" and st["layers"]["offloaded"] == 3
        assert "free VRAM" in st["layers"]["why"] and "KV" in st["layers"]["why"]
        assert "engine offloaded 3/3" in st["layers"]["why"]
        assert st["layers"]["estimate"]["free_vram_mib"] == 143150


async def test_zero_layers_offloaded_is_reported_as_cpu(paths, config):
    install_cuda_bundle(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda"
        await orch.on_ready(supervisor_for(plan), ready_evidence(0))
        st = orch.status(supervisor_for(plan, ready_evidence(0)))
        assert st["backend"] == "cpu" and st["planned_backend"] == "cuda"
        assert [(f["backend"], f["reason"]) for f in st["fallbacks"]] == [("cuda", "cuda_gpu_layers_zero")]
        assert st["fallbacks"][0]["evidence"]["offload_line"].endswith("offloaded 0/3 layers to GPU")
        # what to do about it: the engine's fit margin, and the setting that lowers it
        hint = st["fallbacks"][0]["evidence"]["hint"]
        assert "keeps 1024 MiB free on each device (-fitt)" in hint and '"-fitt", "256"' in hint
        assert "free VRAM (read now) 0: NVIDIA H200 139.8 GiB, about 524 MiB of it taken by the runtime" in hint


async def test_offload_claimed_but_no_vram_held_is_reported_as_cpu(paths, config):
    install_cuda_bundle(paths)
    nvml = rec.FakeNvml([rec.h200(processes=[(999, 900 * rec.MIB)])])  # someone else's VRAM only
    async with orchestrator(paths, cuda_backend(nvml)) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        await orch.on_ready(supervisor_for(plan), ready_evidence(3))
        st = orch.status(supervisor_for(plan, ready_evidence(3)))
        assert st["backend"] == "cpu"
        assert st["fallbacks"][0]["reason"] == "gpu_claimed_but_unused"
        assert st["fallbacks"][0]["evidence"]["process_vram_mib"] == 0


async def test_install_failure_falls_back_to_cpu_with_the_reason(paths, config):
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), FakeInstalls(paths, fail=True)) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu"
        await orch.on_ready(supervisor_for(plan), {"pid": PID})
        st = orch.status(supervisor_for(plan, {}))
        assert st["backend"] == "cpu"
        fb = st["fallbacks"][0]
        assert fb["backend"] == "cuda" and fb["reason"] == "cuda_bundle_install_failed"
        assert fb["evidence"]["status"] == 404
        assert st["fallback_reason"] == "cuda_bundle_install_failed"


async def test_no_gpu_serves_on_cpu_and_says_why(paths, config):
    async with orchestrator(paths, no_gpu_cuda()) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu" and plan.n_gpu_layers == 0
        assert plan.backend_args == ("-ngl", "0")  # the CPU plugin's answer
        await orch.on_ready(supervisor_for(plan), {"pid": PID})
        st = orch.status(supervisor_for(plan, {}))
        assert st["backend"] == "cpu" and st["fallback_reason"] == "gpu_missing"
        assert st["fallbacks"][0]["backend"] == "cuda" and st["fallbacks"][0]["reason"] == "gpu_missing"
        assert st["fallbacks"][0]["evidence"]["failing_library"] == "libnvidia-ml.so.1"
        assert st["layers"]["why"].startswith("CPU plan")


async def test_forced_cuda_without_gpu_fails_loudly(paths, config):
    forced = attrs.evolve(config, backend=BackendConfig(prefer="cuda"))
    async with orchestrator(paths, no_gpu_cuda()) as orch:
        with pytest.raises(StokerError) as err:
            await orch.plan(forced, LR.MakePlan())
        assert err.value.reason == "gpu_missing" and "forced" in err.value.message
        assert "serving on the CPU" not in err.value.message and "nothing is served" in err.value.message
        assert err.value.evidence["detail"] in err.value.message  # the check's own sentence says why
        assert err.value.evidence["forced"] is True
        assert orch.runner.state is F.FallbackState.FAILED
        assert not [t for t in transitions(orch) if t[1] == "CheckPassed"]  # CPU never considered


async def test_gpu_server_dying_before_ready_moves_on(paths, config):
    install_cuda_bundle(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda"
        again = await orch.plan(config, died_before_ready(plan))
        assert again.backend == "cpu"
        skipped = [(s.backend, s.reason) for s in orch.data.skipped]
        assert skipped == [("cuda", R.CUDA_STARTUP_FAILED)]
        assert ("launching", "PlanRequested", "checking", "cuda_startup_failed") in transitions(orch)


async def test_startup_failure_keeps_what_decided_it(paths, config):
    """Seen on an H200: a bundle whose libggml-cuda.so.0 was deleted dies at exec with exit 127;
    the fallback record names the line and the missing library, not only `server_crashed`."""
    line = (
        "/b/cuda-avx2/bin/llama-server: error while loading shared libraries: libggml-cuda.so.0: "
        "cannot open shared object file: No such file or directory"
    )
    install_cuda_bundle(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        again = await orch.plan(
            config, died_before_ready(plan, returncode=127, signal=None, line=line, log_tail=[line])
        )
        assert again.backend == "cpu"
        (skipped,) = orch.data.skipped
        assert skipped.reason == R.CUDA_STARTUP_FAILED
        assert skipped.evidence["missing_library"] == "libggml-cuda.so.0"
        assert skipped.evidence["line"] == line and skipped.evidence["returncode"] == 127
        assert skipped.evidence["exit_reason"] == "server_crashed"


async def test_driver_older_than_the_bundle_is_cuda_unavailable_not_installed(paths, config):
    install_cuda_bundle(paths, min_driver="999.0")
    installs = FakeInstalls(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), installs) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu" and installs.calls == []
        fb = orch.data.skipped[0]
        assert fb.reason == R.CUDA_UNAVAILABLE and fb.evidence["min_driver"] == "999.0"


async def test_archs_that_cannot_run_on_the_gpu_are_refused(paths, config):
    install_cuda_bundle(paths, archs=("100-real",))
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu"
        assert orch.data.skipped[0].evidence["compute_capability"] == ["9.0"]


async def test_the_plan_is_complete_and_the_command_line_comes_from_it_alone(paths, config):
    """Everything the engine is given is in the plan history records: the supervisor turns
    it into argv without the config (another config now changes nothing)."""
    install_cuda_bundle(paths)
    config = attrs.evolve(
        config,
        server=attrs.evolve(config.server, threads=3, flash_attn="on", extra_args=("--jinja",)),
        snapshots=attrs.evolve(config.snapshots, swa_full=True),
    )
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
    assert plan.backend == "cuda" and plan.n_gpu_layers == "auto" and plan.threads == 3
    assert plan.flash_attn == "on" and plan.slot_save_path == str(paths.snapshots_dir)
    assert plan.extra_args == ("--jinja", "--metrics", "--swa-full")
    argv = server_argv(server_spec(plan), api_key_file=paths.runtime_dir / "key")
    flags = dict(zip(argv[1:-3:2], argv[2:-3:2]))  # the named flags, before the extra args
    assert {k: flags[k] for k in ("-ngl", "-t", "-fa", "-c", "--slot-save-path")} == {
        "-ngl": "auto",
        "-t": "3",
        "-fa": "on",
        "-c": "2048",
        "--slot-save-path": str(paths.snapshots_dir),
    }
    assert argv[-3:] == ["--jinja", "--metrics", "--swa-full"]


class TwoDeviceCuda(CudaBackend):
    """A plugin that adds its own launch arguments: the plan asks it, and nothing else knows."""

    def launch_args(self, plan):
        return [*super().launch_args(plan), "--device", "CUDA1", "--split-mode", "none"]


async def test_the_plan_holds_the_backend_plugins_own_launch_arguments(paths, config):
    install_cuda_bundle(paths)
    cuda = TwoDeviceCuda(nvml=rec.FakeNvml(), run=recorded_runner({}), sysfs_root="/nonexistent-sys")
    async with orchestrator(paths, cuda) as orch:
        plan = await orch.plan(config, LR.MakePlan())
    assert plan.backend_args == ("-ngl", "auto", "--device", "CUDA1", "--split-mode", "none")
    argv = server_argv(server_spec(plan), api_key_file=paths.runtime_dir / "key")
    at = argv.index("-ngl")
    assert argv[at : at + 6] == ["-ngl", "auto", "--device", "CUDA1", "--split-mode", "none"]


async def test_a_server_adopted_after_a_daemon_restart_is_not_demoted(paths, config):
    install_cuda_bundle(paths)
    store = open_store(":memory:")
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), store=store) as orch:
        plan = await orch.plan(config, LR.MakePlan())
    # A new daemon on the same store: the machine is still launching, the server adopted.
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), store=store) as again:
        assert again.runner.resumed and again.runner.state is F.FallbackState.LAUNCHING
        await again.on_ready(supervisor_for(plan), {"adopted": True, "pid": PID})
        assert again.data.chosen == "cuda" and again.data.reason is None


async def test_a_respawned_gpu_server_is_proven_again(paths, config):
    install_cuda_bundle(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml([rec.h200(processes=[(PID, 900 * rec.MIB)])]))) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        await orch.on_ready(supervisor_for(plan), ready_evidence(3))
        assert orch.status(supervisor_for(plan, ready_evidence(3)))["backend"] == "cuda"
        # Crashed after ready and respawned by the supervisor (same plan): this time 0 layers.
        await orch.on_ready(supervisor_for(plan), ready_evidence(0))
        st = orch.status(supervisor_for(plan, ready_evidence(0)))
        assert st["backend"] == "cpu" and st["fallbacks"][-1]["reason"] == "cuda_gpu_layers_zero"
        assert st["fallbacks"][-1]["evidence"]["after"] == "respawn"
        await orch.on_ready(supervisor_for(plan), ready_evidence(3))
        assert orch.status(supervisor_for(plan, ready_evidence(3)))["backend"] == "cuda"


async def test_less_free_vram_than_the_fit_margin_skips_the_gpu_launch(paths, config):
    """The H200 case with 699 MiB free: the engine keeps 1024 MiB free, fitted for 16 s and
    offloaded nothing. Stoker now knows that before the launch and goes to the CPU at once."""
    import attrs

    install_cuda_bundle(paths)
    nearly_full = rec.FakeNvml([rec.h200(free=699 * rec.MIB)])
    async with orchestrator(paths, cuda_backend(nearly_full)) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu"
        assert ("checking", "CheckPassed", "checking", "cuda_vram_full") in transitions(orch)
        st = orch.status(supervisor_for(plan))
        [fb] = st["fallbacks"]
        assert fb["reason"] == "cuda_vram_full" and fb["evidence"]["free_vram_mib"] == {"0": 699}
        assert fb["evidence"]["margin_mib"] == 1024 and fb["evidence"]["runtime_reserve_mib"] == 524
        # 699 MiB less the runtime's 524 leaves 175 MiB: a margin below that is room (little for
        # serving), which the hint says, rather than claim no margin would help (the H200 run).
        hint = fb["evidence"]["hint"]
        assert '["-fitt", "87"]' in hint and "below 175 MiB" in hint and "little left" in hint
        # A fixed layer count is not fitted: the engine loads as told, so it is launched.
        fixed = attrs.evolve(config, server=attrs.evolve(config.server, n_gpu_layers=4))
        assert (await orch.plan(fixed, LR.MakePlan())).backend == "cuda"
        # The probe's figure is cached for 30 s: VRAM freed since then is read now, and launched on.
        assert (await orch.plan(config, LR.MakePlan())).backend == "cpu"
        nearly_full.gpus[0]["free"] = 100_000 * rec.MIB
        assert orch.probes.cached("cuda") is not None  # still the old verdict (699 MiB)
        assert (await orch.plan(config, LR.MakePlan())).backend == "cuda"
    # Measured on the H200 with 1499 MiB free: the runtime took 524, the engine saw 975 < 1024
    # and offloaded 0/19 after 12-13 s. That is certain too; with the hint's -fitt 256 it fits.
    async with orchestrator(paths, cuda_backend(rec.FakeNvml([rec.h200(free=1499 * rec.MIB)]))) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu"
        [fb] = orch.status(supervisor_for(plan))["fallbacks"]
        assert fb["reason"] == "cuda_vram_full" and '"-fitt", "256"' in fb["evidence"]["hint"]
        assert "below 975 MiB" in fb["evidence"]["hint"]
        lower = attrs.evolve(config, server=attrs.evolve(config.server, extra_args=("-fitt", "256")))
        assert (await orch.plan(lower, LR.MakePlan())).backend == "cuda"


# --- truth in every figure (the reading that decided, shown) ----------------------------------------


def fallback_of(st, backend):
    return next(f for f in st["fallbacks"] if f["backend"] == backend)


async def test_the_vram_check_reads_nvml_when_it_decides_not_the_probe(paths, config):
    """The probe (cached for 30 s) saw an empty H200; another process has filled it since. The
    decision is taken on a reading made now, and says so with that reading's figures (the H200
    run went on with the probe's word: 3 CUDA crashes, 29.6 s to the CPU server)."""
    install_cuda_bundle(paths)
    nvml = rec.FakeNvml([rec.h200()])
    async with orchestrator(paths, cuda_backend(nvml)) as orch:
        assert (await orch.plan(config, LR.MakePlan())).backend == "cuda"
        nvml.gpus[0]["free"] = 699 * rec.MIB
        assert orch.probes.cached("cuda").detection.devices[0].memory_free_mib == 143150  # the probe's word
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cpu"
        fb = fallback_of(orch.status(supervisor_for(plan)), "cuda")
        assert fb["reason"] == "cuda_vram_full"
        assert fb["evidence"]["free_vram_mib"] == {"0": 699} and fb["evidence"]["free_vram_source"] == "read now"
        assert "0: NVIDIA H200 699 MiB" in fb["message"] and "143150" not in json_of(fb)


def json_of(value) -> str:
    import json

    return json.dumps(value, default=str)


async def test_the_layers_why_quotes_the_reading_that_decided_not_the_cached_probe(paths, config):
    install_cuda_bundle(paths)
    nvml = rec.FakeNvml([rec.h200(free=699 * rec.MIB)])
    async with orchestrator(paths, cuda_backend(nvml)) as orch:
        assert (await orch.plan(config, LR.MakePlan())).backend == "cpu"  # the probe saw 699 MiB
        nvml.gpus[0]["free"] = 100_000 * rec.MIB  # freed since: the reading now overrides the probe
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda"
        st = orch.status(supervisor_for(plan))
        assert st["layers"]["estimate"]["free_vram_mib"] == 100_000
        assert "0: NVIDIA H200 97.7 GiB" in st["layers"]["why"] and "699" not in st["layers"]["why"]
        assert "read now" in st["layers"]["why"]


async def test_a_fixed_layer_count_is_not_called_ngl_auto(paths, config):
    install_cuda_bundle(paths)
    fixed = attrs.evolve(config, server=attrs.evolve(config.server, n_gpu_layers=4))
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(fixed, LR.MakePlan())
        assert plan.backend_args == ("-ngl", "4")
        why = orch.status(supervisor_for(plan))["layers"]["why"]
        assert why.startswith("-ngl 4:") and "auto" not in why and "-fitt" not in why


async def test_two_gpus_are_quoted_one_by_one_against_the_margin_each_keeps(paths, config):
    """Not a sum over both GPUs against a margin quoted once: each GPU's free VRAM, and the
    runtime's share and the margin on each."""
    install_cuda_bundle(paths)
    nvml = rec.FakeNvml([rec.h200(free=1700 * rec.MIB), rec.h200(free=1650 * rec.MIB)])
    async with orchestrator(paths, cuda_backend(nvml)) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda" and plan.backend_env == ()  # both can take layers: both given
        why = orch.status(supervisor_for(plan))["layers"]["why"]
        assert "0: NVIDIA H200 1700 MiB, 1: NVIDIA H200 1650 MiB" in why
        assert "524 MiB CUDA runtime + 1024 MiB margin (-fitt) on each GPU" in why and "3350" not in why
        # The engine then offloaded nothing: the hint quotes what the engine saw on each device.
        zero = {**ready_evidence(0), "device_free_mib": {"CUDA0": 1176, "CUDA1": 1126}}
        await orch.on_ready(supervisor_for(plan), zero)
        hint = fallback_of(orch.status(supervisor_for(plan, zero)), "cuda")["evidence"]["hint"]
        assert "CUDA0 1176 MiB, CUDA1 1126 MiB" in hint and "1024 MiB free on each device (-fitt)" in hint
        assert "3350" not in hint and "2302" not in hint


async def test_a_demoted_respawn_quotes_the_engines_figures_and_is_a_transition(paths, config):
    """Seen on two H200s: settled on cuda with 2 x 139.8 GiB free, then another process filled
    both GPUs, the server crashed and was respawned with the same plan and offloaded nothing.
    `layers.why` went on claiming 279.6 GiB free; history had no row and fallback_reason was null."""
    install_cuda_bundle(paths)
    held = [(PID, 900 * rec.MIB)]
    nvml = rec.FakeNvml([rec.h200(processes=held), rec.h200(processes=held)])
    async with orchestrator(paths, cuda_backend(nvml)) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        await orch.on_ready(supervisor_for(plan), ready_evidence(3))
        st = orch.status(supervisor_for(plan, ready_evidence(3)))
        assert st["backend"] == "cuda" and st["fallback_reason"] is None and "139.8 GiB" in st["layers"]["why"]
        for gpu in nvml.gpus:
            gpu["free"] = 1331 * rec.MIB
        respawn = {**ready_evidence(0), "device_free_mib": {"CUDA0": 807, "CUDA1": 805}}
        await orch.on_ready(supervisor_for(plan), respawn)
        st = orch.status(supervisor_for(plan, respawn))
        assert st["backend"] == "cpu" and st["fallback_reason"] == "cuda_gpu_layers_zero"
        fb = fallback_of(st, "cuda")
        assert fb["reason"] == "cuda_gpu_layers_zero" and fb["evidence"]["after"] == "respawn"
        shown = st["layers"]["why"] + " " + fb["evidence"]["hint"]
        assert "139.8" not in shown and "279" not in shown and "143150" not in json_of(st["layers"])
        assert "CUDA0 807 MiB, CUDA1 805 MiB" in fb["evidence"]["hint"]
        assert "engine saw CUDA0 807 MiB, CUDA1 805 MiB free" in st["layers"]["why"]
        last = orch.store.history(machine="fallback", limit=1)[0]
        assert (last.event, last.to_state, last.reason) == ("LaunchSucceeded", "settled", "cuda_gpu_layers_zero")
        assert last.evidence["after"] == "respawn" and last.evidence["effective_backend"] == "cpu"


async def test_forced_cuda_with_full_vram_says_one_true_thing(paths, config):
    """It said both "serving on the CPU" (the code's generic sentence) and "nothing is served"."""
    install_cuda_bundle(paths)
    forced = attrs.evolve(config, backend=BackendConfig(prefer="cuda"))
    async with orchestrator(paths, cuda_backend(rec.FakeNvml([rec.h200(free=699 * rec.MIB)]))) as orch:
        with pytest.raises(StokerError) as err:
            await orch.plan(forced, LR.MakePlan())
    message = err.value.message
    assert err.value.reason == "cuda_vram_full"
    assert "serving on the CPU" not in message and "nothing is served" in message
    assert "0: NVIDIA H200 699 MiB" in message and "1024 MiB" in message


async def test_a_startup_failure_says_what_its_evidence_says(paths, config):
    """cuda_startup_failed's generic sentence blames a missing library; an out-of-memory exit
    must say out of memory, a missing library must name it."""
    oom = "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 13824.00 MiB on device 0: cudaMalloc failed: out of memory"
    install_cuda_bundle(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        failure = LR.PlanFailure(R.OUT_OF_MEMORY, LR.ExitPhase.NEVER_READY, {"line": oom, "log_tail": [oom]})
        again = await orch.plan(config, LR.MakePlan(previous=plan, failure=failure))
        assert again.backend == "cpu"
        fb = fallback_of(orch.status(supervisor_for(again)), "cuda")
        assert fb["reason"] == "cuda_startup_failed" and fb["evidence"]["exit_reason"] == "out_of_memory"
        assert "out of memory" in fb["message"] and "library" not in fb["message"]
    lib = "llama-server: error while loading shared libraries: libcublas.so.13: cannot open shared object file"
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        again = await orch.plan(config, died_before_ready(plan, returncode=127, line=lib, log_tail=[lib]))
        fb = fallback_of(orch.status(supervisor_for(again)), "cuda")
        assert "libcublas.so.13" in fb["message"] and "out of memory" not in fb["message"]


async def test_a_partial_offload_is_called_partial(paths, config):
    install_cuda_bundle(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml([rec.h200(processes=[(PID, 900 * rec.MIB)])]))) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        await orch.on_ready(supervisor_for(plan), ready_evidence(15, 33))
        st = orch.status(supervisor_for(plan, ready_evidence(15, 33)))
        assert st["backend"] == "cuda" and st["offload"] == "partial"
        await orch.on_ready(supervisor_for(plan), ready_evidence(33, 33))
        assert orch.status(supervisor_for(plan, ready_evidence(33, 33)))["offload"] == "full"


async def test_a_gpu_that_can_take_no_layer_is_not_given_to_the_server(paths, config):
    """GPU 0 is nearly full (300 MiB free: less than the CUDA runtime's share plus the margin);
    the engine would put no layer there but its CUDA context would still take ~520 MiB from
    whoever filled it. The plan gives the server GPU 1 only, and records how."""
    from stoker.daemon.engine.process import server_env

    install_cuda_bundle(paths)
    nvml = rec.FakeNvml([rec.h200(free=300 * rec.MIB), rec.h200()])
    async with orchestrator(paths, cuda_backend(nvml)) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda" and plan.backend_args == ("-ngl", "auto")
        assert dict(plan.backend_env) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
        env = server_env(server_spec(plan))
        assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        st = orch.status(supervisor_for(plan))
        assert "1: NVIDIA H200 139.8 GiB" in st["layers"]["why"]
        assert "left out: 0: NVIDIA H200 300 MiB" in st["layers"]["why"]
        assert st["layers"]["estimate"]["free_vram_mib"] == 143150  # the GPU the server has


async def test_a_forced_backend_that_died_before_ready_says_only_what_happened(paths, config):
    oom = "cudaMalloc failed: out of memory"
    install_cuda_bundle(paths)
    forced = attrs.evolve(config, backend=BackendConfig(prefer="cuda"))
    async with orchestrator(paths, cuda_backend(rec.FakeNvml())) as orch:
        plan = await orch.plan(forced, LR.MakePlan())
        failure = LR.PlanFailure(R.OUT_OF_MEMORY, LR.ExitPhase.NEVER_READY, {"line": oom, "log_tail": [oom]})
        with pytest.raises(StokerError) as err:
            await orch.plan(forced, LR.MakePlan(previous=plan, failure=failure))
    assert err.value.reason == "cuda_startup_failed"
    message = err.value.message
    assert "ran out of memory" in message and "nothing is served" in message
    assert "next backend" not in message and "library" not in message and "serving on the CPU" not in message


class NoDeviceSelection(CudaBackend):
    """A GPU backend that cannot keep its runtime off a device (no launch_env)."""

    def launch_env(self, plan):
        return {}


async def test_a_plugin_that_cannot_keep_its_server_off_a_gpu_is_not_said_to(paths, config):
    install_cuda_bundle(paths)
    nvml = rec.FakeNvml([rec.h200(free=300 * rec.MIB), rec.h200()])
    plugin = NoDeviceSelection(nvml=nvml, run=recorded_runner({}), sysfs_root="/nonexistent-sys")
    async with orchestrator(paths, plugin) as orch:
        plan = await orch.plan(config, LR.MakePlan())
        assert plan.backend == "cuda" and plan.backend_env == ()
        why = orch.status(supervisor_for(plan))["layers"]["why"]
        assert "left out" not in why and "0: NVIDIA H200 300 MiB, 1: NVIDIA H200 139.8 GiB" in why


# --- serve now, upgrade beside ----------------------------------------------------------------


class SlowBuild(FakeInstalls):
    """Only a local build has the CUDA bundle: `first_source` says so, and the build ends
    (writes the bundle) when the test sets `done`."""

    def __init__(self, paths: StokerPaths, *, fail: bool = False):
        super().__init__(paths, fail=fail)
        self.done = trio.Event()

    async def first_source(self, backend, detection=None):
        await trio.lowlevel.checkpoint()
        return Source.LOCAL_BUILD

    async def install(self, backend, *, variant=None, detection=None, beside=False):
        await self.done.wait()
        await super().install(backend, variant=variant, detection=detection)


async def test_a_gpu_engine_only_a_build_can_give_is_built_beside_the_cpu_then_switched_to(paths, config):
    installs = SlowBuild(paths)
    restarts = []
    nvml = rec.FakeNvml([rec.h200(processes=[(PID, 900 * rec.MIB)])])
    async with orchestrator(paths, cuda_backend(nvml), installs) as orch:
        async with trio.open_nursery() as tasks:
            orch.tasks, orch.restart = tasks, lambda: restarts.append(trio.current_time())
            plan = await orch.plan(config, LR.MakePlan())  # at once: the build is not waited for
            assert plan.backend == "cpu" and len(installs.calls) == 0
            await orch.on_ready(supervisor_for(plan), {"pid": PID})
            st = orch.status(supervisor_for(plan, {}))
            assert st["backend"] == "cpu" and st["fallback_reason"] == "gpu_engine_building"
            (fb,) = st["fallbacks"]
            assert (fb["backend"], fb["evidence"]["source"], fb["evidence"]["building"]) == (
                "cuda",
                "local-build",
                "cuda",
            )
            assert "being built here" in fb["message"]
            # the build ends: the CPU server is restarted (once) to be planned on the GPU
            installs.done.set()
            await trio.testing.wait_all_tasks_blocked()  # the build's task ran to its end
            assert restarts
            assert installs.calls[0][1].usable  # built for the detected H200
            assert ("settled", "EngineBuilt", "settled", "gpu_engine_built") in transitions(orch)
            plan = await orch.plan(config, LR.MakePlan())
            assert plan.backend == "cuda"
            await orch.on_ready(supervisor_for(plan), ready_evidence(3))
            st = orch.status(supervisor_for(plan, ready_evidence(3)))
            assert (st["backend"], st["fallback_reason"], st["fallbacks"]) == ("cuda", None, [])
            assert len(restarts) == 1
            tasks.cancel_scope.cancel()


async def test_a_build_beside_that_fails_says_why_on_the_cpu(paths, config):
    installs = SlowBuild(paths, fail=True)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), installs) as orch:
        async with trio.open_nursery() as tasks:
            orch.tasks = tasks
            plan = await orch.plan(config, LR.MakePlan())
            await orch.on_ready(supervisor_for(plan), {"pid": PID})
            installs.done.set()
            await trio.testing.wait_all_tasks_blocked()
            assert not orch.data.building
            st = orch.status(supervisor_for(plan, {}))
            assert st["backend"] == "cpu" and st["fallback_reason"] == "cuda_bundle_install_failed"
            assert st["fallbacks"][0]["evidence"]["status"] == 404
            tasks.cancel_scope.cancel()


async def test_without_a_place_to_build_beside_the_install_is_waited_for(paths, config):
    installs = SlowBuild(paths)
    installs.done.set()
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), installs) as orch:
        plan = await orch.plan(config, LR.MakePlan())  # orch.tasks is None: a `stoker run`-like caller
        assert plan.backend == "cuda"


async def test_a_build_beside_is_run_once_however_often_it_is_asked_for(paths, config):
    installs = SlowBuild(paths)
    async with orchestrator(paths, cuda_backend(rec.FakeNvml()), installs) as orch:
        async with trio.open_nursery() as tasks:
            orch.tasks = tasks
            first = await orch.plan(config, LR.MakePlan())
            await orch.on_ready(supervisor_for(first), {"pid": PID})
            again = await orch.plan(config, LR.MakePlan())  # a restart while it builds
            assert (first.backend, again.backend) == ("cpu", "cpu")
            await trio.testing.wait_all_tasks_blocked()
            assert len(tasks.child_tasks) == 1 and installs.calls == []
            tasks.cancel_scope.cancel()
