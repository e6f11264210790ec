"""The one way a socket method changes the config file: refuse while it is invalid, write the
setting (daemon/config/edit.py), load what it makes, apply that at once (the hot-reload
watcher then finds nothing new), and refuse with config_invalid wherever one step fails."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from stoker.daemon.config.model import ConfigError, load_config
from stoker.daemon.control.controlled import ControlledDaemon
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode


def refuse_while_invalid(daemon: ControlledDaemon, command: str) -> None:
    """Refuse `command` while the config file is invalid: the user fixes it first."""
    if daemon.config_problems:
        raise StokerError(
            ReasonCode.CONFIG_INVALID,
            f"The config file is invalid; fix it before `{command}`.",
            {"problems": list(daemon.config_problems)},
        )


def rewrite_config(daemon: ControlledDaemon, write: Callable[[Path], None], refused: str) -> bool:
    """Write a setting into the config file (`write` edits the file at the path it is given) and
    apply the config it makes; `refused` opens the error when the daemon refuses that config
    (the previous one stays in force). Returns whether the config in force changed."""
    path = daemon.paths.config_file
    try:
        write(path)
        new = load_config(path)
    except ConfigError as err:
        raise StokerError(ReasonCode.CONFIG_INVALID, err.message, err.evidence) from None
    except OSError as err:
        raise StokerError(ReasonCode.CONFIG_INVALID, f"Cannot write {path}: {err}.", {"path": str(path)}) from None
    changed = new != daemon.config
    if not daemon.on_config_change(new):
        raise StokerError(
            ReasonCode.CONFIG_INVALID,
            refused + "; ".join(daemon.config_problems),
            {"problems": list(daemon.config_problems), "config_path": str(path)},
        )
    return changed
