"""Where the daemon's control socket is, in terms cheap enough for every `stoker` command.

The one rule for the runtime directory: StokerPaths (daemon/core/paths.py) builds its paths on
it, and `stoker status` / `stoker ps` find the socket with it before attrs, platformdirs or
pathlib load (daemon/cli/quick.py).
"""

from __future__ import annotations

import os
import sys

APP = "stoker"
SOCKET_NAME = "stoker.sock"


def runtime_dir(env: os._Environ[str] | dict[str, str]) -> str:
    """The runtime directory: `$STOKER_HOME/run`, else `$XDG_RUNTIME_DIR/stoker`, else the
    platform's (macOS), else a per-user directory in the temporary directory (a container, a
    cron job), which the daemon creates 0700 and refuses if someone else owns it."""
    home = env.get("STOKER_HOME")
    if home:
        return os.path.join(os.getcwd(), home, "run")  # as Path(home).absolute() / "run"
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, APP)
    if sys.platform == "darwin":
        import platformdirs

        return platformdirs.user_runtime_dir(APP)
    import tempfile  # here: ~9 ms of every `stoker` command that names no such dir

    return os.path.join(tempfile.gettempdir(), f"{APP}-{os.getuid()}")


def socket_path(env: os._Environ[str] | dict[str, str]) -> str:
    """The control socket's path."""
    return os.path.join(runtime_dir(env), SOCKET_NAME)
