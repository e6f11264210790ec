"""Accelerator backends as plugins: the contract, its records, and the registry.

See `base.py` for the contract and `registry.py` for the `stoker.backends` entry points;
docs/backends.md for what each built-in detects and how.
"""

from stoker.daemon.backends.base import (
    Backend,
    BundleCheck,
    Detection,
    Device,
    DeviceTelemetry,
    LaunchPlanLike,
    ListedDevice,
    Telemetry,
    TelemetryRequest,
)
from stoker.daemon.backends.registry import (
    BUILTIN,
    GROUP,
    BackendRegistry,
    PluginFailure,
    discover_backends,
    load_backend,
    load_backends,
)

__all__ = [
    "BUILTIN",
    "GROUP",
    "Backend",
    "BackendRegistry",
    "BundleCheck",
    "Detection",
    "Device",
    "DeviceTelemetry",
    "LaunchPlanLike",
    "ListedDevice",
    "PluginFailure",
    "Telemetry",
    "TelemetryRequest",
    "discover_backends",
    "load_backend",
    "load_backends",
]
