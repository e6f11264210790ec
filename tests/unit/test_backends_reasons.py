"""Reason codes are backend facts: the built-ins declare their families, a plugin brings its own.

The core asks a backend which code names each fallback step's failure (`reason(kind)`) and in
which order auto mode tries it (`auto_rank`); a plugin's own codes, declared with their
sentences, become ReasonCodes when it is loaded, and a plugin that names a code nobody
declared is refused like any other broken plugin.
"""

from __future__ import annotations

import re
from importlib import metadata

import pytest

from stoker.daemon.backends import Backend, Detection, Device, discover_backends, load_backends
from stoker.daemon.backends.base import ReasonKind as K
from stoker.daemon.backends.registry import family_reason, registered_names, try_order
from stoker.daemon.control import error_codes
from stoker.daemon.core.errors import StokerError
from stoker.states.fallback import table as F
from stoker.daemon.core.machines import MachineRunner
from stoker.states.machine import data_from_json, data_to_json, event_from_json
from stoker.states.reasons import ReasonCode as R
from stoker.states.reasons import message_for, plugin_reasons, register_reasons, stored_reason
from stoker.store import open_store

GROUP = "stoker.backends"


class TpuBackend(Backend):
    """A third party's accelerator with a family of its own codes."""

    name = "tpux"
    device_signature = re.compile(r"^\s+(TPU\d+): (.+) \((\d+) MiB, (\d+) MiB free\)$")
    auto_rank = 5  # tried before CUDA
    reason_messages = {
        "tpux_unavailable": "The TPU runtime did not answer; restart tpud.",
        "tpux_startup_failed": "The TPU server died while loading; see `stoker history`.",
        "tpux_gpu_layers_zero": "The TPU server offloaded nothing; serving on the CPU.",
    }
    reason_family = {
        K.UNAVAILABLE: "tpux_unavailable",
        K.STARTUP_FAILED: "tpux_startup_failed",
        K.GPU_LAYERS_ZERO: "tpux_gpu_layers_zero",
        K.BINARY_MISSING: R.BUNDLE_MISSING,  # a built-in code is fine to name
    }
    reason_codes = frozenset({*reason_family.values(), R.GPU_MISSING})

    def detect(self) -> Detection:
        return Detection.unavailable(self.name, "tpux_unavailable", present=True, devices=[Device(0, "TPU v9")])

    def choose_variant(self, detection, available_variants):
        return "default"


class UndeclaredCode(TpuBackend):
    name = "undeclared"
    reason_messages = {}
    reason_family = {K.UNAVAILABLE: "undeclared_unavailable"}


class StealsBuiltin(TpuBackend):
    name = "thief"
    reason_messages = {"cuda_startup_failed": "mine now"}
    reason_family = {K.STARTUP_FAILED: "cuda_startup_failed"}


class StealsPlugin(TpuBackend):
    name = "copycat"
    reason_family = {K.UNAVAILABLE: "tpux_unavailable"}
    reason_messages = {"tpux_unavailable": "not yours"}


class BadKind(TpuBackend):
    name = "badkind"
    reason_messages = {}
    reason_family = {"exploded": R.SERVER_CRASHED}


def ep(name: str, cls: type) -> metadata.EntryPoint:
    return metadata.EntryPoint(name=name, value=f"test_backends_reasons:{cls.__name__}", group=GROUP)


def test_builtin_families_are_the_codes_stoker_always_stored():
    backends = load_backends()
    cuda, rocm = backends["cuda"], backends["rocm"]
    assert cuda.reason(K.STARTUP_FAILED) is R.CUDA_STARTUP_FAILED
    assert cuda.reason(K.BINARY_MISSING) is R.BINARY_MISSING_NVIDIA_DETECTED
    assert rocm.reason(K.BINARY_MISSING) is R.BINARY_MISSING_AMD_DETECTED
    assert backends["metal"].reason(K.VRAM_FULL) is R.METAL_VRAM_FULL
    assert backends["vulkan"].unavailable_reason is R.VULKAN_UNAVAILABLE
    assert backends["cpu"].reason(K.BUNDLE_INSTALL_FAILED) is R.CPU_BUNDLE_INSTALL_FAILED
    assert backends["cpu"].reason(K.STARTUP_FAILED) is None and backends["cpu"].unavailable_reason is R.PROBE_FAILED
    # Auto mode: the accelerators in the order Stoker always tried them, the CPU last.
    assert try_order(backends) == ("cuda", "rocm", "metal", "vulkan", "cpu")


