"""The backend plugin contract: what every accelerator backend answers, and its records.

A backend is found through the `stoker.backends` entry-point group (see `registry.py`).
`detect()` runs inside the probe subprocess (`daemon/probes/child.py`), so a driver that
crashes or hangs cannot take the daemon down; its answer crosses the process boundary as
JSON through `Detection.to_dict()` / `Detection.from_dict()`.

Everything the core knows about a backend it asks here: its name, where auto mode tries it
(`auto_rank`), which reason code names each fallback step's failure on it (`reason(kind)`),
the codes it brings with their sentences (`reason_messages`), its `--list-devices` signature
and its launch arguments and environment. The core never spells a backend's name or assembles its codes.
"""

from __future__ import annotations

import abc
import enum
import re
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Mapping, Protocol, runtime_checkable

import attrs

from stoker.states.reasons import ReasonCode, message_for

if TYPE_CHECKING:
    from stoker.states.launch.records import GpuLayers


def _device_tuple(devices: Iterable["Device"]) -> tuple["Device", ...]:
    return tuple(devices)


def _reason_or_none(reason: ReasonCode | str | None) -> ReasonCode | None:
    # A plugin's own code arrives as its string; registered, it is a ReasonCode like Stoker's.
    return None if reason is None else ReasonCode(reason)


class ReasonKind(enum.StrEnum):
    """The steps at which the fallback asks a backend which of its codes names the failure."""

    UNAVAILABLE = "unavailable"  # present, its runtime unusable; also what a crashed probe reports
    BINARY_MISSING = "binary_missing"  # present and usable, no bundle installed: installed on demand
    STARTUP_FAILED = "startup_failed"  # its server died before it was ready: the next backend is tried
    GPU_LAYERS_ZERO = "gpu_layers_zero"  # ready, but no layer offloaded: reported as the CPU
    BUNDLE_INSTALL_FAILED = "bundle_install_failed"  # its bundle could not be installed
    VRAM_FULL = "vram_full"  # every device below the engine's fit margin: its server is not started
    SOFTWARE_DEVICE = "software_device"  # ready, but on a software device (a CPU rasteriser): reported as the CPU


@attrs.frozen
class Device:
    """One accelerator (or the CPU) as detection saw it. Memory is in MiB."""

    index: int
    name: str
    memory_total_mib: int | None = None
    memory_free_mib: int | None = None
    compute_capability: str | None = None  # "9.0" for CUDA, "gfx942" for ROCm
    driver_version: str | None = None
    runtime_version: str | None = None  # the CUDA version the driver supports, ROCm, Vulkan API
    device_type: str | None = None  # "discrete", "integrated", "cpu", ... where the tool says

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Device":
        """Parse the JSON form; fields this daemon does not know are ignored."""
        # cattrs loads here, not with this module: the probe subprocess (daemon/probes/child.py)
        # only writes Detections, and every daemon start runs one per GPU backend.
        from stoker.states.convert import structure

        return structure(data, cls)


@attrs.frozen
class Detection:
    """A backend's verdict on this machine, with the evidence that decided it.

    `present`: the hardware is there. `usable`: its runtime can be driven now (a bundle may
    still be missing; that is the fallback orchestrator's business). `reason` is None when
    usable, otherwise the code that explains why not. `evidence` is JSON-safe: driver and
    toolkit versions, compute capability, the failing library, raw tool output excerpts.
    """

    backend: str
    present: bool
    usable: bool
    reason: ReasonCode | None = attrs.field(default=None, converter=_reason_or_none)
    message: str = ""
    devices: tuple[Device, ...] = attrs.field(default=(), converter=_device_tuple)
    evidence: Mapping[str, Any] = attrs.field(factory=dict)

    @classmethod
    def available(cls, backend: str, devices: Iterable[Device], message: str, **evidence: Any) -> "Detection":
        """Hardware present and its runtime usable."""
        return cls(backend, True, True, None, message, tuple(devices), evidence)

    @classmethod
    def unavailable(
        cls,
        backend: str,
        reason: ReasonCode | str,
        *,
        present: bool,
        message: str | None = None,
        devices: Iterable[Device] = (),
        **evidence: Any,
    ) -> "Detection":
        """Not usable, with the reason code (its standard sentence unless `message` is given)."""
        return cls(backend, present, False, reason, message or message_for(reason), tuple(devices), evidence)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "present": self.present,
            "usable": self.usable,
            "reason": None if self.reason is None else str(self.reason),
            "message": self.message,
            "devices": [d.to_dict() for d in self.devices],
            "evidence": dict(self.evidence),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Detection":
        """Parse the JSON form; raises KeyError/ValueError/TypeError on a malformed record."""
        if not isinstance(data.get("present"), bool) or not isinstance(data.get("usable"), bool):
            raise TypeError("present and usable must be booleans")
        return cls(
            backend=str(data["backend"]),
            present=data["present"],
            usable=data["usable"],
            reason=data.get("reason"),
            message=str(data.get("message", "")),
            devices=tuple(Device.from_dict(d) for d in data.get("devices", ())),
            evidence=dict(data.get("evidence") or {}),
        )


