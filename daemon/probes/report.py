"""`stoker probe` for humans: each backend's verdict, reason code, message and evidence.

Pure: the probe reply's records in (a Detection's JSON form, `Detection.to_dict()`, which is
what the daemon sends), text out. A client renders a plugin's reason code as the string it is:
the CLI never loads the plugin that brought it, nor needs to.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

Record = Mapping[str, Any]

INDENT = "    "
MAX_BLOCK_LINES = 12  # raw tool output, tracebacks: enough to act on, not a wall


def verdict(detection: Record) -> str:
    """available | unusable (hardware there, runtime not) | absent."""
    if detection.get("usable"):
        return "available"
    return "unusable" if detection.get("present") else "absent"


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


def _device_line(device: Record) -> str:
    parts = [str(device.get("name"))]
    if device.get("memory_total_mib") is not None:
        mem = f"{device['memory_total_mib']} MiB"
        if device.get("memory_free_mib") is not None:
            mem += f" ({device['memory_free_mib']} MiB free)"
        parts.append(mem)
    if device.get("compute_capability"):
        parts.append(f"cc {device['compute_capability']}")
    if device.get("device_type"):
        parts.append(str(device["device_type"]))
    if device.get("driver_version"):
        parts.append(f"driver {device['driver_version']}")
    if device.get("runtime_version"):
        parts.append(f"runtime {device['runtime_version']}")
    return f"device {device.get('index')}: " + ", ".join(parts)


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


def format_detection(detection: Record) -> str:
    """One backend's block: headline, message, devices, evidence."""
    head = f"{detection.get('backend')}: {verdict(detection)}"
    if detection.get("reason") is not None:
        head += f" [{detection['reason']}]"
    lines = [head]
    if detection.get("message"):
        lines.append(INDENT + str(detection["message"]))
    lines.extend(INDENT + _device_line(d) for d in detection.get("devices") or ())
    evidence = _evidence_lines(detection.get("evidence") or {})
    if evidence:
        lines.append(INDENT + "evidence:")
        lines.extend(INDENT * 2 + e for e in evidence)
    return "\n".join(lines)


def format_probe(detections: Iterable[Record]) -> str:
    """The whole `stoker probe` report: a summary line, then each backend's block."""
    items = list(detections)
    if not items:
        return "No backends were probed."
    usable = [str(d.get("backend")) for d in items if d.get("usable")]
    summary = "Usable backends: " + (", ".join(usable) if usable else "none")
    return "\n\n".join([summary, *(format_detection(d) for d in items)]) + "\n"
