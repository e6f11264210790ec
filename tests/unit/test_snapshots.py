"""KV snapshots without the engine: catalogue, retention, identity, log facts, GGUF facts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from stoker.daemon.core.errors import StokerError
from stoker.daemon.models.facts import facts_from_header, model_facts, read_header
from stoker.daemon.snapshots.layout import KVLog, check_identity, swa_report
from stoker.states.reasons import ReasonCode
from stoker.states.snapshots.policy import Figure
from stoker.store import open_store
from stoker.store.snapshots import SnapshotCatalog, retention_victims
from tests.waits import until

IDENTITY = {
    "instance": "default",
    "model_id": "gguf-s1-" + "m" * 64,
    "model_sha256": None,
    "engine_build": "b1 build 1 commit x source y",
    "n_ctx": 256,
    "n_slots": 1,
    "flash_attn": "on",
    "cache_type_k": "f16",
    "cache_type_v": "f16",
    "swa_full": False,
    "kv_unified": False,
}


def _row(slot=0, size=100, at=1.0, model=IDENTITY["model_id"], **extra):
    return {
        "filename": f"slot{slot}-{int(at * 1000)}-ab.bin",
        "slot_id": slot,
        "model_path": "/m.gguf",
        **IDENTITY,
        "model_id": model,
        "backend": "cpu",
        "variant": "avx2",
        "n_tokens": 10,
        "file_size": size,
        "file_sha256": "f" * 64,
        "cause": "stop",
        "save_ms": 1.0,
        "created_at": at,
        **extra,
    }


@pytest.fixture
def catalog():
    store = open_store(":memory:")
    yield SnapshotCatalog(store)
    store.close()


def test_catalogue_round_trip_newest_first(catalog):
    a = catalog.add(_row(at=1.0))
    b = catalog.add(_row(at=2.0, slot=1))
    assert [r.id for r in catalog.list()] == [b.id, a.id]
    assert catalog.list(slot_id=0) == [a]
    assert a.swa_full is False and a.identity() == IDENTITY
    catalog.remove([a.id])
    assert catalog.get(a.id) is None and catalog.filenames() == {b.filename}


def test_model_digest_cache_is_keyed_by_size_and_mtime(catalog):
    catalog.remember_digest("/m.gguf", 10, 5, "abc")
    assert catalog.cached_digest("/m.gguf", 10, 5) == "abc"
    assert catalog.cached_digest("/m.gguf", 10, 6) is None  # touched: computed again
    assert catalog.cached_digest("/m.gguf", 11, 5) is None


def test_retention_keeps_newest_per_slot_and_model_within_count(catalog):
    recs = [catalog.add(_row(at=float(i))) for i in range(5)]
    other_slot = catalog.add(_row(slot=1, at=0.5))
    other_model = catalog.add(_row(model="n" * 64, at=0.1))
    victims = retention_victims(catalog.list(), max_count=2, max_bytes=10**9)
    assert sorted(v.id for v in victims) == [r.id for r in recs[:3]]
    assert other_slot not in victims and other_model not in victims


def test_retention_byte_budget_removes_oldest_first(catalog):
    recs = [catalog.add(_row(slot=i, at=float(i), size=400)) for i in range(4)]
    victims = retention_victims(catalog.list(), max_count=8, max_bytes=1000)
    assert [v.id for v in victims] == [recs[0].id, recs[1].id]
    assert {v.id for v in retention_victims(catalog.list(), max_count=0, max_bytes=10**9)} == {r.id for r in recs}


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("model_id", "gguf-s1-" + "x" * 64, ReasonCode.SNAPSHOT_MODEL_MISMATCH),
        ("engine_build", "b2", ReasonCode.SNAPSHOT_ENGINE_MISMATCH),
        ("n_ctx", 512, ReasonCode.SNAPSHOT_LAYOUT_MISMATCH),
        ("n_slots", 2, ReasonCode.SNAPSHOT_LAYOUT_MISMATCH),
        ("flash_attn", "off", ReasonCode.SNAPSHOT_LAYOUT_MISMATCH),
        ("cache_type_k", "q8_0", ReasonCode.SNAPSHOT_LAYOUT_MISMATCH),
        ("cache_type_v", "q8_0", ReasonCode.SNAPSHOT_LAYOUT_MISMATCH),
        ("swa_full", True, ReasonCode.SNAPSHOT_LAYOUT_MISMATCH),
    ],
)
def test_every_identity_field_is_checked(field, value, reason):
    check_identity(IDENTITY, dict(IDENTITY), snapshot_id=1)
    with pytest.raises(StokerError) as err:
        check_identity(IDENTITY, {**IDENTITY, field: value}, snapshot_id=1)
    assert err.value.reason == reason
    assert err.value.evidence["differs"] == {field: {"snapshot": IDENTITY[field], "server": value}}


def test_kv_unified_counts_with_several_slots_and_when_known(catalog):
    two = {**IDENTITY, "n_slots": 2}
    with pytest.raises(StokerError) as err:  # the engine answers 400 to this one (seen with -np 2 -kvu)
        check_identity(two, {**two, "kv_unified": True}, snapshot_id=1)
    assert err.value.reason == ReasonCode.SNAPSHOT_LAYOUT_MISMATCH
    assert err.value.evidence["differs"] == {"kv_unified": {"snapshot": False, "server": True}}
    check_identity(IDENTITY, {**IDENTITY, "kv_unified": True}, snapshot_id=1)  # one slot: same cells, restores
    check_identity({**two, "kv_unified": None}, {**two, "kv_unified": True}, snapshot_id=1)  # an older row
    # the catalogue keeps the three states
    for value in (True, False, None):
        assert catalog.add(_row(at=float(len(catalog.list()) + 1), kv_unified=value)).kv_unified is value


def test_backend_is_not_identity(catalog):
    rec = catalog.add(_row(backend="cuda", variant="90"))
    check_identity(rec.identity(), IDENTITY, snapshot_id=rec.id)


GEMMA_LOG = """\
llama_context: n_seq_max             = 1
llama_context: n_ctx                 = 8192
llama_context: n_ctx_seq             = 8192
llama_context: n_ubatch              = 512
llama_context: flash_attn            = auto
llama_context: kv_unified            = false
llama_kv_cache_iswa: using full-size SWA cache (ref: https://github.com/ggml-org/llama.cpp/pull/13194)
llama_kv_cache_iswa: creating non-SWA KV cache, size = 8192 cells
llama_kv_cache:        CPU KV buffer size =    24.00 MiB
llama_kv_cache: size =   24.00 MiB (  8192 cells,   3 layers,  1/1 seqs), K (f16):   12.00 MiB, V (f16):   12.00 MiB
llama_kv_cache_iswa: creating     SWA KV cache, size = 8192 cells
llama_kv_cache:        CPU KV buffer size =   120.00 MiB
llama_kv_cache: size =  120.00 MiB (  8192 cells,  15 layers,  1/1 seqs), K (q8_0):   60.00 MiB, V (q8_0):   60.00 MiB
llama_context: Flash Attention enabled
"""


def test_kv_log_facts_and_swa_full_cost():
    kv = KVLog.parse(GEMMA_LOG.splitlines())
    assert (kv.flash_attn, kv.cache_type_k, kv.cache_type_v, kv.swa_full) == ("on", "q8_0", "q8_0", True)
    assert (kv.kv_mib, kv.swa_mib, kv.swa_cells, kv.n_ctx, kv.n_ctx_seq, kv.n_ubatch) == (
        144.0,
        120.0,
        8192,
        8192,
        8192,
        512,
    )
    facts = facts_from_header(
        {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 512, "gemma3.attention.head_count": 4}
    )
    report = swa_report(facts, kv, swa_full=True)
    # Without --swa-full the SWA cache holds pad256(512 + 512) = 1024 cells instead of 8192.
    assert report["kv_mib_with_swa_full"] == 144.0
    assert report["kv_mib_without_swa_full"] == 24.0 + 120.0 / 8
    assert report["swa_full_cost_mib"] == 105.0
    assert report["benefit"] is True
    off = swa_report(facts, kv, swa_full=False)
    assert off["benefit"] is False and "without --swa-full" in off["why"]


def test_recurrent_and_hybrid_models_cannot_benefit():
    hybrid = facts_from_header(
        {"general.architecture": "jamba", "jamba.ssm.conv_kernel": 4, "jamba.attention.head_count": 8}
    )
    assert hybrid.recurrent and hybrid.hybrid
    report = swa_report(hybrid, KVLog(), swa_full=True)
    assert report["benefit"] is False and report["why"].startswith("hybrid model")
    rwkv = facts_from_header({"general.architecture": "rwkv7", "rwkv7.wkv.head_size": 64})
    assert rwkv.recurrent and not rwkv.hybrid
    assert swa_report(rwkv, KVLog(), swa_full=False)["why"].startswith("recurrent model")


def test_gguf_header_reader_skips_arrays(tmp_path, tiny_model):
    path = tmp_path / "swa.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_uint32("gemma3.attention.sliding_window", 512)
    writer.add_uint32("gemma3.attention.head_count", 4)
    writer.add_block_count(6)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc"] * 1000)
    writer.add_array("tokenizer.ggml.scores", [0.5] * 3000)
    writer.add_string("tokenizer.after_the_vocabulary", "é, found")  # the skip lands exactly here
    writer.add_tensor("x", np.zeros((4,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    meta = read_header(path)
    assert meta["tokenizer.ggml.tokens"] is None and meta["general.architecture"] == "gemma3"
    assert meta["tokenizer.after_the_vocabulary"] == "é, found"
    meta["general.architecture"] = "changed"  # a caller's copy: the cache keeps its own
    assert read_header(path)["general.architecture"] == "gemma3"
    facts = model_facts(path)
    assert (facts.swa, facts.sliding_window, facts.block_count, facts.recurrent) == (True, 512, 6, False)
    assert model_facts(tiny_model).swa is False


@pytest.mark.parametrize(
    ("enabled", "setting", "swa_model", "want"),
    [
        (True, "auto", True, True),
        (True, "auto", False, False),
        (False, "auto", True, False),  # off: no memory spent on a full SWA cache
        (False, True, False, True),  # forced
        (True, False, True, False),
    ],
)
def test_swa_full_flag(tmp_path, tiny_model, enabled, setting, swa_model, want):
    import attrs

    from stoker.daemon.config.model import Config
    from stoker.daemon.core.paths import StokerPaths
    from stoker.daemon.snapshots.layout import snapshot_server_args

    path = tiny_model
    if swa_model:
        path = tmp_path / "swa.gguf"
        writer = gguf.GGUFWriter(str(path), "gemma3")
        writer.add_uint32("gemma3.attention.sliding_window", 512)
        writer.add_tensor("x", np.zeros((4,), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    config = Config()
    config = attrs.evolve(config, snapshots=attrs.evolve(config.snapshots, enabled=enabled, swa_full=setting))
    paths = StokerPaths.from_env()
    slot_dir, args = snapshot_server_args(paths, config, path)
    assert slot_dir == paths.snapshots_dir and slot_dir.is_dir()  # always: enabling needs no relaunch
    assert args == (("--swa-full",) if want else ())


def test_a_truncated_gguf_header_is_a_value_error(tmp_path, tiny_model):
    """Callers (the layer estimate, the SWA check) treat ValueError as "no facts"; a header cut
    inside the vocabulary must not escape as a struct.error (an internal error in planning)."""
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model.read_bytes()[:600])
    with pytest.raises(ValueError, match="past the file.s end"):
        read_header(cut)


# --- a model's identity without reading it whole --------------------------------------------------


def _model(path, *, seed=0, n_layer=2):
    from stoker.daemon.bundles.tinymodel import write_tiny_model

    return write_tiny_model(path, seed=seed, n_layer=n_layer, n_embd=256, n_head=4)


def test_model_identity_reads_little_and_tells_weights_apart(tmp_path):
    from stoker.daemon.models.identity import model_identity

    a = _model(tmp_path / "a.gguf")
    ident = model_identity(a)
    assert ident.model_id.startswith("gguf-s1-") and ident.size == a.stat().st_size
    assert ident.bytes_read < ident.size  # the header and 4 KiB samples, not the file
    # A copy elsewhere is the same model: its snapshots follow it.
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(a.read_bytes())
    assert model_identity(copy).model_id == ident.model_id
    # Same shapes and header, other weights (a fine-tune): another model.
    other = _model(tmp_path / "b.gguf", seed=1)
    assert other.stat().st_size == a.stat().st_size
    assert model_identity(other).model_id != ident.model_id
    # One tensor retrained in place (its bytes around the middle), header untouched: another model.
    from stoker.daemon.models.facts import read_layout

    layout = read_layout(a)
    data = bytearray(a.read_bytes())
    start = layout.data_offset + sorted(layout.tensor_offsets)[-1]
    middle = start + (len(data) - start) // 2
    data[middle - 2048 : middle + 2048] = bytes(4096)
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(bytes(data))
    assert model_identity(edited).model_id != ident.model_id


def test_model_identity_of_a_multi_gb_model_costs_milliseconds(tmp_path):
    """The 13.5 GiB case in small: a sparse 3 GiB file with a real header; reading it whole
    would take seconds, the identity reads a few hundred KiB."""
    import time

    from stoker.daemon.models.identity import MAX_SAMPLES, model_identity

    path = _model(tmp_path / "big.gguf")
    with open(path, "r+b") as fh:
        fh.truncate(3 << 30)  # the tail is a hole: no disk, but a 3 GiB file
    started = time.perf_counter()
    ident = model_identity(path)
    assert time.perf_counter() - started < 0.5
    assert ident.size == 3 << 30 and ident.bytes_read < (MAX_SAMPLES + 2) * 4096 + (1 << 20)


def test_a_row_from_before_model_ids_matches_by_the_cached_full_digest(catalog):
    from stoker.store.snapshots import same_model

    old = {**IDENTITY, "model_id": None, "model_sha256": "s" * 64}
    assert same_model(old, {**IDENTITY, "model_sha256": "s" * 64})
    assert not same_model(old, {**IDENTITY, "model_sha256": None})  # not cached: not proven
    with pytest.raises(StokerError) as err:
        check_identity(old, {**IDENTITY, "model_sha256": None}, snapshot_id=1)
    assert err.value.reason == ReasonCode.SNAPSHOT_MODEL_MISMATCH
    assert err.value.evidence["differs"] == {"model_sha256": {"snapshot": "s" * 64, "server": None}}


def test_the_migration_keeps_old_rows_and_loosens_the_digests(tmp_path):
    from stoker.store.migrations import MIGRATIONS

    path = tmp_path / "old.db"
    store = open_store(path, migrations=MIGRATIONS[:3])
    old = SnapshotCatalog(store)
    row = _row()
    row.pop("model_id")
    row.pop("instance")  # m007 adds it
    row["model_sha256"] = "s" * 64
    old.store.db.table("snapshots").insert({**row, "swa_full": 0, "kv_unified": 0})
    store.close()
    store = open_store(path)
    try:
        new = SnapshotCatalog(store)
        (rec,) = new.list()
        assert (rec.model_sha256, rec.model_id, rec.file_sample_sha256, rec.sealed_at) == ("s" * 64, None, None, None)
        fresh = new.add(_row(at=5.0, file_sha256=None, file_sample_sha256="x" * 64, boot_id="b"))
        assert fresh.file_sha256 is None and fresh.model_sha256 is None
        new.update(fresh.id, file_sha256="f" * 64, sealed_at=6.0)
        assert (new.get(fresh.id).file_sha256, new.get(fresh.id).sealed_at) == ("f" * 64, 6.0)
    finally:
        store.close()


# --- cheap checks at restore ------------------------------------------------------------------------


def _saved(tmp_path, catalog, size=300_000):
    import os as _os

    from stoker.daemon.snapshots.files import FileFacts, sample_digest

    path = tmp_path / "slot0-1-ab.bin"
    path.write_bytes(_os.urandom(size))
    facts = FileFacts.of(path)
    rec = catalog.add(
        _row(
            filename=path.name,
            size=size,
            file_sha256=None,
            file_mtime_ns=facts.mtime_ns,
            file_inode=facts.inode,
            file_sample_sha256=sample_digest(path, size),
        )
    )
    return path, rec


def test_restore_check_reads_only_the_head_and_tail(tmp_path, catalog, monkeypatch):
    from stoker.daemon.snapshots import files

    path, rec = _saved(tmp_path, catalog)
    monkeypatch.setattr(files, "sha256_file", lambda p: pytest.fail("read the whole file"))
    check = files.check_file(path, rec)
    assert check.ok and check.checked == "stat+sample"


def test_restore_check_refuses_a_truncated_or_rewritten_file(tmp_path, catalog):
    import os as _os

    from stoker.daemon.snapshots.files import check_file

    path, rec = _saved(tmp_path, catalog)
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # the engine's header / token ids, rewritten in place, mtime put back
    path.write_bytes(bytes(data))
    _os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    check = check_file(path, rec)
    assert not check.ok and check.evidence["sample_digest_matches"] is False
    with open(path, "r+b") as fh:
        fh.truncate(1000)
    check = check_file(path, rec)
    assert not check.ok and check.evidence["found_size"] == 1000
    path.unlink()
    assert not check_file(path, rec).ok


def test_a_moved_file_needs_the_full_digest(tmp_path, catalog):
    from stoker.daemon.core.digests import sha256_file
    from stoker.daemon.snapshots.files import check_file

    path, rec = _saved(tmp_path, catalog)
    moved = tmp_path / "copy.bin"
    moved.write_bytes(path.read_bytes())  # a backup restored: another inode and mtime
    moved.replace(path)
    check = check_file(path, rec)
    assert not check.ok and "no full digest" in check.evidence["why"]
    catalog.update(rec.id, file_sha256=sha256_file(path))
    check = check_file(path, catalog.get(rec.id))
    assert check.ok and check.checked == "full_sha256" and check.revouched is not None
    assert check.revouched.inode == path.stat().st_ino


def test_a_row_from_before_the_cheap_checks_is_checked_in_full(tmp_path, catalog):
    from stoker.daemon.core.digests import sha256_file
    from stoker.daemon.snapshots.files import check_file

    path = tmp_path / "old.bin"
    path.write_bytes(b"x" * 5000)
    rec = catalog.add(_row(size=5000, file_sha256=sha256_file(path)))
    assert check_file(path, rec).checked == "full_sha256" and check_file(path, rec).ok


def test_residency_is_a_fraction(tmp_path):
    from stoker.daemon.snapshots.files import resident_fraction

    path = tmp_path / "f.bin"
    path.write_bytes(b"y" * (1 << 20))
    value = resident_fraction(path)
    assert value is None or 0.0 <= value <= 1.0
    assert resident_fraction(tmp_path / "missing") is None


def test_prefill_figures_come_from_the_engines_own_lines(tmp_path, catalog):
    from stoker.daemon.snapshots.figures import fold_prefills, prefill_name, prefill_samples
    from stoker.daemon.snapshots.layout import LAUNCH_MARKER

    log_path = tmp_path / "llama-server.log"
    line = "slot print_timing: id  0 | task {t} | prompt eval time = {ms:10.2f} ms / {n:5d} tokens (x)\n"
    old = line.format(t=1, ms=1.0, n=5000)  # a previous launch: not this server's
    log_path.write_bytes(
        old.encode()
        + LAUNCH_MARKER
        + b"1 ====\n"
        + (line.format(t=2, ms=500.0, n=2000) + line.format(t=3, ms=2.0, n=10)).encode()
    )
    samples, cursor = prefill_samples(log_path, None)
    assert samples == [(2000, 0.5), (10, 0.002)]
    fold_prefills(catalog, "cpu", "gguf-s1-m", samples)
    assert catalog.figures("prefill/") == {prefill_name("cpu", "gguf-s1-m", "le4096"): Figure(4000.0, 1)}
    with open(log_path, "ab") as fh:
        fh.write(line.format(t=4, ms=100.0, n=1000).encode())
    assert prefill_samples(log_path, cursor)[0] == [(1000, 0.1)]  # only what came since


def test_retention_says_why_it_drops(catalog):
    from stoker.store.snapshots import retention_plan

    recs = [catalog.add(_row(slot=0, at=float(i), size=400)) for i in range(3)]
    plan = retention_plan(catalog.list(), max_count=2, max_bytes=500)
    assert [(r.id, why) for r, why in plan] == [(recs[0].id, "count"), (recs[1].id, "bytes")]


def _upkeep(tmp_path, catalog, boot="this-boot"):
    from stoker.daemon.snapshots.drops import DropLog
    from stoker.daemon.snapshots.upkeep import SnapshotUpkeep

    events = []
    return SnapshotUpkeep(tmp_path, catalog, DropLog(events.append), events.append, boot=boot), events


async def test_after_a_save_the_file_is_sealed_and_digested_in_the_background(tmp_path, catalog):
    import trio

    from stoker.daemon.core.digests import sha256_file

    path, rec = _saved(tmp_path, catalog)
    upkeep, _ = _upkeep(tmp_path, catalog)
    async with trio.open_nursery() as nursery:
        await nursery.start(upkeep.run)
        await upkeep.after_save(rec)  # returns at once: the work is the upkeep's
        await until(lambda: catalog.get(rec.id).file_sha256, timeout=10, what="the background digest of the saved file")
        nursery.cancel_scope.cancel()
    done = catalog.get(rec.id)
    assert done.sealed_at is not None and done.file_sha256 == sha256_file(path)


def test_a_row_unsealed_when_the_machine_restarted_is_dropped_and_said(tmp_path, catalog):
    path, rec = _saved(tmp_path, catalog)
    catalog.update(rec.id, boot_id="an-earlier-boot")
    upkeep, events = _upkeep(tmp_path, catalog)
    upkeep.cleanup_rows()
    assert catalog.list() == [] and not path.exists()
    (dropped,) = upkeep.drops.latest()
    assert (dropped["reason"], dropped["why"], dropped["snapshot_id"]) == (
        "snapshot_dropped",
        "unsealed_before_reboot",
        rec.id,
    )
    assert {e["topic"] for e in events} == {"snapshot.removed", "snapshot.dropped"}
    # Sealed before the restart, or written on this boot: kept.
    path2, rec2 = _saved(tmp_path, catalog)
    catalog.update(rec2.id, boot_id="an-earlier-boot", sealed_at=1.0)
    upkeep.cleanup_rows()
    assert [r.id for r in catalog.list()] == [rec2.id]


def test_a_digest_never_vouches_for_a_file_changed_after_the_save(tmp_path, catalog):
    import trio

    path, rec = _saved(tmp_path, catalog)
    path.write_bytes(path.read_bytes()[::-1])  # rewritten before the background digest ran
    upkeep, _ = _upkeep(tmp_path, catalog)
    trio.run(upkeep._digest, rec.id, path)
    assert catalog.get(rec.id).file_sha256 is None


def test_the_header_readers_value_types_are_the_gguf_formats():
    """facts.py reads headers with its own copy of the format's value type ids (the daemon's
    start does not import gguf and numpy): it must be the gguf package's, id for id."""
    import gguf

    from stoker.daemon.models.facts import ValueType

    assert {t.name: int(t) for t in ValueType} == {t.name: int(t) for t in gguf.GGUFValueType}


