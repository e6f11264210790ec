"""`stoker service install | status | uninstall`: Stoker as a systemd service.

The unit is written from the command that runs now, so its ExecStart names the `stoker` the
user installed (a pipx venv, a wheel in a venv, the tree's `.venv`), and it is checked with
`systemd-analyze verify` before it replaces anything. A user unit by default
(`~/.config/systemd/user`, `systemctl --user`); `--system` writes one for the whole machine
that runs the daemon as the invoking user.
"""

from __future__ import annotations

import getpass
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import click
from stoker.daemon.cli.output import emit, fail, invoked_path, json_option
from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

UNIT_NAME = "stoker.service"
SYSTEM_DIR = Path("/etc/systemd/system")
# Environment a unit passes on: where Stoker keeps its state, and the front door's address.
PASSED_ENV = ("STOKER_HOME", "STOKER_CACHE_DIR", "STOKER_HOST", "STOKER_PORT")


@attrs.frozen
class UnitPlace:
    """Where the unit lives and which systemctl manages it."""

    path: Path
    system: bool

    @classmethod
    def choose(cls, system: bool) -> UnitPlace:
        if system:
            return cls(SYSTEM_DIR / UNIT_NAME, True)
        config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return cls(config / "systemd" / "user" / UNIT_NAME, False)

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.system else ["--user"]), *args]


def exec_start() -> str:
    """The command line that starts the daemon with the `stoker` running now."""
    path = invoked_path()
    parts = [str(path), "daemon"] if path is not None else [sys.executable, "-m", "stoker.daemon", "daemon"]
    return " ".join(_quoted(p) for p in parts)


def _quoted(word: str) -> str:
    return f'"{word}"' if any(c.isspace() for c in word) else word


def unit_text(system: bool, run_as: str | None) -> str:
    """The unit: Type=notify (the daemon says READY=1 and pings the watchdog), stop by SIGTERM."""
    env = [f"Environment={name}={_quoted(os.environ[name])}" for name in PASSED_ENV if os.environ.get(name)]
    lines = [
        "# Written by `stoker service install`; `stoker service uninstall` removes it.",
        "[Unit]",
        "Description=Stoker: keeps a local llama-server running on the best accelerator",
        "After=network.target",
        "",
        "[Service]",
        # The daemon sends READY=1 once its servers are up, STOPPING=1 when it stops, and
        # WATCHDOG=1 from its event loop at half of WatchdogSec.
        "Type=notify",
        "NotifyAccess=main",
        f"ExecStart={exec_start()}",
        *env,
        *([f"User={run_as}"] if system and run_as else []),
        "WatchdogSec=30",
        # Loading a large model (or a first engine build) can take minutes before READY=1.
        "TimeoutStartSec=900",
        # SIGTERM to the daemon alone: it saves KV snapshots and stops its engines itself.
        "KillMode=mixed",
        "TimeoutStopSec=60",
        "Restart=on-failure",
        "RestartSec=2",
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if system else 'default.target'}",
        "",
    ]
    return "\n".join(lines)


