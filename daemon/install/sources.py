"""The engine's sources on this machine: the local build cache, and a local build.

The install machine (states/install/table.py) tries a configured mirror first, then these. What
this module reports are facts for the table to decide on:

- `find_cached_build`: the cache entry whose bundle.json says this backend, variant and
  platform and that the backend's plugin accepts for the detected hardware (the newest
  builder revision first), or a miss with every entry looked at and why it did not fit. The
  entry then goes through the same copy, digest, unpack, verify and smoke steps as a download.
- `check_toolchain`: whether the build plan (daemon/bundles/variants.py) can build the backend
  here; the plan names the backends it builds and probes the compiler, cmake and what the
  backend needs (nvcc for CUDA), so the core never lists backends or tools itself.
- `run_build`: `python -m daemon bundle build --json` as a child process in its own process
  group. A child rather than a thread: cmake and the compilers it starts die with it when the
  daemon stops (TERM, a grace, then KILL to the group), where a thread could only be
  abandoned with its compilers still running. The builder's file lock serialises builds, so a
  `stoker bundle build` or a test session building the same recipe is waited for, then found
  in the cache. Its progress lines (`compile: 45% ...`) are parsed for the bus.

`STOKER_BUILD_SOURCE` (a `stoker bundle build --source` spec) replaces the pinned source for
the daemon's local builds: a developer's llama.cpp checkout, or a test's small tree.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Mapping
from urllib.parse import unquote, urlparse

import attrs
import trio

from stoker.daemon.backends.base import Backend, Detection
from stoker.daemon.bundles.archive import check_digest
from stoker.daemon.bundles.build import BuildResult, cached_builds
from stoker.daemon.bundles.installed import bundle_meta_of
from stoker.daemon.bundles.metadata import ManifestEntry
from stoker.daemon.bundles.variants import BACKENDS, SAFE_CPU_VARIANTS, BuildPlan, default_cpu_variant, host_platform
from stoker.daemon.core.digests import sha256_file
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.process_group import stop_on_cancel
from stoker.daemon.core.launch_records import launch_record
from stoker.states.install import table as I
from stoker.states.install import effects as IE
from stoker.states.install.sources import Source
from stoker.states.reasons import ReasonCode

BUILD_SOURCE_ENV = "STOKER_BUILD_SOURCE"
KILL_GRACE_S = 5.0
_STEP = re.compile(r"^(configure|compile): (\d+)%")

BuildProgress = Callable[[dict[str, Any]], None]


# --- the build cache ------------------------------------------------------------------------


@attrs.frozen
class CacheLookup:
    """A cached build that fits (or None) and what the cache held, for the history."""

    hit: BuildResult | None
    evidence: dict[str, Any]


def _revision(result: BuildResult) -> int:
    return int(result.meta.build.get("builder_revision") or 0)


def find_cached_build(
    cache: list[BuildResult],
    cache_dir: Path,
    backend: str,
    variant: str,
    plugin: Backend | None,
    detection: Detection | None,
    platform: str | None = None,
) -> CacheLookup:
    """The newest fitting entry of the build cache for this backend, variant and platform."""
    platform = platform or host_platform()
    refused: dict[str, str] = {}
    fitting = []
    for result in cache:
        meta = result.meta
        label = f"{result.cache_key} ({meta.backend}-{meta.variant} {meta.platform})"
        if (meta.backend, meta.variant, meta.platform) != (backend, variant, platform):
            refused[label] = f"not {backend}-{variant} for {platform}"
            continue
        if plugin is not None and detection is not None:
            check = plugin.explain_bundle(detection, meta.to_dict())
            if not check.ok:
                refused[label] = f"{check.reason}: {check.message}"
                continue
        fitting.append(result)
    fitting.sort(key=lambda r: (_revision(r), r.zip_path.stat().st_mtime), reverse=True)
    evidence: dict[str, Any] = {"cache": str(cache_dir), "entries": len(cache)}
    if refused:
        evidence["refused"] = refused
    if not fitting:
        what = f"{backend}-{variant} for {platform}"
        evidence["message"] = (
            f"The build cache {cache_dir} holds no {what} build."
            if not cache
            else f"None of the {len(cache)} build(s) in {cache_dir} is a {what} build that fits this machine."
        )
        evidence["cause"] = str(ReasonCode.BUNDLE_MISSING)
        return CacheLookup(None, evidence)
    hit = fitting[0]
    evidence.update(cache_key=hit.cache_key, builder_revision=_revision(hit), version=hit.meta.version)
    return CacheLookup(hit, evidence)


def cached_variants(cache: list[BuildResult], backend: str, platform: str | None = None) -> list[str]:
    """The variants the build cache holds for this backend and platform."""
    platform = platform or host_platform()
    return sorted({r.meta.variant for r in cache if (r.meta.backend, r.meta.platform) == (backend, platform)})


def buildable_variants(backend: str) -> tuple[str, ...]:
    """The variants a local build can make for this backend (this CPU's default first); none
    for a backend the build plan does not build."""
    if backend not in BACKENDS:
        return ()
    first = default_cpu_variant()
    return (first, *(v for v in SAFE_CPU_VARIANTS if v != first))


def entry_for_zip(path: Path) -> ManifestEntry:
    """A local bundle zip (a file the user named, a cached or local build) as a manifest entry:
    a file:// URL, its sha256 and size, what its bundle.json says (blocking)."""
    meta = bundle_meta_of(path)
    if not path.is_file():
        raise StokerError(
            ReasonCode.BUNDLE_MISSING, "Only a bundle zip installs through the install service.", {"path": str(path)}
        )
    return ManifestEntry(
        url=path.as_uri(),
        sha256=sha256_file(path),
        size=path.stat().st_size,
        backend=meta.backend,
        variant=meta.variant,
        version=meta.version,
        platform=meta.platform,
    )


def source_label(source: str | None, origin: str | None) -> str | None:
    """How status names where a bundle came from: `mirror <manifest URL>`, `file <path>`,
    `build-cache`, `local-build`."""
    if source in ("mirror", "file") and origin:
        return f"{source} {origin}"
    return source


def install_row(record: Any, progress: dict[str, Any] | None) -> dict[str, Any]:
    """One install machine for status: state, reason, the source of its bundle (or the one
    being tried), every source tried for its last request, a build's last progress; once the slot
    holds a bundle, the record of it (version, who put it there: install, engine_update,
    engine_rollback; what `.previous` holds), whoever wrote it last."""
    data = record.data or {}
    holds, previous = data.get("holds") or {}, data.get("previous") or {}
    resting = record.state == "installed" and holds
    source, origin = (holds.get("source"), holds.get("origin")) if resting else (data.get("source"), data.get("origin"))
    return {
        "machine": record.id,
        "state": record.state,
        "reason": record.reason,
        "backend": data.get("backend"),
        "variant": data.get("variant"),
        "source": source_label(source, origin),
        "origin": origin,
        "tried": list(data.get("tried") or ()),
        "progress": progress,
        "version": holds.get("version"),
        "by": holds.get("by"),
        "previous": previous.get("version"),
    }


def failure_sentence(backend: str, variant: str, evidence: Mapping[str, Any]) -> str:
    """Why an install failed, in each tried source's own words when there were several."""
    tried = [t for t in evidence.get("tried") or () if t.get("outcome") != "installed"]
    if len(tried) > 1:  # in the order they were tried
        said = " ".join(f"{t['source']}: {str(t.get('message') or t.get('reason')).rstrip('.')}." for t in tried)
        what = f"from any source ({said})"
    else:
        what = f"at {evidence.get('step', '?')}: {evidence.get('message') or 'see the evidence'}"
    return (
        f"Installing the {backend} bundle ({variant}) failed {what} The previous state is intact; "
        f"retry with `stoker install {backend}`."
    )


def copy_file_url(url: str, dest: Path, sha256: str, size: int, reason: ReasonCode) -> str:
    """A file:// mirror: copy into the downloads dir through a part file, checking as it goes."""
    source = Path(unquote(urlparse(url).path))
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_suffix(dest.suffix + ".part")
    try:
        with open(source, "rb") as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
    except OSError as err:
        part.unlink(missing_ok=True)
        raise StokerError(reason, f"Copying {url} failed: {err}.", {"url": url, "error": str(err)}) from None
    figures = check_digest(part, sha256, size, discard=True, url=url, kind="digest_mismatch")
    os.replace(part, dest)
    return str(figures["sha256"])


# --- the toolchain --------------------------------------------------------------------------


@attrs.frozen
class ToolchainReport:
    """Whether this machine can build the backend now, with the evidence either way."""

    ready: bool
    evidence: dict[str, Any]


def check_toolchain(
    backend: str, variant: str, environ: Mapping[str, str] | None = None, builder: list[str] | None = None
) -> ToolchainReport:
    """Ask the build plan: does it build `backend`, and are its tools here? (blocking) A
    backend's own `builder` (its plugin's `build_argv`) builds what the plan does not."""
    env = os.environ if environ is None else environ
    path = env.get("PATH", "")
    if backend not in BACKENDS and builder:
        return ToolchainReport(True, {"builder": builder[0], "variant": variant})
    if backend not in BACKENDS:
        return ToolchainReport(
            False,
            {
                "cause": str(ReasonCode.BUNDLE_MISSING),
                "message": f"Stoker's builder does not build the {backend} backend (it builds: {', '.join(BACKENDS)}).",
                "buildable": list(BACKENDS),
            },
        )
    try:
        plan = BuildPlan.for_backend(backend, variant)
    except StokerError as err:
        return ToolchainReport(False, _missing(backend, err.message, {**err.evidence, "PATH": path}))
    missing = [tool for tool in ("readelf",) if _which(tool, path) is None]
    if plan.toolchain.generator != "Ninja" and _which("make", path) is None:
        missing.append("make or ninja")
    if missing:
        return ToolchainReport(
            False,
            _missing(backend, f"The build needs {', '.join(missing)}, not found.", {"missing": missing, "PATH": path}),
        )
    return ToolchainReport(True, {"toolchain": plan.toolchain.to_dict(), "variant": plan.variant})


def _which(tool: str, path: str) -> str | None:
    return shutil.which(tool, path=path)


def _missing(backend: str, what: str, evidence: dict[str, Any]) -> dict[str, Any]:
    return {
        **evidence,
        "cause": str(ReasonCode.BUILD_TOOLCHAIN_MISSING),
        "message": (
            f"{what.rstrip('.')}: this machine cannot build the {backend} engine. Install the build tools "
            f"(a C++ compiler, cmake, make or ninja, binutils), or configure a bundle mirror."
        ),
    }


# --- the build ------------------------------------------------------------------------------


def build_command(
    backend: str,
    variant: str,
    environ: Mapping[str, str] | None = None,
    archs: tuple[str, ...] = (),
    builder: list[str] | None = None,
) -> list[str]:
    """The child's argv: the CLI's own build, the result as one JSON document on stdout;
    `archs`: the device architectures to build for (the backend plugin's `build_archs`);
    `builder`: a backend plugin's own build (what the builder does not build)."""
    if builder and backend not in BACKENDS:
        return list(builder)
    env = os.environ if environ is None else environ
    argv = [
        sys.executable,
        "-m",
        "stoker.daemon",
        "bundle",
        "build",
        "--backend",
        backend,
        "--variant",
        variant,
        "--json",
    ]
    if env.get(BUILD_SOURCE_ENV):
        argv += ["--source", env[BUILD_SOURCE_ENV]]
    if archs:
        argv += ["--cuda-archs", ";".join(archs)]
    return argv


def progress_of(line: str) -> dict[str, Any]:
    """A builder progress line as figures: {line, step, percent} (step and percent where it says)."""
    line = line.strip()
    m = _STEP.match(line)
    if m is None:
        return {"line": line[:200]}
    return {"line": line[:200], "step": m.group(1), "percent": int(m.group(2))}


@attrs.frozen
class BuiltBundle:
    """What the build child answered: the zip in the build cache and its figures."""

    zip_path: Path
    sha256: str
    size: int
    cache_key: str
    cached: bool
    seconds: float
    log: str | None


# The niceness of a build made while another engine serves (a GPU engine built beside the CPU
# one): the compilers take the cores the serving engine leaves, and a build that serves
# nothing yet (the CPU engine of a first run) is not slowed by it.
BESIDE_BUILD_NICE = 10


async def run_build(
    backend: str,
    variant: str,
    progress: BuildProgress,
    archs: tuple[str, ...] = (),
    builder: list[str] | None = None,
    nice: int = 0,
) -> BuiltBundle:
    """Build (or find built) the bundle in a child process, at `nice` (inherited by cmake and
    the compilers); StokerError with the builder's reason (bundle_build_failed,
    source_digest_mismatch...) and its evidence if it fails."""
    argv = build_command(backend, variant, archs=archs, builder=builder)
    stdout = bytearray()
    tail: list[str] = []

    async def collect(stream: trio.abc.ReceiveStream) -> None:
        async for chunk in stream:
            stdout.extend(chunk)

    # Recorded before the spawn: a build a killed daemon left is ended by the next one
    # (daemon/core/launch_records.py), not left compiling beside the build its install restarts.
    with launch_record("build") as record:
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(
                lambda task_status: trio.run_process(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    check=False,
                    start_new_session=True,  # its own group: a kill reaches cmake and the compilers
                    deliver_cancel=stop_on_cancel(KILL_GRACE_S),
                    env=record.env(),
                    preexec_fn=(lambda: os.nice(nice)) if nice else None,
                    task_status=task_status,
                )
            )
            record.record_process(proc.pid)
            assert proc.stdout is not None and proc.stderr is not None
            nursery.start_soon(collect, proc.stdout)
            pending = b""
            async for chunk in proc.stderr:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for raw in lines:
                    text = raw.decode(errors="replace").strip()
                    if text:
                        tail = (tail + [text])[-20:]
                        progress(progress_of(text))
    return _answer(argv, proc.returncode, bytes(stdout), tail)


def _answer(argv: list[str], returncode: int | None, stdout: bytes, tail: list[str]) -> BuiltBundle:
    try:  # `--json`: one document (indented) on stdout, the progress on stderr
        doc = json.loads(stdout.decode(errors="replace"))
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("ok") is True:
        return BuiltBundle(
            Path(doc["zip"]),
            str(doc["sha256"]),
            int(doc["size"]),
            str(doc["cache_key"]),
            bool(doc["cached"]),
            float(doc["seconds"]),
            doc.get("log"),
        )
    error = (doc or {}).get("error") if isinstance(doc, dict) else None
    evidence = {"argv": " ".join(argv[1:]), "returncode": returncode, "stderr_tail": "\n".join(tail)}
    if isinstance(error, dict):
        raise StokerError(
            str(error.get("reason") or ReasonCode.BUNDLE_BUILD_FAILED),
            str(error.get("message") or "The local build failed."),
            {**evidence, **dict(error.get("evidence") or {})},
        )
    raise StokerError(
        ReasonCode.BUNDLE_BUILD_FAILED, f"The local build exited with {returncode} and no answer.", evidence
    )


# --- the install machine's effects for these sources -----------------------------------------


async def variant_to_make(paths: StokerPaths, backend: str, plugin: Backend | None, detection: Detection | None) -> str:
    """With no mirror entry to say it: the variant the backend's plugin picks among those the
    build cache holds and a local build can make (the builder's default otherwise)."""
    cache = await trio.to_thread.run_sync(cached_builds, paths)
    offered = list(dict.fromkeys([*buildable_variants(backend), *cached_variants(cache, backend)]))
    chosen = plugin.choose_variant(detection, offered) if plugin and detection and offered else None
    return chosen or (offered[0] if offered else "default")


async def cache_attempt(
    paths: StokerPaths,
    effect: IE.FindCachedBuild,
    plugin: Backend | None,
    detection: Detection | None,
    reason: ReasonCode,
) -> tuple[I.Resolved | I.SourceUnavailable, ManifestEntry | None]:
    """The build cache's fitting entry as a file:// bundle, or a miss with what was there."""
    cache = await trio.to_thread.run_sync(cached_builds, paths)
    found = find_cached_build(cache, paths.build_cache_dir, effect.backend, effect.variant, plugin, detection)
    if found.hit is None:
        return I.SourceUnavailable(reason, found.evidence, cause=ReasonCode.BUNDLE_MISSING), None
    entry = await trio.to_thread.run_sync(entry_for_zip, found.hit.zip_path)
    return I.Resolved(entry.url, entry.sha256, entry.size, found.evidence, origin=str(found.hit.zip_path.parent)), entry


async def toolchain_attempt(
    effect: IE.CheckToolchain, reason: ReasonCode, builder: list[str] | None = None
) -> I.ToolchainReady | I.SourceUnavailable:
    report = await trio.to_thread.run_sync(check_toolchain, effect.backend, effect.variant, None, builder)
    if report.ready:
        return I.ToolchainReady(report.evidence)
    return I.SourceUnavailable(reason, report.evidence, cause=ReasonCode(report.evidence["cause"]))


async def build_attempt(
    effect: IE.BuildBundle,
    progress: BuildProgress,
    archs: tuple[str, ...] = (),
    builder: list[str] | None = None,
    nice: int = 0,
) -> tuple[I.Resolved, ManifestEntry]:
    """Build from the pinned source for `archs` (empty: the builder's default); progress
    figures {phase, source, line, step, percent}."""

    def figures(fig: dict[str, Any]) -> None:
        progress({"phase": "building", "source": Source.LOCAL_BUILD.value, **fig})

    built = await run_build(effect.backend, effect.variant, figures, archs, builder, nice)
    entry = await trio.to_thread.run_sync(entry_for_zip, built.zip_path)
    evidence = {"cache_key": built.cache_key, "cached": built.cached, "build_seconds": built.seconds, "log": built.log}
    if archs:
        evidence["archs"] = list(archs)
    return I.Resolved(entry.url, entry.sha256, entry.size, evidence, origin=str(built.zip_path.parent)), entry
