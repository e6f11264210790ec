"""Why an engine process ended: one rule table, one classifier, for every engine Stoker runs.

The supervised server, `bundle verify`'s `--version`/`--list-devices` runs and the smoke
generation all exit the same way and are named by `classify_exit`. The order is fixed:

1. the signal: SIGILL means the build uses an instruction this CPU cannot run (the CPU that
   advertises AMX but faults on it), whatever the log says;
2. the engine's own log lines, in the order of `LOG_RULES` (llama-server's words,
   docs/engine-process.md "Exits"), each rule's last matching line being the evidence;
3. a library the loader could not find, where the caller names the backend's startup-failed
   code (its plugin's, `cuda_startup_failed`...): a GPU runtime that is not there;
4. the kernel OOM killer (the caller's evidence: the cgroup's oom_kill count moved) for a
   SIGKILL, which the log cannot state because the process died mid-line;
5. anything else is a crash, with the last line that looks like an error.

Pure: no I/O, the caller hands in the status and the log's lines.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

from stoker.states.reasons import ReasonCode

# How many log lines an exit's evidence carries.
EVIDENCE_LINES = 20
# A shell that runs the engine reports a signal as 128 + signo.
_SHELL_SIGNAL_BASE = 128


@attrs.frozen
class LogRule:
    """A reason the engine states in its log: `pattern` on one line, `applies` to the status."""

    pattern: re.Pattern[str]
    reason: ReasonCode
    applies: Callable[[int | None], bool] = lambda _returncode: True


def _status_one(returncode: int | None) -> bool:
    return returncode == 1


# First match wins. The model_missing rule asks for the GGUF opener's "No such file" (or a
# .gguf path after it): a bare "No such file or directory" is also what the loader prints for
# a missing shared library, and a file that exists but is not a model is model_load_failed.
LOG_RULES: tuple[LogRule, ...] = (
    LogRule(re.compile(r"couldn't bind HTTP server socket|address already in use", re.I), ReasonCode.PORT_IN_USE),
    # ggml-rpc on the head (ggml-rpc.cpp): a worker that answered HELLO with another protocol
    # version, then one that could not be reached or stopped answering mid-run (its abort).
    LogRule(re.compile(r"RPC server version mismatch"), ReasonCode.RPC_VERSION_MISMATCH),
    LogRule(
        re.compile(r"Remote RPC server crashed|Failed to connect to \S+:\d+|RPC handshake failed for"),
        ReasonCode.RPC_WORKER_LOST,
    ),
    LogRule(
        re.compile(r"out of memory|cudaMalloc failed|unable to allocate \w+ buffer|std::bad_alloc", re.I),
        ReasonCode.OUT_OF_MEMORY,
    ),
    LogRule(
        re.compile(r"failed to open GGUF file.*No such file|No such file or directory.*\.gguf", re.I),
        ReasonCode.MODEL_MISSING,
    ),
    # The CUDA runtime failing to initialise: the load error that follows is its consequence.
    LogRule(
        re.compile(
            r"failed to initialize CUDA|CUDA driver version is insufficient|no CUDA-capable device"
            r"|ggml_cuda_init: failed",
            re.I,
        ),
        ReasonCode.CUDA_UNAVAILABLE,
    ),
    LogRule(
        re.compile(r"error loading model|exiting due to model loading error|failed to load model", re.I),
        ReasonCode.MODEL_LOAD_FAILED,
    ),
    # ggml-rpc-server (tools/rpc/rpc-server.cpp): a bind that failed, a device it does not have.
    LogRule(re.compile(r"Failed to create server socket"), ReasonCode.PORT_IN_USE),
    LogRule(
        re.compile(r"^error: unknown (?:device|argument): |^No devices found$|^Invalid parameters$"),
        ReasonCode.SERVER_BAD_ARGUMENTS,
    ),
    # The argument parser refusing its command line (common/arg.cpp): a config problem.
    LogRule(
        re.compile(
            r"error: invalid argument:|error while handling (?:argument|environment variable)"
            r"|error: unknown value for|expected value for argument"
        ),
        ReasonCode.SERVER_BAD_ARGUMENTS,
        _status_one,
    ),
)
_MISSING_LIBRARY = re.compile(r"error while loading shared libraries: (\S+?):")
_ERRORISH = re.compile(r"error|failed|abort|assert|exception|terminate|fatal|illegal", re.IGNORECASE)
OOM_KILLER_LINE = "the kernel OOM killer fired (cgroup memory.events oom_kill)"


@attrs.frozen
class ExitReport:
    """How a server ended: exit status, reason code and evidence; `expected` if we stopped it."""

    returncode: int | None
    signal: str | None
    reason: ReasonCode
    evidence: dict[str, Any]
    expected: bool
    log_path: Path


def exit_signal(returncode: int | None) -> int | None:
    """The signal that ended the process, from a Popen returncode or a shell's 128+N."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    if _SHELL_SIGNAL_BASE < returncode < _SHELL_SIGNAL_BASE + 65:
        return returncode - _SHELL_SIGNAL_BASE
    return None


def signal_name(returncode: int | None) -> str | None:
    """`SIGKILL` for -9 (and for 137, a shell's way of saying it); None for a plain exit."""
    signo = exit_signal(returncode)
    if signo is None:
        return None
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"SIG{signo}"


def missing_library(lines: Sequence[str]) -> str | None:
    """The shared library the dynamic loader could not find, if the log says so."""
    for line in lines:
        if m := _MISSING_LIBRARY.search(line):
            return m.group(1)
    return None


def classify_exit(
    returncode: int | None,
    log_tail: Sequence[str],
    *,
    oom_killed: bool = False,
    startup_failed: ReasonCode | None = None,
) -> tuple[ReasonCode, dict[str, Any]]:
    """The reason code for an engine's exit and its evidence (signal or status, line, log tail).

    `returncode` None means the status is unknown (an adopted server is not our child): the
    log alone decides. A clean exit (0) is still a reason here: a server is not meant to
    end by itself, and a tool run that exits 0 is not classified by its caller.
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
    library = missing_library(lines)
    if library is not None:
        evidence["missing_library"] = library
    reason, line = _decide(returncode, lines, oom_killed=oom_killed, startup_failed=startup_failed, library=library)
    evidence["line"] = line or _last(lines, _ERRORISH)
    return reason, evidence


def _decide(
    returncode: int | None,
    lines: list[str],
    *,
    oom_killed: bool,
    startup_failed: ReasonCode | None,
    library: str | None,
) -> tuple[ReasonCode, str | None]:
    """(reason, the line that decided it, if a line did)."""
    if exit_signal(returncode) == signal.SIGILL:
        return ReasonCode.CPU_ILLEGAL_INSTRUCTION, None
    for rule in LOG_RULES:
        if rule.applies(returncode) and (line := _last(lines, rule.pattern)) is not None:
            return rule.reason, line
    if library is not None and startup_failed is not None:
        return startup_failed, _last(lines, _MISSING_LIBRARY)
    if oom_killed and exit_signal(returncode) == signal.SIGKILL:
        return ReasonCode.OUT_OF_MEMORY, OOM_KILLER_LINE
    return ReasonCode.SERVER_CRASHED, None


def _last(lines: Sequence[str], pattern: re.Pattern[str]) -> str | None:
    for line in reversed(lines):
        if pattern.search(line):
            return line
    return None
