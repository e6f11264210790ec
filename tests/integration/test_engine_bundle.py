"""The real engine: Stoker's own CPU build, reused from the cache, verified with the smoke gate,
installed, and serving a completion from its installed location."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from click.testing import CliRunner

from stoker.daemon.bundles.build import build_bundle
from stoker.daemon.bundles.installed import find_installed, install_bundle
from stoker.daemon.bundles.smoke import generate
from stoker.daemon.bundles.verify import verify_bundle
from stoker.daemon.cli.group import cli
from stoker.daemon.core.paths import StokerPaths

pytestmark = pytest.mark.engine


def test_the_same_inputs_never_build_twice(cpu_bundle):
    started = time.monotonic()
    lines = []
    again = build_bundle(StokerPaths.from_env(), backend="cpu", progress=lines.append)
    assert again.cached and again.zip_path == cpu_bundle
    assert time.monotonic() - started < 5
    assert any("cached build" in line for line in lines)
    assert again.log_path.is_file() and again.log_path.stat().st_size > 0


def test_bundle_verifies_with_the_smoke_gate(cpu_bundle):
    report = verify_bundle(cpu_bundle, expect_backend="cpu", expect_version="b11434", smoke=True)
    assert report.steps == ("files", "metadata", "version", "devices", "smoke")
    assert [d.strip() for d in report.devices] == ["(none)"]
    assert "build 11434, commit b11434" in report.version_line
    assert report.smoke_tokens == report.meta.smoke.tokens and len(report.smoke_tokens) == 16


def test_bundle_contract(cpu_bundle):
    report = verify_bundle(cpu_bundle, run_engine=False)
    meta = report.meta
    assert meta.server == "bin/llama-server" and meta.variant in ("avx2", "compat")
    assert meta.source["sha256"] == "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
    assert meta.llama["build_number"] == 11434
    assert any(f.path.startswith("bin/libllama") for f in meta.files)
    assert not any(lib.startswith("/") for lib in meta.required_system_libs)
    assert "-DGGML_AMX_TILE=OFF" in meta.build["flags"]


def test_installed_bundle_serves_a_completion_from_its_new_home(installed_cpu_bundle, tiny_model, tmp_path):
    bundle = installed_cpu_bundle
    assert find_installed(StokerPaths.from_env(), "cpu") == bundle
    # Relocatable: every binary finds its libraries next to itself, not in the build tree.
    for entry in bundle.meta.files:
        if entry.path.startswith("bin/"):
            dyn = subprocess.run(
                ["readelf", "-d", str(bundle.root / entry.path)], capture_output=True, text=True
            ).stdout
            assert set(re.findall(r"R(?:UN)?PATH.*\[(.*)\]", dyn)) <= {"$ORIGIN"}
    tokens = generate(bundle.server, tiny_model, "Hello world", 8, tmp_path / "run")
    assert len(tokens) == 8
    assert generate(bundle.server, tiny_model, "Hello world", 8, tmp_path / "again") == tokens  # greedy


def test_cli_inspect_verify_install_list(cpu_bundle):
    runner = CliRunner()
    inspected = runner.invoke(cli, ["bundle", "inspect", str(cpu_bundle), "--json"])
    assert inspected.exit_code == 0, inspected.output
    assert json.loads(inspected.stdout)["backend"] == "cpu"
    verified = runner.invoke(cli, ["bundle", "verify", str(cpu_bundle), "--smoke", "--json"])
    assert verified.exit_code == 0, verified.output
    assert json.loads(verified.stdout)["steps"][-1] == "smoke"
    wrong = runner.invoke(cli, ["bundle", "verify", str(cpu_bundle), "--expect-backend", "cuda", "--json"])
    assert wrong.exit_code == 1 and json.loads(wrong.stdout)["error"]["reason"] == "bundle_metadata_mismatch"
    installed = runner.invoke(cli, ["bundle", "install", str(cpu_bundle), "--json"])
    assert installed.exit_code == 0, installed.output
    listing = json.loads(runner.invoke(cli, ["bundle", "list", "--json"]).stdout)
    assert [b["backend"] for b in listing["installed"]] == ["cpu"]
    assert str(cpu_bundle) in [c["zip"] for c in listing["cache"]]
    built = runner.invoke(cli, ["bundle", "build", "--backend", "cpu", "--json"])
    assert built.exit_code == 0 and json.loads(built.stdout)["cached"] is True


def test_install_twice_keeps_the_previous(cpu_bundle):
    paths = StokerPaths.from_env()
    install_bundle(cpu_bundle, paths)
    second = install_bundle(cpu_bundle, paths)
    assert (paths.bundles_dir / f"{second.meta.slot}.previous" / "bin" / "llama-server").is_file()


def test_safe_variant_runs_quantized_kernels_on_this_cpu(installed_cpu_bundle, tmp_path):
    """Q8_0 matmuls are where -march=native faults on a CPU that lies about AMX; avx2 must not."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "q8.gguf", weights="q8_0")
    assert len(generate(installed_cpu_bundle.server, model, "Once upon a time", 8, tmp_path / "run")) == 8
