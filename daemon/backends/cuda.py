"""NVIDIA CUDA: detection through NVML, falling back to nvidia-smi when NVML cannot load."""

from __future__ import annotations

import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any, Iterable, Mapping

from stoker.daemon.backends.base import (
    BUNDLE_FITS,
    BundleCheck,
    Detection,
    Device,
    GpuBackend,
    LaunchPlanLike,
    Telemetry,
    TelemetryRequest,
    excerpt,
    version_tuple,
)
from stoker.daemon.backends.cuda_arch import archs_for, cc_supported, parse_cc, split_archs
from stoker.daemon.backends.cuda_telemetry import NvmlTelemetry
from stoker.daemon.backends.pci import pci_display_vendor_present
from stoker.daemon.backends.tools import ToolResult, ToolRunner, run_tool
from stoker.states.reasons import ReasonCode

R = ReasonCode

SMI_QUERY = (
    "nvidia-smi",
    "--query-gpu=name,memory.total,memory.free,driver_version,compute_cap",
    "--format=csv,noheader,nounits",
)
# compute_cap is a query field only since driver ~510; older drivers reject it.
SMI_QUERY_NO_CC = (
    "nvidia-smi",
    "--query-gpu=name,memory.total,memory.free,driver_version",
    "--format=csv,noheader,nounits",
)
NVIDIA_PCI_VENDOR = "0x10de"
NVML_LIBRARY = "libnvidia-ml.so.1"  # what pynvml dlopens on Linux
_MIB = 1024 * 1024

# NVML error classes (pynvml builds them as NVMLError_<Name>), grouped by what they mean.
_CANNOT_LOAD = {"NVMLError_LibraryNotFound", "NVMLError_FunctionNotFound"}
_NO_DRIVER = {"NVMLError_DriverNotLoaded"}


def _nvml_error_name(exc: BaseException) -> str:
    return type(exc).__name__


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _cuda_version(number: int) -> str:
    """NVML's 13000 -> '13.0'."""
    return f"{number // 1000}.{(number % 1000) // 10}"


