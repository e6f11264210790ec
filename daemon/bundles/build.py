"""`stoker bundle build`: configure and compile llama-server, package it, cache it by its inputs.

The cache key is the sha256 of every input that changes the output: the source digest, the
backend and variant, every cmake flag, the compiler, cmake and toolkit versions, the stamped
build number and commit, the smoke spec and this builder's revision. A pinned source's digest
is its pin, so a cached build is found without fetching anything and returns at once.

One build of a recipe runs at a time per cache (a file lock per cache key): a second caller
waits, then finds the first one's result in the cache; builds of different recipes run side by
side. Blocking code; the daemon calls it from a thread.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

import attrs

from stoker.daemon.bundles.archive import pack_bundle
from stoker.daemon.bundles.metadata import BUNDLE_JSON, SCHEMA_VERSION, BundleMeta, FileEntry, SmokeReference
from stoker.daemon.bundles.smoke import SmokeSpec, engine_env, run_smoke
from stoker.daemon.bundles.source import SourceSpec, SourceTree, resolve_source, tree_digest
from stoker.daemon.bundles.variants import BuildPlan
from stoker.daemon.bundles.verify import sha256_file
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

Progress = Callable[[str], None]

# Bump when packaging changes what a bundle contains: old cache entries then stop matching.
BUILDER_REVISION = 2  # 2: llama-fit-params and rpc-server packaged beside llama-server
BUNDLE_ZIP = "bundle.zip"
BUILD_LOG = "build.log"
SERVER_PATH = "bin/llama-server"
# role -> (cmake target = the binary's name in bin/, the source directory that defines it):
# packaged beside llama-server when the source tree has them (older trees lack fit-params).
TOOL_TARGETS = {"fit_params": ("llama-fit-params", "tools/fit-params"), "rpc_server": ("ggml-rpc-server", "tools/rpc")}
_RPC_PROTO = re.compile(r"#define\s+RPC_PROTO_(MAJOR|MINOR|PATCH)_VERSION\s+(\d+)")
_PROGRESS = re.compile(r"^\[\s*(\d+)(?:%\]|/(\d+)\])")
_NEEDED = re.compile(r"\(NEEDED\)\s+Shared library: \[(.+?)\]")
_RUNPATH = re.compile(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*?)\]")
_VERSION = re.compile(r"version: (\S+) \(build (\d+), commit (\S+)\)")


@attrs.frozen
class BuildResult:
    zip_path: Path
    meta: BundleMeta
    cache_key: str
    cached: bool
    log_path: Path
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": True,
            "zip": str(self.zip_path),
            "cache_key": self.cache_key,
            "cached": self.cached,
            "log": str(self.log_path),
            "seconds": round(self.seconds, 1),
            "backend": self.meta.backend,
            "variant": self.meta.variant,
            "version": self.meta.version,
            "size": self.zip_path.stat().st_size,
            "sha256": sha256_file(self.zip_path),
        }

    @classmethod
    def from_cache_entry(cls, entry: Path) -> "BuildResult":
        meta = BundleMeta.from_json((entry / BUNDLE_JSON).read_bytes())
        return cls(entry / BUNDLE_ZIP, meta, entry.name, True, entry / BUILD_LOG, 0.0)


def cache_key(plan: BuildPlan, source_digest: str, spec: SourceSpec, smoke: SmokeSpec) -> str:
    inputs = plan.cache_inputs(
        source_digest,
        {
            "build_number": spec.build_number or 0,
            "commit": spec.commit or "unknown",
            "smoke": smoke.to_dict(),
            "builder_revision": BUILDER_REVISION,
        },
    )
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def cached_builds(paths: StokerPaths) -> list[BuildResult]:
    """Every complete entry of the build cache."""
    root = paths.build_cache_dir
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        if entry.is_dir() and (entry / BUNDLE_ZIP).is_file() and (entry / BUNDLE_JSON).is_file():
            try:
                out.append(BuildResult.from_cache_entry(entry))
            except StokerError:
                continue  # an entry from an older schema: ignored, never trusted
    return out


@contextmanager
def _build_lock(paths: StokerPaths, name: str, progress: Progress, waiting: str) -> Iterator[None]:
    """The cache's file lock `name`, held for the block; `waiting` is said while another holds it."""
    paths.build_cache_dir.mkdir(parents=True, exist_ok=True)
    with open(paths.build_cache_dir / name, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(waiting)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run_logged(cmd: list[str], cwd: Path, log: TextIO, progress: Progress, step: str) -> None:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        stdin=subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    last_pct, last_time = -1, 0.0
    tail: list[str] = []
    for line in proc.stdout:
        log.write(line)
        tail = (tail + [line.rstrip()])[-30:]
        m = _PROGRESS.match(line)
        if m:
            pct = int(m.group(1)) * 100 // int(m.group(2)) if m.group(2) else int(m.group(1))
            # Enough to show life on a 5-minute build without flooding a terminal.
            if pct >= last_pct + 5 or time.monotonic() - last_time > 15:
                progress(f"{step}: {pct}%  {line.split(']', 1)[-1].strip()[:80]}")
                last_pct, last_time = pct, time.monotonic()
    if proc.wait() != 0:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED,
            evidence={"step": step, "returncode": proc.returncode, "log": log.name, "log_tail": "\n".join(tail)},
        )