def verify(text: str) -> str | None:
    """systemd-analyze's objection to the unit, or None when it passes (or is not installed)."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        candidate = Path(tmp) / UNIT_NAME
        candidate.write_text(text)
        done = subprocess.run(
            [analyze, "verify", str(candidate)], check=False, capture_output=True, text=True, timeout=60
        )
    return None if done.returncode == 0 else (done.stderr or done.stdout).strip()


def systemctl(place: UnitPlace, *args: str) -> subprocess.CompletedProcess[str] | None:
    """Run systemctl; None when there is no systemctl at all."""
    if shutil.which("systemctl") is None:
        return None
    return subprocess.run(place.systemctl(*args), check=False, capture_output=True, text=True, timeout=120)


def _manager_unavailable(place: UnitPlace, said: str) -> StokerError:
    return StokerError(
        ReasonCode.SERVICE_MANAGER_UNAVAILABLE,
        f"The unit is at {place.path}, but systemd cannot be reached here ({said or 'no systemctl'}). "
        "Start Stoker with `stoker daemon` instead, or run this again where systemd runs.",
        {"unit": str(place.path)},
    )


def _manage(place: UnitPlace, *args: str) -> None:
    done = systemctl(place, *args)
    if done is None or done.returncode != 0:
        raise _manager_unavailable(place, "" if done is None else (done.stderr or done.stdout).strip())


@attrs.frozen
class ServiceReport:
    """What a service command did or found."""

    unit: str
    installed: bool
    changed: bool
    started: bool
    active: str | None  # systemctl is-active's word, when systemd answers
    enabled: str | None


def _state(place: UnitPlace, installed: bool, changed: bool, started: bool) -> ServiceReport:
    def ask(verb: str) -> str | None:
        done = systemctl(place, verb, UNIT_NAME)
        word = done.stdout.strip() if done is not None else ""
        return word or None

    return ServiceReport(str(place.path), installed, changed, started, ask("is-active"), ask("is-enabled"))


def _human(report: ServiceReport) -> str:
    if not report.installed:
        return f"not installed (no {report.unit})"
    head = f"{'wrote' if report.changed else 'unchanged'} {report.unit}"
    manager = f"active: {report.active or '?'}, enabled: {report.enabled or '?'}"
    return f"{head}\n{manager}" + ("\nstarted" if report.started else "")


@click.group()
def service() -> None:
    """Run Stoker as a systemd service (a user unit; --system for the machine)."""


system_option = click.option("--system", is_flag=True, help="A system unit in /etc/systemd/system (as root).")


@service.command()
@system_option
@click.option("--run-as", default=None, help="With --system: the user the daemon runs as (default: the invoking user).")
@click.option("--no-start", is_flag=True, help="Write and check the unit only; do not enable or start it.")
@json_option
def install(system: bool, run_as: str | None, no_start: bool, as_json: bool) -> None:
    """Write the unit (checked by systemd-analyze), enable it and start it."""
    place = UnitPlace.choose(system)
    text = unit_text(system, run_as or os.environ.get("SUDO_USER") or getpass.getuser())
    try:
        objection = verify(text)
        if objection is not None:
            raise StokerError(
                ReasonCode.SERVICE_UNIT_INVALID,
                f"systemd-analyze refuses the unit, so nothing was written: {objection}",
                {"exec_start": exec_start()},
            )
        changed = not place.path.exists() or place.path.read_text() != text
        if changed:
            place.path.parent.mkdir(parents=True, exist_ok=True)
            staged = place.path.with_suffix(".tmp")
            staged.write_text(text)
            staged.replace(place.path)
        if not no_start:
            _manage(place, "daemon-reload")
            _manage(place, "enable", "--now", UNIT_NAME)
        report = _state(place, True, changed, not no_start)
        emit(as_json, attrs.asdict(report), lambda _: _human(report))
    except StokerError as err:
        fail(as_json, err)


@service.command()
@system_option
@json_option
def status(system: bool, as_json: bool) -> None:
    """Where the unit is and what systemd says of it."""
    place = UnitPlace.choose(system)
    report = _state(place, place.path.exists(), False, False)
    emit(as_json, attrs.asdict(report), lambda _: _human(report).replace("unchanged ", "unit "))


@service.command()
@system_option
@json_option
def uninstall(system: bool, as_json: bool) -> None:
    """Stop and disable the service, then remove its unit."""
    place = UnitPlace.choose(system)
    installed = place.path.exists()
    if installed:
        # Where systemd does not run, nothing can be running under it: the unit still goes.
        systemctl(place, "disable", "--now", UNIT_NAME)
        place.path.unlink()
        systemctl(place, "daemon-reload")
    removed = ServiceReport(str(place.path), False, installed, False, None, None)
    emit(as_json, attrs.asdict(removed), lambda _: _removed(removed))


def _removed(report: ServiceReport) -> str:
    return f"removed {report.unit}" if report.changed else f"not installed (no {report.unit})"


def register(cli: click.Group) -> None:
    cli.add_command(service)
