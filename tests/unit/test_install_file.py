"""`install_file`: how every CLI command installs a local bundle, without a daemon here.

With no daemon running, the CLI takes the daemon's lock and runs the install service itself:
the same machine, steps, promote and history as a daemon's install. (Through a running
daemon: tests/integration/test_install_service.py.)
"""

from __future__ import annotations

import os

import pytest

from bundlekit import engine_script, make_bundle_dir, make_bundle_zip
from stoker.daemon.bundles.installed import PREVIOUS, find_installed
from stoker.daemon.cli.install import install_file
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.core.pidlock import acquire_lock
from stoker.states.reasons import ReasonCode
from stoker.store.database import open_store


@pytest.fixture
def paths():
    return StokerPaths.from_env()


def machine(paths: StokerPaths, slot: str):
    store = open_store(paths.db_file)
    try:
        return store.machine(f"install:{slot}"), [
            h.to_state for h in reversed(store.history(machine=f"install:{slot}"))
        ]
    finally:
        store.close()


def test_without_a_daemon_the_install_machine_runs_here(tmp_path, paths):
    zip_path = make_bundle_zip(tmp_path, "a.zip", smoke_tokens=None)
    lines: list[str] = []
    installed = install_file(paths, zip_path, progress=lines.append)
    assert installed["root"] == str(paths.bundles_dir / "cpu-avx2")
    assert find_installed(paths, "cpu", "avx2") is not None
    record, states = machine(paths, "cpu-avx2")
    assert record.state == "installed"
    # The daemon's steps, recorded; installed only once the slot holds it (promoting first).
    assert states[-4:] == ["validating", "smoke_testing", "promoting", "installed"]
    assert any("no daemon runs" in line for line in lines)
    os.close(acquire_lock(paths.lock_file))  # released: a daemon may start now
    assert sorted(p.name for p in paths.bundles_dir.iterdir()) == ["cpu-avx2"]  # no staging left


def test_another_local_bundle_replaces_the_slot_and_the_first_reinstalls(tmp_path, paths):
    """The machine knows which bundle is in the slot: installing the first zip again after a
    second one is a real install, not "already installed"."""
    first = make_bundle_zip(tmp_path, "a.zip", smoke_tokens=None)
    second = make_bundle_zip(tmp_path, "b.zip", smoke_tokens=None)
    install_file(paths, first)
    lib = "bin/libggml-fake.so"
    first_lib = (paths.bundles_dir / "cpu-avx2" / lib).read_bytes()
    install_file(paths, second)
    assert (paths.bundles_dir / ("cpu-avx2" + PREVIOUS) / lib).read_bytes() == first_lib
    install_file(paths, first)
    assert (paths.bundles_dir / "cpu-avx2" / lib).read_bytes() == first_lib


def test_a_directory_is_installed_through_the_same_machine(tmp_path, paths):
    src = make_bundle_dir(tmp_path / "dir", variant="compat", smoke_tokens=None)
    assert install_file(paths, src)["variant"] == "compat"
    assert machine(paths, "cpu-compat")[0].state == "installed"


def test_a_directory_with_a_link_is_refused_before_anything_runs(tmp_path, paths):
    src = make_bundle_dir(tmp_path / "dir", smoke_tokens=None)
    (src / "bin" / "libextra.so").symlink_to("/etc/passwd")
    with pytest.raises(StokerError) as err:
        install_file(paths, src)
    assert err.value.reason == ReasonCode.BUNDLE_UNSAFE_ARCHIVE and err.value.evidence["path"] == "bin/libextra.so"
    assert not paths.bundles_dir.exists() or not any(paths.bundles_dir.iterdir())


def test_a_bad_bundle_fails_with_the_cause_and_leaves_the_slot(tmp_path, paths):
    install_file(paths, make_bundle_zip(tmp_path, "good.zip", smoke_tokens=None))
    bad = make_bundle_zip(tmp_path, "bad.zip", smoke_tokens=None, script=engine_script(build=1))  # stamped 11434
    with pytest.raises(StokerError) as err:
        install_file(paths, bad)
    assert err.value.evidence["cause"] == "bundle_metadata_mismatch"
    assert find_installed(paths, "cpu", "avx2") is not None
    assert machine(paths, "cpu-avx2")[0].state == "failed"


def test_the_smoke_test_runs_only_when_asked(tmp_path, paths):
    """A local install smoke-tests when asked (`bundle install --smoke`, `stoker run`), as before:
    this fake engine cannot generate, so only the asked install fails, at smoke_testing."""
    zip_path = make_bundle_zip(tmp_path, "a.zip")  # records reference tokens
    install_file(paths, zip_path)
    with pytest.raises(StokerError) as err:
        install_file(paths, make_bundle_zip(tmp_path, "b.zip"), smoke=True)
    assert err.value.evidence["step"] == "smoke_testing"
