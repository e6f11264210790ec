"""Where the engine comes from: a fresh home with no manifest finds its engine by itself.

The install chain (states/install/table.py) tries a configured mirror, then the local build cache,
then a local build from the pinned source, and the install history says which one served.

- cache present: the session's real CPU build (the `cpu_bundle` fixture), alone in a private
  build cache; the daemon reaches ready on it, its smoke test run, and says `build-cache`.
- no cache, a toolchain: a local build of a *small* llama.cpp stand-in tree (one C file whose
  `--version` and `--list-devices` answer like llama-server's) through the real builder (cmake,
  the compiler, packaging, the cache) in seconds. Rebuilding the real engine costs ~10 min on
  2 cores, and the session fixture has already proven that the pinned source builds; what is
  proven here is the chain's step: no manifest, a cache miss, the toolchain found, the build
  run as a child of the daemon, its zip installed through the same verified steps.
- no cache, no toolchain (PATH without cmake): the install fails cleanly, its reason and the
  evidence name cmake, every source's attempt is in the history and nothing is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.waits import wait_until

FAKE_MAIN = r"""#include <stdio.h>
#include <string.h>
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        fprintf(stderr, "version: 0.0.1 (build %d, commit %s)\n", BUILD_NUMBER, BUILD_COMMIT);
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "--list-devices") == 0) {
        printf("Available devices:\n  (none)\n");
        return 0;
    }
    fprintf(stderr, "a stand-in for llama-server: it serves nothing\n");
    return 1;
}
"""

FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(standin C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_executable(llama-server main.c)
target_compile_definitions(llama-server PRIVATE BUILD_NUMBER=${LLAMA_BUILD_NUMBER}
                           BUILD_COMMIT="${LLAMA_BUILD_COMMIT}")
"""


@pytest.fixture
def standin_tree(tmp_path) -> str:
    """A source spec for a two-file llama.cpp stand-in tree: builds in seconds."""
    tree = tmp_path / "standin"
    tree.mkdir()
    (tree / "main.c").write_text(FAKE_MAIN)
    (tree / "CMakeLists.txt").write_text(FAKE_CMAKE)
    (tree / "LICENSE").write_text("MIT, a test's stand-in\n")
    return f"dir:{tree}#build=7&commit=standin7"


def fresh_env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("STOKER_MANIFEST_URL", "STOKER_BUILD_SOURCE")}
    return {**env, "STOKER_CACHE_DIR": str(cache), **extra}


def install_rows(d: DaemonProcess) -> list[dict]:
    return d.call("status").get("installs") or []


def settled_install(d: DaemonProcess, timeout: float) -> dict:
    st = d.wait_for(
        lambda s: any(i["state"] in ("installed", "failed") for i in s.get("installs") or []), timeout, "an install"
    )
    return next(i for i in st["installs"] if i["state"] in ("installed", "failed"))


def stoker_status(d: DaemonProcess) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=d.env, capture_output=True, text=True, timeout=60
    )
    return out.stdout


@pytest.mark.engine
def test_fresh_home_without_a_manifest_is_served_from_the_build_cache(stoker_home, tmp_path, cpu_bundle, model):
    entry = Path(cpu_bundle).parent
    cache = tmp_path / "cache"
    shutil.copytree(entry, cache / "builds" / entry.name)
    d = DaemonProcess(stoker_home, fresh_env(cache))
    write_config(d.paths, tiny_config(model))
    assert not d.paths.bundles_dir.exists()
    d.start()
    try:
        st = d.wait_state("ready", timeout=180)
        assert st["backend"] == "cpu"
        [row] = st["installs"]
        assert (
            row["state"] == "installed"
            and row["source"] == "build-cache"
            and row["origin"] == str(cache / "builds" / entry.name)
        )
        assert [(t["source"], t["outcome"], t["reason"]) for t in row["tried"]] == [
            ("mirror", "unavailable", "bundle_missing"),
            ("build-cache", "installed", None),
        ]
        history = [
            (r["from_state"], r["event"], r["to_state"], r["evidence"])
            for r in reversed(d.history(machine=row["machine"]))
        ]
        steps = [(a, e, b) for a, e, b, _ in history]
        assert steps[:3] == [
            ("requested", "InstallRequested", "resolving"),
            ("resolving", "SourceUnavailable", "searching_cache"),
            ("searching_cache", "Resolved", "downloading"),
        ]
        assert history[1][3]["message"].startswith("No bundle manifest is configured")
        assert history[2][3]["cache_key"] == entry.name
        smoke, last = history[-2], history[-1]
        assert smoke[:3] == ("smoke_testing", "SmokePassed", "promoting") and smoke[3]["smoke"] == "passed"
        assert last[:3] == ("promoting", "Promoted", "installed")  # installed once the slot holds it
        assert last[3]["source"] == "build-cache" and last[3]["seconds"] > 0
        assert f"cpu-{row['variant']}: installed from build-cache" in stoker_status(d)
    finally:
        d.stop()
        for proc in servers_for(model):
            proc.kill()


