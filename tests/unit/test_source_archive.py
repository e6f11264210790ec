"""An engine source archive (an sdist's tarball) whose members would land outside the tree, or
whose links lead out, is refused as `bundle_unsafe_archive` before or while it is unpacked,
never an internal error; a well-formed one unpacks the llama.cpp tree alone."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from stoker.daemon.bundles.source import _unpack
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

TREE = ["pkg-1.0/vendor/llama.cpp/CMakeLists.txt", "pkg-1.0/vendor/llama.cpp/ggml/CMakeLists.txt"]


def tarball(path: Path, files: list[str], links: dict[str, str] | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in files:
            info = tarfile.TarInfo(name)
            info.size = 2
            tar.addfile(info, io.BytesIO(b"x\n"))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type = tarfile.SYMTYPE
            info.linkname = target
            tar.addfile(info)
    return path


def test_a_well_formed_source_unpacks_only_the_tree(tmp_path):
    archive = tarball(tmp_path / "src.tar.gz", [*TREE, "pkg-1.0/setup.py", "pkg-1.0/vendor/llama.cpp/src/a.c"])
    _unpack(archive, tmp_path / "out")
    found = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert found == ["CMakeLists.txt", "ggml/CMakeLists.txt", "src/a.c"]


@pytest.mark.parametrize(
    "member", ["pkg-1.0/vendor/llama.cpp/../../../../escape.c", "pkg-1.0/vendor/llama.cpp/src/../../../../../x"]
)
def test_a_member_that_climbs_out_is_refused_and_nothing_lands_outside(tmp_path, member):
    archive = tarball(tmp_path / "src.tar.gz", [*TREE, member])
    with pytest.raises(StokerError) as err:
        _unpack(archive, tmp_path / "deep" / "out")
    assert err.value.reason is ReasonCode.BUNDLE_UNSAFE_ARCHIVE
    assert not list(tmp_path.rglob("escape.c")) and not (tmp_path / "x").exists()


def test_a_link_that_leads_out_is_refused_not_an_internal_error(tmp_path):
    archive = tarball(tmp_path / "src.tar.gz", TREE, links={"pkg-1.0/vendor/llama.cpp/src": "/etc"})
    with pytest.raises(StokerError) as err:
        _unpack(archive, tmp_path / "out")
    assert err.value.reason is ReasonCode.BUNDLE_UNSAFE_ARCHIVE
