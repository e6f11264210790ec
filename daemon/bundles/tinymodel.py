"""A tiny random-weight llama GGUF that loads in milliseconds, for tests and smoke checks.

The weights are random but seeded, so the same arguments always write the same bytes and a
given engine build always generates the same greedy tokens from it: that is what the bundle
smoke test compares. The architecture facts (required keys, tensor names, numpy shapes being
ggml's reversed) are in ENGINE.md, "Tiny test models".
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import gguf
import numpy as np

# Words give the tokenizer something better than bytes for ordinary prompts; the rest of any
# text falls back to the 256 byte tokens, so every prompt tokenizes.
_WORDS = (
    "the",
    "a",
    "and",
    "of",
    "to",
    "in",
    "is",
    "it",
    "hello",
    "world",
    "stoker",
    "engine",
    "once",
    "upon",
    "time",
    "there",
    "was",
    "cat",
    "dog",
    "fire",
    "coal",
    "steam",
    "train",
    "one",
    "two",
    "three",
    "red",
    "blue",
    "green",
    "yes",
    "no",
)

SPM_SPACE = "\u2581"  # sentencepiece's word-boundary marker


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    scores = [0.0, 0.0, 0.0]
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(gguf.TokenType.BYTE)
        scores.append(0.0)
    # Longer pieces score higher so the SPM merger prefers whole words over bytes.
    for rank, word in enumerate(_WORDS):
        for piece in (SPM_SPACE + word, word):
            tokens.append(piece)
            types.append(gguf.TokenType.NORMAL)
            scores.append(-1.0 - rank * 0.01)
    tokens.append(SPM_SPACE)
    types.append(gguf.TokenType.NORMAL)
    scores.append(-5.0)
    return tokens, scores, [int(t) for t in types]


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _bpe_vocab() -> tuple[list[str], list[str], list[int]]:
    byte_chars = _gpt2_byte_chars()
    tokens = ["<unk>", "<s>", "</s>"] + byte_chars
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.NORMAL] * 256
    space = byte_chars[ord(" ")]
    merges: list[str] = []
    known = set(tokens)
    # Build each word left to right from pairs; the writer drops an EMPTY merges list
    # silently, and llama.cpp then refuses the vocabulary, so there is always at least one.
    for word in _WORDS:
        piece = space
        for ch in word:
            merged = piece + ch
            if merged not in known:
                merges.append(f"{piece} {ch}")
                tokens.append(merged)
                types.append(gguf.TokenType.NORMAL)
                known.add(merged)
            piece = merged
    return tokens, merges, [int(t) for t in types]


def _tensor(rng: np.random.Generator, shape: Sequence[int], scale: float) -> np.ndarray:
    return (rng.standard_normal(size=tuple(shape)) * scale).astype(np.float32)


# weights -> (the layer matrices' ggml type, or None for F32; the file type recorded)
_WEIGHT_TYPES = {
    "f32": (None, gguf.LlamaFileType.ALL_F32),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
}


def _add_matrix(writer: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> None:
    if qtype is None:
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def write_tiny_model(
    path: str | Path,
    *,
    n_layer: int = 2,
    n_embd: int = 128,
    n_head: int = 2,
    n_ctx: int = 256,
    seed: int = 0,
    vocab: str = "spm",
    weights: str = "f32",
    pooling: int | None = None,
    fim: bool = False,
) -> Path:
    """Write a seeded random-weight llama GGUF to `path` and return the path.

    `pooling` (llama.cpp's pooling type: 1 mean, 2 cls, 3 last, 4 rank) states it in the header,
    as an embedding (or reranking) model's GGUF does. `fim=True` names three byte tokens as the
    fill-in-the-middle prefix, suffix and middle tokens, so that llama-server's /infill answers
    (a model without them gets its 501).

    `weights="q8_0"` or `"q4_0"` quantizes the layer matrices: those types take ggml's
    quantized CPU kernels (and AMX where the CPU claims it), which F32 weights never reach.
    """
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
    if vocab not in ("spm", "bpe"):
        raise ValueError(f"vocab must be 'spm' or 'bpe', not {vocab!r}")
    if weights not in _WEIGHT_TYPES:
        raise ValueError(f"weights must be one of {sorted(_WEIGHT_TYPES)}, not {weights!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head_dim = n_embd // n_head
    n_ff = 2 * n_embd
    rng = np.random.default_rng(seed)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"stoker-tiny-{n_layer}x{n_embd}-{vocab}-s{seed}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    qtype, file_type = _WEIGHT_TYPES[weights]
    writer.add_file_type(file_type)
    if pooling is not None:
        writer.add_pooling_type(gguf.PoolingType(pooling))

    if vocab == "spm":
        tokens, scores, types = _spm_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
    else:
        tokens, merges, types = _bpe_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    if fim:
        for key, token in (
            (gguf.Keys.Tokenizer.FIM_PRE_ID, 3),
            (gguf.Keys.Tokenizer.FIM_SUF_ID, 4),
            (gguf.Keys.Tokenizer.FIM_MID_ID, 5),
        ):
            writer.add_uint32(key, token)
    n_vocab = len(tokens)

    # numpy shapes are ggml's reversed: (rows = outputs, cols = inputs).
    writer.add_tensor("token_embd.weight", _tensor(rng, (n_vocab, n_embd), 1.0))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", _tensor(rng, (n_vocab, n_embd), n_embd**-0.5))
    for i in range(n_layer):
        scale = n_embd**-0.5
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        _add_matrix(writer, f"blk.{i}.attn_q.weight", _tensor(rng, (n_embd, n_embd), scale), qtype)
        _add_matrix(writer, f"blk.{i}.attn_k.weight", _tensor(rng, (n_embd, n_embd), scale), qtype)
        _add_matrix(writer, f"blk.{i}.attn_v.weight", _tensor(rng, (n_embd, n_embd), scale), qtype)
        _add_matrix(writer, f"blk.{i}.attn_output.weight", _tensor(rng, (n_embd, n_embd), scale), qtype)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        _add_matrix(writer, f"blk.{i}.ffn_gate.weight", _tensor(rng, (n_ff, n_embd), scale), qtype)
        _add_matrix(writer, f"blk.{i}.ffn_up.weight", _tensor(rng, (n_ff, n_embd), scale), qtype)
        _add_matrix(writer, f"blk.{i}.ffn_down.weight", _tensor(rng, (n_embd, n_ff), n_ff**-0.5), qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
