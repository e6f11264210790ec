"""`stoker status` and `stoker ps` as the daemon renders them, and `stoker --help`, before click loads.

These two are what people type most, often in a loop or a prompt, and the full command line
costs them ~200 ms of imports (click, attrs, cattrs, the status records) on top of Python's own
start. Here they cost one round trip: the socket path from the one runtime-dir rule, the socket
method `status.text` (the daemon renders the same text the full CLI would, with the renderer of
daemon/control/status_text.py), and the text printed. Only json and socket load.

Anything else (another command, an option such as `--json`), or a daemon that cannot answer so
(none running, an older daemon without `status.text`, a model it does not know), returns None:
the full command line then runs the command and says what is wrong in its usual words and exit
codes. `stoker --help` prints the text click lays out at the width it uses on a terminal of 80
columns or more (daemon/cli/help_text.py, generated and checked by docs/cli_reference.py). The reply is checked against its record's shape (`StatusText`: text a string, failed a
boolean) by hand, as building the record would cost what this path saves.
"""

from __future__ import annotations

import sys

# A status text is a few KiB; a reply larger than this is not one.
MAX_REPLY = 16 * 1024 * 1024


def request(argv: list[str]) -> dict[str, object] | None:
    """The `status.text` parameters for `stoker ps`, `stoker status` or `stoker status MODEL`; None
    for any other command line."""
    if argv == ["ps"]:
        return {"view": "ps"}
    if argv[:1] == ["status"] and len(argv) <= 2 and not any(arg.startswith("-") for arg in argv[1:]):
        return {"view": "status", **({"model": argv[1]} if len(argv) == 2 else {})}
    return None


def _reply(params: dict[str, object]) -> bytes | None:
    import json  # here, and socket: a command that is neither of the two loads neither
    import os
    import socket

    from stoker.daemon.core.runtime_path import socket_path

    frame = {"jsonrpc": "2.0", "id": 1, "method": "status.text", "params": params}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10.0)
            sock.connect(socket_path(os.environ))
            sock.sendall(json.dumps(frame).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk or len(data) > MAX_REPLY:
                    return None
                data += chunk
            return data
    except OSError:
        return None


def _help(argv: list[str]) -> bool:
    """Whether click would print exactly help_text.TEXT for this command line: `stoker --help`
    run as `stoker`, on a terminal of 80 columns or more (or a pipe), where its layout is fixed."""
    import os

    if argv not in (["--help"], ["-h"]) or os.path.basename(sys.argv[0]) != "stoker":
        return False
    import shutil

    return shutil.get_terminal_size().columns >= 80


def _print(text: str) -> bool:
    """Write `text` to stdout; False when the reader has gone (`stoker ps | head -0`): stdout then
    points at /dev/null, so that Python's own flush at exit says nothing either."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
        return True
    except BrokenPipeError:
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False


def answered(argv: list[str]) -> int | None:
    """Print the daemon's text for `stoker status` / `stoker ps` (or the help that `stoker --help`
    prints) and return the command's exit code (1 when the model described has failed, as the
    full command); None when the full command line must run instead."""
    if _help(argv):
        from stoker.daemon.cli.help_text import TEXT

        return 0 if _print(TEXT) else 1
    params = request(argv)
    if params is None:
        return None
    params["colour"] = sys.stdout.isatty()
    data = _reply(params)
    import json

    try:
        message = json.loads(data) if data is not None else None
    except ValueError:
        return None
    result = message.get("result") if isinstance(message, dict) else None
    if (
        not isinstance(result, dict)
        or not isinstance(result.get("text"), str)
        or not isinstance(result.get("failed"), bool)
    ):
        return None
    if not _print(result["text"] + "\n"):
        return 1
    return 1 if result["failed"] else 0
