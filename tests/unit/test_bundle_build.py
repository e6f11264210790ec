"""The builder's cache, progress, logs and packaging, with a stand-in cmake (no compiler)."""

from __future__ import annotations

import os
import shutil
import zipfile
from pathlib import Path

import pytest

from bundlekit import engine_script
from stoker.daemon.bundles.build import build_bundle, cached_builds, collect_outputs
from stoker.daemon.bundles.source import SourceSpec
from stoker.daemon.bundles.variants import BuildPlan, Toolchain
from stoker.daemon.bundles.verify import verify_bundle
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode

FAKE_CMAKE = """#!/bin/sh
echo "$@" >> "$FAKE_CMAKE_LOG"
if [ "$1" = "-S" ]; then mkdir -p "$4"; echo "-- Configuring done"; exit 0; fi
if [ "$1" = "--build" ]; then
  if [ -n "$FAKE_CMAKE_FAIL" ]; then echo "[1/2] Building CXX object a.o"; echo "a.cpp:1: error: boom"; exit 2; fi
  mkdir -p "$2/bin"
  echo "[1/2] Building CXX object a.o"
  echo "[2/2] Linking CXX executable bin/llama-server"
  cp "$FAKE_SERVER" "$2/bin/llama-server"; chmod 755 "$2/bin/llama-server"
  for t in "$@"; do case "$t" in llama-fit-params|ggml-rpc-server) cp "$FAKE_SERVER" "$2/bin/$t";; esac; done
  exit 0
fi
exit 1
"""


@pytest.fixture
def fake_toolchain(tmp_path, monkeypatch):
    bindir = tmp_path / "fakebin"
    bindir.mkdir()
    (bindir / "cmake").write_text(FAKE_CMAKE)
    os.chmod(bindir / "cmake", 0o755)
    server = tmp_path / "fake-server"
    server.write_text(engine_script(build=7))
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CMAKE_LOG", str(tmp_path / "cmake-calls.log"))
    monkeypatch.setenv("FAKE_SERVER", str(server))
    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "llama.cpp"
    src.mkdir()
    (src / "CMakeLists.txt").write_text("project(fake)\n")
    (src / "LICENSE").write_text("MIT\n")
    plan = BuildPlan.for_backend("cpu", "compat", toolchain=Toolchain("c++ fake 1.0", "cmake fake", "Ninja"))
    spec = SourceSpec.parse(f"dir:{src}#build=7&commit=b11434")
    return plan, spec, tmp_path / "cmake-calls.log"


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def test_build_then_cached_without_running_cmake(fake_toolchain):
    plan, spec, log = fake_toolchain
    paths = StokerPaths.from_env()
    lines: list[str] = []
    first = build_bundle(paths, plan=plan, source=spec, progress=lines.append)
    assert not first.cached
    assert any("compile: 50%" in line for line in lines) and any("compile: 100%" in line for line in lines)
    assert any("smoke reference NOT recorded" in line for line in lines)  # the fake cannot generate
    configure, compile_ = calls(log)
    assert "-DLLAMA_BUILD_NUMBER=7" in configure and "-DLLAMA_BUILD_COMMIT=b11434" in configure
    assert "-DGGML_NATIVE=OFF" in configure and "--target llama-server" in compile_
    assert first.log_path.read_text().count("Linking CXX executable") == 1
    assert not (paths.cache_dir / "work" / first.cache_key).exists()  # the build tree is gone
    meta = first.meta
    assert (meta.version, meta.variant, meta.llama["commit"]) == ("b7", "compat", "b11434")
    assert meta.smoke is not None and meta.smoke.tokens is None
    assert [f.path for f in meta.files] == ["LICENSE.llama.cpp", "bin/llama-server"]
    with zipfile.ZipFile(first.zip_path) as zf:
        assert zf.namelist()[0] == "bundle.json"
    assert verify_bundle(first.zip_path, expect_version="b7").steps[-1] == "devices"

    lines.clear()
    again = build_bundle(paths, plan=plan, source=spec, progress=lines.append)
    assert again.cached and again.zip_path == first.zip_path and again.cache_key == first.cache_key
    assert len(calls(log)) == 2  # cmake was not run again
    assert lines and "cached build" in lines[0]
    assert [c.cache_key for c in cached_builds(paths)] == [first.cache_key]


