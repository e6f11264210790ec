"""`stoker chat [PROMPT]`: talk to the server through the front door.

One question (PROMPT, or what stdin holds when it is not a terminal) answered and printed as it
streams; with no PROMPT on a terminal, a conversation (the REPL keeps its history). The request
goes to the front door, the stable address every client uses (docs/frontdoor.md), never to the
engine's own port: a server that restarts meanwhile holds the request, it does not fail it.

The address is the one the running daemon reports (`stoker status`: frontdoor.url), or --url.
Where the front door is off, or its port was held by another program, `stoker chat` says so and
stops (frontdoor_unavailable): it does not fall back to the engine's port and per-launch key,
which any OpenAI client may still use (`stoker status --json`: endpoint, api_key).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping

import click

from stoker.daemon.cli.output import emit, fail, json_option, reported
from stoker.daemon.cli.lifecycle import SETTLED_FAILURES, call
from stoker.daemon.core.errors import StokerError
from stoker.daemon.frontdoor.client import API_KEY_ENV, ChatAnswer, FrontDoorClient
from stoker.states.reasons import ReasonCode

REPL_HELP = "/exit or Ctrl-D leaves, /reset forgets the conversation, Ctrl-C stops an answer"


def frontdoor_url(st: Mapping[str, Any]) -> str:
    """The front door's /v1 URL from the daemon's status, or why there is none."""
    fd = st.get("frontdoor")
    if not isinstance(fd, Mapping):
        raise StokerError(
            ReasonCode.FRONTDOOR_UNAVAILABLE,
            "The running daemon reports no front door (it is older than this stoker): restart it "
            "(`stoker shutdown`, then `stoker run`).",
        )
    if fd.get("url"):
        return str(fd["url"])
    config = (st.get("config") or {}).get("path", "the config file")
    if not fd.get("enabled"):
        raise StokerError(
            ReasonCode.FRONTDOOR_UNAVAILABLE,
            f"The front door is off (`[frontdoor] enabled = false` in {config}), and `stoker chat` talks to the "
            f"server only through it. Set it to true and restart the daemon (`stoker shutdown`, then `stoker run`); "
            f"meanwhile any OpenAI client can use the engine's own endpoint and key (`stoker status --json`).",
            {"config": config},
        )
    raise StokerError(
        ReasonCode.FRONTDOOR_UNAVAILABLE,
        f"The front door is not listening on {fd.get('address')}: the port was held by another program when the "
        f"daemon started, or the config changed since (enabled, host and port are read at start). "
        f"`stoker logs | grep 'front door'` says why; free the port or set `[frontdoor] port` in {config}, then "
        f"restart the daemon.",
        {"address": fd.get("address"), "config": config},
    )


def resolve_url(url: str | None, as_json: bool) -> tuple[str, dict[str, Any] | None]:
    """--url as given, else the running daemon's front door; with the status it came from."""
    if url:
        return url, None
    st = call("status", as_json)
    with reported(as_json):
        return frontdoor_url(st), st


def _note(as_json: bool, text: str) -> None:
    if not as_json:
        click.secho(text, fg="cyan", err=True)


def _write(text: str) -> None:
    click.echo(text, nl=False)


def footer(answer: ChatAnswer) -> str:
    first = "" if answer.first_token_s is None else f", first token after {answer.first_token_s} s"
    return f"({answer.tokens} tokens in {answer.seconds} s{first}, through {answer.url})"


def one_shot(client: FrontDoorClient, prompt: str, options: dict[str, Any], as_json: bool) -> None:
    """Ask `prompt` once: the answer streamed to stdout, or one JSON document."""
    messages = options.pop("preamble") + [{"role": "user", "content": prompt}]
    shown: list[str] = []

    def show(piece: str) -> None:
        shown.append(piece)
        _write(piece)

    try:
        answer = client.chat(messages, on_text=None if as_json else show, **options)
    except StokerError as err:
        if shown:  # the error starts on its own line, after what was streamed
            click.echo("")
        fail(as_json, err)
    if as_json:
        emit(True, {"ok": True, "prompt": prompt, **answer.to_dict()})
    else:
        click.echo("")
        click.secho(footer(answer), dim=True, err=True)


def repl(client: FrontDoorClient, options: dict[str, Any]) -> None:
    """A conversation on the terminal, until /exit or Ctrl-D."""
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:  # pragma: no cover - not every Python has it
        pass
    preamble: list[dict[str, str]] = options.pop("preamble")
    history: list[dict[str, str]] = []
    click.secho(f"chatting with {options['model']} through {client.url} ({REPL_HELP})", dim=True, err=True)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            click.echo("", err=True)
            return
        except KeyboardInterrupt:
            click.echo("", err=True)
            click.secho(f"({REPL_HELP})", dim=True, err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return
        if text == "/reset":
            history.clear()
            click.secho("(conversation forgotten)", dim=True, err=True)
            continue
        turn = history + [{"role": "user", "content": text}]
        pieces: list[str] = []

        def show(piece: str) -> None:
            pieces.append(piece)
            _write(piece)

        try:
            answer = client.chat(preamble + turn, on_text=show, **options)
        except KeyboardInterrupt:
            click.echo("")
            click.secho("(answer stopped)", dim=True, err=True)
            if pieces:  # what was shown stays in the conversation
                history = turn + [{"role": "assistant", "content": "".join(pieces)}]
            continue
        except StokerError as err:
            click.echo("")
            click.secho(f"error [{err.reason}]: {err.message}", fg="red", err=True)
            continue
        click.echo("")
        history = turn + [{"role": "assistant", "content": answer.content}]


@click.command("chat")
@click.argument("prompt", required=False)
@click.option("--model", default="default", show_default=True, help="The model to ask (the server serves one).")
@click.option(
    "--key",
    envvar=API_KEY_ENV,
    show_envvar=True,
    default=None,
    help="A user API key (`stoker key create`); needed where [frontdoor] require_keys is set.",
)
@click.option("--system", default=None, help="A system prompt.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="At most this many tokens an answer.")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (the server's default otherwise).")
@click.option("--url", default=None, help="The front door's /v1 URL (default: the one the running daemon reports).")
@click.option("--timeout", default=900.0, show_default=True, help="Seconds to wait for an answer.")
@json_option
def chat(
    prompt: str | None,
    model: str,
    key: str | None,
    system: str | None,
    max_tokens: int | None,
    temperature: float | None,
    url: str | None,
    timeout: float,
    as_json: bool,
) -> None:
    """Chat through the front door: answer PROMPT (or stdin), or talk on a terminal."""
    interactive = prompt is None and sys.stdin.isatty()
    if prompt is None and not interactive:
        prompt = sys.stdin.read().strip()
        if not prompt:
            raise click.UsageError("no PROMPT given and stdin is empty")
    if interactive and as_json:
        raise click.UsageError("--json answers one PROMPT; give one (or pipe it on stdin)")
    address, st = resolve_url(url, as_json)
    if st is not None and st.get("state") not in ("ready", *SETTLED_FAILURES):
        _note(as_json, f"the server is {st.get('state')}; the front door holds the request until it is ready")
    options: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "preamble": [{"role": "system", "content": system}] if system else [],
    }
    with FrontDoorClient(address, key, timeout=timeout) as client:
        if interactive:
            repl(client, options)
        else:
            assert prompt is not None
            one_shot(client, prompt, options, as_json)


def register(cli: click.Group) -> None:
    cli.add_command(chat)
