"""Where Stoker keeps its files: platformdirs by default, all under STOKER_HOME when set."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import attrs
import platformdirs

APP = "stoker"


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
        home = env.get("STOKER_HOME")
        if home:
            root = Path(home).absolute()
            return cls(root / "config", root / "data", root / "run", cache)
        runtime = env.get("XDG_RUNTIME_DIR")
        if runtime:
            runtime_dir = Path(runtime) / APP
        elif sys.platform == "darwin":
            runtime_dir = Path(platformdirs.user_runtime_dir(APP))
        else:
            # No XDG runtime dir (a container, a cron job): a per-user dir that control.py
            # creates 0700 and refuses if someone else owns it.
            runtime_dir = Path(tempfile.gettempdir()) / f"{APP}-{os.getuid()}"
        return cls(Path(platformdirs.user_config_dir(APP)), Path(platformdirs.user_data_dir(APP)), runtime_dir, cache)

    @property
    def config_file(self) -> Path:
        return self.config_dir / "config.toml"

    @property
    def db_file(self) -> Path:
        return self.data_dir / "stoker.db"

    @property
    def bundles_dir(self) -> Path:
        return self.data_dir / "bundles"

    @property
    def snapshots_dir(self) -> Path:
        return self.data_dir / "snapshots"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def logs_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def socket_path(self) -> Path:
        return self.runtime_dir / "stoker.sock"

    @property
    def lock_file(self) -> Path:
        return self.data_dir / "daemon.lock"

    @property
    def build_cache_dir(self) -> Path:
        return self.cache_dir / "builds"

    @property
    def source_cache_dir(self) -> Path:
        return self.cache_dir / "sources"
