"""Running the vendors' command-line tools (nvidia-smi, amd-smi, vulkaninfo, sysctl).

Detection runs inside the probe subprocess, so these calls are blocking by design. Backends
take a `ToolRunner` so that tests replay recorded answers instead of needing the hardware.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Callable, Sequence

import attrs


@attrs.frozen
class ToolResult:
    """What a tool answered. `missing`: the executable is not installed."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""
    missing: bool = False

    @property
    def ok(self) -> bool:
        return not self.missing and self.returncode == 0

    @classmethod
    def not_installed(cls, argv: Sequence[str]) -> "ToolResult":
        return cls(tuple(argv), 127, "", f"{argv[0]}: not found", missing=True)


ToolRunner = Callable[[Sequence[str]], ToolResult]

TOOL_TIMEOUT_S = 10.0


def run_tool(argv: Sequence[str]) -> ToolResult:
    """Run a tool with a bounded time; a missing executable is an answer, not an error."""
    if shutil.which(argv[0]) is None:
        return ToolResult.not_installed(argv)
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, errors="replace", timeout=TOOL_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return ToolResult(tuple(argv), 124, out, f"timed out after {TOOL_TIMEOUT_S:g}s")
    except OSError as e:
        return ToolResult(tuple(argv), 126, "", f"{type(e).__name__}: {e}")
    return ToolResult(tuple(argv), done.returncode, done.stdout, done.stderr)


def recorded_runner(answers: dict[str, ToolResult | str]) -> ToolRunner:
    """A runner that replays answers keyed by the executable's name (tests and fixtures).

    A str answer is a successful stdout; a tool not in `answers` is not installed.
    """

    def run(argv: Sequence[str]) -> ToolResult:
        answer = answers.get(argv[0])
        if answer is None:
            return ToolResult.not_installed(argv)
        if isinstance(answer, str):
            return ToolResult(tuple(argv), 0, answer)
        return attrs.evolve(answer, argv=tuple(argv))

    return run
