"""FakeGPU: an accelerator Stoker has never heard of, brought by a third-party distribution.

Its device is whatever `FAKEGPU_DEVICES` says: "NAME:MiB" is one device with that much free
memory, "offline" is hardware that is there but whose runtime does not answer, unset is no
device at all. Its engine bundle is Stoker's CPU build under another name, so a real
llama-server serves under it. Everything Stoker knows about it comes from this file: its
name, where auto mode tries it, its reason codes with their sentences, and the
`--list-devices` line its engine prints.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

from daemon.backends.base import Backend, Detection, Device, ReasonKind
from states.reasons import ReasonCode

ENV = "FAKEGPU_DEVICES"


class FakeGpuBackend(Backend):
    name = "fakegpu"
    # The CPU build underneath lists no device.
    device_signature = re.compile(r"^\s+\(none\)\s*$")
    auto_rank = 50  # after the built-in GPUs, before the CPU
    reason_messages = {
        "fakegpu_unavailable": "The FakeGPU runtime does not answer; set FAKEGPU_DEVICES to NAME:MiB and probe again.",
        "fakegpu_startup_failed": "The FakeGPU server died before it was ready (the device was lost); "
        "Stoker went on to the next backend.",
        "fakegpu_gpu_layers_zero": "The FakeGPU server offloaded no layer (its engine is the CPU build), "
        "so it is reported as the CPU.",
        "fakegpu_bundle_install_failed": "Installing the FakeGPU bundle failed; install it with `stoker bundle install`.",
    }
    reason_family = {
        ReasonKind.UNAVAILABLE: "fakegpu_unavailable",
        ReasonKind.STARTUP_FAILED: "fakegpu_startup_failed",
        ReasonKind.GPU_LAYERS_ZERO: "fakegpu_gpu_layers_zero",
        ReasonKind.BUNDLE_INSTALL_FAILED: "fakegpu_bundle_install_failed",
    }
    reason_codes = frozenset({*reason_family.values(), ReasonCode.GPU_MISSING.value})

    def detect(self) -> Detection:
        spec = os.environ.get(ENV)
        if not spec:
            return Detection.unavailable(
                self.name, ReasonCode.GPU_MISSING, present=False, message=f"No FakeGPU: {ENV} is not set."
            )
        name, _, mib = spec.partition(":")
        if not mib.isdigit():
            return Detection.unavailable(self.name, "fakegpu_unavailable", present=True, env=spec)
        device = Device(0, name, int(mib), int(mib), device_type="discrete", runtime_version="fake 1.0")
        return Detection.available(self.name, [device], f"1 FakeGPU: {name}", env=spec)

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        variants = sorted(available_variants)
        return variants[0] if detection.usable and variants else None