def test_a_plugin_brings_its_own_codes_with_their_sentences():
    registry = discover_backends([ep("tpux", TpuBackend)])
    assert registry.failures == ()
    tpu = registry.backends["tpux"]
    code = tpu.reason(K.STARTUP_FAILED)
    assert isinstance(code, R) and code == "tpux_startup_failed" and str(code) == "tpux_startup_failed"
    assert message_for(code) == "The TPU server died while loading; see `stoker history`."
    assert R("tpux_unavailable") is tpu.unavailable_reason  # one member per code, like the built-ins
    assert tpu.reason(K.VRAM_FULL) is None  # not declared: the core leaves it to the engine
    assert "tpux_unavailable" not in {c.value for c in R}  # the documented table stays Stoker's
    assert {(r.owner, r.code) for r in plugin_reasons()} >= {("tpux", c) for c in TpuBackend.reason_messages}
    # Its auto_rank puts it before the built-in GPUs; the CPU stays last.
    assert try_order({**load_backends(), "tpux": tpu})[0] == "tpux"
    assert try_order({**load_backends(), "tpux": tpu})[-1] == "cpu"
    # Its codes go everywhere a reason goes: detections, errors, socket replies, machine rows.
    detection = tpu.detect()
    assert Detection.from_dict(detection.to_dict()) == detection
    assert detection.message == "The TPU runtime did not answer; restart tpud."
    err = StokerError(code, evidence={"returncode": 1})
    assert err.to_dict()["message"] == message_for(code)
    assert error_codes.code_for(code) != error_codes.APPLICATION_ERROR
    data = F.FallbackData(candidates=("tpux", "cpu"), skipped=(F.Skipped("tpux", code, {}),), reason=code)
    assert data_from_json(F.FALLBACK, data_to_json(data)) == data


def test_family_reason_falls_back_to_the_generic_code():
    backends = load_backends()
    assert family_reason(backends, "cuda", K.GPU_LAYERS_ZERO, R.GPU_CLAIMED_BUT_UNUSED) is R.CUDA_GPU_LAYERS_ZERO
    assert family_reason(backends, "cpu", K.STARTUP_FAILED, R.SERVER_CRASHED) is R.SERVER_CRASHED
    assert family_reason(backends, "gone", K.STARTUP_FAILED, R.SERVER_CRASHED) is R.SERVER_CRASHED


@pytest.mark.parametrize(
    "cls, words",
    [
        (UndeclaredCode, "'undeclared_unavailable' is neither Stoker's nor declared"),
        (StealsBuiltin, "'cuda_startup_failed' is a built-in reason code"),
        (StealsPlugin, "'tpux_unavailable' is already declared by the 'tpux' plugin"),
        (BadKind, "reason_family names 'exploded'"),
    ],
)
def test_a_plugin_with_unknown_or_stolen_codes_is_not_loaded(cls, words):
    discover_backends([ep("tpux", TpuBackend)])
    registry = discover_backends([ep(cls.name, cls)])
    assert registry.backends == {}
    assert words in registry.failures[0].error
    assert message_for(R.CUDA_STARTUP_FAILED).startswith("The CUDA server failed to start")
    assert message_for("tpux_unavailable") == TpuBackend.reason_messages["tpux_unavailable"]
    with pytest.raises(ValueError):
        R("undeclared_unavailable")


def test_registered_names_never_import_a_plugin():
    points = [metadata.EntryPoint(name="zluda", value="no_such_module_for_stoker:Backend", group=GROUP)]
    assert registered_names(points) == ("cpu", "cuda", "rocm", "vulkan", "metal", "zluda")


def test_a_code_stored_by_a_plugin_since_uninstalled_still_reads_back():
    """A daemon with the GoneGPU plugin stored its codes; the plugin was uninstalled; the next
    daemon restores its machines from those rows at start-up and must not fail on them."""
    gone = "gonegpu_unavailable"  # no plugin in this process declares it
    with pytest.raises(ValueError):
        R(gone)  # what the socket and the config get: only codes a loaded plugin declared
    store = open_store(":memory:")
    skipped = {"backend": "gonegpu", "reason": gone, "evidence": {"runtime": "no answer"}}
    store.record_step(
        machine_id="fallback",
        kind="fallback",
        from_state="checking",
        event="CheckFailed",
        event_data={"backend": "gonegpu", "reason": gone, "evidence": skipped["evidence"]},
        to_state="checking",
        data={"candidates": ["gonegpu", "cpu"], "index": 1, "skipped": [skipped], "reason": gone},
        reason=gone,
    )
    runner = MachineRunner(F.FALLBACK, "fallback", store)  # what the daemon does at start-up
    assert runner.state == F.FallbackState.CHECKING and runner.data.reason == gone
    assert runner.data.skipped[0].reason == gone and str(runner.data.skipped[0].reason) == gone
    (row,) = store.history(machine="fallback")
    assert event_from_json(F.FALLBACK, row.event, row.event_data).reason == gone  # history reads too
    # Its sentence went with the plugin: the one shown says so instead of raising.
    assert message_for(gone) == (
        "A reason recorded by a backend plugin that is no longer installed (gonegpu_unavailable); its own "
        "explanation went with the plugin. Reinstall the plugin to read it; the evidence is in `stoker history`."
    )
    assert error_codes.code_for(gone) != error_codes.APPLICATION_ERROR  # a reply can carry it
    # Only code-shaped strings are admitted, and only through the store's reader.
    for junk in ("GoneGPU failed", "gonegpu__x", "x" * 65, 42):
        with pytest.raises(ValueError):
            stored_reason(junk)
    with pytest.raises(ValueError):
        R("gonegpu_startup_failed")  # a code nobody declared or stored is still refused
    # The plugin reinstalled: its own sentence again.
    register_reasons("gonegpu", {gone: "The GoneGPU runtime does not answer."})
    assert message_for(gone) == "The GoneGPU runtime does not answer."