def test_retention_drops_are_history_rows_with_their_reason(tmp_path, catalog):
    """`stoker history` reads the store's transitions: every drop is one, with its reason code."""
    from stoker.daemon.cli.lifecycle import format_history
    from stoker.daemon.snapshots.drops import DropLog
    from stoker.daemon.snapshots.upkeep import SnapshotUpkeep

    upkeep = SnapshotUpkeep(tmp_path, catalog, DropLog(None, catalog.store), boot="b")
    recs = [catalog.add(_row(slot=0, at=float(i), size=400)) for i in range(3)]
    upkeep.apply_retention(max_count=2, max_bytes=500)
    rows = catalog.store.history(machine="snapshots")
    assert [(r.event, r.reason, r.evidence["snapshot_id"]) for r in rows] == [
        ("bytes", "snapshot_dropped", recs[1].id),
        ("count", "snapshot_dropped", recs[0].id),
    ]
    assert "saved --bytes--> dropped  [snapshot_dropped]" in format_history(rows)
    # A row whose file is gone is dropped, and said (snapshot_removed).
    upkeep.cleanup_rows()
    (gone,) = catalog.store.history(machine="snapshots", limit=1)
    assert (gone.event, gone.reason, gone.evidence["snapshot_id"]) == ("file_gone", "snapshot_removed", recs[2].id)
