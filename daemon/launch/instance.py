"""One server instance: its name, and the store ids and files that belong to it alone.

Each llama-server the daemon runs is an instance with its own launch machine, fallback
machine, identity file and log, so that a second instance (another model, an RPC worker) is
constructed beside the first without touching it: one per configured model (its NAME is the
instance's, daemon/config/instances.py). A config without [models] runs `default`, whose
machines keep the ids the store has always had (`launch`, `fallback`), so that history and
`stoker history --machine launch` read the same before and after. Another instance's are
`launch:<name>` and `fallback:<name>`, like `install:<slot>` and `probe:<backend>`.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from stoker.daemon.config.placement import model_name
from stoker.daemon.config.instances import DEFAULT_INSTANCE
from stoker.daemon.core.paths import StokerPaths


@attrs.frozen
class ServerInstance:
    """A server instance's name and what is keyed by it."""

    name: str = attrs.field(default=DEFAULT_INSTANCE, converter=model_name)

    @property
    def is_default(self) -> bool:
        return self.name == DEFAULT_INSTANCE

    @classmethod
    def of_machine(cls, kind: str, machine_id: str) -> ServerInstance | None:
        """The instance whose machine of `kind` has the store id `machine_id` (None: not one)."""
        if machine_id == kind:
            return cls()
        prefix, _, name = machine_id.partition(":")
        try:
            return cls(name) if prefix == kind and name else None
        except ValueError:
            return None

    def machine_id(self, kind: str) -> str:
        """The store id of this instance's machine of `kind` (`launch`, `fallback`)."""
        return kind if self.is_default else f"{kind}:{self.name}"

    def identity_file(self, paths: StokerPaths) -> Path:
        """Where the running server's identity is recorded (what a restarted daemon proves)."""
        return paths.runtime_dir / ("server.json" if self.is_default else f"server-{self.name}.json")

    def log_path(self, paths: StokerPaths) -> Path:
        """The server's own log (stdout and stderr), appended to across launches."""
        return paths.logs_dir / ("llama-server.log" if self.is_default else f"llama-server-{self.name}.log")

    def launch_root(self, paths: StokerPaths) -> Path:
        """Where this instance's launch directories are made: its own, so that the start-up
        sweep of unrecorded launches (daemon/engine/orphans.py) never touches another's."""
        return paths.runtime_dir / ("launch" if self.is_default else f"launch-{self.name}")
