"""A corpus of hostile and broken bundles: each refused with its reason code, nothing written
outside staging. The engine is a shell script, so the whole corpus runs in about a second."""

from __future__ import annotations

import os
import stat
import zipfile
from pathlib import Path

import pytest

from bundlekit import add_raw_entry, engine_script, make_bundle_dir, make_bundle_zip, tree_snapshot
from stoker.daemon.bundles.archive import ArchiveLimits, unpack_bundle
from stoker.daemon.bundles.installed import find_installed, install_bundle, list_installed
from stoker.daemon.bundles.verify import verify_bundle
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.states.reasons import ReasonCode


@pytest.fixture
def paths(stoker_home):
    return StokerPaths.from_env()


def refused(reason, fn, *args, **kwargs) -> StokerError:
    with pytest.raises(StokerError) as err:
        fn(*args, **kwargs)
    assert err.value.reason == reason, err.value.to_dict()
    return err.value


def assert_nothing_installed(paths, workdir: Path, before: set[str]) -> None:
    """No slot, no staging leftovers, and not one new path anywhere around the zip."""
    if paths.bundles_dir.exists():
        assert list(paths.bundles_dir.iterdir()) == []
    assert tree_snapshot(workdir) == before


def flip_byte_in_member(zip_path: Path, member: str) -> None:
    with zipfile.ZipFile(zip_path) as zf:
        info = zf.getinfo(member)
    with open(zip_path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        pos = info.header_offset + 30 + name_len + extra_len + info.compress_size // 2
        f.seek(pos)
        byte = f.read(1)
        f.seek(pos)
        f.write(bytes([byte[0] ^ 0xFF]))


# --- the archive itself -------------------------------------------------------------------


def hostile_zip(tmp_path: Path, name: str, data: bytes = b"owned", mode: int = stat.S_IFREG | 0o644) -> Path:
    zip_path = make_bundle_zip(tmp_path)
    add_raw_entry(zip_path, name, data, mode=mode)
    return zip_path


@pytest.mark.parametrize(
    "entry, mode",
    [
        ("../escaped.txt", stat.S_IFREG | 0o644),
        ("bin/../../escaped.txt", stat.S_IFREG | 0o644),
        ("/tmp/stoker-absolute-escape.txt", stat.S_IFREG | 0o644),
        ("C:/escaped.txt", stat.S_IFREG | 0o644),
        ("bin\\..\\..\\escaped.txt", stat.S_IFREG | 0o644),
        ("bin/link", stat.S_IFLNK | 0o777),
        ("bin/fifo", stat.S_IFIFO | 0o644),
        ("bin/dev", stat.S_IFCHR | 0o644),
        ("bin/LLAMA-SERVER", stat.S_IFREG | 0o755),  # collides on a case-insensitive filesystem
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "drive", "backslash", "symlink", "fifo", "chardev", "casefold-dup"],
)
def test_unsafe_entries_refuse_the_whole_archive(tmp_path, paths, entry, mode):
    data = b"/etc/passwd" if stat.S_ISLNK(mode) else b"owned"
    zip_path = hostile_zip(tmp_path, entry, data, mode)
    before = tree_snapshot(tmp_path)
    refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, install_bundle, zip_path, paths)
    assert_nothing_installed(paths, tmp_path, before)
    assert not Path("/tmp/stoker-absolute-escape.txt").exists()
    assert not (paths.data_dir / "escaped.txt").exists()


def test_symlink_out_of_the_tree_in_a_directory_bundle(tmp_path, paths):
    src = make_bundle_dir(tmp_path / "dir")
    os.symlink("/etc/passwd", src / "bin" / "passwd")
    refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, verify_bundle, src, run_engine=False)
    refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, install_bundle, src, paths)
    assert list(paths.bundles_dir.iterdir()) == []


def test_zip_bomb_is_refused_from_the_central_directory(tmp_path, paths):
    zip_path = make_bundle_zip(tmp_path)
    with zipfile.ZipFile(zip_path, "a", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("bin/bomb", "w") as out:
            chunk = bytes(1 << 20)
            for _ in range(64):
                out.write(chunk)
    before = tree_snapshot(tmp_path)
    err = refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, install_bundle, zip_path, paths)
    assert "zip bomb" in err.message and err.evidence["ratio"] > 200
    assert_nothing_installed(paths, tmp_path, before)


def test_absurd_sizes_and_counts(tmp_path):
    zip_path = make_bundle_zip(tmp_path)
    for limits in (ArchiveLimits(max_entries=2), ArchiveLimits(max_file_size=100), ArchiveLimits(max_total_size=1000)):
        staging = tmp_path / "staging"
        refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, unpack_bundle, zip_path, staging, limits)
        assert list(staging.iterdir()) == []  # refused before anything was written


def test_not_a_zip(tmp_path, paths):
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"PK\x03\x04 this is not really a zip")
    refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, install_bundle, junk, paths)


