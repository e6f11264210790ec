"""KV snapshots through a real daemon and the real engine: the token-identical gate, every
refusal, a full disk and a daemon killed during a save."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from stoker.daemon.core.errors import StokerError
from tests.integration.daemon_harness import DaemonProcess, servers_for, tiny_config, write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

PROMPT = "hello world, this conversation goes on for a while"  # byte tokens mostly: ~50 of ctx 256
MORE = " and then some more"


@pytest.fixture
def daemon(daemon, model):
    """The integration suite's daemon, with snapshots on."""
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    return daemon


class Engine:
    """The ready server's HTTP API, with the per-launch key from `stoker status`."""

    def __init__(self, status: dict) -> None:
        self.url = status["endpoint"]
        self.headers = {"Authorization": f"Bearer {status['api_key']}"}

    def post(self, path: str, body: dict) -> dict:
        resp = httpx.post(self.url + path, json=body, headers=self.headers, timeout=300)
        assert resp.status_code == 200, resp.text
        return resp.json()

    def tokenize(self, text: str) -> list[int]:
        return self.post("/tokenize", {"content": text})["tokens"]

    def complete(self, tokens: list[int], n: int = 12) -> tuple[list[int], dict]:
        out = self.post(
            "/completion",
            {
                "prompt": tokens,
                "n_predict": n,
                "temperature": 0,
                "cache_prompt": True,
                "return_tokens": True,
                "id_slot": 0,
            },
        )
        return out["tokens"], out["timings"]

    def erase(self, slot: int = 0) -> None:
        self.post(f"/slots/{slot}?action=erase", {})


def relaunched(d: DaemonProcess, old_pid: int, timeout: float = 120) -> dict:
    return d.wait_for(lambda s: s["state"] == "ready" and s["pid"] != old_pid, timeout, "a relaunched server")


def gate(d: DaemonProcess, n: int = 12, prompt: str = PROMPT) -> dict:
    """Greedy continuation after restart + restore == the same server's uninterrupted one."""
    st = d.wait_state("ready", timeout=300)
    eng = Engine(st)
    first = eng.tokenize(prompt)
    gen1, _ = eng.complete(first, n)
    second = first + gen1 + eng.tokenize(MORE)
    reference, _ = eng.complete(second, n)  # uninterrupted: the slot's cache carries req 1
    eng.erase()
    again, _ = eng.complete(first, n)
    assert again == gen1
    d.call("restart")  # saves slot 0 (cause restart), relaunches, restores before ready
    st = relaunched(d, st["pid"], 300)
    report = st["snapshots"]
    assert report["enabled"] and report["benefit"] and len(report["restored"]) == 1, report
    assert report["restored"][0]["n_tokens"] >= len(first)
    eng = Engine(st)
    after, timings = eng.complete(second, n)
    assert after == reference
    # Only the new tokens were processed: the restored cache served the rest.
    assert timings["prompt_n"] <= len(second) - len(first), timings
    listed = d.call("snapshot.list")["snapshots"]
    assert listed[0]["cause"] == "restart" and listed[0]["fits_server"] is True
    return st


def test_gate_tiny_model_token_identical_after_restart(daemon):
    daemon.start()
    gate(daemon)


@pytest.mark.gemma
@pytest.mark.slow
def test_gate_gemma_token_identical_after_restart(stoker_home, installed_cpu_bundle):
    """Gemma 3 is a sliding-window model: the conversation is longer than its 512-token window,
    and Stoker must have added --swa-full for the restore to spare the prefill."""
    from tests.model_files import model_file

    d = DaemonProcess(stoker_home)
    model = model_file("gemma3-270m", d.paths)
    write_config(
        d.paths, tiny_config(model, snapshots=True, ctx_size=2048, stall_timeout_s=120.0, ready_timeout_s=300.0)
    )
    d.start()
    try:
        long_prompt = " ".join(["The river carried the old boat past the mill and the quiet town."] * 50)
        st = gate(d, n=16, prompt=long_prompt)
        report = st["snapshots"]
        assert report["swa_full"] is True and report["model"]["sliding_window"] == 512
        assert report["swa_full_cost_mib"] > 0 and report["kv_mib_with_swa_full"] > report["kv_mib_without_swa_full"]
    finally:
        d.stop()


