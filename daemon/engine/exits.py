"""Why a supervised llama-server exited: a reason code and the evidence that decided it.

The core rules (SIGILL first, then the engine's own log lines) are the shared engine
classifier in `daemon/bundles/exitcodes.py`; this adds what only a supervisor knows: the
CUDA runtime failing to initialise, a rejected command line, the kernel OOM killer, an unexpected clean exit, an
adopted server whose exit status is not ours to read, and the deciding log line. Pure.
"""

from __future__ import annotations

import re
import signal
from typing import Any, Sequence

from daemon.bundles.exitcodes import classify_engine_exit, exit_signal
from daemon.bundles.exitcodes import signal_name as _signal_name
from states.reasons import ReasonCode

# How many log lines an exit's evidence carries.
EVIDENCE_LINES = 20

_CUDA_INIT = re.compile(
    r"failed to initialize CUDA|CUDA driver version is insufficient|no CUDA-capable device"
    r"|ggml_cuda_init: failed",
    re.IGNORECASE,
)
# The engine's argument parser refusing its command line (common/arg.cpp): a config problem.
_BAD_ARGUMENTS = re.compile(
    r"error: invalid argument:|error while handling (?:argument|environment variable)"
    r"|error: unknown value for|expected value for argument",
)
# The line that decided a log rule, or the last one that looks like an error.
_DECIDING = {
    ReasonCode.PORT_IN_USE: re.compile(r"couldn't bind HTTP server socket|address already in use", re.I),
    ReasonCode.OUT_OF_MEMORY: re.compile(
        r"out of memory|cudaMalloc failed|unable to allocate \w+ buffer|std::bad_alloc", re.I
    ),
    ReasonCode.MODEL_MISSING: re.compile(r"failed to open GGUF file|No such file or directory", re.I),
    ReasonCode.MODEL_LOAD_FAILED: re.compile(
        r"error loading model|exiting due to model loading error|failed to load model", re.I
    ),
    ReasonCode.CUDA_UNAVAILABLE: _CUDA_INIT,
    ReasonCode.SERVER_BAD_ARGUMENTS: _BAD_ARGUMENTS,
}
_ERRORISH = re.compile(r"error|failed|abort|assert|exception|terminate|fatal|illegal", re.IGNORECASE)
# Stand-in status for an exit we could not observe (an adopted server is not our child).
_UNKNOWN_FAILURE = 1


def signal_name(returncode: int | None) -> str | None:
    """`SIGKILL` for -9 (and for 137, a shell's way of saying it); None for a plain exit."""
    return _signal_name(exit_signal(returncode))


def classify_exit(
    returncode: int | None,
    log_tail: Sequence[str],
    *,
    oom_killed: bool = False,
    backend: str | None = None,
) -> tuple[ReasonCode, dict[str, Any]]:
    """The reason code for a server's exit and its evidence (signal or status, line, log tail).

    `returncode` None means the status is unknown (an adopted server): the log alone decides.
    `oom_killed` is the caller's evidence that the kernel OOM killer fired (the cgroup's
    `memory.events` oom_kill count moved): the log cannot say so, the process died mid-line.
    """
    lines = [line.rstrip("\r\n") for line in log_tail]
    sig = signal_name(returncode)
    evidence: dict[str, Any] = {
        "returncode": returncode,
        "signal": sig,
        "exit_code": returncode if sig is None else None,
        "line": None,
        "log_tail": lines[-EVIDENCE_LINES:],
    }
    status = _UNKNOWN_FAILURE if returncode is None else returncode
    reason = classify_engine_exit(status, "\n".join(lines), backend=backend) or ReasonCode.SERVER_CRASHED
    if reason in (ReasonCode.MODEL_LOAD_FAILED, ReasonCode.SERVER_CRASHED) and _last(lines, _CUDA_INIT):
        reason = ReasonCode.CUDA_UNAVAILABLE
    if reason == ReasonCode.SERVER_CRASHED and returncode == 1 and _last(lines, _BAD_ARGUMENTS):
        reason = ReasonCode.SERVER_BAD_ARGUMENTS
    if reason == ReasonCode.SERVER_CRASHED and oom_killed and exit_signal(returncode) == signal.SIGKILL:
        reason = ReasonCode.OUT_OF_MEMORY
        evidence["line"] = "the kernel OOM killer fired (cgroup memory.events oom_kill)"
        return reason, evidence
    evidence["line"] = _last(lines, _DECIDING.get(reason, _ERRORISH)) or _last(lines, _ERRORISH)
    return reason, evidence


def _last(lines: Sequence[str], pattern: re.Pattern[str]) -> str | None:
    for line in reversed(lines):
        if pattern.search(line):
            return line
    return None
