"""What the catalog records of a GGUF file's header: architecture, parameters, quantization,
context length, whether it carries a chat template. Read with facts.py's header reader (the
gguf package's type ids, arrays skipped undecoded), so a 15 GB model costs milliseconds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stoker.daemon.core.errors import StokerError
from stoker.daemon.models.facts import read_layout
from stoker.states.reasons import ReasonCode


def file_type_name(value: Any) -> str | None:
    """`general.file_type` as a quantization name (15 -> Q4_K_M), or None."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    from gguf import LlamaFileType  # gguf imports numpy: only once a header is shown

    try:
        name = LlamaFileType(value).name
    except ValueError:
        return f"file_type {value}"
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def header_facts(path: Path | str) -> dict[str, Any]:
    """The catalog's facts from `path`'s GGUF header; pull_not_gguf when it has none."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError as err:
        raise StokerError(
            ReasonCode.PULL_NOT_GGUF, f"{path} cannot be read ({err.strerror}).", {"path": str(path)}
        ) from None
    if magic != b"GGUF":
        raise StokerError(
            ReasonCode.PULL_NOT_GGUF,
            f"{path.name} is not a GGUF file (it starts with {magic!r}).",
            {"path": str(path), "magic": magic.hex()},
        )
    try:
        layout = read_layout(path)
    except (OSError, ValueError) as err:
        raise StokerError(
            ReasonCode.PULL_NOT_GGUF,
            f"{path.name} is not a GGUF file the engine can load (its header: {err}).",
            {"path": str(path)},
        ) from None
    meta = layout.meta
    arch = str(meta.get("general.architecture") or "unknown")

    def number(key: str) -> int | None:
        value = meta.get(key)
        return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

    return {
        "architecture": arch,
        "name": meta.get("general.name") if isinstance(meta.get("general.name"), str) else None,
        "size_label": meta.get("general.size_label") if isinstance(meta.get("general.size_label"), str) else None,
        "parameters": layout.n_params or None,
        "quantization": file_type_name(meta.get("general.file_type")),
        "context_length": number(f"{arch}.context_length"),
        "block_count": number(f"{arch}.block_count"),
        "embedding_length": number(f"{arch}.embedding_length"),
        "chat_template": isinstance(meta.get("tokenizer.chat_template"), str),
        "tensors": len(layout.tensor_offsets),
    }
