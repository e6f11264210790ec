"""promote: the one way a bundle enters its slot, for `install_bundle` and the install service.

What a crash must never leave: a slot whose names exist without their data. So every staged
file and directory is fsynced before the rename that makes the bundle launchable, and the
bundles directory after it (the old `install_bundle` renamed without either).
"""

from __future__ import annotations

import os

import pytest

from bundlekit import make_bundle_dir, make_bundle_zip
from stoker.daemon.bundles import installed
from stoker.daemon.bundles.installed import PREVIOUS, install_bundle, promote
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode


@pytest.fixture
def paths():
    p = StokerPaths.from_env()
    p.bundles_dir.mkdir(parents=True, exist_ok=True)
    return p


@pytest.fixture
def disk_log(monkeypatch):
    """What reached the disk, in order: ("fsync", path) and ("replace", src, dst)."""
    log: list[tuple[str, ...]] = []
    real_fsync, real_open, real_replace = os.fsync, os.open, os.replace
    opened: dict[int, str] = {}

    def tracking_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = os.path.realpath(path)
        return fd

    def tracking_fsync(fd):
        log.append(("fsync", opened.get(fd, f"fd {fd}")))
        real_fsync(fd)

    def tracking_replace(src, dst):
        log.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "fsync", tracking_fsync)
    monkeypatch.setattr(os, "replace", tracking_replace)
    return log


def test_every_staged_file_is_on_disk_before_the_rename(tmp_path, paths, disk_log):
    staged = make_bundle_dir(paths.bundles_dir / ".staging-test" / "bundle")
    files = {os.path.realpath(os.path.join(d, f)) for d, _, fs in os.walk(staged) for f in fs}
    dirs = {os.path.realpath(d) for d, _, _ in os.walk(staged)}
    bundle = promote(staged, paths.bundles_dir)
    assert bundle.root == paths.bundles_dir / "cpu-avx2"
    rename = disk_log.index(("replace", os.path.realpath(staged), os.path.realpath(bundle.root)))
    synced_before = {entry[1] for entry in disk_log[:rename] if entry[0] == "fsync"}
    assert files | dirs <= synced_before
    assert ("fsync", os.path.realpath(paths.bundles_dir)) in disk_log[rename:]


def test_install_bundle_and_a_second_install_keep_the_previous(tmp_path, paths, disk_log):
    first = install_bundle(make_bundle_zip(tmp_path, "a.zip"), paths)
    install_bundle(make_bundle_zip(tmp_path, "b.zip"), paths)
    slot = os.path.realpath(first.root)
    assert ("replace", slot, slot + PREVIOUS) in disk_log  # the old slot kept, by rename
    assert sum(1 for e in disk_log if e == ("fsync", os.path.realpath(paths.bundles_dir))) == 2


def test_a_resumed_promote_finds_the_rename_done(tmp_path, paths):
    staged = make_bundle_dir(paths.bundles_dir / ".install-cpu-avx2" / "bundle")
    promote(staged, paths.bundles_dir, slot="cpu-avx2")
    again = promote(staged, paths.bundles_dir, slot="cpu-avx2")  # the daemon died after the rename
    assert again.root == paths.bundles_dir / "cpu-avx2"


def test_a_staged_bundle_for_another_slot_is_refused(tmp_path, paths):
    staged = make_bundle_dir(paths.bundles_dir / ".install-cpu-compat" / "bundle", variant="avx2")
    with pytest.raises(StokerError) as err:
        promote(staged, paths.bundles_dir, slot="cpu-compat")
    assert err.value.reason == ReasonCode.BUNDLE_METADATA_MISMATCH
    assert not (paths.bundles_dir / "cpu-avx2").exists() and staged.is_dir()
    assert installed.find_installed(paths, "cpu") is None
