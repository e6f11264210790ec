"""The compiled code that attrs and cattrs generate, kept between runs of the CLI.

attrs writes each record's `__init__`, `__eq__`, `__repr__`... as source text and compiles it
when the class is made; cattrs does the same for the function that structures a record, at
its first use. For the `status` reply's records that is ~20 compiles of up to 14 kB each, the
largest share of what `stoker status` and `stoker ps` cost beyond the interpreter (the rest:
click, attrs and cattrs themselves). Python keeps a module's bytecode in `__pycache__`; this
keeps these the same way, one file per source text, which holds what was compiled (the
interpreter's cache tag, the file name, the mode and the source) beside its code: a changed
record, or a new attrs or cattrs that writes other source, is another key, never a stale hit.

`install(directory)` points the `compile` that attrs' and cattrs' generators call (their
module's own name, looked up at each call) at the cache. Any failure to read or write the
cache falls back to compiling: the cache only ever saves time. The directory is the user's
cache directory (0700), as the bytecode it holds runs in their processes.
"""

from __future__ import annotations

import builtins
import marshal
import os
import re
import sys
import zlib
from pathlib import Path
from types import CodeType
from typing import Any

# The generators whose `compile` is pointed at the cache: attrs' class builder and cattrs' hooks.
GENERATORS = ("attr._make", "cattrs.gen")
CACHE_SUFFIX = ".code"

_compile = builtins.compile
# attrs salts each class's `__hash__` with a number drawn from the class's name by `hash()`, which
# changes from run to run: it is left out of the key, so a cached `__hash__` keeps the salt of the
# run that compiled it (still one number per class, which is all the salt is for).
HASH_SALT = re.compile(r"(return hash\(\(\s*)-?\d+,")


class CodeCache:
    """Compiled code by the hash of what was compiled, one marshal file each under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.hits = 0
        self.misses = 0
        self._trusted: bool | None = None

    def trusted(self) -> bool:
        """Whether the directory is the user's own and no one else may write in it (the code
        it holds runs in this process); created 0700 when missing. Asked once."""
        if self._trusted is None:
            try:
                self.directory.mkdir(parents=True, mode=0o700, exist_ok=True)
                st = self.directory.stat()
                self._trusted = st.st_uid == os.getuid() and not st.st_mode & 0o022
            except OSError:
                self._trusted = False
        return self._trusted

    def compile(self, source: Any, filename: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
        """`compile(source, filename, mode)`, from the cache when it holds it (only plain
        source text is cached; any other call is compiled as asked)."""
        if args or kwargs or not isinstance(source, str) or not isinstance(filename, str) or not self.trusted():
            return _compile(source, filename, mode, *args, **kwargs)
        key = "\0".join((sys.implementation.cache_tag or "", filename, mode, HASH_SALT.sub(r"\1SALT,", source)))
        # A file is named by a checksum of its key and holds the key itself: a hit is the very
        # same text, compared whole (no hash library to load for it).
        path = self.directory / f"{zlib.crc32(key.encode()):08x}-{len(key)}{CACHE_SUFFIX}"
        try:
            stored, code = marshal.loads(path.read_bytes())
        except (OSError, EOFError, ValueError, TypeError):
            stored = code = None
        if stored == key and isinstance(code, CodeType):
            self.hits += 1
            return code
        self.misses += 1
        code = _compile(source, filename, mode)
        self._write(path, key, code)
        return code

    def _write(self, path: Path, key: str, code: CodeType) -> None:
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as out:
                out.write(marshal.dumps((key, code)))
            os.replace(tmp, path)  # whole or absent, for a process reading it at the same time
        except OSError:
            pass  # a read-only or full cache directory: compiled each time, as without the cache


_installed: CodeCache | None = None


def install(directory: Path) -> CodeCache:
    """Point the generators imported so far at the cache in `directory` (call it again after
    importing another: once installed, the first directory stays)."""
    global _installed
    if _installed is None:
        _installed = CodeCache(directory)
    for name in GENERATORS:
        module = sys.modules.get(name)
        if module is not None:
            module.compile = _installed.compile  # type: ignore[attr-defined]
    return _installed


def extend() -> None:
    """Point the generators imported since `install` at its cache too (nothing before it)."""
    if _installed is not None:
        install(_installed.directory)


def install_for_cli() -> CodeCache | None:
    """`install` under the user's cache directory (STOKER_CACHE_DIR), attrs loaded with it."""
    import attr._make  # noqa: F401  (the generator of every record's methods)
    from stoker.daemon.core.paths import StokerPaths

    return install(StokerPaths.from_env().cache_dir / "code")
