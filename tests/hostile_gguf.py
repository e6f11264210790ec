"""A corpus of hostile GGUF headers: each starts with the GGUF magic and breaks the format in one
way a reader that trusts its lengths would fall for (recursing 100,000 deep, looping over a
count of 2^64, reading past the file's end, accepting a version the engine refuses).

Built byte by byte with struct (not gguf-py's writer, which refuses to write most of them).
"""

from __future__ import annotations

import struct
from pathlib import Path

U64_MAX = 2**64 - 1

# GGUF value types
UINT32, STRING, ARRAY, UINT64 = 4, 8, 9, 10


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, value: bytes) -> bytes:
    return s(key) + struct.pack("<I", vtype) + value


def u32(value: int) -> bytes:
    return struct.pack("<I", value)


def array(etype: int, count: int, body: bytes) -> bytes:
    return struct.pack("<IQ", etype, count) + body


def tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return (
        s(name)
        + struct.pack("<I", n)
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", ggml_type, offset)
    )


def gguf(
    kvs: list[bytes],
    tensors: list[bytes] = (),
    *,
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    pad: int = 64,
) -> bytes:
    """A GGUF file: header, key-values, tensor infos, then `pad` bytes standing for the data."""
    head = b"GGUF" + struct.pack(
        "<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    return head + b"".join(kvs) + b"".join(tensors) + b"\0" * pad


ARCH = kv("general.architecture", STRING, s("llama"))


def _nested(depth: int) -> bytes:
    # An array of arrays of arrays ... `depth` deep: each level one element, the innermost empty.
    return struct.pack("<IQ", ARRAY, 1) * depth + struct.pack("<IQ", UINT32, 0)


def corpus() -> dict[str, bytes]:
    """Every hostile header by the name of what it breaks."""
    vocab = array(STRING, 10, b"".join(s(f"t{i}") for i in range(10)))
    return {
        "arrays-nested-100000-deep": gguf([ARCH, kv("evil", ARRAY, _nested(100_000))]),
        "string-past-end-of-file": gguf(
            [ARCH, kv("general.name", STRING, struct.pack("<Q", 10_000) + b"short")], pad=0
        ),
        "version-999": gguf([ARCH], version=999),
        "version-1": gguf([ARCH], version=1),
        "version-0": gguf([ARCH], version=0),
        "truncated-last-array": gguf(
            [ARCH, kv("tokenizer.ggml.scores", ARRAY, array(UINT32, 100, u32(1) * 10))], pad=0
        ),
        "truncated-string-array": gguf([ARCH, kv("tokenizer.ggml.tokens", ARRAY, vocab[: len(vocab) - 6])], pad=0),
        "string-in-array-past-end": gguf(
            [ARCH, kv("tokenizer.ggml.tokens", ARRAY, array(STRING, 2, s("a") + struct.pack("<Q", 2**40) + b"b"))],
            pad=0,
        ),
        "huge-kv-count": gguf([ARCH], n_kv=U64_MAX),
        "huge-tensor-count": gguf([ARCH], n_tensors=U64_MAX),
        "huge-key-length": gguf([struct.pack("<Q", U64_MAX) + b"key"]),
        "huge-scalar-array-count": gguf([ARCH, kv("evil", ARRAY, array(UINT64, 2**61, b""))]),
        "huge-string-array-count": gguf([ARCH, kv("evil", ARRAY, array(STRING, 2**62, b""))]),
        "unknown-value-type": gguf([ARCH, kv("evil", 99, b"\0" * 8)]),
        "unknown-array-element-type": gguf([ARCH, kv("evil", ARRAY, array(77, 3, b"\0" * 24))]),
        "duplicate-key": gguf([ARCH, ARCH]),
        "tensor-with-1000-dims": gguf([ARCH], [tensor("t", [1] * 4, n_dims=1000)]),
        "tensor-with-0-dims": gguf([ARCH], [tensor("t", [], n_dims=0)]),
        "tensor-name-past-end": gguf([ARCH], [struct.pack("<Q", 2**50) + b"t"], pad=0),
        "tensor-data-past-end": gguf([ARCH], [tensor("t", [4], offset=1 << 40)]),
        "alignment-not-a-power-of-two": gguf([ARCH, kv("general.alignment", UINT32, u32(3))], [tensor("t", [4])]),
        "alignment-zero": gguf([ARCH, kv("general.alignment", UINT32, u32(0))], [tensor("t", [4])]),
        "magic-only": b"GGUF",
        "header-cut-in-counts": b"GGUF" + struct.pack("<I", 3) + b"\1\0\0",
    }


def write_corpus(directory: Path) -> dict[str, Path]:
    """The corpus as files `<name>.gguf` under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, data in corpus().items():
        path = directory / f"{name}.gguf"
        path.write_bytes(data)
        out[name] = path
    return out
