"""The `stoker` command line. Each command group lives in its own module and registers here."""

from __future__ import annotations

import click

from daemon.cli.output import run_guarded


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stoker", prog_name="stoker")
def cli() -> None:
    """Stoker keeps a local llama-server running on the best accelerator this machine has."""


def _register() -> None:
    # Imported here so that a broken optional group never stops `stoker --help`.
    from daemon.cli import bundle

    cli.add_command(bundle.bundle)
    try:
        from daemon.cli import service
    except ImportError:  # pragma: no cover - while the daemon commands are being built
        return
    service.register(cli)


_register()


def main() -> None:
    """Console-script entry point."""
    run_guarded(cli)
