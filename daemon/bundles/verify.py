"""Proving a bundle is what it says and that its engine runs here.

The steps, in order, each failing with its own reason code:
  files     every listed file present with its size, mode and sha256; nothing unlisted,
            no links                                            -> bundle_digest_mismatch
  metadata  backend, version and platform as expected           -> bundle_metadata_mismatch
  version   `llama-server --version` names the stamped build     -> bundle_metadata_mismatch
  devices   `--list-devices` shows the backend's signature       -> bundle_verify_failed
  smoke     greedy tokens equal the build-time reference         -> bundle_verify_failed
Any engine run that dies with SIGILL is cpu_illegal_instruction instead. Engines run from an
empty directory (ggml may load backend libraries from the cwd) with LLAMA_ARG_* dropped, each
recorded before its spawn (daemon/core/launch_records.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import attrs

from stoker.daemon.backends.base import Backend, LaunchRequest, ReasonKind
from stoker.daemon.backends.registry import load_backend
from stoker.daemon.core.confined import confined
from stoker.daemon.core.digests import sha256_file
from stoker.daemon.bundles.archive import ArchiveLimits, unpack_bundle
from stoker.daemon.bundles.metadata import BUNDLE_JSON, BundleMeta
from stoker.daemon.bundles.smoke import SmokeSpec, engine_env, run_smoke
from stoker.daemon.bundles.variants import host_platform
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.launch_records import launch_record
from stoker.daemon.engine.exits import classify_exit
from stoker.states.reasons import ReasonCode

Progress = Callable[[str], None]

_VERSION = re.compile(r"version: (\S+) \(build (\d+), commit (\S+)\)")


@attrs.frozen
class VerifyReport:
    root: Path
    meta: BundleMeta
    steps: tuple[str, ...]
    version_line: str | None = None
    devices: tuple[str, ...] = ()
    smoke_tokens: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "root": str(self.root),
            "backend": self.meta.backend,
            "variant": self.meta.variant,
            "version": self.meta.version,
            "steps": list(self.steps),
            "version_line": self.version_line,
            "devices": list(self.devices),
            "smoke_tokens": None if self.smoke_tokens is None else list(self.smoke_tokens),
        }


def check_files(root: Path, meta: BundleMeta) -> None:
    """Every listed file matches; nothing unlisted hides beside them (ggml would load a stray .so)."""
    root = Path(root)
    listed = {f.path for f in meta.files} | {BUNDLE_JSON}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                raise StokerError(
                    ReasonCode.BUNDLE_UNSAFE_ARCHIVE, "The bundle holds a link or special file.", {"path": rel}
                )
            if path.is_file() and rel not in listed:
                raise StokerError(
                    ReasonCode.BUNDLE_DIGEST_MISMATCH,
                    "The bundle holds a file its metadata does not list.",
                    {"path": rel},
                )
    for entry in meta.files:
        # bundle.json names the file: resolved, it must still lie in the bundle (a link out is refused).
        path = confined(root, entry.path, reason=ReasonCode.BUNDLE_VERIFY_FAILED, what="bundle.json")
        if not path.is_file():
            raise StokerError(
                ReasonCode.BUNDLE_VERIFY_FAILED, "A file listed in bundle.json is missing.", {"path": entry.path}
            )
        st = path.stat()
        actual = sha256_file(path)
        if st.st_size != entry.size or actual != entry.sha256:
            raise StokerError(
                ReasonCode.BUNDLE_DIGEST_MISMATCH,
                evidence={
                    "path": entry.path,
                    "expected_sha256": entry.sha256,
                    "actual_sha256": actual,
                    "expected_size": entry.size,
                    "actual_size": st.st_size,
                },
            )
        if st.st_mode & 0o777 != entry.mode:
            raise StokerError(
                ReasonCode.BUNDLE_DIGEST_MISMATCH,
                "A bundle file's mode differs from its metadata.",
                {"path": entry.path, "expected": oct(entry.mode), "actual": oct(st.st_mode & 0o777)},
            )


def check_expectations(
    meta: BundleMeta,
    *,
    backend: str | None = None,
    version: str | None = None,
    variant: str | None = None,
    platform: str | None = None,
) -> None:
    """The metadata says what the caller expected (a manifest entry, a --expect-* option)."""
    wanted = {"backend": backend, "version": version, "variant": variant, "platform": platform}
    got = {"backend": meta.backend, "version": meta.version, "variant": meta.variant, "platform": meta.platform}
    diff = {k: {"expected": v, "actual": got[k]} for k, v in wanted.items() if v is not None and v != got[k]}
    if diff:
        raise StokerError(ReasonCode.BUNDLE_METADATA_MISMATCH, evidence=diff)


def judging_backend(meta: BundleMeta) -> Backend:
    """The plugin of the bundle's backend: it knows the engine's device lines and what a
    missing library means there. bundle_verify_failed when none is registered or it fails to load."""
    try:
        return load_backend(meta.backend)
    except Exception as exc:  # not registered, or a plugin that fails to load: nothing can judge it
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            f"No loadable backend plugin named {meta.backend!r} can judge this bundle.",
            {"backend": meta.backend, "error": f"{type(exc).__name__}: {exc}"},
        ) from None


def devices_env(backend: Backend) -> dict[str, str]:
    """The environment a plan on every device gives the backend's server (Backend.launch_env):
    verification runs the engine on the devices a launch would use (a Vulkan software device,
    for one, only where the plugin names it)."""
    return backend.launch_env(LaunchRequest("auto"))


def _run_engine(server: Path, args: list[str], step: str, backend: Backend, timeout: float) -> tuple[str, str]:
    # Recorded before the spawn (daemon/core/launch_records.py), in a session of its own: the
    # timeout is this process's, so a daemon killed while `--list-devices` hangs on a broken
    # driver leaves the engine to the next daemon's sweep. Run from the record's empty cwd.
    with launch_record("verify") as record:
        try:
            proc = subprocess.Popen(
                [str(server), *args],
                cwd=record.cwd,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                errors="replace",
                stdin=subprocess.DEVNULL,
                env=record.env(engine_env(devices_env(backend))),
                start_new_session=True,
            )
        except OSError as err:
            raise StokerError(
                ReasonCode.BUNDLE_VERIFY_FAILED,
                "The engine binary cannot be executed.",
                {"step": step, "error": str(err)},
            ) from None
        record.record_process(proc.pid)
        try:
            out, err_text = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise StokerError(
                ReasonCode.BUNDLE_VERIFY_FAILED,
                f"`llama-server {' '.join(args)}` did not finish.",
                {"step": step, "timeout_s": timeout},
            ) from None
        except BaseException:
            _kill_group(proc)
            raise
    if proc.returncode != 0:
        tail = (out + err_text)[-8000:]
        reason, exit_evidence = classify_exit(
            proc.returncode, tail.splitlines(), startup_failed=backend.reason(ReasonKind.STARTUP_FAILED)
        )
        evidence = {"step": step, "engine_reason": str(reason), **exit_evidence}
        if reason == ReasonCode.CPU_ILLEGAL_INSTRUCTION:
            raise StokerError(reason, evidence=evidence)
        raise StokerError(ReasonCode.BUNDLE_VERIFY_FAILED, evidence=evidence)
    return out, err_text


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """The engine and its group killed (it leads the group, and is our child not yet reaped, so
    the group's id is still ours), then reaped."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def check_version(server: Path, meta: BundleMeta, backend: Backend, timeout: float = 30.0) -> str:
    """`--version` must name the build number and commit stamped at build time."""
    out, err = _run_engine(server, ["--version"], "version", backend, timeout)
    m = _VERSION.search(err + out)
    if not m:
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            "`llama-server --version` printed no version line.",
            {"output": (err + out)[-1000:]},
        )
    expected = (str(meta.llama.get("build_number")), str(meta.llama.get("commit")))
    if (m.group(2), m.group(3)) != expected:
        raise StokerError(
            ReasonCode.BUNDLE_METADATA_MISMATCH,
            "The engine's build stamp differs from bundle.json.",
            {
                "expected": {"build": expected[0], "commit": expected[1]},
                "actual": {"build": m.group(2), "commit": m.group(3)},
            },
        )
    return m.group(0)


