"""Naming how an engine process ended: one classifier for verify, smoke tests and the supervisor.

The signal decides first: a SIGILL means the build uses an instruction this CPU cannot run
(the CPU that advertises AMX but faults on it), whatever the log says. Then the log's own
words, then a generic crash.
"""

from __future__ import annotations

import re
import signal
from typing import Any

from states.reasons import ReasonCode

# A shell that runs the engine reports a signal as 128 + signo.
_SHELL_SIGNAL_BASE = 128

# (pattern in the log tail, reason), first match wins. Patterns are llama-server's own words
# (ENGINE.md, "Lifecycle and endpoints").
_LOG_RULES: tuple[tuple[re.Pattern[str], ReasonCode], ...] = (
    (re.compile(r"couldn't bind HTTP server socket|address already in use", re.I), ReasonCode.PORT_IN_USE),
    (re.compile(r"out of memory|cudaMalloc failed|unable to allocate \w+ buffer|std::bad_alloc", re.I),
     ReasonCode.OUT_OF_MEMORY),
    (re.compile(r"failed to open GGUF file.*No such file|No such file or directory.*\.gguf", re.I),
     ReasonCode.MODEL_MISSING),
    (re.compile(r"error loading model|exiting due to model loading error|failed to load model", re.I),
     ReasonCode.MODEL_LOAD_FAILED),
)
_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: (\S+?):")
_GPU_BACKENDS = ("cuda", "rocm", "vulkan", "metal")


def exit_signal(returncode: int | None) -> int | None:
    """The signal that ended the process, from a Popen returncode or a shell's 128+N."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if _SHELL_SIGNAL_BASE < returncode < _SHELL_SIGNAL_BASE + 65:
        return returncode - _SHELL_SIGNAL_BASE
    return None


def signal_name(signo: int | None) -> str | None:
    if signo is None:
        return None
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"SIG{signo}"


def classify_engine_exit(returncode: int | None, log_tail: str = "", *, backend: str | None = None) -> ReasonCode | None:
    """The reason code for an engine exit, or None for a clean exit (0) or one still running."""
    if returncode is None or returncode == 0:
        return None
    if exit_signal(returncode) == signal.SIGILL:
        return ReasonCode.CPU_ILLEGAL_INSTRUCTION
    for pattern, reason in _LOG_RULES:
        if pattern.search(log_tail):
            return reason
    if _MISSING_LIBRARY.search(log_tail) and backend in _GPU_BACKENDS:
        return ReasonCode(f"{backend}_startup_failed")
    return ReasonCode.SERVER_CRASHED


def exit_evidence(returncode: int | None, log_tail: str = "", *, lines: int = 20) -> dict[str, Any]:
    """What a reason code is stored with: the exit status, the signal and the log's last lines."""
    signo = exit_signal(returncode)
    evidence: dict[str, Any] = {"returncode": returncode, "signal": signal_name(signo)}
    missing = _MISSING_LIBRARY.search(log_tail)
    if missing:
        evidence["missing_library"] = missing.group(1)
    evidence["log_tail"] = "\n".join(log_tail.rstrip().splitlines()[-lines:])
    return evidence
