"""A multi-GB llama-shaped GGUF (F16, few layers), for benchmarks that must pay for model size.

    .venv/bin/python tests/bench/bigmodel.py /tmp/big-3g.gguf --gib 3

8B-shaped layers (n_embd 4096, 32 heads, 8 KV heads, n_ff 14336: 436 MB each in F16) with as
many of them as the size asks; the tiny model's vocabulary. Tensors are written one at a time
(GGUFWriter's tensor-info path), so writing 3 GiB holds one tensor in memory, not the model.
The weights are a seeded pool of small normal values, rolled per tensor: every tensor's bytes
differ, the engine computes finite numbers, and writing costs seconds, not minutes of RNG.
The same arguments always write the same bytes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stoker.daemon.bundles.tinymodel import _spm_vocab  # noqa: E402

N_EMBD, N_HEAD, N_HEAD_KV, N_FF = 4096, 32, 8, 14336
_POOL = 1 << 24


def _layer_shapes(i: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, numpy shape, is_matrix) of one block; numpy shapes are ggml's reversed."""
    kv = N_EMBD // N_HEAD * N_HEAD_KV
    return [
        (f"blk.{i}.attn_norm.weight", (N_EMBD,), False),
        (f"blk.{i}.attn_q.weight", (N_EMBD, N_EMBD), True),
        (f"blk.{i}.attn_k.weight", (kv, N_EMBD), True),
        (f"blk.{i}.attn_v.weight", (kv, N_EMBD), True),
        (f"blk.{i}.attn_output.weight", (N_EMBD, N_EMBD), True),
        (f"blk.{i}.ffn_norm.weight", (N_EMBD,), False),
        (f"blk.{i}.ffn_gate.weight", (N_FF, N_EMBD), True),
        (f"blk.{i}.ffn_up.weight", (N_FF, N_EMBD), True),
        (f"blk.{i}.ffn_down.weight", (N_EMBD, N_FF), True),
    ]


def layer_bytes() -> int:
    return sum(int(np.prod(s)) * (2 if m else 4) for _, s, m in _layer_shapes(0))


def big_model(gib: float, ctx: int = 8192) -> Path:
    """The model of about `gib` GiB in the temp dir, written by the first benchmark that asks and
    kept for the next (one trained for more context than 8192 tokens is a file of its own)."""
    trained = "" if ctx <= 8192 else f"-ctx{ctx}"
    path = Path(tempfile.gettempdir()) / f"stoker-bench-{gib:g}g{trained}.gguf"
    if not path.is_file():
        write_big_model(path, gib, ctx=max(ctx, 8192))
    return path


def write_big_model(path: Path, gib: float, *, ctx: int = 8192, seed: int = 0) -> Path:
    """Write the model (if absent or of another size request) and return its path."""
    path = Path(path)
    n_layer = max(1, round(gib * 2**30 / layer_bytes()))
    tokens, scores, types = _spm_vocab()
    n_vocab = len(tokens)
    tensors: list[tuple[str, tuple[int, ...], bool]] = [
        ("token_embd.weight", (n_vocab, N_EMBD), True),
        ("output_norm.weight", (N_EMBD,), False),
        ("output.weight", (n_vocab, N_EMBD), True),
    ]
    for i in range(n_layer):
        tensors += _layer_shapes(i)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"stoker-bench-{n_layer}x{N_EMBD}-f16-s{seed}")
    writer.add_context_length(ctx)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    for name, shape, matrix in tensors:
        dtype = np.dtype(np.float16 if matrix else np.float32)
        writer.add_tensor_info(name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()

    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(_POOL) * N_EMBD**-0.5).astype(np.float16)
    for k, (_, shape, matrix) in enumerate(tensors):
        if not matrix:
            writer.write_tensor_data(np.ones(shape, dtype=np.float32))
            continue
        start = (k * 7919 * 4099) % _POOL
        writer.write_tensor_data(np.resize(np.roll(pool, -start), shape))
    writer.close()
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("path", type=Path)
    ap.add_argument("--gib", type=float, default=3.0)
    args = ap.parse_args()
    t = time.perf_counter()
    write_big_model(args.path, args.gib)
    print(f"{args.path}: {args.path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
