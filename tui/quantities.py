"""How the TUI writes quantities: bytes, MiB, rates, durations, clock times."""

from __future__ import annotations

import time
from typing import Any


def size(n: float | None) -> str:
    """Bytes as B/KiB/MiB/GiB with three significant digits."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


def mib(n: float | None) -> str:
    """MiB figures (NVML, psutil) in MiB or GiB."""
    if n is None:
        return "-"
    return f"{n / 1024:.1f} GiB" if n >= 10240 else f"{n:.0f} MiB"


def rate(bytes_per_s: float | None) -> str:
    return "-" if bytes_per_s is None else size(bytes_per_s) + "/s"


def duration(seconds: float | None) -> str:
    """12s, 4m05s, 3h02m, 2d04h."""
    if seconds is None:
        return "-"
    s = int(max(0, seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def clock(at: float | None) -> str:
    """Local wall-clock time of day."""
    return "-" if at is None else time.strftime("%H:%M:%S", time.localtime(at))


def stamp(at: float | None) -> str:
    """Local date and time."""
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at))


def short_stamp(at: float | None) -> str:
    """Local month-day and time to the minute."""
    return "-" if at is None else time.strftime("%m-%d %H:%M", time.localtime(at))


def number(value: Any, unit: str = "", fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value) + unit
