"""The daemon must not die of the disk: a full disk, a read-only database, refusals at start-up.

The real thing, not a stub: STOKER_HOME's data directory (the database, the logs, the bundle)
is a small tmpfs mounted for the test, filled to the last byte while a real daemon serves a
real llama-server. Mounting needs CAP_SYS_ADMIN (root here; a privileged CI container): where
it is refused, the tests that need it skip and say so.
"""

from __future__ import annotations

import errno
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stoker.daemon.engine.chat import chat_once
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

DISK_SIZE = "48m"  # the CPU bundle (~20 MB unpacked), the database and the logs fit with room


def _mount(args: list[str], what: str) -> None:
    result = subprocess.run(["mount", *args], capture_output=True, text=True)
    if result.returncode != 0:
        pytest.skip(
            f"cannot {what} here ({result.stderr.strip() or result.returncode}): this scenario needs "
            f"CAP_SYS_ADMIN (root, or a privileged CI container)"
        )


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path) -> int:
    """Fill the filesystem to its last byte (the free tails of the log files' pages included, so
    that even a short line cannot be appended); the bytes it took."""
    taken = 0
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for block in (1 << 20, 4096, 1):
            while True:
                try:
                    taken += os.write(fd, b"\0" * block)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC, exc
                    break
    finally:
        os.close(fd)
    for log in (disk / "logs").glob("*"):
        fd = os.open(log, os.O_WRONLY | os.O_APPEND)
        try:
            while True:
                os.write(fd, b"\n")
        except OSError:
            pass
        finally:
            os.close(fd)
    return taken


def free(disk: Path) -> None:
    (disk / "filler").unlink()


def db_rows(d: DaemonProcess) -> list[tuple[str, str, str]]:
    """The transitions the database file holds (what a crash now would keep), oldest first."""
    with sqlite3.connect(f"file:{d.paths.db_file}?mode=ro", uri=True) as db:
        rows = db.execute("select machine_id, event, to_state from transitions order by id").fetchall()
    db.close()
    return rows


def assert_serves(st: dict) -> None:
    answer = chat_once(st["endpoint"], st["api_key"], "Hello", max_tokens=4, timeout=60)
    assert answer["tokens"] >= 1


@pytest.fixture
def small_disk(stoker_home):
    data = stoker_home / "data"
    data.mkdir(parents=True, exist_ok=True)
    _mount(["-t", "tmpfs", "-o", f"size={DISK_SIZE},mode=0700", "tmpfs", str(data)], "mount a tmpfs")
    yield data
    _umount(data)


@pytest.fixture
def disk_daemon(small_disk, stoker_home, cpu_bundle, model):
    """A daemon whose data directory is the small disk (installed there after it was mounted)."""
    from stoker.daemon.bundles.installed import install_bundle

    d = DaemonProcess(stoker_home)
    install_bundle(cpu_bundle, d.paths)
    # Stable after 2 s: the timer's transition is what killed the daemon 30 s into a full disk.
    write_config(d.paths, tiny_config(model).replace("stable_after_s = 30", "stable_after_s = 2"))
    yield d
    d.stop()
    leftovers = servers_for(model)
    for proc in leftovers:
        proc.kill()
    assert not leftovers, f"servers left behind: {[p.pid for p in leftovers]}"


