"""`stoker bundle ...` against fake bundles: JSON shapes, reason codes and exit statuses."""

from __future__ import annotations

import json

from click.testing import CliRunner

from bundlekit import engine_script, make_bundle_dir, make_bundle_zip
from stoker.daemon.cli.group import cli


def run(*args):
    return CliRunner().invoke(cli, ["bundle", *args])


def test_inspect_zip_and_dir(tmp_path):
    zip_path = make_bundle_zip(tmp_path)
    for target in (zip_path, tmp_path / "bundle.zip.src"):
        res = run("inspect", str(target), "--json")
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout)["variant"] == "avx2"
    human = run("inspect", str(zip_path))
    assert "cpu-avx2 b11434" in human.stdout and "bin/llama-server" in human.stdout


def test_verify_ok_and_failures(tmp_path):
    ok = run("verify", str(make_bundle_zip(tmp_path)), "--expect-backend", "cpu", "--json")
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.stdout)["steps"] == ["files", "metadata", "version", "devices"]
    sigill = make_bundle_dir(tmp_path / "sigill", script=engine_script(crash_on="devices"))
    res = run("verify", str(sigill), "--json")
    assert res.exit_code == 1
    error = json.loads(res.stdout)["error"]
    assert error["reason"] == "cpu_illegal_instruction" and error["evidence"]["signal"] == "SIGILL"
    human = run("verify", str(sigill))
    assert human.exit_code == 1 and "cpu_illegal_instruction" in human.stderr


def test_missing_file_and_bad_options(tmp_path):
    res = run("verify", str(tmp_path / "nope.zip"), "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["error"]["reason"] == "bundle_missing"
    res = run("build", "--backend", "cpu", "--cuda-archs", "90-real", "--json")
    assert res.exit_code == 1 and json.loads(res.stdout)["error"]["reason"] == "bundle_build_failed"
    assert run("build", "--backend", "rocm").exit_code == 2


def test_install_then_list(tmp_path):
    zip_path = make_bundle_zip(tmp_path)
    res = run("install", str(zip_path), "--json")
    assert res.exit_code == 0, res.output
    listing = json.loads(run("list", "--json").stdout)
    assert [(b["backend"], b["variant"]) for b in listing["installed"]] == [("cpu", "avx2")]