def _elf_dynamic(path: Path) -> tuple[list[str], list[str]]:
    if shutil.which("readelf") is None:
        raise StokerError(ReasonCode.BUNDLE_BUILD_FAILED, "readelf (binutils) is needed to package the build.")
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    return _NEEDED.findall(out), _RUNPATH.findall(out)


def collect_outputs(
    bin_dir: Path,
    dest: Path,
    programs: tuple[str, ...] = ("llama-server",),
    bundled: tuple[str, ...] = (),
    bundled_dirs: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """Copy the programs and the libraries they need from the build into `dest/bin`.

    Libraries are copied under the names the loader asks for (their sonames), as regular
    files: bundles hold no symlinks. A NEEDED library whose soname starts with one of
    `bundled` is copied from `bundled_dirs` (the CUDA runtime from the toolkit) with its own
    closure; a `bundled` library that cannot be found fails the build rather than ship a bundle
    that needs the toolkit. Returns the NEEDED libraries left to the host.
    """
    (dest / "bin").mkdir(parents=True, exist_ok=True)
    system: set[str] = set()
    queue = [(name, bin_dir / name, True) for name in programs]
    done: set[str] = set()
    while queue:
        name, path, ours = queue.pop()
        if name in done:
            continue
        done.add(name)
        src = path.resolve()
        target = dest / "bin" / name
        shutil.copyfile(src, target)
        os.chmod(target, 0o755)
        needed, runpaths = _elf_dynamic(src)
        # The vendor's libraries find each other by soname once loaded through ours.
        if ours and any(p and p != "$ORIGIN" for p in runpaths):
            raise StokerError(
                ReasonCode.BUNDLE_BUILD_FAILED,
                "A built binary is not relocatable (its RUNPATH is not $ORIGIN).",
                {"file": name, "runpath": runpaths},
            )
        for lib in needed:
            if (bin_dir / lib).exists():
                queue.append((lib, bin_dir / lib, True))
            elif lib.startswith(bundled):
                found = next((Path(d) / lib for d in bundled_dirs if (Path(d) / lib).exists()), None)
                if found is None:
                    raise StokerError(
                        ReasonCode.BUNDLE_BUILD_FAILED,
                        f"{lib} is to be carried in the bundle but is not in the toolkit's library folders.",
                        {"library": lib, "searched": list(bundled_dirs), "needed_by": name},
                    )
                queue.append((lib, found, False))
            else:
                system.add(lib)
    return tuple(sorted(system))


def _file_entries(root: Path) -> tuple[FileEntry, ...]:
    entries = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == BUNDLE_JSON:
            continue
        entries.append(FileEntry(rel, path.stat().st_size, path.stat().st_mode & 0o777, sha256_file(path)))
    return tuple(entries)


def source_tools(source_root: Path) -> dict[str, str]:
    """role -> cmake target of the engine's tools this source tree can build."""
    return {
        role: target
        for role, (target, where) in TOOL_TARGETS.items()
        if (source_root / where / "CMakeLists.txt").is_file()
    }


def rpc_protocol(source_root: Path) -> str | None:
    """ggml-rpc's protocol version as the source declares it ("7.0.0"), or None if it does not."""
    header = source_root / "ggml" / "include" / "ggml-rpc.h"
    if not header.is_file():
        return None
    parts = dict(_RPC_PROTO.findall(header.read_text(errors="replace")))
    if set(parts) != {"MAJOR", "MINOR", "PATCH"}:
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def _engine_version(server: Path, scratch: Path) -> str:
    scratch.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [str(server), "--version"],
        capture_output=True,
        text=True,
        errors="replace",
        cwd=scratch,
        env=engine_env(),
        timeout=30,
    )
    m = _VERSION.search(proc.stderr + proc.stdout)
    return m.group(1) if m else "unknown"


