"""The `stoker` command line. Each command group lives in its own module and registers here."""

from __future__ import annotations

import click

from stoker.daemon.cli.output import run_guarded


# Command -> the module whose `register(group)` adds it. A command's module is imported when the
# command runs (or `--help` lists them), never all of them at start: importing every group took
# ~0.9 s of each `stoker` run (numpy and gguf through the bundle modules), a cost every command paid.
# tests/unit/test_cli_lazy.py checks this table against what the modules really register.
COMMANDS = {
    "bundle": "bundle",
    "daemon": "lifecycle",
    "service": "systemd",
    "status": "lifecycle",
    "up": "lifecycle",
    "down": "lifecycle",
    "restart": "lifecycle",
    "shutdown": "lifecycle",
    "history": "lifecycle",
    "ps": "model_view",
    "show": "model_view",
    "run": "run",
    "probe": "probe",
    "use": "probe",
    "install": "install",
    "engine": "engine",
    "snapshot": "snapshot",
    "telemetry": "telemetry",
    "tui": "tui_cmd",
    "config": "config_cmd",
    "key": "key",
    "pull": "models",
    "models": "models",
    "rm": "models",
    "logs": "logs",
    "chat": "chat",
    "worker": "worker",
}
COMMAND_MODULES = tuple(dict.fromkeys(COMMANDS.values()))


class LazyGroup(click.Group):
    """The `stoker` group: each command comes from its module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            load(COMMANDS[cmd_name], self)
        return self.commands.get(cmd_name)


def load(module_name: str, group: click.Group) -> None:
    """Register one module's commands on `group` (once)."""
    import importlib

    loaded = group.__dict__.setdefault("_stoker_loaded", set())
    if module_name not in loaded:
        loaded.add(module_name)
        importlib.import_module(f"stoker.daemon.cli.{module_name}").register(group)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stoker", prog_name="stoker")
def cli() -> None:
    """Stoker keeps a local llama-server running on the best accelerator this machine has."""


def main() -> None:
    """Console-script entry point."""
    run_guarded(cli)
