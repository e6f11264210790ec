"""Where Stoker keeps its files: platformdirs by default, all under STOKER_HOME when set.

The data, log, snapshot and runtime directories are the user's alone (0700, their files 0600):
KV snapshots hold whole conversations as token ids, the database and the logs hold prompts'
traces and paths. `make_private` creates them so and tightens what an older Stoker left open;
the daemon also runs with umask 077, so what it and its server create later is private from
the start.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal

import attrs
import platformdirs

from stoker.daemon.core.runtime_path import APP, SOCKET_NAME, runtime_dir

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


class _Below:
    """A path named `name` below the root directory `root` of a StokerPaths, read as an attribute."""

    def __init__(self, root: Literal["config_dir", "data_dir", "runtime_dir", "cache_dir"], name: str) -> None:
        self.root, self.name = root, name

    def __get__(self, paths: StokerPaths, owner: object = None) -> Path:
        return Path(getattr(paths, self.root)) / self.name


@attrs.frozen
class StokerPaths:
    config_dir: Path
    data_dir: Path
    runtime_dir: Path
    cache_dir: Path

    @classmethod
    def from_env(cls, environ: os._Environ[str] | dict[str, str] | None = None) -> "StokerPaths":
        """Resolve the paths; STOKER_HOME puts config, data and runtime under one directory.

        The build cache stays in the user cache dir even with STOKER_HOME (tests set a fresh
        STOKER_HOME each, and an engine build costs minutes); STOKER_CACHE_DIR overrides it.
        """
        env = os.environ if environ is None else environ
        cache = Path(env["STOKER_CACHE_DIR"]) if env.get("STOKER_CACHE_DIR") else Path(platformdirs.user_cache_dir(APP))
        runtime = Path(runtime_dir(env))
        home = env.get("STOKER_HOME")
        if home:
            root = Path(home).absolute()
            return cls(root / "config", root / "data", runtime, cache)
        return cls(Path(platformdirs.user_config_dir(APP)), Path(platformdirs.user_data_dir(APP)), runtime, cache)

    # Stoker's files and directories, each below one of the four roots.
    config_file = _Below("config_dir", "config.toml")
    db_file = _Below("data_dir", "stoker.db")
    bundles_dir = _Below("data_dir", "bundles")
    snapshots_dir = _Below("data_dir", "snapshots")
    models_dir = _Below("data_dir", "models")
    logs_dir = _Below("data_dir", "logs")
    socket_path = _Below("runtime_dir", SOCKET_NAME)
    lock_file = _Below("data_dir", "daemon.lock")
    build_cache_dir = _Below("cache_dir", "builds")
    source_cache_dir = _Below("cache_dir", "sources")

    @property
    def private_dirs(self) -> tuple[Path, ...]:
        """The directories only their owner may read: data, logs, snapshots, runtime."""
        return (self.data_dir, self.logs_dir, self.snapshots_dir, self.runtime_dir)

    def make_private(self) -> list[str]:
        """Create the private directories 0700 and tighten them and what they hold (the database,
        logs, snapshots, identity records; the data dir's own files, not its bundles and models
        beneath) to 0700/0600; the paths it tightened. What is not the user's own is left alone
        (the control socket refuses a runtime dir someone else owns)."""
        tightened: list[str] = []
        for directory in self.private_dirs:
            directory.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
            deep = directory != self.data_dir
            for root, dirs, files in os.walk(directory):
                for path, mode in [(Path(root), PRIVATE_DIR_MODE)] + [
                    (Path(root, f), PRIVATE_FILE_MODE) for f in files
                ]:
                    try:
                        if _tighten(path, mode):
                            tightened.append(str(path))
                    except OSError:
                        continue  # gone meanwhile, or a read-only mount
                if not deep:
                    dirs.clear()
        return tightened


def _tighten(path: Path, mode: int) -> bool:
    """Drop group and other bits (never adds any); True if it changed the mode."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.getuid() or not stat.S_IMODE(st.st_mode) & 0o077:
        return False
    os.chmod(path, stat.S_IMODE(st.st_mode) & mode)
    return True