def _record_smoke(server: Path, smoke: SmokeSpec, scratch: Path, progress: Progress) -> SmokeReference:
    model = smoke.write_model(scratch)
    model_doc = {**dict(smoke.model), "sha256": sha256_file(model)}
    tokens: tuple[int, ...] | None
    try:
        tokens = run_smoke(server, smoke, scratch)
        progress(f"smoke reference: {len(tokens)} greedy tokens recorded")
    except StokerError as err:
        tokens = _smoke_on_cpu(server, smoke, scratch, progress, err)
    return SmokeReference(model_doc, smoke.prompt, smoke.n_predict, tokens)


def _smoke_on_cpu(
    server: Path, smoke: SmokeSpec, scratch: Path, progress: Progress, err: StokerError
) -> tuple[int, ...] | None:
    """The reference from the engine's own CPU code (`--device none`) when the build host's GPU
    cannot run the bundle: a CUDA family built for other architectures than this host's GPU (a
    Turing-Ampere bundle built on an H200 dies at its first kernel). Every device must produce the
    CPU's tokens on the smoke model (F32, greedy; checked on CUDA and Vulkan against the CPU), so
    the bundle stays installable where its GPU is. None where the engine cannot run at all here
    (`native` on a CPU that lies): `verify --smoke` then says there is nothing to compare with."""
    try:
        tokens = run_smoke(server, smoke, scratch, args=("--device", "none"))
    except StokerError as again:
        progress(f"smoke reference NOT recorded: [{err.reason}] {err.message}; on the CPU: {again.message}")
        return None
    progress(
        f"smoke reference: {len(tokens)} greedy tokens recorded on the engine's CPU code "
        f"(this host's devices cannot run it: {err.message})"
    )
    return tokens


def build_bundle(
    paths: StokerPaths,
    *,
    backend: str = "cpu",
    variant: str | None = None,
    source: SourceSpec | None = None,
    cuda_archs: tuple[str, ...] | None = None,
    jobs: int | None = None,
    progress: Progress = lambda _: None,
    plan: BuildPlan | None = None,
) -> BuildResult:
    """Build (or find in the cache) the bundle for these inputs; return its zip and metadata."""
    started = time.monotonic()
    spec = source or SourceSpec.default()
    plan = plan or BuildPlan.for_backend(backend, variant, cuda_archs)
    smoke = SmokeSpec.for_variant(plan.variant)
    digest = spec.sha256 if spec.kind != "dir" else tree_digest(Path(spec.location))
    assert digest is not None
    key = cache_key(plan, digest, spec, smoke)
    entry = paths.build_cache_dir / key
    if (entry / BUNDLE_ZIP).is_file():
        progress(f"cached build {key} ({plan.backend}-{plan.variant}); nothing to compile")
        return BuildResult.from_cache_entry(entry)
    # One build per recipe at a time (a second caller of the same recipe waits, then finds it
    # built); builds of different recipes run side by side: the CPU engine that serves now is
    # not queued behind a GPU engine built beside it. The source is unpacked under a lock of
    # its own, shared by every recipe.
    with _build_lock(paths, f".build-{key}.lock", progress, "the same engine build is running; waiting for it"):
        if (entry / BUNDLE_ZIP).is_file():  # built by the caller we waited for
            progress(f"cached build {key} ({plan.backend}-{plan.variant}); built while we waited")
            return BuildResult.from_cache_entry(entry)
        with _build_lock(paths, ".source.lock", progress, "another build is unpacking the source; waiting"):
            tree = resolve_source(spec, paths, progress)
        return _build(paths, plan, tree, smoke, key, jobs or os.cpu_count() or 1, progress, started)


