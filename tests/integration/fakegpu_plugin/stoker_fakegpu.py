"""FakeGPU: an accelerator Stoker has never heard of, brought by a third-party distribution.

Its devices are whatever `FAKEGPU_DEVICES` says: "NAME:MiB" is one device with that much free
memory, "NAME:MiB,NAME:MiB" two of them, "offline" is hardware that is there but whose runtime
does not answer, unset is no device at all. Its engine bundle is Stoker's CPU build under
another name, so a real llama-server serves under it. Everything Stoker knows about it comes
from this file: its name, where auto mode tries it, its reason codes with their sentences,
the `--list-devices` line its engine prints, how its free memory is read now (the file named
by `FAKEGPU_NOW`, "MiB,MiB" per device, while it exists: another tenant filling the devices
after the probe) and how its server is kept to some devices (`FAKEGPU_VISIBLE_DEVICES`).

Its bundle can also be "built" (`FAKEGPU_BUILD`, a directory): the build is this module run
as a child, speaking the builder's protocol; it says `compile: 29%`, touches `started`, waits
until `go` exists, then answers with `bundle.zip` from that directory (what the test made).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable

from stoker.daemon.backends.base import (
    Backend,
    Detection,
    Device,
    DeviceTelemetry,
    ReasonKind,
    Telemetry,
    TelemetryRequest,
)
from stoker.states.reasons import ReasonCode

ENV = "FAKEGPU_DEVICES"
NOW_ENV = "FAKEGPU_NOW"
VISIBLE_ENV = "FAKEGPU_VISIBLE_DEVICES"
BUILD_ENV = "FAKEGPU_BUILD"


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
        "fakegpu_vram_full": "No FakeGPU device has room for a layer; the FakeGPU server was not started.",
    }
    reason_family = {
        ReasonKind.UNAVAILABLE: "fakegpu_unavailable",
        ReasonKind.STARTUP_FAILED: "fakegpu_startup_failed",
        ReasonKind.GPU_LAYERS_ZERO: "fakegpu_gpu_layers_zero",
        ReasonKind.BUNDLE_INSTALL_FAILED: "fakegpu_bundle_install_failed",
        ReasonKind.VRAM_FULL: "fakegpu_vram_full",
    }
    reason_codes = frozenset({*reason_family.values(), ReasonCode.GPU_MISSING.value})

    def detect(self) -> Detection:
        spec = os.environ.get(ENV)
        if not spec:
            return Detection.unavailable(
                self.name, ReasonCode.GPU_MISSING, present=False, message=f"No FakeGPU: {ENV} is not set."
            )
        devices = []
        for index, part in enumerate(spec.split(",")):
            name, _, mib = part.partition(":")
            if not mib.isdigit():
                return Detection.unavailable(self.name, "fakegpu_unavailable", present=True, env=spec)
            devices.append(Device(index, name, int(mib), int(mib), device_type="discrete", runtime_version="fake 1.0"))
        return Detection.available(self.name, devices, f"{len(devices)} FakeGPU: {spec}", env=spec)

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        variants = sorted(available_variants)
        return variants[0] if detection.usable and variants else None

    def build_argv(self, variant: str) -> list[str] | None:
        return [sys.executable, "-m", "stoker_fakegpu", variant] if os.environ.get(BUILD_ENV) else None

    def launch_env(self, plan) -> dict[str, str]:
        return {VISIBLE_ENV: ",".join(str(i) for i in plan.devices)} if plan.devices else {}

    def read_telemetry(self, handle: TelemetryRequest) -> Telemetry | None:
        now = os.environ.get(NOW_ENV)
        if not now or not Path(now).is_file():
            return None  # nothing to read now: the probe's figures stand
        free = [int(mib) for mib in Path(now).read_text().split(",")]
        wanted = handle.devices or tuple(range(len(free)))
        return Telemetry(self.name, tuple(DeviceTelemetry(i, memory_free_mib=free[i]) for i in wanted if i < len(free)))


def build(variant: str) -> None:
    """The FakeGPU bundle's build: slow until the test says `go`."""
    where, started = Path(os.environ[BUILD_ENV]), time.monotonic()
    print("configure: 100% fakegpu", file=sys.stderr, flush=True)
    print(f"compile: 29% fakegpu-{variant}, waiting for {where / 'go'}", file=sys.stderr, flush=True)
    (where / "started").write_text(f"{os.nice(0)}\n")  # the niceness it was started at
    while not (where / "go").exists():
        time.sleep(0.05)
    print("compile: 100% fakegpu", file=sys.stderr, flush=True)
    zip_path = where / "bundle.zip"
    data = zip_path.read_bytes()
    answer = {
        "ok": True,
        "zip": str(zip_path),
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "cache_key": f"fakegpu-{variant}",
        "cached": False,
        "seconds": round(time.monotonic() - started, 2),
    }
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    build(sys.argv[1])
