"""KV snapshots without the engine: catalogue, retention, identity, log facts, GGUF facts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from daemon.core.errors import StokerError
from daemon.models.facts import facts_from_header, model_facts, read_header
from daemon.snapshots.layout import KVLog, check_identity, swa_report
from states.reasons import ReasonCode
from store import open_store
from store.snapshots import SnapshotCatalog, retention_victims

IDENTITY = {
    "model_sha256": "m" * 64,
    "engine_build": "b1 build 1 commit x source y",
    "n_ctx": 256,
    "n_slots": 1,
    "flash_attn": "on",
    "cache_type_k": "f16",
    "cache_type_v": "f16",
    "swa_full": False,
    "kv_unified": False,
}


def _row(slot=0, size=100, at=1.0, model="m" * 64, **extra):
    return {
        "filename": f"slot{slot}-{int(at * 1000)}-ab.bin",
        "slot_id": slot,
        "model_path": "/m.gguf",
        **IDENTITY,
        "model_sha256": model,
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
        ("model_sha256", "x" * 64, ReasonCode.SNAPSHOT_MODEL_MISMATCH),
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

    from daemon.config.model import Config
    from daemon.core.paths import StokerPaths
    from daemon.snapshots.service import snapshot_server_args

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
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_header(cut)
