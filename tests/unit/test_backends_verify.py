"""Bundle verification asks the backend plugin for its `--list-devices` signature.

The fake engine (tests/bundlekit.py) prints the device lines a real build of each backend
prints; verification must accept exactly what the backend's own plugin parses, so the two can
never disagree again (the old table took ROCm and Vulkan lines without memory figures, and a
"Metal" device name no build prints).
"""

from __future__ import annotations

import pytest

from bundlekit import engine_script, make_bundle_dir
from stoker.daemon.backends import load_backends
from stoker.daemon.bundles.verify import verify_dir
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

LINES = {
    "cpu": "  (none)",
    "cuda": "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)",
    "rocm": "  ROCm0: AMD Instinct MI300X (196592 MiB, 196100 MiB free)",
    "vulkan": "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)",
    "metal": "  MTL0: Apple M2 Max (49152 MiB, 49000 MiB free)",
}


@pytest.mark.parametrize("backend", sorted(LINES))
def test_each_builtin_bundle_is_judged_by_its_plugin(tmp_path, backend):
    root = make_bundle_dir(
        tmp_path / "b", backend=backend, variant="default", script=engine_script(devices=LINES[backend])
    )
    report = verify_dir(root)
    assert report.devices == (LINES[backend],)
    assert load_backends()[backend].parse_list_devices("\n".join(report.devices))


@pytest.mark.parametrize(
    "backend, line",
    [
        ("rocm", "  ROCm0: AMD Instinct MI300X"),  # what the old table accepted: no memory figures
        ("metal", "  Metal: Apple M2 Max"),  # a device name ggml-metal does not print
        ("cuda", "  (none)"),  # a CUDA bundle whose CUDA library did not load: a CPU engine
        ("cpu", "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"),
    ],
)
def test_a_line_the_plugin_does_not_parse_fails_verification(tmp_path, backend, line):
    root = make_bundle_dir(tmp_path / "b", backend=backend, variant="default", script=engine_script(devices=line))
    with pytest.raises(StokerError) as err:
        verify_dir(root)
    assert err.value.reason == ReasonCode.BUNDLE_VERIFY_FAILED
    assert err.value.evidence["devices"] == [line]
    assert err.value.evidence["signature"] == load_backends()[backend].device_signature.pattern


def test_a_bundle_for_a_backend_no_plugin_provides_is_refused(tmp_path):
    root = make_bundle_dir(tmp_path / "b", backend="nosuchgpu", variant="default")
    with pytest.raises(StokerError) as err:
        verify_dir(root)
    assert err.value.reason == ReasonCode.BUNDLE_VERIFY_FAILED
    assert "nosuchgpu" in err.value.message and "LookupError" in err.value.evidence["error"]
    assert "step" not in err.value.evidence  # refused before the engine ran


LOADER_ERROR = """#!/bin/sh
echo "llama-server: error while loading shared libraries: libcuda.so.1: cannot open shared object file: No such file or directory" >&2
exit 127
"""


@pytest.mark.parametrize("backend, engine_reason", [("cuda", "cuda_startup_failed"), ("cpu", "server_crashed")])
def test_a_missing_runtime_library_is_named_by_the_backends_own_code(tmp_path, backend, engine_reason):
    """The plugin's startup_failed code names a GPU runtime the loader cannot find; the CPU has none."""
    root = make_bundle_dir(tmp_path / "b", backend=backend, variant="default", script=LOADER_ERROR)
    with pytest.raises(StokerError) as err:
        verify_dir(root)
    assert err.value.reason == ReasonCode.BUNDLE_VERIFY_FAILED
    assert err.value.evidence["engine_reason"] == engine_reason
    assert err.value.evidence["missing_library"] == "libcuda.so.1"