def test_the_engine_tools_the_source_defines_are_packaged_with_the_rpc_protocol(fake_toolchain):
    plan, spec, log = fake_toolchain
    src = Path(spec.location)
    for where in ("tools/fit-params", "tools/rpc"):
        (src / where).mkdir(parents=True)
        (src / where / "CMakeLists.txt").write_text("# target\n")
    (src / "ggml" / "include").mkdir(parents=True)
    (src / "ggml" / "include" / "ggml-rpc.h").write_text(
        "#define RPC_PROTO_MAJOR_VERSION    7\n#define RPC_PROTO_MINOR_VERSION 1\n#define RPC_PROTO_PATCH_VERSION 2\n"
    )
    meta = build_bundle(StokerPaths.from_env(), plan=plan, source=spec).meta
    _, compile_ = calls(log)
    assert "--target llama-server llama-fit-params ggml-rpc-server" in compile_
    assert dict(meta.tools) == {"fit_params": "bin/llama-fit-params", "rpc_server": "bin/ggml-rpc-server"}
    assert meta.rpc_protocol == "7.1.2"
    assert {"bin/llama-fit-params", "bin/ggml-rpc-server"} <= {f.path for f in meta.files}


def test_changed_source_is_a_new_build(fake_toolchain, tmp_path):
    plan, spec, log = fake_toolchain
    paths = StokerPaths.from_env()
    a = build_bundle(paths, plan=plan, source=spec)
    (Path(spec.location) / "ggml.c").write_text("int x;\n")
    b = build_bundle(paths, plan=plan, source=spec)
    assert not b.cached and a.cache_key != b.cache_key
    assert len(calls(log)) == 4


def test_failed_build_keeps_its_log_and_caches_nothing(fake_toolchain, monkeypatch):
    plan, spec, _ = fake_toolchain
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    paths = StokerPaths.from_env()
    with pytest.raises(StokerError) as err:
        build_bundle(paths, plan=plan, source=spec)
    assert err.value.reason == ReasonCode.BUNDLE_BUILD_FAILED
    assert err.value.evidence["step"] == "compile" and "error: boom" in err.value.evidence["log_tail"]
    assert Path(err.value.evidence["log"]).is_file()
    assert cached_builds(paths) == []


def test_collect_outputs_copies_the_closure_and_names_system_libs(tmp_path):
    true = shutil.which("true")
    bindir = tmp_path / "build" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy(true, bindir / "llama-server")
    system = collect_outputs(bindir, tmp_path / "stage")
    assert "libc.so.6" in system
    assert (tmp_path / "stage" / "bin" / "llama-server").stat().st_mode & 0o777 == 0o755


def test_collect_outputs_carries_the_vendor_libraries_it_is_told_to(tmp_path):
    # As a CUDA bundle carries libcudart/libcublas from the toolkit: here libc from the system's
    # library folder stands in for the vendor's (a real ELF closure, read with readelf).
    true = shutil.which("true")
    bindir = tmp_path / "build" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy(true, bindir / "llama-server")
    libdir = next(
        d for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64") if Path(d, "libc.so.6").exists()
    )
    system = collect_outputs(bindir, tmp_path / "stage", bundled=("libc.so",), bundled_dirs=(str(tmp_path), libdir))
    assert (tmp_path / "stage" / "bin" / "libc.so.6").is_file()
    assert "libc.so.6" not in system
    with pytest.raises(StokerError) as err:
        collect_outputs(bindir, tmp_path / "stage2", bundled=("libc.so",), bundled_dirs=(str(tmp_path),))
    assert err.value.reason == ReasonCode.BUNDLE_BUILD_FAILED and err.value.evidence["library"] == "libc.so.6"