@attrs.frozen
class BundleCheck:
    """Whether a bundle's build fits the detected hardware; `reason` None means it fits."""

    reason: ReasonCode | None
    message: str = ""
    evidence: Mapping[str, Any] = attrs.field(factory=dict)

    @property
    def ok(self) -> bool:
        return self.reason is None

    def to_dict(self) -> dict[str, Any]:
        return {
            "reason": None if self.reason is None else str(self.reason),
            "message": self.message,
            "evidence": dict(self.evidence),
        }


BUNDLE_FITS = BundleCheck(None, "the bundle fits this hardware")


@runtime_checkable
class LaunchPlanLike(Protocol):
    """What `launch_args` and `launch_env` read from a plan: how many layers to offload (a
    count, or "auto": the engine fits them to free VRAM), and the devices to give the server
    (the detection's device indices; empty = all of them). The planner hands a
    `LaunchRequest`; tests may hand any such object."""

    @property
    def gpu_layers(self) -> GpuLayers: ...

    @property
    def devices(self) -> tuple[int, ...]: ...


@attrs.frozen
class LaunchRequest:
    """The planner's question to a backend's `launch_args` and `launch_env`
    (daemon/fallback/launch_plan.py). `devices`: the detected devices (their `Device.index`)
    the server may use, when the plan keeps it off the others (empty = every one)."""

    gpu_layers: GpuLayers
    devices: tuple[int, ...] = ()


@attrs.frozen
class TelemetryRequest:
    """What to read: which devices (empty = all) and, optionally, one process's share."""

    devices: tuple[int, ...] = ()
    pid: int | None = None


@attrs.frozen
class DeviceTelemetry:
    """One device's reading; None wherever the platform cannot say (that figure is unknown)."""

    index: int
    name: str | None = None
    memory_used_mib: int | None = None
    memory_total_mib: int | None = None
    memory_free_mib: int | None = None  # as the driver says (total - used where it does not)
    utilization_percent: int | None = None  # compute
    memory_utilization_percent: int | None = None  # memory controller busy
    temperature_c: int | None = None
    power_w: float | None = None
    process_memory_mib: int | None = None  # the requested pid's VRAM on this device
    compute_processes: int | None = None  # processes holding a compute context on it, ours included


@attrs.frozen
class Telemetry:
    """A cheap, frequent reading (cached ~5 s by the caller), unlike detection (~30 s)."""

    backend: str
    devices: tuple[DeviceTelemetry, ...] = ()
    process_memory_mib: int | None = None  # VRAM held by the requested pid; None = unknown
    source: str | None = None  # what read it (nvml, sysfs, ...) where not the backend itself

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


@attrs.frozen
class ListedDevice:
    """One line of `llama-server --list-devices` that a backend's signature matched."""

    backend: str
    name: str  # the engine's device name: CUDA0, ROCm0, Vulkan0, MTL0
    description: str
    memory_total_mib: int | None = None
    memory_free_mib: int | None = None


