"""Run a backend's detect() out of process, so a crashing or hanging driver costs one probe.

`run_probe` never raises for anything the probe does: a segfault, a hang past the timeout,
a non-zero exit or garbage on stdout all become an unavailable Detection whose evidence says
what happened. (Cancellation from outside - daemon shutdown - still propagates, as it must.)
The probe machine in states/ decides what a result means; this module only obtains it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from typing import Any, Mapping, Sequence

import trio

from stoker.daemon.backends.base import Detection, excerpt
from stoker.daemon.backends.registry import load_backend
from stoker.daemon.core.process_group import stop_on_cancel
from stoker.daemon.engine.exits import signal_name
from stoker.daemon.core.launch_records import launch_record
from stoker.daemon.probes.child import MARKER
from stoker.states.reasons import ReasonCode

KILL_GRACE_S = 1.0
MAX_OUTPUT_BYTES = 1 << 20  # a detection is a few KiB; more is noise


def unavailable_reason_for(backend: str) -> ReasonCode:
    """The backend's own code for "present but unusable" (`cuda_unavailable`...), asked of its
    plugin; probe_failed where no plugin of that name loads."""
    try:
        return load_backend(backend).unavailable_reason
    except Exception:  # not registered, or broken: the probe's failure is all there is to say
        return ReasonCode.PROBE_FAILED


def probe_command(backend: str, *, target: str | None = None, python: str = sys.executable) -> list[str]:
    """The argv of the probe subprocess."""
    argv = [python, "-m", "stoker.daemon.probes.child", backend]
    if target:
        argv += ["--target", target]
    return argv


def _failure(backend: str, message: str, **evidence: Any) -> Detection:
    # Presence is unknown when the probe itself failed; False keeps the orchestrator from
    # installing a bundle for hardware nobody has seen.
    return Detection.unavailable(
        backend, unavailable_reason_for(backend), present=False, message=message, probe_failed=True, **evidence
    )


def parse_probe_output(backend: str, stdout: str) -> Detection | None:
    """The Detection the child printed after its marker, or None if there is none."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(MARKER):
            data = json.loads(line[len(MARKER) :])
            detection = Detection.from_dict(data)
            if detection.backend != backend:
                raise ValueError(f"probe for {backend!r} answered for {detection.backend!r}")
            return detection
    return None


async def run_probe(
    backend: str,
    *,
    timeout: float,
    target: str | None = None,
    python: str = sys.executable,
    env: Mapping[str, str] | None = None,
) -> Detection:
    """Detect `backend` in a subprocess; a crash or a hang becomes an unavailable Detection.

    `target` ("module:attr") loads the backend from there instead of the entry points
    (tests, development). `env` replaces the subprocess's environment.
    """
    argv = probe_command(backend, target=target, python=python)
    started = trio.current_time()
    result: subprocess.CompletedProcess[bytes] | None = None
    # Output goes to temporary files, not pipes: a daemonised grandchild holding a pipe open
    # cannot stall us, and a probe killed on timeout still leaves its stderr as evidence.
    # Recorded before the spawn: a probe a killed daemon left (hung on a driver, say) is ended by
    # the next one (daemon/core/launch_records.py).
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, launch_record("probe") as record:
        with trio.move_on_after(timeout):
            result = await trio.run_process(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                check=False,
                start_new_session=True,  # its own process group, so a kill reaches its children
                deliver_cancel=stop_on_cancel(KILL_GRACE_S),
                env=record.env(env),
            )
        stdout, stderr_raw = await trio.to_thread.run_sync(_read_both, out, err)
    elapsed = round(trio.current_time() - started, 3)
    evidence: dict[str, Any] = {"probe_argv": " ".join(argv[1:]), "probe_seconds": elapsed}
    stderr = excerpt(stderr_raw, 1500)
    if stderr:
        evidence["stderr"] = stderr
    if result is None:
        return _failure(
            backend,
            f"The {backend} probe timed out after {timeout:g}s and was killed.",
            probe=f"probe timed out after {timeout:g}s",
            timeout_s=timeout,
            **evidence,
        )
    if result.returncode < 0:
        name = signal_name(result.returncode)
        return _failure(
            backend,
            f"The {backend} probe crashed with {name} (a driver or runtime fault); treating {backend} as unavailable.",
            probe=f"probe crashed with {name}",
            signal=name,
            **evidence,
        )
    # The probe ran to its end; a detection it printed is the verdict, whatever its status.
    try:
        detection = parse_probe_output(backend, stdout)
    except (ValueError, KeyError, TypeError) as e:
        detection, what, probe = None, f"printed an invalid detection ({type(e).__name__})", f"invalid detection: {e}"
    else:
        what = f"exited with status {result.returncode} without a detection"
        probe = f"probe exited with status {result.returncode}"
    if detection is None:
        return _failure(
            backend,
            f"The {backend} probe {what}.",
            probe=probe,
            stdout=excerpt(stdout, 1000),
            exit_status=result.returncode,
            **evidence,
        )
    return detection


def _read_both(out: Any, err: Any) -> tuple[str, str]:
    texts = []
    for f in (out, err):
        f.seek(0)
        texts.append(f.read(MAX_OUTPUT_BYTES).decode("utf-8", "replace"))
    return texts[0], texts[1]


async def run_probes(
    backends: Sequence[str], *, timeout: float, env: Mapping[str, str] | None = None
) -> dict[str, Detection]:
    """Probe several backends concurrently, each in its own subprocess."""
    results: dict[str, Detection] = {}

    async def one(name: str) -> None:
        results[name] = await run_probe(name, timeout=timeout, env=env)

    async with trio.open_nursery() as nursery:
        for name in backends:
            nursery.start_soon(one, name)
    return {name: results[name] for name in backends}