# --- content and metadata -----------------------------------------------------------------


def test_flipped_byte_inside_the_zip(tmp_path, paths):
    zip_path = make_bundle_zip(tmp_path)
    flip_byte_in_member(zip_path, "bin/libggml-fake.so")
    before = tree_snapshot(tmp_path)
    refused(ReasonCode.BUNDLE_DIGEST_MISMATCH, install_bundle, zip_path, paths)
    assert_nothing_installed(paths, tmp_path, before)


def test_flipped_byte_in_an_unpacked_bundle(tmp_path):
    src = make_bundle_dir(tmp_path / "dir")
    lib = src / "bin" / "libggml-fake.so"
    data = bytearray(lib.read_bytes())
    data[100] ^= 0x01
    lib.write_bytes(bytes(data))
    err = refused(ReasonCode.BUNDLE_DIGEST_MISMATCH, verify_bundle, src)
    assert err.evidence["path"] == "bin/libggml-fake.so"


def test_a_file_replaced_with_a_consistent_zip_crc(tmp_path, paths):
    """A re-zipped tampered file has a valid CRC: only the sha256 in bundle.json catches it."""
    src = make_bundle_dir(tmp_path / "dir")
    (src / "bin" / "libggml-fake.so").write_bytes(b"tampered")
    os.chmod(src / "bin" / "libggml-fake.so", 0o644)
    from stoker.daemon.bundles.archive import pack_bundle

    zip_path = pack_bundle(src, tmp_path / "tampered.zip")
    refused(ReasonCode.BUNDLE_DIGEST_MISMATCH, install_bundle, zip_path, paths)


def test_unlisted_file_is_refused(tmp_path):
    src = make_bundle_dir(tmp_path / "dir")
    (src / "bin" / "libggml-cuda.so").write_bytes(b"sneaky")
    refused(ReasonCode.BUNDLE_DIGEST_MISMATCH, verify_bundle, src)


def test_wrong_backend_and_version(tmp_path, paths):
    zip_path = make_bundle_zip(tmp_path)
    err = refused(ReasonCode.BUNDLE_METADATA_MISMATCH, verify_bundle, zip_path, expect_backend="cuda")
    assert err.evidence["backend"] == {"expected": "cuda", "actual": "cpu"}
    refused(ReasonCode.BUNDLE_METADATA_MISMATCH, verify_bundle, zip_path, expect_version="b1")
    refused(ReasonCode.BUNDLE_METADATA_MISMATCH, install_bundle, zip_path, paths, expect_backend="cuda")
    assert list(paths.bundles_dir.iterdir()) == []


def test_metadata_for_another_platform(tmp_path):
    src = make_bundle_dir(tmp_path / "dir", platform="darwin-arm64")
    refused(ReasonCode.BUNDLE_METADATA_MISMATCH, verify_bundle, src)


def test_build_stamp_that_disagrees_with_metadata(tmp_path):
    src = make_bundle_dir(tmp_path / "dir", script=engine_script(build=1))
    err = refused(ReasonCode.BUNDLE_METADATA_MISMATCH, verify_bundle, src)
    assert err.evidence["actual"]["build"] == "1"


def test_missing_binary(tmp_path, paths):
    src = make_bundle_dir(tmp_path / "dir")
    (src / "bin" / "llama-server").unlink()
    from stoker.daemon.bundles.archive import pack_bundle

    zip_path = pack_bundle(src, tmp_path / "nobinary.zip")
    err = refused(ReasonCode.BUNDLE_VERIFY_FAILED, install_bundle, zip_path, paths)
    assert err.evidence["path"] == "bin/llama-server"
    assert list(paths.bundles_dir.iterdir()) == []


def test_missing_bundle_json(tmp_path, paths):
    src = make_bundle_dir(tmp_path / "dir")
    (src / "bundle.json").unlink()
    refused(ReasonCode.BUNDLE_VERIFY_FAILED, verify_bundle, src)


def test_garbage_bundle_json(tmp_path):
    src = make_bundle_dir(tmp_path / "dir")
    (src / "bundle.json").write_text('{"schema_version": 1, "backend": ')
    refused(ReasonCode.BUNDLE_METADATA_MISMATCH, verify_bundle, src)


# --- engines that crash -------------------------------------------------------------------


@pytest.mark.parametrize("step", ["version", "devices"])
def test_engine_dying_of_sigill_is_cpu_illegal_instruction(tmp_path, paths, step):
    zip_path = make_bundle_zip(tmp_path, script=engine_script(crash_on=step, sig="ILL"))
    before = tree_snapshot(tmp_path)
    err = refused(ReasonCode.CPU_ILLEGAL_INSTRUCTION, install_bundle, zip_path, paths)
    assert err.evidence["signal"] == "SIGILL" and err.evidence["step"] == step
    assert "log_tail" in err.evidence
    assert_nothing_installed(paths, tmp_path, before)