def _build(
    paths: StokerPaths,
    plan: BuildPlan,
    tree: SourceTree,
    smoke: SmokeSpec,
    key: str,
    jobs: int,
    progress: Progress,
    started: float,
) -> BuildResult:
    work = paths.cache_dir / "work" / key
    shutil.rmtree(work, ignore_errors=True)
    build_dir, stage = work / "build", work / "bundle"
    work.mkdir(parents=True)
    log_path = work / BUILD_LOG
    progress(f"building {plan.backend}-{plan.variant} ({key}) with {jobs} jobs; log: {log_path}")
    with open(log_path, "w", buffering=1) as log:  # line-buffered: `tail -f` shows a live build
        configure = [
            "cmake",
            "-S",
            str(tree.root),
            "-B",
            str(build_dir),
            "-G",
            plan.toolchain.generator,
            *plan.flags,
            f"-DLLAMA_BUILD_NUMBER={tree.build_number}",
            f"-DLLAMA_BUILD_COMMIT={tree.commit}",
        ]
        _run_logged(configure, work, log, progress, "configure")
        tools = source_tools(tree.root)
        targets = ["llama-server", *tools.values()]
        compile_ = ["cmake", "--build", str(build_dir), "--target", *targets, "-j", str(jobs)]
        _run_logged(compile_, work, log, progress, "compile")
    system_libs = collect_outputs(build_dir / "bin", stage, tuple(targets), plan.bundled_libs, plan.bundled_lib_dirs)
    licenses = [(tree.root / "LICENSE", "LICENSE.llama.cpp")]
    # The CUDA runtime is redistributed under NVIDIA's EULA (its Attachment A lists cudart and cuBLAS).
    licenses += [(Path(d).parent / "EULA.txt", "LICENSE.cuda-runtime.txt") for d in plan.bundled_lib_dirs[:1]]
    for license_file, name in licenses:
        if license_file.is_file():
            shutil.copyfile(license_file, stage / name)
            os.chmod(stage / name, 0o644)
    server = stage / SERVER_PATH
    llama_version = _engine_version(server, work / "smoke")
    reference = _record_smoke(server, smoke, work / "smoke", progress)
    meta = BundleMeta(
        schema_version=SCHEMA_VERSION,
        backend=plan.backend,
        variant=plan.variant,
        version=f"b{tree.build_number}" if tree.build_number else f"dev-{tree.digest[:12]}",
        platform=plan.platform,
        server=SERVER_PATH,
        source=tree.pin(),
        llama={"version": llama_version, "build_number": tree.build_number, "commit": tree.commit},
        build={
            "flags": list(plan.flags),
            **plan.toolchain.to_dict(),
            "cache_key": key,
            "builder_revision": BUILDER_REVISION,
            "host_cpu": plan.host_cpu,
        },
        cuda_archs=plan.cuda_archs,
        min_driver=plan.min_driver,
        cpu_requires=plan.cpu_requires,
        required_system_libs=tuple(sorted(set(system_libs) | set(plan.declared_system_libs))),
        files=_file_entries(stage),
        smoke=reference,
        tools={role: f"bin/{target}" for role, target in tools.items()},
        rpc_protocol=rpc_protocol(tree.root),
    )
    (stage / BUNDLE_JSON).write_text(meta.to_json())
    # The finished entry appears whole or not at all.
    tmp_entry = paths.build_cache_dir / f".{key}.tmp"
    shutil.rmtree(tmp_entry, ignore_errors=True)
    tmp_entry.mkdir(parents=True)
    pack_bundle(stage, tmp_entry / BUNDLE_ZIP)
    shutil.copyfile(stage / BUNDLE_JSON, tmp_entry / BUNDLE_JSON)
    shutil.copyfile(log_path, tmp_entry / BUILD_LOG)
    entry = paths.build_cache_dir / key
    shutil.rmtree(entry, ignore_errors=True)
    os.replace(tmp_entry, entry)
    shutil.rmtree(work, ignore_errors=True)  # the build tree is hundreds of MB; the log is kept
    seconds = time.monotonic() - started
    progress(f"built {plan.backend}-{plan.variant} in {seconds:.0f} s: {entry / BUNDLE_ZIP}")
    return BuildResult(entry / BUNDLE_ZIP, meta, key, False, entry / BUILD_LOG, seconds)