def check_devices(server: Path, meta: BundleMeta, backend: Backend, timeout: float = 60.0) -> tuple[str, ...]:
    """`--list-devices` must show the backend's devices, as its plugin's signature knows them
    ("(none)" for the CPU, a CUDAn line for CUDA): the plugin is asked, never a table here."""
    out, err = _run_engine(server, ["--list-devices"], "devices", backend, timeout)
    lines = out.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Available devices:") + 1
    except StopIteration:
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            "`--list-devices` printed no device list.",
            {"stdout": out[-1000:], "stderr": err[-1000:]},
        ) from None
    devices = tuple(line for line in lines[start:] if line.strip())
    if not backend.parse_list_devices("\n".join(devices)):
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            f"The engine does not show the {meta.backend} backend's device signature.",
            {"devices": list(devices), "backend": meta.backend, "signature": backend.device_signature.pattern},
        )
    return devices


def check_smoke(server: Path, meta: BundleMeta, timeout: float = 120.0) -> tuple[int, ...]:
    """The token-identical gate: greedy tokens on the tiny model equal the recorded reference."""
    ref = meta.smoke
    if ref is None:
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            "The bundle records no smoke reference to compare with.",
            {"backend": meta.backend},
        )
    model_args = {k: v for k, v in ref.model.items() if k != "sha256"}
    spec = SmokeSpec(model=model_args, prompt=ref.prompt, n_predict=ref.n_predict)
    with tempfile.TemporaryDirectory(prefix="stoker-smoke-") as scratch:
        model = spec.write_model(Path(scratch))
        if ref.model.get("sha256") and sha256_file(model) != ref.model["sha256"]:
            raise StokerError(
                ReasonCode.BUNDLE_VERIFY_FAILED,
                "The tiny model written here differs from the one the reference was made with.",
                {"expected": ref.model["sha256"], "actual": sha256_file(model)},
            )
        # Run before judging a missing reference: a SIGILL here is the more useful answer.
        env = devices_env(judging_backend(meta))
        tokens = run_smoke(server, spec, Path(scratch), timeout=timeout, env=env)
    if ref.tokens is None:
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            "The bundle records no smoke tokens (its build host could not run it); nothing to compare.",
            {"actual": list(tokens)},
        )
    if tokens != ref.tokens:
        first = next(
            (i for i, (a, b) in enumerate(zip(tokens, ref.tokens)) if a != b), min(len(tokens), len(ref.tokens))
        )
        raise StokerError(
            ReasonCode.BUNDLE_VERIFY_FAILED,
            "Smoke tokens differ from the build-time reference.",
            {"expected": list(ref.tokens), "actual": list(tokens), "first_difference": first},
        )
    return tokens


