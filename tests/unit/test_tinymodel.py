"""The tiny test model: deterministic bytes and a well-formed llama GGUF."""

from __future__ import annotations

import hashlib

import gguf
import pytest

from stoker.daemon.bundles.tinymodel import write_tiny_model


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_arguments_write_the_same_bytes(tmp_path):
    a = write_tiny_model(tmp_path / "a.gguf")
    b = write_tiny_model(tmp_path / "b.gguf")
    assert _digest(a) == _digest(b)
    assert _digest(write_tiny_model(tmp_path / "c.gguf", seed=1)) != _digest(a)


@pytest.mark.parametrize("vocab", ["spm", "bpe"])
def test_model_has_the_llama_keys_and_tensors(tmp_path, vocab):
    path = write_tiny_model(tmp_path / "m.gguf", n_layer=3, vocab=vocab)
    reader = gguf.GGUFReader(str(path))
    keys = set(reader.fields)
    for key in (
        "llama.context_length",
        "llama.embedding_length",
        "llama.block_count",
        "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
    ):
        assert key in keys
    if vocab == "bpe":
        assert "tokenizer.ggml.merges" in keys
    names = {t.name for t in reader.tensors}
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= names
    assert "blk.2.ffn_down.weight" in names
    assert path.stat().st_size < 3_000_000


def test_the_fixture_model_exists(tiny_model):
    assert tiny_model.is_file()
    assert tiny_model.suffix == ".gguf"


def test_head_count_must_divide_width(tmp_path):
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "x.gguf", n_embd=100, n_head=3)


@pytest.mark.parametrize(
    "weights, ggml_type", [("q8_0", gguf.GGMLQuantizationType.Q8_0), ("q4_0", gguf.GGMLQuantizationType.Q4_0)]
)
def test_quantized_layer_weights(tmp_path, weights, ggml_type):
    path = write_tiny_model(tmp_path / "q.gguf", weights=weights)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert types["blk.0.attn_q.weight"] == ggml_type and types["blk.1.ffn_down.weight"] == ggml_type
    assert types["token_embd.weight"] == gguf.GGMLQuantizationType.F32
    assert path.stat().st_size < write_tiny_model(tmp_path / "f.gguf").stat().st_size
    with pytest.raises(ValueError):
        write_tiny_model(tmp_path / "x.gguf", weights="q2_k")
