"""The probe subprocess: `python -m daemon.probes.child BACKEND [--target MODULE:ATTR]`.

Loads one backend, runs its `detect()`, and prints the Detection as one JSON line after
`MARKER` on stdout. Whatever the plugin prints itself goes to stderr. A crash here (a
driver that segfaults in NVML, a hang) is the parent's to classify: see probe_runner.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import traceback

MARKER = "STOKER-DETECTION "


def _failed(name: str, reason: str, what: str, error: Exception) -> dict[str, object]:
    """A Detection dict for a backend that raised `error` (`what` it was doing: the message's
    start), with the error and its traceback as evidence."""
    raised = f"{type(error).__name__}: {error}"
    evidence = {"error": raised, "traceback": traceback.format_exc(limit=5)}
    return {
        "backend": name,
        "present": False,
        "usable": False,
        "reason": reason,
        "message": f"{what}: {raised}",
        "devices": [],
        "evidence": evidence,
    }


def probe(name: str, target: str | None = None) -> dict[str, object]:
    """Detect one backend; every failure inside this process becomes a Detection dict."""
    from stoker.daemon.backends.registry import BUILTIN_TARGETS, load_backend, load_target
    from stoker.states.reasons import ReasonCode

    target = target or BUILTIN_TARGETS.get(name)
    try:
        backend = load_target(name, target) if target else load_backend(name)
    except Exception as e:
        return _failed(name, str(ReasonCode.PROBE_FAILED), f"The {name} backend could not be loaded", e)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            detection = backend.detect()
        return detection.to_dict()
    except Exception as e:
        return _failed(name, str(backend.unavailable_reason), f"The {name} probe raised", e)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m daemon.probes.child")
    parser.add_argument("backend")
    parser.add_argument("--target", help="load the backend from MODULE:ATTR instead of the entry points")
    args = parser.parse_args(argv)
    result = probe(args.backend, args.target)
    sys.stdout.write(MARKER + json.dumps(result, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