def wait_unwritable(d: DaemonProcess, timeout: float = 60.0) -> dict:
    """Push transitions (fresh probes) until one cannot be written; the status that says so."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = d.call("status")
        if not st["store"]["writable"]:
            return st
        assert d.proc is not None and d.proc.poll() is None, f"the daemon died:\n{d.log_text()[-3000:]}"
        d.call("probe", fresh=True)
        time.sleep(0.2)
    raise AssertionError(f"the full disk never refused a write; last status {st['store']}")


def test_a_full_disk_leaves_the_daemon_serving_and_the_transitions_catch_up(disk_daemon, small_disk):
    d = disk_daemon.start()
    ready = d.wait_state("ready")
    written_before = len(db_rows(d))
    fill(small_disk)
    st = wait_unwritable(d)
    time.sleep(3)  # the Stable timer (2 s) fires on the full disk: this is what killed the daemon
    assert d.proc.poll() is None, f"the daemon died on a full disk:\n{d.log_text()[-3000:]}"
    st = d.call("status")
    assert (st["state"], st["pid"]) == ("ready", ready["pid"])
    assert st["store"]["reason"] == "store_write_failed" and "full" in st["store"]["error"]
    assert st["store"]["pending"] >= 1 and "cannot be written" in st["store"]["message"]
    assert_serves(st)
    # The CLI says it too.
    out = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "status"], env=d.env, capture_output=True, text=True, timeout=30
    ).stdout
    assert "store     store_write_failed: The state database" in out
    # History shows what happened while the disk was full (held in memory: no id yet).
    held = [row for row in d.history(limit=200) if row["id"] is None]
    assert len(held) == st["store"]["pending"] >= 1
    free(small_disk)
    st = d.wait_for(lambda s: s["store"]["writable"], 30, "the held-back transitions written")
    assert st["store"]["pending"] == 0 and st["state"] == "ready"
    rows = db_rows(d)
    assert len(rows) >= written_before + len(held)
    assert ("launch", "Stable", "ready") in rows[written_before:]
    assert [r["id"] for r in d.history(limit=200)] == sorted((r["id"] for r in d.history(limit=200)), reverse=True)


def test_a_server_crash_on_a_full_disk_is_a_reason_not_a_dead_daemon(disk_daemon, small_disk, model):
    d = disk_daemon.start()
    ready = d.wait_state("ready")
    fill(small_disk)
    os.kill(ready["pid"], 9)
    st = d.wait_state("failed", 60)
    assert d.proc.poll() is None, f"the daemon died:\n{d.log_text()[-3000:]}"
    # Not server_spawn_failed's "reinstall the bundle": the log cannot be written, and it says so.
    assert st["reason"] == "server_files_unwritable", st
    assert "llama-server.log" in st["message"] and "No space left on device" in st["message"]
    assert "reinstall" not in st["message"]
    assert servers_for(model) == []
    free(small_disk)
    assert d.call("up")
    st = d.wait_state("ready", 60)
    assert_serves(st)
    d.wait_for(lambda s: s["store"]["writable"] and s["store"]["pending"] == 0, 30, "the transitions written")
    events = [(m, e) for m, e, _to in db_rows(d)]
    assert ("launch", "ServerExited") in events and ("launch", "SpawnFailed") in events


def test_a_read_only_database_at_start_is_survived_and_catches_up(daemon):
    """The database file is read-only (a bind mount: root ignores chmod); the daemon starts, serves,
    says store_write_failed, and writes everything once the file is writable again."""
    d = daemon.start()
    d.wait_state("ready")
    d.stop()
    db = str(d.paths.db_file)
    written_before = len(db_rows(d))
    _mount(["--bind", db, db], "bind-mount the database")
    try:
        _mount(["-o", "remount,ro,bind", db], "remount the database read-only")
        d.start()
        st = d.wait_for(lambda s: not s["store"]["writable"], 60, "the read-only database refusing a write")
        assert "readonly" in st["store"]["error"]
        st = d.wait_state("ready")
        assert_serves(st)
        assert len(db_rows(d)) == written_before  # nothing reached the file
    finally:
        _umount(Path(db))
    st = d.wait_for(lambda s: s["store"]["writable"], 30, "the held-back transitions written")
    assert st["store"]["pending"] == 0
    rows = db_rows(d)
    assert ("launch", "Ready", "ready") in rows[written_before:]


# --- start-up refusals: one line, the right reason --------------------------------------------


def start_and_fail(d: DaemonProcess) -> str:
    d.start(wait=False)
    assert d.proc is not None
    assert d.proc.wait(60) == 1
    return d.log_text()


def test_a_refusal_inside_the_root_nursery_is_one_line_with_its_reason(tmp_path_factory):
    """A socket path too long for a Unix socket is refused by the control service, inside trio's
    nursery: that printed a 70-line ExceptionGroup traceback, with internal_error."""
    home = tmp_path_factory.mktemp("h") / ("x" * 90)
    d = DaemonProcess(home)
    out = start_and_fail(d)
    assert "Traceback" not in out and "ExceptionGroup" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error [")]
    assert len(errors) == 1 and errors[0].startswith("error [runtime_dir_unusable]: The control socket path"), out


def test_a_read_only_data_dir_is_refused_in_one_line(small_disk, stoker_home, tmp_path):
    _mount(["-o", "remount,ro", str(small_disk)], "remount the tmpfs read-only")
    d = DaemonProcess(stoker_home)
    d.output = tmp_path / "daemon-output.log"  # not in the read-only data dir
    out = start_and_fail(d)
    assert "Traceback" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error [")]
    assert len(errors) == 1 and errors[0].startswith("error [data_dir_unwritable]: ") and "Read-only" in errors[0]


def test_stoker_run_reports_the_daemons_own_reason(stoker_home):
    from stoker.daemon.cli.run import start_daemon
    from stoker.daemon.core.errors import StokerError
    from stoker.daemon.core.paths import StokerPaths

    paths = StokerPaths.from_env()
    paths.data_dir.mkdir(parents=True)
    paths.db_file.write_bytes(b"not a database, not at all" * 100)
    with pytest.raises(StokerError) as info:
        start_daemon(paths, as_json=True)
    assert info.value.reason == "store_corrupt"  # not internal_error
    assert str(paths.db_file) in info.value.message


# --- the logs are capped ----------------------------------------------------------------------


def test_the_server_log_is_rotated_and_a_long_running_one_trimmed(daemon, model):
    """A launch rotates an oversized log; a serving server's log is trimmed to the cap, and
    the launch's own lines (which the KV layout is read from) are kept."""
    logs = daemon.paths.logs_dir
    logs.mkdir(parents=True, exist_ok=True)
    (logs / "llama-server.log").write_bytes(b"old line\n" * 20_000)  # 180 KB, over a 64 KiB cap
    write_config(daemon.paths, tiny_config(model) + "[logs]\nmax_bytes = 65536\nkeep = 2\n")
    d = daemon.start()
    st = d.wait_state("ready")
    log = Path(st["log_path"])
    assert (logs / "llama-server.log.1").read_bytes().startswith(b"old line\n")
    assert log.stat().st_mode & 0o777 == 0o600
    # A chatty server: grow the live log past the cap (as its request lines would).
    with open(log, "ab") as fh:
        fh.write(b"request line\n" * 10_000)
    wait_until(lambda: log.stat().st_size < 65536, timeout=30, what="the live log trimmed under its cap", tick=0.5)
    text = log.read_text(errors="replace")
    assert "==== stoker: launch " in text and "llama_kv_cache" in text and "log trimmed" in text
    assert (logs / "llama-server.log.1").read_bytes().count(b"request line\n") == 10_000
    assert sorted(p.name for p in logs.glob("llama-server.log*")) == [
        "llama-server.log",
        "llama-server.log.1",
        "llama-server.log.2",
    ]
    assert_serves(st)