def verify_dir(
    root: Path,
    *,
    expect_backend: str | None = None,
    expect_version: str | None = None,
    expect_variant: str | None = None,
    smoke: bool = False,
    run_engine: bool = True,
    progress: Progress = lambda _: None,
) -> VerifyReport:
    """Verify an unpacked bundle directory in place."""
    root = Path(root)
    meta = BundleMeta.read(root)
    check_files(root, meta)
    progress("files: every digest matches")
    check_expectations(
        meta, backend=expect_backend, version=expect_version, variant=expect_variant, platform=host_platform()
    )
    steps = ["files", "metadata"]
    if not run_engine:
        return VerifyReport(root, meta, tuple(steps))
    server = root / meta.server
    backend = judging_backend(meta)
    version_line = check_version(server, meta, backend)
    progress(f"engine: {version_line}")
    devices = check_devices(server, meta, backend)
    progress(f"devices: {', '.join(d.strip() for d in devices)}")
    steps += ["version", "devices"]
    tokens = None
    if smoke:
        tokens = check_smoke(server, meta)
        progress(f"smoke: {len(tokens)} tokens identical to the reference")
        steps.append("smoke")
    return VerifyReport(root, meta, tuple(steps), version_line, devices, tokens)


def verify_bundle(path: Path, *, limits: ArchiveLimits = ArchiveLimits(), **kwargs: Any) -> VerifyReport:
    """Verify a bundle zip (unpacked into a throwaway staging dir) or an unpacked directory."""
    path = Path(path)
    if path.is_dir():
        return verify_dir(path, **kwargs)
    if not path.is_file():
        raise StokerError(ReasonCode.BUNDLE_MISSING, "The bundle file does not exist.", {"path": str(path)})
    with tempfile.TemporaryDirectory(prefix="stoker-staging-") as staging:
        report = verify_dir(unpack_bundle(path, Path(staging) / "bundle", limits), **kwargs)
        return attrs.evolve(report, root=path)
