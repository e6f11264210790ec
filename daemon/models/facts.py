"""What a GGUF model's metadata says about KV snapshots: sliding window, recurrent layers.

`gguf.GGUFReader` parses every tensor and the whole vocabulary with numpy (tens of seconds
for Gemma 3's 262k-token vocabulary on a busy 2-core machine), so this reads only the
key-value header, skipping arrays without decoding them, with the GGUF format's value type ids
(`ValueType`: the gguf package's `GGUFValueType`, which tests/unit/test_snapshots.py holds it
to, copied so that the daemon's start does not import gguf and numpy). Results are cached by
(path, size, mtime): in memory, and in the daemon in gguf-headers.json under its data dir, so a
daemon started again does not parse a header it has parsed before.
"""

from __future__ import annotations

import enum
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import attrs

from stoker.daemon.core.kept import KeptAnswers


class ValueType(enum.IntEnum):
    """The GGUF format's metadata value types (gguf-py's `GGUFValueType`)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_SCALARS = {
    ValueType.UINT8: "<B",
    ValueType.INT8: "<b",
    ValueType.UINT16: "<H",
    ValueType.INT16: "<h",
    ValueType.UINT32: "<I",
    ValueType.INT32: "<i",
    ValueType.FLOAT32: "<f",
    ValueType.BOOL: "<?",
    ValueType.UINT64: "<Q",
    ValueType.INT64: "<q",
    ValueType.FLOAT64: "<d",
}
# Key fragments of recurrent state (Mamba/SSM, RWKV, LFM2 short convolutions): such a model
# keeps per-sequence recurrent state that the engine re-computes after a slot restore.
_RECURRENT_MARKERS = (".ssm.", ".wkv.", ".time_mix_", ".token_shift_count", ".shortconv.")


@attrs.frozen
class ModelFacts:
    """The metadata facts that decide whether a snapshot can spare a re-prefill."""

    architecture: str
    sliding_window: int | None  # tokens; None: every layer attends to the whole context
    recurrent: bool  # has recurrent (SSM/RWKV/conv) state
    attention: bool  # has attention layers (recurrent + attention = hybrid)
    block_count: int | None
    # One KV cell's bytes with an f16 cache: layers x KV heads x (key + value length) x 2. None
    # where the header does not say (per-layer head counts, no attention). The server's own KV
    # buffers (its log) are the exact figure; this one is for before a server ran.
    kv_bytes_per_token_f16: int | None = None

    @property
    def swa(self) -> bool:
        return bool(self.sliding_window)

    @property
    def hybrid(self) -> bool:
        return self.recurrent and self.attention

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "swa": self.swa, "hybrid": self.hybrid}


class GGUFError(ValueError):
    """The file is not a GGUF header Stoker (or the engine) can read: a length or count past the
    file's end, a version or type it does not know, arrays nested too deep."""


