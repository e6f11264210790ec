"""The `stoker` command line. Each command group lives in its own module and registers here."""

from __future__ import annotations

import click

from daemon.cli.output import run_guarded


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stoker", prog_name="stoker")
def cli() -> None:
    """Stoker keeps a local llama-server running on the best accelerator this machine has."""


# Each module exposes `register(group)`; listed here so the command set is visible in one place.
COMMAND_MODULES = (
    "bundle",
    "service",
    "run",
    "probe",
    "install",
    "engine",
    "snapshot",
    "telemetry",
    "tui_cmd",
    "config_cmd",
    "key",
    "models",
    "logs",
    "chat",
    "worker",
)


def _register() -> None:
    import importlib

    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"daemon.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"daemon.cli.{name}":
                continue  # a command group not built yet
            raise
        module.register(cli)


_register()


def main() -> None:
    """Console-script entry point."""
    run_guarded(cli)
