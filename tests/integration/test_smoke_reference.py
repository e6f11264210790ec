"""A bundle's smoke reference when its build host cannot run it on its GPU.

A CUDA family built for other GPUs than the build host's (Turing-Ampere built on an H200) dies at
its first kernel there. Its reference is then recorded from the engine's own CPU code, which is
what every device must produce on the smoke model, so the bundle installs where its GPU is.
The real engine, behind a wrapper that dies like such a bundle unless no device is used."""

from __future__ import annotations

from pathlib import Path

from stoker.daemon.bundles.archive import unpack_bundle
from stoker.daemon.bundles.build import _record_smoke
from stoker.daemon.bundles.installed import bundle_meta_of
from stoker.daemon.bundles.smoke import SmokeSpec

DIES_ON_ITS_GPU = """#!/bin/sh
here=$(dirname "$0")
case " $* " in
  *" --device none "*) exec "$here/llama-server.real" "$@" ;;
  *" -m "*) echo "CUDA error: no kernel image is available for execution on the device" >&2; kill -ABRT $$ ;;
esac
exec "$here/llama-server.real" "$@"
"""


def wrapped_engine(cpu_bundle: Path, tmp_path: Path, script: str) -> Path:
    root = unpack_bundle(cpu_bundle, tmp_path / "bundle")
    server = root / bundle_meta_of(cpu_bundle).server
    server.rename(server.with_name("llama-server.real"))
    server.write_text(script)
    server.chmod(0o755)
    return server


def test_a_bundle_its_build_host_cannot_run_records_the_cpu_reference(cpu_bundle, tmp_path):
    server = wrapped_engine(cpu_bundle, tmp_path, DIES_ON_ITS_GPU)
    said: list[str] = []
    ref = _record_smoke(server, SmokeSpec(), tmp_path / "smoke", said.append)
    assert ref.tokens == bundle_meta_of(cpu_bundle).smoke.tokens  # the CPU bundle's own reference
    assert said[-1].startswith("smoke reference: 16 greedy tokens recorded on the engine's CPU code"), said


def test_an_engine_that_cannot_run_at_all_records_none_and_says_why(cpu_bundle, tmp_path):
    server = wrapped_engine(cpu_bundle, tmp_path, "#!/bin/sh\nkill -ILL $$\n")
    said: list[str] = []
    ref = _record_smoke(server, SmokeSpec(), tmp_path / "smoke", said.append)
    assert ref.tokens is None
    assert said[-1].startswith("smoke reference NOT recorded") and "on the CPU" in said[-1], said
