"""The PCI bus as sysfs shows it: hardware presence that needs no vendor driver or tool."""

from __future__ import annotations

from pathlib import Path


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""


def pci_display_vendor_present(vendor: str, sysfs_root: Path | str = "/sys") -> bool | None:
    """Whether a display/3D controller (PCI class 0x03xxxx) of `vendor` is on the bus.

    None when sysfs has no PCI view (macOS, containers without /sys): unknown, not absent.
    """
    devices = Path(sysfs_root) / "bus" / "pci" / "devices"
    if not devices.is_dir():
        return None
    vendor = vendor.lower()
    for dev in devices.iterdir():
        if _read(dev / "vendor") == vendor and _read(dev / "class").startswith("0x03"):
            return True
    return False