class CudaBackend(GpuBackend, device="CUDA", codes="cuda", vendor="nvidia"):
    name = "cuda"
    auto_rank = 10
    # On an H200 (CUDA 13, driver 580) NVML said 1499 MiB free and the engine saw 975 MiB after
    # creating its context; a server that offloaded nothing still held 542 MiB
    # (docs/gpu-verification.md).
    runtime_reserve_mib = 524

    def __init__(
        self,
        *,
        nvml: ModuleType | Any | None = None,
        run: ToolRunner = run_tool,
        sysfs_root: Path | str = "/sys",
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._environ = environ
        self._nvml = nvml
        self._run = run
        self._sysfs_root = Path(sysfs_root)
        self._telemetry = NvmlTelemetry(self.name, self._load_nvml)

    # -- detection ---------------------------------------------------------------------

    def _load_nvml(self) -> Any:
        if self._nvml is None:
            import pynvml  # nvidia-ml-py; loading the .so happens in nvmlInit, not here

            self._nvml = pynvml
        return self._nvml

    def detect(self) -> Detection:
        """NVML first; nvidia-smi only when NVML itself cannot be loaded."""
        try:
            nvml = self._load_nvml()
            nvml.nvmlInit()
        except ImportError as e:
            return self._detect_with_smi({"nvml": f"ImportError: {e}"})
        except Exception as e:  # pynvml raises NVMLError subclasses
            name = _nvml_error_name(e)
            if name in _CANNOT_LOAD:
                return self._detect_with_smi({"nvml": f"{name}: {e}", "failing_library": NVML_LIBRARY})
            return self._nvml_init_failed(name, str(e))
        try:
            return self._detect_with_nvml(nvml)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    def _pci_present(self) -> bool | None:
        return pci_display_vendor_present(NVIDIA_PCI_VENDOR, self._sysfs_root)

    def _nvml_init_failed(self, name: str, text: str) -> Detection:
        pci = self._pci_present()
        evidence: dict[str, Any] = {"source": "nvml", "nvml": f"{name}: {text}", "pci_nvidia_display": pci}
        if (name in _NO_DRIVER and not pci) or pci is False:
            message = (
                "No NVIDIA GPU: the NVIDIA kernel driver is not loaded and no NVIDIA display device is on the PCI bus."
                if name in _NO_DRIVER
                else f"No NVIDIA GPU on the PCI bus (NVML init failed: {name})."
            )
            return Detection.unavailable(self.name, R.GPU_MISSING, present=False, message=message, **evidence)
        return Detection.unavailable(
            self.name,
            R.CUDA_UNAVAILABLE,
            present=True,
            message=f"NVIDIA hardware or driver is installed but NVML could not initialise ({name}: {text}); "
            "check the driver installation (a driver/library version mismatch needs a reboot).",
            **evidence,
        )

    def _detect_with_nvml(self, nvml: Any) -> Detection:
        evidence: dict[str, Any] = {"source": "nvml"}
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception as e:
            driver = None
            evidence["driver_error"] = f"{_nvml_error_name(e)}: {e}"
        try:
            cuda_driver = _cuda_version(int(nvml.nvmlSystemGetCudaDriverVersion()))
        except Exception as e:
            cuda_driver = None
            evidence["cuda_driver_error"] = f"{_nvml_error_name(e)}: {e}"
        evidence.update(driver=driver, cuda_driver_version=cuda_driver)
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            return Detection.unavailable(
                self.name,
                R.CUDA_UNAVAILABLE,
                present=True,
                message=f"NVML initialised but could not count devices ({_nvml_error_name(e)}).",
                nvml=f"{_nvml_error_name(e)}: {e}",
                **evidence,
            )
        evidence["device_count"] = count
        if count == 0:
            return Detection.unavailable(
                self.name,
                R.GPU_MISSING,
                present=False,
                message="The NVIDIA driver is installed but reports no GPU.",
                **evidence,
            )
        # NVML ignores CUDA_VISIBLE_DEVICES; the engine's CUDA runtime does not.
        indices = self._visible(count, lambda i: _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i))))
        hidden = self._hidden_verdict(count, indices, evidence)
        if hidden is not None:
            return hidden
        devices: list[Device] = []
        errors: dict[str, str] = {}
        for index in indices:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                name = _text(nvml.nvmlDeviceGetName(handle))
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            except Exception as e:
                errors[str(index)] = f"{_nvml_error_name(e)}: {e}"
                continue
            devices.append(
                Device(
                    index=index,
                    name=name,
                    memory_total_mib=int(mem.total) // _MIB,
                    memory_free_mib=int(mem.free) // _MIB,
                    compute_capability=f"{major}.{minor}",
                    driver_version=driver,
                    runtime_version=cuda_driver,
                    device_type="discrete",
                )
            )
        if errors:
            evidence["device_errors"] = errors
        evidence["compute_capabilities"] = sorted({d.compute_capability for d in devices if d.compute_capability})
        if not devices:
            return Detection.unavailable(
                self.name,
                R.CUDA_UNAVAILABLE,
                present=True,
                message=f"NVML sees {count} NVIDIA GPU(s) but none could be queried (fallen off the bus or in a bad state).",
                **evidence,
            )
        return Detection.available(self.name, devices, _summary(devices, driver, cuda_driver), **evidence)

    def _detect_with_smi(self, evidence: dict[str, Any]) -> Detection:
        evidence = {**evidence, "source": "nvidia-smi"}
        result = self._run(SMI_QUERY)
        if not result.missing and result.returncode != 0 and "compute_cap" in (result.stdout + result.stderr):
            result = self._run(SMI_QUERY_NO_CC)
        evidence["nvidia_smi"] = " ".join(result.argv)
        if result.missing:
            pci = self._pci_present()
            evidence["pci_nvidia_display"] = pci
            if pci:
                return Detection.unavailable(
                    self.name,
                    R.CUDA_UNAVAILABLE,
                    present=True,
                    message="An NVIDIA GPU is on the PCI bus but neither NVML nor nvidia-smi is available: "
                    "install the NVIDIA driver.",
                    **evidence,
                )
            return Detection.unavailable(
                self.name,
                R.GPU_MISSING,
                present=False,
                message="No NVIDIA GPU: NVML cannot be loaded and nvidia-smi is not installed.",
                **evidence,
            )
        output = result.stdout + "\n" + result.stderr
        evidence["raw"] = excerpt(output, 1000)
        if result.returncode != 0:
            if "No devices were found" in output:
                return Detection.unavailable(
                    self.name, R.GPU_MISSING, present=False, message="nvidia-smi reports no NVIDIA GPU.", **evidence
                )
            return Detection.unavailable(
                self.name,
                R.CUDA_UNAVAILABLE,
                present=True,
                message=f"nvidia-smi failed (exit {result.returncode}): {excerpt(output, 200)}",
                **evidence,
            )
        devices = parse_smi_csv(result.stdout)
        if not devices:
            return Detection.unavailable(
                self.name, R.GPU_MISSING, present=False, message="nvidia-smi lists no NVIDIA GPU.", **evidence
            )
        indices = self._visible(len(devices), lambda i: None)
        hidden = self._hidden_verdict(len(devices), indices, evidence)
        if hidden is not None:
            return hidden
        devices = [devices[i] for i in indices]
        driver = devices[0].driver_version
        evidence.update(
            driver=driver,
            cuda_driver_version=None,
            device_count=len(devices),
            compute_capabilities=sorted({d.compute_capability for d in devices if d.compute_capability}),
        )
        return Detection.available(self.name, devices, _summary(devices, driver, None), **evidence)

    def _visible(self, count: int, uuid_of: Any) -> list[int]:
        """The indices CUDA_VISIBLE_DEVICES lets the CUDA runtime see (all when it is unset)."""
        env = os.environ if self._environ is None else self._environ
        value = env.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return list(range(count))
        return visible_indices(value, [_try(lambda i=i: uuid_of(i)) for i in range(count)])

    def _hidden_verdict(self, count: int, indices: list[int], evidence: dict[str, Any]) -> Detection | None:
        """gpu_missing when CUDA_VISIBLE_DEVICES hides every GPU the driver reports."""
        env = os.environ if self._environ is None else self._environ
        value = env.get("CUDA_VISIBLE_DEVICES")
        if value is None:
            return None
        evidence.update(cuda_visible_devices=value, visible_indices=indices)
        if indices:
            return None
        return Detection.unavailable(
            self.name,
            R.GPU_MISSING,
            present=False,
            message=f"The driver reports {count} NVIDIA GPU(s) but CUDA_VISIBLE_DEVICES={value!r} hides all of them "
            "from CUDA; unset it or name a GPU.",
            **evidence,
        )

    # -- bundles, variants, launch -------------------------------------------------------

    def build_archs(self, detection: Detection | None) -> tuple[str, ...]:
        """Real code for every detected GPU's compute capability and nothing else ("90-real"
        on an H200): one architecture builds in minutes where all the families take most of an
        hour. The bundle records them; `explain_bundle` refuses it on a GPU it cannot run on."""
        if detection is None or not detection.usable:
            return ()
        return archs_for(d.compute_capability for d in detection.devices)

    def explain_bundle(self, detection: Detection, bundle_meta: Mapping[str, Any]) -> BundleCheck:
        """Driver floor, CUDA toolkit vs driver, and compute capability vs built architectures."""
        if not detection.usable:
            return BundleCheck(detection.reason or R.CUDA_UNAVAILABLE, detection.message, dict(detection.evidence))
        driver = detection.evidence.get("driver") or next(
            (d.driver_version for d in detection.devices if d.driver_version), None
        )
        min_driver = bundle_meta.get("min_driver")
        if min_driver and driver and version_tuple(driver) < version_tuple(min_driver):
            return BundleCheck(
                R.CUDA_UNAVAILABLE,
                f"NVIDIA driver {driver} is older than this CUDA bundle's minimum {min_driver}; update the driver.",
                {"driver": driver, "min_driver": min_driver},
            )
        toolkit = _toolkit_version(bundle_meta)
        cuda_driver = detection.evidence.get("cuda_driver_version")
        if toolkit and cuda_driver and version_tuple(toolkit)[:1] > version_tuple(cuda_driver)[:1]:
            # Minor-version compatibility covers 13.x on a 13.0 driver; a new major does not run.
            return BundleCheck(
                R.CUDA_UNAVAILABLE,
                f"The bundle was built with CUDA {toolkit} but driver {driver} supports CUDA {cuda_driver}; update the driver.",
                {"toolkit": toolkit, "cuda_driver_version": cuda_driver, "driver": driver},
            )
        archs = split_archs(bundle_meta.get("cuda_archs") or bundle_meta.get("cuda_architectures"))
        per_device: dict[str, tuple[str, bool | None]] = {}
        for device in detection.devices:
            cc = parse_cc(device.compute_capability)
            if cc is not None and device.compute_capability is not None:
                per_device[f"{device.index}:{device.name}"] = (device.compute_capability, cc_supported(cc, archs))
        if per_device and all(ok is False for _, ok in per_device.values()):
            ccs = sorted({cc for cc, _ in per_device.values()})
            return BundleCheck(
                R.CUDA_UNAVAILABLE,
                f"This bundle was built for CUDA architectures {';'.join(archs)}, which cannot run on compute "
                f"capability {', '.join(ccs)}; install a bundle built for this GPU.",
                {"compute_capability": ccs, "cuda_archs": list(archs), "driver": driver},
            )
        return BUNDLE_FITS

    def choose_variant(self, detection: Detection, available_variants: Iterable[str]) -> str | None:
        """The highest `cudaNN` variant the driver supports, else the only/first variant."""
        variants = sorted(set(available_variants))
        if not detection.usable or not variants:
            return None
        driver_major = (version_tuple(detection.evidence.get("cuda_driver_version")) or (None,))[0]
        numbered = []
        for v in variants:
            m = re.match(r"^cuda[-_]?(\d+)", v)
            if m is not None:
                numbered.append((int(m.group(1)), v))
        if numbered and driver_major is not None:
            fitting = [(n, v) for n, v in numbered if n <= driver_major]
            return max(fitting)[1] if fitting else None
        for preferred in ("default", "cuda"):
            if preferred in variants:
                return preferred
        return variants[0]

    def launch_env(self, plan: LaunchPlanLike) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for the plan's devices, by NVML index: with
        CUDA_DEVICE_ORDER=PCI_BUS_ID the runtime numbers GPUs as NVML does (by PCI bus), so the
        indices name the same GPUs whatever the daemon's own CUDA_VISIBLE_DEVICES said. A GPU
        the runtime does not see gets no CUDA context (~520 MiB on an H200)."""
        if not plan.devices:
            return {}
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in plan.devices)}

    # -- telemetry -----------------------------------------------------------------------

    def read_telemetry(self, handle: TelemetryRequest) -> Telemetry | None:
        """NVML per device (daemon/backends/cuda_telemetry.py); raises when NVML cannot load."""
        return self._telemetry.read(handle)

    def release_telemetry(self) -> None:
        """Shut NVML down until the next reading."""
        self._telemetry.release()


def visible_indices(value: str, uuids: list[str | None]) -> list[int]:
    """The device indices CUDA_VISIBLE_DEVICES selects, in its order, the way the CUDA runtime reads it.

    Entries are indices or (prefixes of) GPU UUIDs; the list ends at the first entry that names
    no device (so "" and "-1" hide every GPU), and a device named twice ends it too.
    """
    chosen: list[int] = []
    for token in value.split(","):
        token = token.strip()
        if token.isdigit():
            index = int(token)
            if index >= len(uuids):
                break
        elif token.upper().startswith(("GPU-", "MIG-")):
            matches = [i for i, u in enumerate(uuids) if u and u.lower().startswith(token.lower())]
            if len(matches) != 1:
                break
            index = matches[0]
        else:
            break
        if index in chosen:
            break
        chosen.append(index)
    return chosen


def _try(call: Any) -> Any:
    try:
        return call()
    except Exception:
        return None


def _toolkit_version(meta: Mapping[str, Any]) -> str | None:
    build: Mapping[str, Any] = meta["build"] if isinstance(meta.get("build"), Mapping) else {}
    raw = meta.get("toolkit_version") or build.get("toolkit") or build.get("cuda_toolkit")
    if isinstance(raw, Mapping):
        raw = raw.get("version")
    m = re.search(r"(\d+\.\d+(?:\.\d+)?)", str(raw or ""))
    return m.group(1) if m else None


def _summary(devices: list[Device], driver: str | None, cuda: str | None) -> str:
    names = ", ".join(f"{d.name} ({d.memory_total_mib} MiB, cc {d.compute_capability or '?'})" for d in devices)
    tail = f"driver {driver or '?'}" + (f", CUDA {cuda}" if cuda else "")
    return f"{len(devices)} NVIDIA GPU(s): {names}; {tail}"


def parse_smi_csv(stdout: str) -> list[Device]:
    """Parse `nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version[,compute_cap]`."""
    devices: list[Device] = []
    for line in stdout.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4 or not fields[0]:
            continue
        name, total, free, driver = fields[:4]
        cc = fields[4] if len(fields) > 4 and parse_cc(fields[4]) else None
        devices.append(
            Device(
                index=len(devices),
                name=name,
                memory_total_mib=int(total) if total.isdigit() else None,
                memory_free_mib=int(free) if free.isdigit() else None,
                compute_capability=cc,
                driver_version=driver or None,
                device_type="discrete",
            )
        )
    return devices


__all__ = ["CudaBackend", "parse_smi_csv", "visible_indices", "SMI_QUERY", "ToolResult"]