def test_engine_dying_of_sigill_during_the_smoke_run(tmp_path):
    src = make_bundle_dir(tmp_path / "dir", script=engine_script(crash_on="serve", sig="ILL"))
    err = refused(ReasonCode.CPU_ILLEGAL_INSTRUCTION, verify_bundle, src, smoke=True)
    assert "main: loading model" in err.evidence["log_tail"]  # the engine's last lines


@pytest.mark.parametrize("step", ["version", "devices", "serve"])
def test_engine_dying_of_sigsegv_is_a_verify_failure(tmp_path, step):
    src = make_bundle_dir(tmp_path / "dir", script=engine_script(crash_on=step, sig="SEGV"))
    err = refused(ReasonCode.BUNDLE_VERIFY_FAILED, verify_bundle, src, smoke=True)
    assert err.evidence["signal"] == "SIGSEGV"


def test_cpu_bundle_whose_engine_shows_a_gpu_is_refused(tmp_path):
    src = make_bundle_dir(
        tmp_path / "dir", script=engine_script(devices="  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)")
    )
    refused(ReasonCode.BUNDLE_VERIFY_FAILED, verify_bundle, src)


def test_cuda_signature_is_matched(tmp_path):
    line = "  CUDA0: NVIDIA H200 (143155 MiB, 142629 MiB free)"
    src = make_bundle_dir(tmp_path / "ok", backend="cuda", script=engine_script(devices=line))
    assert verify_bundle(src, expect_backend="cuda").devices == (line,)
    no_gpu = make_bundle_dir(tmp_path / "none", backend="cuda")
    refused(ReasonCode.BUNDLE_VERIFY_FAILED, verify_bundle, no_gpu)


# --- the good path ------------------------------------------------------------------------


def test_good_fake_bundle_installs_and_keeps_the_previous(tmp_path, paths):
    first = make_bundle_zip(tmp_path, "first.zip")
    second = make_bundle_zip(tmp_path, "second.zip")
    report = verify_bundle(first, expect_backend="cpu", expect_version="b11434")
    assert report.steps == ("files", "metadata", "version", "devices")
    a = install_bundle(first, paths)
    assert a.root == paths.bundles_dir / "cpu-avx2" and a.server.is_file()
    b = install_bundle(second, paths)
    assert (paths.bundles_dir / "cpu-avx2.previous").is_dir()
    names = sorted(p.name for p in paths.bundles_dir.iterdir())
    assert names == ["cpu-avx2", "cpu-avx2.previous"]  # no staging left behind
    assert [x.root for x in list_installed(paths)] == [b.root]
    assert find_installed(paths, "cpu", "avx2").root == b.root
    assert find_installed(paths, "cuda") is None


def test_a_slot_lost_between_renames_falls_back_to_previous(tmp_path, paths):
    install_bundle(make_bundle_zip(tmp_path, "a.zip"), paths)
    install_bundle(make_bundle_zip(tmp_path, "b.zip"), paths)
    import shutil

    shutil.rmtree(paths.bundles_dir / "cpu-avx2")
    found = find_installed(paths, "cpu", "avx2")
    assert found is not None and found.root.name == "cpu-avx2.previous"


def test_find_installed_prefers_a_safe_variant_and_never_native(tmp_path, paths, monkeypatch):
    from stoker.daemon.bundles import installed

    install_bundle(make_bundle_zip(tmp_path, "n.zip", variant="native", cpu_requires=("native",)), paths)
    monkeypatch.setattr(installed, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "bmi2", "avx", "sse4_2"}))
    assert find_installed(paths, "cpu") is None
    assert find_installed(paths, "cpu", "native") is not None
    install_bundle(make_bundle_zip(tmp_path, "c.zip", variant="compat"), paths)
    assert find_installed(paths, "cpu").meta.variant == "compat"
    install_bundle(make_bundle_zip(tmp_path, "a.zip", variant="avx2", cpu_requires=("avx2",)), paths)
    assert find_installed(paths, "cpu").meta.variant == "avx2"
    monkeypatch.setattr(installed, "cpu_flags", lambda: frozenset({"sse4_2"}))
    assert find_installed(paths, "cpu").meta.variant == "compat"


@pytest.mark.parametrize(
    "entry",
    ["/".join(["d"] * 2000) + "/f", "bin/" + "x" * 300, "/".join(["deep"] * 60) + "/f"],
    ids=["2000-levels", "long-component", "60-levels"],
)
def test_absurdly_deep_or_long_entry_paths_are_refused_not_a_crash(tmp_path, paths, entry):
    """A 2000-level nested entry path crashed the installer with RecursionError
    (Path.mkdir(parents=True) recurses once per level); it is judged with the other names."""
    zip_path = hostile_zip(tmp_path, entry)
    before = tree_snapshot(tmp_path)
    err = refused(ReasonCode.BUNDLE_UNSAFE_ARCHIVE, install_bundle, zip_path, paths)
    assert "too deep or too long" in err.message
    assert_nothing_installed(paths, tmp_path, before)