def _saved(d: DaemonProcess) -> dict:
    st = d.wait_state("ready")
    eng = Engine(st)
    eng.complete(eng.tokenize(PROMPT), 8)
    saved = d.call("snapshot.save")["saved"]
    assert len(saved) == 1 and saved[0]["slot_id"] == 0 and saved[0]["cause"] == "manual"
    return saved[0]


def _refused(d: DaemonProcess, reason: str, **params) -> dict:
    with pytest.raises(StokerError) as err:
        d.call("snapshot.restore", **params)
    assert err.value.reason == reason, err.value.to_dict()
    st = d.call("status")
    assert st["state"] == "ready"  # a refusal never breaks the server
    Engine(st).complete(Engine(st).tokenize("still serving"), 2)
    return err.value.evidence


def test_refused_tampered_truncated_bad_slot_and_engine(daemon):
    daemon.start()
    snap = _saved(daemon)
    path = daemon.paths.snapshots_dir / snap["filename"]
    good = path.read_bytes()
    assert good[:4] == b"qsgg"  # the engine's magic 'ggsq', little-endian
    same = daemon.call("snapshot.restore", id=snap["id"])
    assert same["n_tokens"] == snap["n_tokens"] and same["saved_on"] == same["restored_on"] == "cpu"
    assert same["cross_backend"] is False and same.get("note") is None
    # Saved by another backend's build of the same engine (a CUDA server before a fallback):
    # restored, and the result says the continuation is this backend's arithmetic.
    with sqlite3.connect(daemon.paths.db_file) as db:
        db.execute("update snapshots set backend = 'cuda' where id = ?", [snap["id"]])
    crossed = daemon.call("snapshot.restore", id=snap["id"])
    assert crossed["n_tokens"] == snap["n_tokens"] and crossed["cross_backend"] is True
    assert crossed["note"].startswith("saved on cuda, restored on cpu") and "near-tied" in crossed["note"]
    with sqlite3.connect(daemon.paths.db_file) as db:
        db.execute("update snapshots set backend = 'cpu' where id = ?", [snap["id"]])
    # Bad slot ids: the engine would wrap 1 onto slot 0 (id % n_slots).
    assert _refused(daemon, "snapshot_bad_slot", id=snap["id"], slot=1)["n_slots"] == 1
    _refused(daemon, "snapshot_bad_slot", id=snap["id"], slot=-1)
    _refused(daemon, "snapshot_not_found", id=snap["id"] + 100)
    # Tampered: same size, one byte flipped.
    path.write_bytes(good[:-10] + bytes([good[-10] ^ 0xFF]) + good[-9:])
    ev = _refused(daemon, "snapshot_corrupt", id=snap["id"])
    assert ev["digest_matches"] is False and ev["found_size"] == len(good)
    # Truncated.
    path.write_bytes(good[: len(good) // 2])
    assert _refused(daemon, "snapshot_corrupt", id=snap["id"])["found_size"] == len(good) // 2
    path.write_bytes(good)
    # Another engine build in the catalogue: refused before the engine sees it.
    with sqlite3.connect(daemon.paths.db_file) as db:
        db.execute("update snapshots set engine_build = 'b1 build 1 commit other' where id = ?", [snap["id"]])
    _refused(daemon, "snapshot_engine_mismatch", id=snap["id"])


def test_engine_refusal_clears_the_slot_and_the_server_keeps_serving(daemon):
    daemon.start()
    snap = _saved(daemon)
    path = daemon.paths.snapshots_dir / snap["filename"]
    # A file that passes Stoker's checks (its catalogue row is rewritten to match) but not the engine's.
    bad = b"qsgg" + b"\x04\x00\x00\x00" + b"\xff\xff\xff\x7f" + b"\x00" * 64
    path.write_bytes(bad)
    import hashlib

    with sqlite3.connect(daemon.paths.db_file) as db:
        db.execute(
            "update snapshots set file_size = ?, file_sha256 = ? where id = ?",
            [len(bad), hashlib.sha256(bad).hexdigest(), snap["id"]],
        )
    ev = _refused(daemon, "snapshot_restore_failed", id=snap["id"])
    assert ev["status"] == 400
    slots = httpx.get(
        daemon.call("status")["endpoint"] + "/slots", headers=Engine(daemon.call("status")).headers, timeout=30
    ).json()
    assert slots[0]["is_processing"] is False


def test_refused_after_ctx_parallel_and_model_change(daemon, model, tmp_path):
    daemon.start()
    snap = _saved(daemon)
    # Context size changed: the relaunched server refuses the snapshot on its own (auto) ...
    pid = daemon.call("status")["pid"]
    write_config(daemon.paths, tiny_config(model, snapshots=True, ctx_size=512))
    st = relaunched(daemon, pid)
    assert st["n_ctx"] == 512
    refused = st["snapshots"]["refused"]
    assert refused and refused[0]["reason"] == "snapshot_layout_mismatch"
    assert set(refused[0]["evidence"]["differs"]) == {"n_ctx"}
    # ... and on demand.
    assert "n_ctx" in _refused(daemon, "snapshot_layout_mismatch", id=snap["id"])["differs"]
    # Parallel changed (slot count, and so the context per slot).
    write_config(daemon.paths, tiny_config(model, snapshots=True, parallel=2, ctx_size=512))
    st = relaunched(daemon, st["pid"])
    assert st["snapshots"]["refused"] and st["snapshots"]["restored"] == []
    assert "n_slots" in _refused(daemon, "snapshot_layout_mismatch", id=snap["id"])["differs"]
    # Another model (same architecture and shapes, other weights): the engine would take it.
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    other = write_tiny_model(tmp_path / "other.gguf", seed=7)
    write_config(daemon.paths, tiny_config(other, snapshots=True))
    st = relaunched(daemon, st["pid"])
    assert st["model"] == str(other)
    assert st["snapshots"]["restored"] == [] and st["snapshots"]["refused"] == []  # none for this model
    _refused(daemon, "snapshot_model_mismatch", id=snap["id"])
    listed = daemon.call("snapshot.list")["snapshots"]
    assert {r["why_not"] for r in listed} == {"snapshot_model_mismatch"}
    # Back on the first model and settings: the newest snapshot that fits is restored by itself.
    fits = [r for r in listed if (r["n_ctx"], r["n_slots"]) == (256, 1)]
    assert len(fits) >= 2 and len(listed) > len(fits)
    write_config(daemon.paths, tiny_config(model, snapshots=True))
    st = relaunched(daemon, st["pid"])
    assert [r["id"] for r in st["snapshots"]["restored"]] == [fits[0]["id"]]
    for proc in servers_for(other):
        proc.kill()


def test_a_unified_kv_cache_is_a_different_layout_with_several_slots(daemon, model):
    """Measured: a slot saved from a 2-slot per-slot cache, restored into a 2-slot unified one
    (`-kvu`), makes the engine answer 400 and clear the slot. Stoker refuses it first."""
    write_config(daemon.paths, tiny_config(model, snapshots=True, parallel=2))
    daemon.start()
    snap = _saved(daemon)
    assert snap["n_slots"] == 2 and snap["kv_unified"] is False
    write_config(daemon.paths, tiny_config(model, snapshots=True, parallel=2, extra_args=["-kvu"]))
    st = relaunched(daemon, daemon.call("status")["pid"])
    refused = st["snapshots"]["refused"]
    assert st["snapshots"]["restored"] == [] and refused, st["snapshots"]
    assert {r["reason"] for r in refused} == {"snapshot_layout_mismatch"}
    assert refused[0]["evidence"]["differs"] == {"kv_unified": {"snapshot": False, "server": True}}
    Engine(st).complete(Engine(st).tokenize("still serving"), 2)
    # Back to a per-slot cache: the newest per-slot snapshot comes back by itself, the one the
    # unified server saved on its way out (kv_unified true) is passed over.
    write_config(daemon.paths, tiny_config(model, snapshots=True, parallel=2))
    st = relaunched(daemon, st["pid"])
    listed = daemon.call("snapshot.list")["snapshots"]
    assert [r["kv_unified"] for r in listed][:1] == [True]
    newest_per_slot = next(r["id"] for r in listed if r["kv_unified"] is False)
    assert newest_per_slot > snap["id"]
    assert [r["id"] for r in st["snapshots"]["restored"]] == [newest_per_slot]


def test_retention_and_rm(daemon, model):
    write_config(daemon.paths, tiny_config(model, snapshots={"max_count": 2}))
    daemon.start()
    st = daemon.wait_state("ready")
    eng = Engine(st)
    ids = []
    for i in range(4):
        eng.complete(eng.tokenize(f"{PROMPT} {i}"), 2)
        ids.append(daemon.call("snapshot.save")["saved"][0]["id"])
    listed = daemon.call("snapshot.list")
    assert [r["id"] for r in listed["snapshots"]] == ids[:1:-1]  # the two newest, newest first
    files = sorted(p.name for p in daemon.paths.snapshots_dir.iterdir())
    assert files == sorted(r["filename"] for r in listed["snapshots"])
    assert daemon.call("snapshot.rm", id=ids[-1]) == {"removed": ids[-1]}
    assert [r["id"] for r in daemon.call("snapshot.list")["snapshots"]] == [ids[-2]]
    assert len(list(daemon.paths.snapshots_dir.iterdir())) == 1
    with pytest.raises(StokerError) as err:
        daemon.call("snapshot.rm", id=ids[-1])
    assert err.value.reason == "snapshot_not_found"
    # The CLI with --json.
    env = {**os.environ, "STOKER_HOME": str(daemon.home)}
    stoker = [sys.executable, "-m", "stoker.daemon"]
    out = subprocess.run([*stoker, "snapshot", "list", "--json"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert '"snapshots"' in out.stdout
    bad = subprocess.run([*stoker, "snapshot", "restore", "999", "--json"], env=env, capture_output=True, text=True)
    assert bad.returncode == 1 and "snapshot_not_found" in bad.stdout


def test_down_saves_and_disabled_does_not(daemon, model):
    daemon.start()
    st = daemon.wait_state("ready")
    eng = Engine(st)
    eng.complete(eng.tokenize(PROMPT), 4)
    daemon.call("down")
    rows = daemon.call("snapshot.list")["snapshots"]
    assert [r["cause"] for r in rows] == ["stop"]
    with pytest.raises(StokerError) as err:
        daemon.call("snapshot.save")
    assert err.value.reason == "snapshot_server_not_ready"
    write_config(daemon.paths, tiny_config(model, snapshots=False))
    wait_until(
        lambda: not daemon.call("snapshot.list")["enabled"], timeout=30, what="snapshots turned off by the reload"
    )
    daemon.call("up")
    st = daemon.wait_state("ready")
    assert st["snapshots"] == {"enabled": False}
    Engine(st).complete(Engine(st).tokenize(PROMPT), 4)
    daemon.stop()  # shutdown: snapshots are off, nothing saved
    daemon.start()
    assert len(daemon.call("snapshot.list")["snapshots"]) == 1


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_disk_full_during_save_keeps_the_previous_snapshot(daemon):
    snaps = daemon.paths.snapshots_dir
    if not _mount_tmpfs(snaps, "1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        daemon.start()
        first = _saved(daemon)
        before = (snaps / first["filename"]).read_bytes()
        # Fill the disk, leaving less than the next snapshot needs.
        free = os.statvfs(snaps).f_bavail * os.statvfs(snaps).f_frsize
        (snaps / "filler").write_bytes(b"\0" * max(0, free - 8192))
        eng = Engine(daemon.call("status"))
        eng.complete(eng.tokenize(PROMPT * 3), 8)  # ~150 tokens, ~150 KiB of KV
        with pytest.raises(StokerError) as err:
            daemon.call("snapshot.save")
        assert err.value.reason == "snapshot_disk_full", err.value.to_dict()
        assert (snaps / first["filename"]).read_bytes() == before
        assert [r["id"] for r in daemon.call("snapshot.list")["snapshots"]] == [first["id"]]
        assert sorted(p.name for p in snaps.iterdir()) == sorted([first["filename"], "filler"])  # no partial file
        assert daemon.call("snapshot.restore", id=first["id"])["n_tokens"] == first["n_tokens"]
        assert daemon.call("status")["state"] == "ready"
        (snaps / "filler").unlink()
        daemon.stop()
    finally:
        daemon.stop()
        subprocess.run(["umount", "-l", str(snaps)], capture_output=True)


def test_daemon_killed_during_a_save_leaves_no_half_snapshot(daemon):
    daemon.start()
    first = _saved(daemon)
    st = daemon.call("status")
    server_pid = st["pid"]
    # Freeze the engine so that the next save hangs inside the engine, then kill the daemon.
    os.kill(st["pid"], signal.SIGSTOP)
    errors: list[Exception] = []

    def save() -> None:
        try:
            daemon.call("snapshot.save")
        except Exception as exc:  # the daemon dies under it
            errors.append(exc)

    saver = threading.Thread(target=save)
    saver.start()
    time.sleep(1.0)
    daemon.kill9()
    os.kill(st["pid"], signal.SIGCONT)
    saver.join(30)
    # The resumed engine drops the save whose client died (checked: no file appears), so what
    # a kill can leave comes from two narrow windows, planted here: a kill while the engine
    # writes (a partial file) and one between the rename and the row (an uncatalogued file).
    (daemon.paths.snapshots_dir / "partial-deadbeef.bin").write_bytes(b"half")
    (daemon.paths.snapshots_dir / "slot0-1-abcd.bin").write_bytes(b"orphan")
    daemon.start()
    st = daemon.wait_state("ready")
    assert st["pid"] == server_pid  # adopted: the engine outlived the daemon
    rows = daemon.call("snapshot.list")["snapshots"]
    assert [r["id"] for r in rows] == [first["id"]]
    time.sleep(0.5)  # the resumed engine may still write the partial file it was asked for
    daemon.call("snapshot.save")  # a save cleans up what is not in flight
    names = {p.name for p in daemon.paths.snapshots_dir.iterdir()}
    rows = daemon.call("snapshot.list")["snapshots"]
    assert names == {r["filename"] for r in rows}
    assert not any(n.startswith("partial-") for n in names)


# --- nothing on the ready path reads a whole file; nothing dropped silently ------------------


def test_first_ready_of_a_multi_gb_model_does_not_read_it_whole(daemon, tmp_path):
    """The first ready of a model file used to wait for a sha256 of all of it (12-13 s
    for 13.5 GiB on an H200). A real model padded to 3 GiB (a hole after its tensors; the engine
    loads with `-lm none`, so it reads its tensors and nothing else): after ready, the file is
    still almost entirely out of the page cache, so the daemon read a few MB of it at most."""
    from stoker.daemon.bundles.tinymodel import write_tiny_model
    from stoker.daemon.snapshots.files import resident_fraction

    big = write_tiny_model(tmp_path / "padded.gguf", seed=3)
    with open(big, "r+b") as fh:
        fh.truncate(3 << 30)
    assert resident_fraction(big) < 0.01
    write_config(daemon.paths, tiny_config(big, snapshots=True, extra_args=["-lm", "none"]))
    daemon.start()
    st = daemon.wait_state("ready", timeout=120)
    assert st["snapshots"]["enabled"] and st["snapshots"]["benefit"], st["snapshots"]
    assert resident_fraction(big) < 0.05  # hashed whole, it would be 1.0
    rows = daemon.call("history", machine="launch", limit=20)
    at = {r["event"]: r["at"] for r in reversed(rows)}
    assert at["Ready"] - at["LoadStarted"] < 3.0  # a sha256 of 3 GiB alone takes longer here
    # Snapshots of it work, identified by the model's header and samples.
    eng = Engine(st)
    eng.complete(eng.tokenize(PROMPT), 4)
    (saved,) = daemon.call("snapshot.save")["saved"]
    assert saved["model_id"].startswith("gguf-s1-") and saved["model_sha256"] is None
    assert daemon.call("snapshot.restore", id=saved["id"])["n_tokens"] == saved["n_tokens"]


def test_restore_or_reprefill_is_decided_from_the_figures_and_said(daemon):
    """A restore checks the file's stat facts and a digest of its head and tail (not
    all of it), measures the engine's restore speed, and each ready says per slot whether it
    restored or left the conversation to a re-prefill, with the figures that decided."""
    daemon.start()
    st = daemon.wait_state("ready")
    eng = Engine(st)
    first = eng.tokenize(PROMPT)
    gen, _ = eng.complete(first, 8)
    daemon.call("restart")
    st = relaunched(daemon, st["pid"])
    report = st["snapshots"]
    (decision,) = report["restore_decisions"]
    (restored,) = report["restored"]
    assert decision["choice"] == "restore" and decision["snapshot_id"] == restored["id"]
    assert "no prefill figure" in decision["why"]  # prompts under 64 tokens measure no prefill
    assert restored["checked"] == "stat+sample" and restored["resident"] is not None
    assert report["budgets"]["kv_bytes_per_token"] > 0 and report["budgets"]["max_bytes"] >= 2 << 30
    listed = daemon.call("snapshot.list")["snapshots"]
    model_id = listed[0]["model_id"]
    # The figures that would make a re-prefill clearly faster here (a GPU's prefill against a
    # slow disk): the next server leaves the slot to the next request, and says why.
    with sqlite3.connect(daemon.paths.db_file) as db:
        for name, value in (
            (f"prefill/cpu/{model_id}/le1024", 1e9),
            ("restore/cpu/cache", 0.001),
            ("restore/cpu/disk", 0.001),
            # Whole restores measured at 1000 s a MB (the daemon's side): these decide once kept.
            *(
                (f"restore_wall/cpu/{where}/{moment}", value)
                for where in ("cache", "disk")
                for moment, value in (("x", 1.0), ("y", 1000.0), ("xx", 1.0), ("xy", 1000.0))
            ),
        ):
            db.execute(
                "insert or replace into snapshot_figures (name, value, samples, updated_at) values (?, ?, 5, 0)",
                [name, value],
            )
    daemon.call("restart")
    st = relaunched(daemon, st["pid"])
    report = st["snapshots"]
    (decision,) = report["restore_decisions"]
    assert report["restored"] == [] and decision["choice"] == "reprefill", report
    assert decision["why"].startswith("re-prefilling") and decision["prefill_s_est"] < decision["restore_s_est"]
    assert decision["figures"]["prefill_tok_s"]["le1024"]["value"] == 1e9
    # The conversation goes on: the request re-processes it (nothing was restored).
    again, timings = Engine(st).complete(first, 8)
    assert again == gen and timings["prompt_n"] >= len(first) - 1


def test_retention_says_what_it_drops(daemon, model):
    """Retention and refusals are never silent: status, the event bus and the log."""
    write_config(daemon.paths, tiny_config(model, snapshots={"max_count": 1}))
    daemon.start()
    eng = Engine(daemon.wait_state("ready"))
    eng.complete(eng.tokenize(PROMPT), 2)
    first = daemon.call("snapshot.save")["saved"][0]
    eng.complete(eng.tokenize(PROMPT + MORE), 2)
    second = daemon.call("snapshot.save")["saved"][0]
    (dropped,) = daemon.call("status")["snapshots"]["dropped"]
    assert (dropped["reason"], dropped["why"], dropped["snapshot_id"]) == ("snapshot_dropped", "count", first["id"])
    assert dropped["max_count"] == 1 and dropped["file_size"] == first["file_size"]
    assert [r["id"] for r in daemon.call("snapshot.list")["snapshots"]] == [second["id"]]
    # A byte budget smaller than one snapshot: the save is refused before it is paid for, and said.
    write_config(daemon.paths, tiny_config(model, snapshots={"max_count": 1, "max_bytes": 1000}))
    wait_until(
        lambda: daemon.call("snapshot.list")["max_bytes"] == 1000, timeout=30, what="the new byte budget in force"
    )
    with pytest.raises(StokerError) as err:
        daemon.call("snapshot.save")
    assert err.value.reason == "snapshot_dropped" and err.value.evidence["why"] == "too_big"
    assert err.value.evidence["expected_bytes"] > 1000 == err.value.evidence["max_bytes"]
    refused, rotated = daemon.call("status")["snapshots"]["dropped"][-2:]
    assert (refused["why"], refused["max_bytes"]) == ("too_big", 1000)
    # ... and the snapshot kept so far no longer fits the new budget either: removed, and said.
    assert (rotated["why"], rotated["snapshot_id"], rotated["total_bytes"]) == (
        "bytes",
        second["id"],
        second["file_size"],
    )
    assert daemon.call("snapshot.list")["snapshots"] == []
    log = daemon.output.read_text()
    assert "snapshot_dropped" in log and "too_big" in log
    env = {**os.environ, "STOKER_HOME": str(daemon.home)}
    out = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", "snapshot", "list"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert f"snapshot {second['id']}: snapshot_dropped bytes" in out.stdout and "snapshot_dropped too_big" in out.stdout


def test_a_stop_skips_the_save_that_a_re_prefill_beats_and_says_so(daemon):
    """With figures where re-prefilling the conversation beats saving it and restoring it (a GPU's
    prefill against a slow disk), a restart saves nothing for it and says why, with the estimates."""
    daemon.start()
    st = daemon.wait_state("ready")
    eng = Engine(st)
    eng.complete(eng.tokenize(PROMPT), 4)
    daemon.call("restart")  # the first save measures the save and restore figures
    st = relaunched(daemon, st["pid"])
    saved_before = len(daemon.call("snapshot.list")["snapshots"])
    assert saved_before == 1
    model_id = daemon.call("snapshot.list")["snapshots"][0]["model_id"]
    with sqlite3.connect(daemon.paths.db_file) as db:
        for name, value in ((f"prefill/cpu/{model_id}/le1024", 1e9), ("restore/cpu/cache", 0.001), ("save/cpu", 0.001)):
            db.execute(
                "insert or replace into snapshot_figures (name, value, samples, updated_at) values (?, ?, 5, 0)",
                [name, value],
            )
    eng = Engine(st)
    eng.complete(eng.tokenize(PROMPT + " and again"), 4)
    daemon.call("restart")
    st = relaunched(daemon, st["pid"])
    assert len(daemon.call("snapshot.list")["snapshots"]) == saved_before  # nothing new was saved
    skipped = [d for d in st["snapshots"]["dropped"] if d["reason"] == "snapshot_save_skipped"]
    (entry,) = skipped
    assert entry["choice"] == "skip" and entry["cause"] == "restart", entry
    assert entry["prefill_s_est"] < entry["save_s_est"] + entry["restore_s_est"]
    assert entry["why"].startswith("re-prefilling")


def _stoker(d: DaemonProcess, *args: str) -> str:
    """`stoker ARGS` as a user runs it, against this daemon; its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "stoker.daemon", *args], env=d.env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_drops_and_refusals_are_in_stoker_history(daemon):
    """A snapshot given up is a history row with its reason code: removed on request, and a file
    the restore's checks refused; `stoker snapshot restore` says its times and both estimates."""
    daemon.start()
    snap = _saved(daemon)
    restored = _stoker(daemon, "snapshot", "restore", str(snap["id"]))
    assert f"restored snapshot {snap['id']} into slot 0" in restored and "on the daemon's side" in restored
    assert "estimates: restore ~" in restored and "this command:" in restored, restored
    # The restore was measured whole (the daemon's side), for the next estimate.
    with sqlite3.connect(daemon.paths.db_file) as db:
        walls = {n for (n,) in db.execute("select name from snapshot_figures where name like 'restore_wall/%'")}
    assert {f"restore_wall/cpu/cache/{m}" for m in ("x", "y", "xx", "xy")} <= walls, walls
    path = daemon.paths.snapshots_dir / snap["filename"]
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    _refused(daemon, "snapshot_corrupt", id=snap["id"])
    path.write_bytes(good)
    _stoker(daemon, "snapshot", "rm", str(snap["id"]))
    history = _stoker(daemon, "history", "--machine", "snapshots")
    lines = history.splitlines()
    assert "--rm--> dropped  [snapshot_removed]" in lines[0], history
    assert "--file_check--> refused  [snapshot_corrupt]" in lines[1], history
    rows = daemon.call("history", machine="snapshots")
    assert rows[0]["evidence"]["snapshot_id"] == snap["id"] and rows[0]["kind"] == "snapshot"
