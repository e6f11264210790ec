"""`stoker probe` for humans: each backend's verdict, reason code, message and evidence.

Pure: verdicts in (a Detection, or the probe reply's ProbeReport records), text out. A client
renders a plugin's reason code as the string it is: the CLI never loads the plugin that brought
it, nor needs to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from stoker.daemon.backends.base import Device


class Verdict(Protocol):
    """What a report reads of one backend's probe: a Detection has it, and so has a ProbeReport."""

    @property
    def backend(self) -> str: ...
    @property
    def present(self) -> bool: ...
    @property
    def usable(self) -> bool: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def message(self) -> str: ...
    @property
    def devices(self) -> Sequence[Device]: ...
    @property
    def evidence(self) -> Mapping[str, Any]: ...


INDENT = "    "
MAX_BLOCK_LINES = 12  # raw tool output, tracebacks: enough to act on, not a wall


def verdict(detection: Verdict) -> str:
    """available | unusable (hardware there, runtime not) | absent."""
    if detection.usable:
        return "available"
    return "unusable" if detection.present else "absent"


def _scalar(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (list, tuple, set, frozenset)):
        return ", ".join(_scalar(v) for v in value) if value else "(none)"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}={_scalar(v)}" for k, v in value.items()) if value else "(none)"
    return str(value)


def _device_line(device: Device) -> str:
    parts = [str(device.name)]
    if device.memory_total_mib is not None:
        mem = f"{device.memory_total_mib} MiB"
        if device.memory_free_mib is not None:
            mem += f" ({device.memory_free_mib} MiB free)"
        parts.append(mem)
    if device.compute_capability:
        parts.append(f"cc {device.compute_capability}")
    if device.device_type:
        parts.append(str(device.device_type))
    if device.driver_version:
        parts.append(f"driver {device.driver_version}")
    if device.runtime_version:
        parts.append(f"runtime {device.runtime_version}")
    return f"device {device.index}: " + ", ".join(parts)


def _evidence_lines(evidence: Mapping[str, Any]) -> list[str]:
    lines = []
    for key, value in evidence.items():
        if isinstance(value, str) and "\n" in value.strip():
            body = value.strip().splitlines()
            if len(body) > MAX_BLOCK_LINES:
                body = ["..."] + body[-MAX_BLOCK_LINES:]
            lines.append(f"{key}:")
            lines.extend(INDENT + "| " + b for b in body)
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return lines


def format_detection(detection: Verdict) -> str:
    """One backend's block: headline, message, devices, evidence."""
    head = f"{detection.backend}: {verdict(detection)}"
    if detection.reason is not None:
        head += f" [{detection.reason}]"
    lines = [head]
    if detection.message:
        lines.append(INDENT + str(detection.message))
    lines.extend(INDENT + _device_line(d) for d in detection.devices)
    evidence = _evidence_lines(detection.evidence)
    if evidence:
        lines.append(INDENT + "evidence:")
        lines.extend(INDENT * 2 + e for e in evidence)
    return "\n".join(lines)


def format_probe(detections: Iterable[Verdict]) -> str:
    """The whole `stoker probe` report: a summary line, then each backend's block."""
    items = list(detections)
    if not items:
        return "No backends were probed."
    usable = [str(d.backend) for d in items if d.usable]
    summary = "Usable backends: " + (", ".join(usable) if usable else "none")
    return "\n\n".join([summary, *(format_detection(d) for d in items)]) + "\n"