class Backend(abc.ABC):
    """One accelerator backend. Subclass it and register it under `stoker.backends`.

    `detect` runs in the probe subprocess; everything else is cheap, pure and runs in the
    daemon. Constructors take no required arguments (the registry calls `cls()`); tests
    inject recorded hardware answers through keyword arguments.
    """

    name: ClassVar[str]
    # The regex for this backend's `llama-server --list-devices` lines; groups:
    # 1 engine device name, 2 description, 3 total MiB, 4 free MiB (where printed).
    # Bundle verification asks it too: a bundle's engine must list this backend's devices.
    device_signature: ClassVar[re.Pattern[str]]
    # Which code names each fallback step's failure here (`reason(kind)`). A kind left out
    # falls back to a generic code (server_crashed, bundle_missing, ...), or is skipped
    # (vram_full: the engine is left to fit); UNAVAILABLE defaults to probe_failed.
    reason_family: ClassVar[Mapping[ReasonKind, str]] = {}
    # The codes this backend brings itself, each with the sentence a user reads: registered
    # when the plugin is loaded (states/reasons.py `register_reasons`). The built-ins bring
    # none; their codes are Stoker's own.
    reason_messages: ClassVar[Mapping[str, str]] = {}
    # Every reason code detect/check_bundle/launch verification can produce for it.
    reason_codes: ClassVar[frozenset[str]] = frozenset()
    # Where auto mode tries it: lowest first, ties by name. The built-in GPUs take 10-40, a
    # plugin 100 unless it says otherwise, the CPU 1000: the floor, always last.
    auto_rank: ClassVar[int] = 100
    # Whether it offloads to an accelerator: the CPU does not (its launch arguments say -ngl 0,
    # and telemetry reads no accelerator through it).
    offloads: ClassVar[bool] = True
    # VRAM per device that the backend's runtime takes before the engine measures "free" and
    # fits its layers (the layer estimate counts it); 0 where unmeasured.
    runtime_reserve_mib: ClassVar[int] = 0

    def reason(self, kind: ReasonKind) -> ReasonCode | None:
        """This backend's code for a fallback step, or None where it declares none."""
        code = self.reason_family.get(kind)
        return None if code is None else ReasonCode(code)

    @property
    def unavailable_reason(self) -> ReasonCode:
        """The code for "present but cannot be used" (also what a crashed probe reports)."""
        return self.reason(ReasonKind.UNAVAILABLE) or ReasonCode.PROBE_FAILED

    @abc.abstractmethod
    def detect(self) -> Detection:
        """Look at the hardware and its runtime; never raises for a hardware problem."""

    def quick_detect(self) -> Detection | None:
        """`detect()`'s answer when it can be had without loading a driver or running a tool
        (the wrong platform, none of the backend's tools on PATH), else None.

        The daemon calls this in-process before it spawns a probe subprocess: the answer must
        be exactly what `detect()` would say, and nothing here may touch a driver."""
        return None

    @abc.abstractmethod
    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        """The bundle variant that fits this detection, or None if none of them does."""

    def build_argv(self, variant: str) -> list[str] | None:
        """A backend Stoker's builder does not build may bring its own: the argv of a child
        that speaks the builder's protocol (progress lines such as `compile: 45%` on stderr,
        one JSON answer on stdout: ok, zip, sha256, size, cache_key, cached, seconds). None:
        the builder's own build, where it builds this backend."""
        return None

    def build_archs(self, detection: Detection | None) -> tuple[str, ...]:
        """The device architectures a local build of this backend's bundle is made for, from
        the detected devices (empty: the builder's default)."""
        return ()

    def explain_bundle(self, detection: Detection, bundle_meta: Mapping[str, Any]) -> BundleCheck:
        """Whether a bundle (its `bundle.json` as a dict) can run here, with evidence."""
        return BUNDLE_FITS

    def check_bundle(self, detection: Detection, bundle_meta: Mapping[str, Any]) -> ReasonCode | None:
        """The reason this bundle cannot run on the detected hardware, or None if it can."""
        return self.explain_bundle(detection, bundle_meta).reason

    def launch_args(self, plan: LaunchPlanLike) -> list[str]:
        """The llama-server arguments this backend adds for a plan: `-ngl auto` or `-ngl N`;
        `-ngl 0` where it offloads nothing. Asked once, when planning ends: the plan records
        the answer, and that is what runs."""
        if not self.offloads:
            return ["-ngl", "0"]
        layers = plan.gpu_layers
        return ["-ngl", "auto" if layers == "auto" else str(int(layers))]

    def launch_env(self, plan: LaunchPlanLike) -> dict[str, str]:
        """Environment variables this backend sets for a plan's server: where the plan names
        `devices`, whatever keeps the backend's runtime off the others (CUDA_VISIBLE_DEVICES
        for CUDA: a runtime that sees a GPU takes VRAM on it even when no layer goes there).
        Asked once, when planning ends, and recorded in the plan. None by default: a backend
        that cannot restrict its devices leaves the engine every one."""
        return {}

    def parse_list_devices(self, output: str) -> tuple[ListedDevice, ...]:
        """This backend's devices in `llama-server --list-devices` output (empty: not loaded)."""
        found = []
        for line in output.splitlines():
            m = self.device_signature.match(line)
            if m is None:
                continue
            groups = m.groups()
            if not groups:  # the CPU's "(none)": a CPU-only build, nothing to name
                found.append(ListedDevice(self.name, m.group(0).strip(), "no accelerator device"))
                continue
            total = int(groups[2]) if len(groups) > 2 and groups[2] is not None else None
            free = int(groups[3]) if len(groups) > 3 and groups[3] is not None else None
            found.append(ListedDevice(self.name, groups[0], groups[1], total, free))
        return tuple(found)

    def software_devices(self, engine_devices: Iterable[str]) -> tuple[str, ...]:
        """Those of the devices the engine said it loaded on (its `using device NAME (DESC)`
        lines, as `NAME (DESC)`) that are software on the CPU (a Vulkan rasteriser such as
        llvmpipe), where this backend can tell: a launch on them is not accelerated. None by default."""
        return ()

    def read_telemetry(self, handle: TelemetryRequest) -> Telemetry | None:
        """A cheap telemetry reading (blocking, fast: callers run it in a thread), or None
        where this backend has no way to read one. Raises when it has one but the reading
        fails (its library cannot load): the error is what a person is shown."""
        return None

    def release_telemetry(self) -> None:
        """Let go of what `read_telemetry` holds open (a driver library) until the next reading."""