def test_fresh_home_without_manifest_or_cache_builds_the_engine_here(stoker_home, tmp_path, standin_tree, model):
    cache = tmp_path / "empty-cache"
    d = DaemonProcess(stoker_home, fresh_env(cache, STOKER_BUILD_SOURCE=standin_tree))
    write_config(d.paths, tiny_config(model))
    d.start()
    try:
        row = settled_install(d, timeout=240)
        assert row["state"] == "installed", row
        assert row["source"] == "local-build"
        assert [(t["source"], t["outcome"], t["reason"]) for t in row["tried"]] == [
            ("mirror", "unavailable", "bundle_missing"),
            ("build-cache", "unavailable", "bundle_missing"),
            ("local-build", "installed", None),
        ]
        rows = [
            (r["from_state"], r["event"], r["to_state"], r["evidence"])
            for r in reversed(d.history(machine=row["machine"]))
        ]
        assert [(a, e, b) for a, e, b, _ in rows[:5]] == [
            ("requested", "InstallRequested", "resolving"),
            ("resolving", "SourceUnavailable", "searching_cache"),
            ("searching_cache", "SourceUnavailable", "checking_toolchain"),
            ("checking_toolchain", "ToolchainReady", "building"),
            ("building", "Resolved", "downloading"),
        ]
        assert "holds no cpu-" in rows[2][3]["message"]
        assert rows[3][3]["toolchain"]["cmake"].startswith("cmake version")
        built = rows[4][3]
        assert built["cached"] is False and (cache / "builds" / built["cache_key"] / "bundle.zip").is_file()
        bundle = d.paths.bundles_dir / f"cpu-{row['variant']}"
        # Installed: verified (--version, --list-devices) and promoted, by the effect that follows the transition.
        wait_until((bundle / "bundle.json").is_file, timeout=30, what=f"{bundle}/bundle.json (the promoted build)")
        assert '"build_number": 7' in (bundle / "bundle.json").read_text()
    finally:
        d.stop()


def test_no_manifest_no_cache_no_toolchain_fails_cleanly_and_says_why(stoker_home, tmp_path, model):
    path = tmp_path / "bin"
    path.mkdir()
    cxx = shutil.which("c++")
    assert cxx is not None
    (path / "c++").symlink_to(cxx)  # a compiler, and no cmake
    cache = tmp_path / "empty-cache"
    d = DaemonProcess(stoker_home, fresh_env(cache, PATH=str(path)))
    write_config(d.paths, tiny_config(model))
    d.start()
    try:
        row = settled_install(d, timeout=120)
        assert row["state"] == "failed" and row["reason"] == "cpu_bundle_install_failed"
        assert [(t["source"], t["outcome"], t["reason"]) for t in row["tried"]] == [
            ("mirror", "unavailable", "bundle_missing"),
            ("build-cache", "unavailable", "bundle_missing"),
            ("local-build", "unavailable", "build_toolchain_missing"),
        ]
        failed = d.history(machine=row["machine"])[0]
        assert failed["to_state"] == "failed" and failed["reason"] == "cpu_bundle_install_failed"
        evidence = failed["evidence"]
        assert evidence["cause"] == "build_toolchain_missing" and evidence["PATH"] == str(path)
        assert "cmake" in evidence["message"] and "cmake" in evidence["error"]
        st = d.wait_state("failed", timeout=60)
        assert st["reason"] == "cpu_bundle_install_failed"
        assert not d.paths.bundles_dir.exists() or not any(d.paths.bundles_dir.iterdir())
        assert not cache.joinpath("work").exists()  # no build was started
        shown = stoker_status(d)
        assert "engine    cpu-" in shown and "failed (local-build) [cpu_bundle_install_failed]" in shown, shown
    finally:
        d.stop()


# --- the build as the daemon runs it: a child process, its progress, its end ------------------


async def test_a_local_build_reports_its_progress_then_is_found_in_the_cache(tmp_path, monkeypatch, standin_tree):
    from stoker.daemon.install.sources import run_build

    monkeypatch.setenv("STOKER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("STOKER_BUILD_SOURCE", standin_tree)
    seen: list[dict] = []
    with trio.fail_after(180):
        built = await run_build("cpu", "compat", seen.append)
    assert built.cached is False and built.zip_path.is_file() and built.size == built.zip_path.stat().st_size
    assert ("compile", 100) in [(f.get("step"), f.get("percent")) for f in seen]
    assert any(f["line"].startswith("built cpu-compat in") for f in seen)
    with trio.fail_after(60):
        again = await run_build("cpu", "compat", seen.append)
    assert again.cached is True and again.sha256 == built.sha256 and again.cache_key == built.cache_key
