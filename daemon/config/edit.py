"""Editing config.toml in place: `stoker use` sets `[backend] prefer`, `stoker key require`
`[frontdoor] require_keys`, and neither touches anything else.

The file stays the single source of truth that `stoker config check`, an editor and the
hot-reload watcher all see. A symlinked config file (dotfiles kept in a repository) is written
where it really is: the link stays a link, its target gets the new text, atomically and with
its own mode.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from stoker.daemon.config.model import parse_config


def set_value(text: str, section: str, key: str, value: str) -> str:
    """`text` (a config.toml) with `[section] key = value` (`value` written as TOML already),
    everything else untouched: the key's line replaced, else added under the section's header,
    else the section added at the end."""
    line = f"{key} = {value}"
    lines = text.splitlines()
    header = re.compile(rf"^\s*\[\s*{re.escape(section)}\s*\]\s*(#.*)?$")
    any_header = re.compile(r"^\s*\[")
    start = next((i for i, l in enumerate(lines) if header.match(l)), None)
    if start is None:
        body = text.rstrip("\n")
        return (body + "\n\n" if body else "") + f"[{section}]\n{line}\n"
    end = next((i for i in range(start + 1, len(lines)) if any_header.match(lines[i])), len(lines))
    existing = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for i in range(start + 1, end):
        if existing.match(lines[i]):
            lines[i] = line
            break
    else:
        lines.insert(start + 1, line)
    return "\n".join(lines) + "\n"


def write_value(path: Path, section: str, key: str, value: str) -> None:
    """Set `[section] key = value` in the config file atomically (tmp, fsync, rename), through a
    symlink to the file it names; ConfigError (nothing written) if the result would be refused."""
    path = Path(path)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    try:
        text = target.read_text()
    except FileNotFoundError:
        text = ""
    new = set_value(text, section, key, value)
    parse_config(new, path.parent, path)  # never write a file the daemon would refuse
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(new)
            f.flush()
            os.fsync(f.fileno())
        if target.exists():
            os.chmod(tmp, target.stat().st_mode & 0o777)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def set_backend_prefer(text: str, value: str) -> str:
    """`text` (a config.toml) with `[backend] prefer = value`, everything else untouched."""
    return set_value(text, "backend", "prefer", f'"{value}"')


def write_preference(path: Path, value: str) -> None:
    """`stoker use`: `[backend] prefer` set in the config file (`write_value`)."""
    write_value(path, "backend", "prefer", f'"{value}"')


def write_require_keys(path: Path, required: bool) -> None:
    """`stoker key require [--off]`: `[frontdoor] require_keys` set in the config file (`write_value`)."""
    write_value(path, "frontdoor", "require_keys", "true" if required else "false")
