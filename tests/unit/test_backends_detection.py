"""The Detection record across the process boundary, and the `stoker probe` report."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stoker.daemon.backends import Detection, Device
from stoker.daemon.control.client import typed_reply
from stoker.daemon.control.replies import ProbeReply
from stoker.daemon.probes.report import format_detection, format_probe, verdict
from stoker.states.reasons import ReasonCode as R, message_for

H200 = Device(0, "NVIDIA H200", 143771, 143150, "9.0", "580.95.05", "13.0", "discrete")


def test_unavailable_uses_the_reason_message_by_default():
    d = Detection.unavailable("cuda", R.GPU_MISSING, present=False, nvml="NVMLError_LibraryNotFound")
    assert d.message == message_for(R.GPU_MISSING)
    assert d.evidence == {"nvml": "NVMLError_LibraryNotFound"}
    assert d.to_dict()["reason"] == "gpu_missing"


def test_from_dict_rejects_malformed_records():
    good = Detection.available("cuda", [H200], "ok").to_dict()
    for broken in (
        {**good, "present": "yes"},
        {**good, "reason": "not_a_code"},
        {k: v for k, v in good.items() if k != "backend"},
    ):
        with pytest.raises((TypeError, ValueError, KeyError)):
            Detection.from_dict(broken)


json_scalars = st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20)
devices = st.builds(
    Device,
    index=st.integers(0, 16),
    name=st.text(min_size=1, max_size=30),
    memory_total_mib=st.none() | st.integers(0, 10**7),
    memory_free_mib=st.none() | st.integers(0, 10**7),
    compute_capability=st.none() | st.sampled_from(["8.6", "9.0", "gfx942"]),
)


@given(
    backend=st.sampled_from(["cpu", "cuda", "rocm", "vulkan", "metal", "rpc"]),
    present=st.booleans(),
    usable=st.booleans(),
    reason=st.none() | st.sampled_from(list(R)),
    devs=st.lists(devices, max_size=3),
    evidence=st.dictionaries(st.text(max_size=10), json_scalars | st.lists(json_scalars, max_size=3), max_size=5),
)
def test_json_roundtrip(backend, present, usable, reason, devs, evidence):
    d = Detection(backend, present, usable, reason, "m", tuple(devs), evidence)
    again = Detection.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again == d
    assert format_probe([d])  # never raises on any record


def test_report_shows_verdict_reason_message_and_evidence():
    cpu = Detection.available(
        "cpu",
        [Device(0, "Intel(R) Xeon(R) Processor", 24106, 22588, device_type="cpu")],
        "Intel(R) Xeon(R) Processor, 2 logical CPUs",
        advertised=["avx2", "amx_tile"],
        unusable=[],
        tests={"amx_tile": "usable"},
    )
    cuda = Detection.unavailable(
        "cuda",
        R.CUDA_UNAVAILABLE,
        present=True,
        message="NVIDIA driver 535.104.05 is older than this CUDA bundle's minimum 580.00; update the driver.",
        driver="535.104.05",
        min_driver="580.00",
        raw="line one\nline two",
    )
    vulkan = Detection.unavailable("vulkan", R.GPU_MISSING, present=False, software_devices=["llvmpipe"])
    text = format_probe([cpu, cuda, vulkan])
    assert text.splitlines()[0] == "Usable backends: cpu"
    assert "cpu: available\n" in text
    assert "cuda: unusable [cuda_unavailable]" in text
    assert "vulkan: absent [gpu_missing]" in text
    assert "device 0: Intel(R) Xeon(R) Processor, 24106 MiB (22588 MiB free), cpu" in text
    assert "advertised: avx2, amx_tile" in text and "unusable: (none)" in text
    assert "tests: amx_tile=usable" in text
    assert "min_driver: 580.00" in text
    assert "| line one" in text and "| line two" in text
    assert message_for(R.GPU_MISSING) in text


def test_report_of_a_gpu_device_and_nothing():
    d = Detection.available("cuda", [H200], "1 NVIDIA GPU(s)")
    assert (
        "device 0: NVIDIA H200, 143771 MiB (143150 MiB free), cc 9.0, discrete, driver 580.95.05, runtime 13.0"
        in format_detection(d)
    )
    assert verdict(attrs.evolve(d, usable=False)) == "unusable"
    assert format_probe([]) == "No backends were probed."


def test_long_evidence_blocks_are_cut():
    d = Detection.unavailable("cuda", R.PROBE_FAILED, present=False, stderr="\n".join(f"l{i}" for i in range(100)))
    text = format_detection(d)
    assert "l99" in text and "l5\n" not in text and "..." in text


def test_a_client_renders_a_plugin_code_it_has_never_loaded():
    """The CLI does not load plugins: a code only the daemon registered is shown as it is."""
    record = {
        "backend": "zluda",
        "present": True,
        "usable": False,
        "reason": "zluda_unavailable",
        "message": "The ZLUDA runtime did not start; reinstall it.",
        "devices": [{"index": 0, "name": "RX 7900"}],
        "evidence": {"probe": "probe timed out after 20s"},
        "generation": 1,
        "cached": False,
        "age_s": 0.0,
    }
    reply = typed_reply("probe", {"backends": [record], "elapsed_s": 0.5}, ProbeReply)
    text = format_probe(reply.backends)
    assert "zluda: unusable [zluda_unavailable]" in text and "The ZLUDA runtime did not start" in text
    assert "device 0: RX 7900" in text and "probe: probe timed out after 20s" in text