# The GGUF versions llama.cpp reads (1 was dropped long ago; 3 is current).
GGUF_VERSIONS = (2, 3)
# llama.cpp reads no nested arrays at all; gguf-py can write one level. Deeper is hostile (a
# 100,000-deep nest once exhausted the reader's recursion).
MAX_ARRAY_DEPTH = 2
MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes one entry takes: a key-value pair (key length, an empty key, type, a byte of
# value) and a tensor info (name length, an empty name, n_dims, type, offset). A count that
# would need more bytes than the file holds is refused before any loop runs over it.
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8


class _Header:
    """A bounded reader over the mapped file: every length, count and offset is checked against
    the bytes left before it is used, so a hostile header fails as `GGUFError`, never by running
    off the end, looping over a count of 2^64, or recursing without end."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0

    def _need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise GGUFError(f"{what} needs {n} bytes at offset {self.pos}, past the file's end ({self.size} bytes)")

    def unpack(self, fmt: str) -> Any:
        width = struct.calcsize(fmt)
        self._need(width, "a value")
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += width
        return value

    def string(self) -> str:
        n = self.unpack("<Q")
        self._need(n, "a string")
        text = self.buf[self.pos : self.pos + n].decode("utf-8", "replace")
        self.pos += n
        return text

    def skip(self, n: int, what: str) -> None:
        self._need(n, what)
        self.pos += n

    def _skip_strings(self, count: int) -> None:
        # A vocabulary: 262k strings for Gemma 3. Step over the length prefixes without
        # slicing or decoding (that alone took ~0.3 s, on every GPU launch plan).
        self._need(8 * count, "an array of strings")
        buf, pos, size, length = self.buf, self.pos, self.size, struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > size:
                raise GGUFError(f"an array of strings runs past the file's end ({size} bytes)")
            pos += 8 + length(buf, pos)[0]
            if pos > size:
                raise GGUFError(f"a string in an array runs past the file's end ({size} bytes)")
        self.pos = pos

    def value(self, vtype: int, keep: bool, depth: int = 0) -> Any:
        if vtype == ValueType.STRING:
            return self.string()
        if vtype == ValueType.ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise GGUFError(f"arrays are nested more than {MAX_ARRAY_DEPTH} deep")
            etype, count = self.unpack("<I"), self.unpack("<Q")
            if etype not in _SCALARS and etype not in (ValueType.STRING, ValueType.ARRAY):
                raise GGUFError(f"an array's element type {etype} is no GGUF type")
            smallest = struct.calcsize(_SCALARS[ValueType(etype)]) if etype in _SCALARS else 8
            self._need(smallest * count, f"an array of {count} elements")
            if etype in _SCALARS and not keep:
                self.pos += smallest * count  # skipped, not decoded
                return None
            if keep:
                return [self.value(etype, keep, depth + 1) for _ in range(count)]
            if etype == ValueType.STRING:
                self._skip_strings(count)
            else:
                for _ in range(count):
                    self.value(etype, False, depth + 1)
            return None
        if vtype not in _SCALARS:
            raise GGUFError(f"a value's type {vtype} is no GGUF type")
        return self.unpack(_SCALARS[ValueType(vtype)])


def read_header(path: Path) -> dict[str, Any]:
    """The GGUF key-value metadata, with array values left out (None); cached by path, size
    and mtime (every GPU launch plan reads it for the layer estimate)."""
    return dict(read_layout(path).meta)


@attrs.frozen
class GGUFLayout:
    """Where things are in a GGUF file: its metadata, where the tensor data starts, and each
    tensor's data offset (from that start), in file order."""

    meta: dict[str, Any]
    data_offset: int
    tensor_offsets: tuple[int, ...]
    n_params: int = 0  # elements over every tensor: the parameter count the catalog shows
    # Each array's element count by key (the arrays themselves are skipped: None in `meta`).
    array_lengths: dict[str, int] = attrs.field(factory=dict, hash=False)
    # The bytes of the input layer's tensors (the token embeddings, `token_embd.*`), which the
    # engine keeps on the host even with every layer on a GPU: from the data offsets (the next
    # tensor's offset, or the file's end, less this one's), so alignment padding included.
    input_bytes: int = 0


_DEFAULT_ALIGNMENT = 32
_INPUT_TENSORS = b"token_embd."  # the input layer's tensors (llama.cpp's LLM_TENSOR_TOKEN_EMBD)


_LAYOUTS: dict[tuple[str, int, int], GGUFLayout] = {}
# Where the daemon keeps the layouts it parsed (keep_layouts_in, at its start), so that a daemon
# started again plans without parsing the header once more (0.07-0.12 s for Gemma 3's 262k-token
# vocabulary on this 2-core machine); in memory only until then (the CLI, tests).
_KEPT = KeptAnswers(None, 32)


def keep_layouts_in(path: Path | None) -> None:
    """Keep parsed layouts in `path` (JSON, 0600, by path, size and mtime) from now on."""
    global _KEPT
    _KEPT = KeptAnswers(path, 32)


def _from_kept(key: str) -> GGUFLayout | None:
    entry: Any = _KEPT.get(key)
    try:
        return GGUFLayout(
            dict(entry["meta"]),
            int(entry["data_offset"]),
            tuple(int(o) for o in entry["tensor_offsets"]),
            int(entry["n_params"]),
            {str(k): int(v) for k, v in entry["array_lengths"].items()},
            int(entry["input_bytes"]),
        )
    except (TypeError, KeyError, ValueError, AttributeError):
        return None  # none kept, or not one this code wrote: parsed again


def _keep(key: str, layout: GGUFLayout) -> None:
    _KEPT.put(
        key,
        {
            "meta": layout.meta,
            "data_offset": layout.data_offset,
            "tensor_offsets": list(layout.tensor_offsets),
            "n_params": layout.n_params,
            "array_lengths": layout.array_lengths,
            "input_bytes": layout.input_bytes,
        },
    )


def read_layout(path: str | Path) -> GGUFLayout:
    """The header and the tensor infos (names, shapes and types skipped over), not the data;
    cached by path, size and mtime (the plan, the ready hook and the model's identity ask), in
    memory and, in the daemon, in a file under its data dir (keep_layouts_in)."""
    path = Path(path)
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    found = _LAYOUTS.get(key)
    if found is None:
        if len(_LAYOUTS) >= 16:
            _LAYOUTS.clear()
        text_key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
        found = _from_kept(text_key)
        if found is None:
            found = _read_layout(path)
            _keep(text_key, found)
        _LAYOUTS[key] = found
    return found


def _read_layout(path: Path) -> GGUFLayout:
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size < 4 or fh.read(4) != b"GGUF":
            raise GGUFError("it does not start with GGUF")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Header(buf))