class GpuBackend(Backend):
    """A built-in GGML GPU backend, which names the rest of its declaration on its class line:

        class CudaBackend(GpuBackend, device="CUDA", codes="cuda", vendor="nvidia")

    `device` is the engine's device-name prefix (CUDA0, ROCm0, Vulkan0, MTL0), which gives the
    `--list-devices` line shape. `codes` and `vendor` name its fallback codes, one rule for all:
    `<codes>_<kind>` for each kind (cuda_unavailable, rocm_vram_full, ...) and
    `binary_missing_<vendor>_detected`; `kinds` adds kinds beyond the common ones. Its
    `reason_codes` are that family, gpu_missing and out_of_memory, and gpu_claimed_but_unused
    where the platform reports a process's own VRAM (`process_vram`), so it can be proven.
    """

    def __init_subclass__(
        cls,
        *,
        device: str | None = None,
        codes: str = "",
        vendor: str = "",
        kinds: tuple[ReasonKind, ...] = (),
        process_vram: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init_subclass__(**kwargs)
        if device is None:
            return  # a subclass of a GPU backend (a test double): its parent's declaration stands
        cls.device_signature = re.compile(rf"^\s+({device}\d+): (.+) \((\d+) MiB, (\d+) MiB free\)$")
        family = (
            ReasonKind.UNAVAILABLE,
            ReasonKind.BINARY_MISSING,
            ReasonKind.STARTUP_FAILED,
            ReasonKind.GPU_LAYERS_ZERO,
            ReasonKind.BUNDLE_INSTALL_FAILED,
            ReasonKind.VRAM_FULL,
            *kinds,
        )
        cls.reason_family = {
            kind: ReasonCode(
                f"binary_missing_{vendor}_detected" if kind is ReasonKind.BINARY_MISSING else f"{codes}_{kind.value}"
            )
            for kind in family
        }
        proven = {ReasonCode.GPU_CLAIMED_BUT_UNUSED.value} if process_vram else set()
        cls.reason_codes = frozenset(
            {ReasonCode.GPU_MISSING.value, ReasonCode.OUT_OF_MEMORY.value, *cls.reason_family.values(), *proven}
        )

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        """A portable build (one that runs on any device of its backend): 'default', else the only variant."""
        return portable_variant(detection, available_variants)


def version_tuple(text: str | None) -> tuple[int, ...]:
    """'580.95.05' -> (580, 95, 5); non-numeric parts end the tuple."""
    out: list[int] = []
    for part in re.split(r"[.\-+ ]", (text or "").strip()):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


def portable_variant(
    detection: Detection, available_variants: Iterable[str], preferred: Iterable[str] = ()
) -> str | None:
    """For builds that run on any device of their backend: the first of `preferred` offered,
    else 'default', else the only variant; None when the detection is unusable."""
    variants = sorted(set(available_variants))
    if not detection.usable or not variants:
        return None
    for v in (*sorted(preferred), "default"):
        if v in variants:
            return v
    return variants[0] if len(variants) == 1 else None


def excerpt(text: str | bytes | None, limit: int = 2000) -> str:
    """A bounded excerpt of tool output for evidence (the tail, where errors usually are)."""
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]