def test_the_daemon_writes_its_own_log_file_privately(daemon):
    d = daemon.start()  # returns once the socket answers: "daemon ready" is logged just after
    log = d.paths.logs_dir / "daemon.log"
    wait_until(lambda: "daemon ready" in log.read_text(), timeout=10, what="'daemon ready' in the daemon's own log")
    assert log.stat().st_mode & 0o777 == 0o600


def test_the_daemon_log_is_rotated_and_quiet_on_a_full_disk(small_disk, capsys):
    import logging

    from stoker.daemon.core.logfiles import DaemonLogHandler, LogRotation

    logs = small_disk / "logs"
    handler = DaemonLogHandler(logs / "daemon.log", LogRotation(max_bytes=65536, keep=2))
    logger = logging.getLogger("test.daemon.log")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(3000):
            logger.warning("line %d %s", i, "x" * 60)
        names = sorted(p.name for p in logs.glob("daemon.log*"))
        assert names == ["daemon.log", "daemon.log.1", "daemon.log.2"]  # two generations kept
        assert all(p.stat().st_size <= 65536 and p.stat().st_mode & 0o777 == 0o600 for p in logs.glob("daemon.log*"))
        fill(small_disk)
        for i in range(50):
            logger.warning("on a full disk %d %s", i, "y" * 4000)
        err = capsys.readouterr().err
        # One line says the log cannot be written; no traceback per record.
        assert err.count("cannot write the daemon log") == 1 and "Traceback" not in err
    finally:
        logger.removeHandler(handler)
        handler.close()