def _parse(head: _Header) -> GGUFLayout:
    head.pos = 4
    version = head.unpack("<I")
    if version not in GGUF_VERSIONS:
        raise GGUFError(f"GGUF version {version} is not one llama.cpp reads ({', '.join(map(str, GGUF_VERSIONS))})")
    n_tensors = head.unpack("<Q")
    n_kv = head.unpack("<Q")
    head._need(n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_BYTES, f"{n_kv} keys and {n_tensors} tensors")
    out: dict[str, Any] = {}
    offsets: list[int] = []
    inputs: list[int] = []  # indices (into offsets) of the input layer's tensors
    n_params = 0
    lengths: dict[str, int] = {}
    for _ in range(n_kv):
        key = head.string()
        if key in out:
            raise GGUFError(f"the key {key[:80]!r} is given twice")
        vtype = head.unpack("<I")
        if vtype == ValueType.ARRAY:
            head._need(12, "an array's type and count")
            lengths[key] = struct.unpack_from("<Q", head.buf, head.pos + 4)[0]
        out[key] = head.value(vtype, keep=False)
    for index in range(n_tensors):
        name_length = head.unpack("<Q")
        head._need(name_length, "a tensor's name")
        if name_length >= len(_INPUT_TENSORS) and head.buf[head.pos : head.pos + len(_INPUT_TENSORS)] == _INPUT_TENSORS:
            inputs.append(index)
        head.pos += name_length
        n_dims = head.unpack("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"a tensor has {n_dims} dimensions (1 to {MAX_DIMS} are possible)")
        head._need(8 * n_dims + 4 + 8, "a tensor's shape, type and offset")
        elements = 1
        for dim in struct.unpack_from(f"<{n_dims}Q", head.buf, head.pos):
            elements *= dim
        n_params += elements
        head.pos += 8 * n_dims + 4  # the dimensions and the type
        offsets.append(head.unpack("<Q"))
    alignment = out.get("general.alignment")
    if alignment is not None and (not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1)):
        raise GGUFError(f"general.alignment {alignment!r} is not a power of two")
    alignment = alignment or _DEFAULT_ALIGNMENT
    data_offset = (head.pos + alignment - 1) // alignment * alignment
    beyond = [o for o in offsets if data_offset + o > head.size]
    if beyond:
        raise GGUFError(f"a tensor's data starts at {data_offset + beyond[0]}, past the file's end ({head.size} bytes)")
    starts = sorted({*offsets, head.size - data_offset})
    following = dict(zip(starts, starts[1:]))
    input_bytes = sum(following.get(offsets[i], offsets[i]) - offsets[i] for i in inputs)
    return GGUFLayout(out, data_offset, tuple(offsets), n_params, lengths, input_bytes)


def vocab_size(path: str | Path) -> int | None:
    """The tokens in the model's vocabulary (the length of tokenizer.ggml.tokens); None: not said."""
    return read_layout(path).array_lengths.get("tokenizer.ggml.tokens")


def _kv_bytes_per_token(meta: dict[str, Any], arch: str) -> int | None:
    def number(key: str) -> int | None:
        value = meta.get(f"{arch}.{key}")
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None

    layers, heads = number("block_count"), number("attention.head_count")
    kv_heads = number("attention.head_count_kv") or heads
    embd = number("embedding_length")
    head_dim = embd // heads if embd and heads else None
    key, value = number("attention.key_length") or head_dim, number("attention.value_length") or head_dim
    if not (layers and kv_heads and key and value):
        return None
    return layers * kv_heads * (key + value) * 2


def facts_from_header(meta: dict[str, Any]) -> ModelFacts:
    arch = str(meta.get("general.architecture") or "unknown")
    own = [k for k in meta if k.startswith(arch + ".")]
    window = meta.get(f"{arch}.attention.sliding_window")
    return ModelFacts(
        architecture=arch,
        sliding_window=int(window) if isinstance(window, (int, float)) and window > 0 else None,
        recurrent=any(marker in k[len(arch) :] for k in own for marker in _RECURRENT_MARKERS),
        attention=f"{arch}.attention.head_count" in meta,
        block_count=meta.get(f"{arch}.block_count"),
        kv_bytes_per_token_f16=_kv_bytes_per_token(meta, arch),
    )


# llama.cpp's pooling types (LLAMA_POOLING_TYPE_*): an embedding model's GGUF states one.
_POOLING_KINDS = {1: "embedding", 2: "embedding", 3: "embedding", 4: "rerank"}
_ENCODERS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "jina-bert-v3", "neo-bert", "modern-bert")


def kind_from_header(meta: dict[str, Any]) -> str:
    """What a model is for, as its header says: "embedding" (a pooling type, or an encoder
    architecture), "rerank" (rank pooling), else "chat"."""
    arch = str(meta.get("general.architecture") or "")
    pooling = meta.get(f"{arch}.pooling_type")
    if isinstance(pooling, int) and pooling in _POOLING_KINDS:
        return _POOLING_KINDS[pooling]
    return "embedding" if arch in _ENCODERS else "chat"


def model_kind(path: str | Path) -> str:
    """`kind_from_header` of the file at `path` (blocking; its header is cached)."""
    return kind_from_header(read_header(Path(path)))


def model_facts(path: str | Path) -> ModelFacts:
    """The model's snapshot-relevant facts (from the header, which read_header caches)."""
    return facts_from_header(read_header(Path(path)))
