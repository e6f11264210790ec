"""Write docs/protocol-methods.md from the socket methods' declarations: `python docs/protocol_methods.py [--check]`."""

from __future__ import annotations

import collections.abc
import enum
import json
import sys
import types
import typing
from pathlib import Path
from typing import Any

import attrs

from stoker.daemon.control.methods import METHODS
from stoker.daemon.control.params import Method, Param
from stoker.daemon.control.protocol import SUBSCRIBE

PAGE = Path(__file__).resolve().parent / "protocol-methods.md"

INTRO = """# Socket methods

Every method the daemon answers on its control socket, with its parameters, its reply and the
reason codes it can fail with. Generated from the methods' declarations
(`daemon/control/methods.py`, the handlers in `daemon/control/handlers/`) by
`python docs/protocol_methods.py`; never edit by hand. Framing, error replies and the event
stream are in [protocol.md](protocol.md); what each reason means is in
[reason-codes.md](reason-codes.md).

A reply that is a record lists its fields with their JSON types below the method; a client
reads it with `ControlClient.call(method, returns=Record)` (one converter, states/convert.py):
fields it does not know are ignored, so a newer daemon may add some, and a field it needs
that an older daemon does not send is `daemon_version_skew`, naming the field.

Parameters are by name (`params` is an object). Before a method runs, one validator refuses with
`bad_request`: a parameter the method does not declare, a missing required one, a value of the
wrong JSON type (`true` is not an integer), an integer beyond the 64-bit range the daemon stores,
and a value outside its bounds or choices. `null` for an optional parameter is the same as
leaving it out. Any method may also answer `internal_error` (a bug; the daemon log has the
traceback).
"""

SUBSCRIBE_SECTION = f"""## `{SUBSCRIBE}`

Turn this connection into the daemon's event stream (the control server answers it itself).
See [protocol.md](protocol.md#the-event-stream-subscribe) for the events, their order and what
happens to a subscriber that falls behind.

Parameters: none.

Reply:

```text
{{"subscribed": true, "seq": S}}, then event notifications (the first has seq S + 1).
```
"""


def _summary_body_reply(declared: Method) -> tuple[str, str, str]:
    doc = declared.doc
    text, _, reply = doc.partition("Reply:")
    summary, _, body = text.strip().partition("\n\n")
    return " ".join(summary.split()), body.strip(), reply.strip()


def _param_row(param: Param) -> str:
    default = (
        ""
        if param.default is None
        else f"`{str(param.default).lower() if isinstance(param.default, bool) else param.default}`"
    )
    required = "yes" if param.required else "no"
    return f"| `{param.name}` | {param.describe()} | {required} | {default} | {param.doc} |"


def _section(declared: Method, described: dict[type, str]) -> str:
    summary, body, reply = _summary_body_reply(declared)
    lines = [f"## `{declared.name}`", "", summary, ""]
    if body:
        lines += [" ".join(paragraph.split()) + "\n" for paragraph in body.split("\n\n")]
    if declared.params:
        lines += ["| parameter | type | required | default | meaning |", "|---|---|---|---|---|"]
        lines += [_param_row(param) for param in declared.params]
        lines.append("")
    else:
        lines += ["Parameters: none.", ""]
    lines += ["Reply:", "", "```text", reply, "```", ""]
    if declared.result is not None:
        lines += _record_tables(declared.result, declared.name, described)
    errors = ["bad_request", *declared.errors]
    lines += ["Errors: " + ", ".join(f"`{reason}`" for reason in errors) + ".", ""]
    return "\n".join(lines)


def _type_name(hint: Any) -> str:
    """A field's type as the reference writes it: records by name, containers with their items."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in args)
    if origin is typing.Literal:
        return " or ".join(f"`{json.dumps(arg)}`" for arg in args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return f"list of {_type_name(args[0])}"
    if origin in (dict, collections.abc.Mapping):
        return "object"
    if hint is type(None):
        return "null"
    if hint is typing.Any:
        return "any"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    if hint in names:
        return names[hint]
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "string"
    return f"`{hint.__name__}`" if isinstance(hint, type) else str(hint)


def _records_in(hint: Any) -> list[type]:
    if isinstance(hint, type) and attrs.has(hint):
        return [hint]
    return [found for arg in typing.get_args(hint) for found in _records_in(arg)]


def _record_tables(result: Any, method: str, described: dict[type, str]) -> list[str]:
    """The reply record's fields with their types (a list of records: says so first), then each
    record it holds; a record an earlier method's section has described is linked to it.
    `described` maps each record described so far to that method."""
    lines = [] if isinstance(result, type) else [f"The reply is a {_type_name(result)}.", ""]
    queue = _records_in(result)
    while queue:
        current = queue.pop(0)
        if current in described:
            if described[current] != method:
                first = described[current]
                lines += [f"`{current.__name__}`: as in [`{first}`](#{first.replace('.', '')}).", ""]
            continue
        described[current] = method
        hints = typing.get_type_hints(current)
        doc = " ".join((current.__doc__ or "").split())
        lines += [f"`{current.__name__}`: {doc}", "", "| field | type |", "|---|---|"]
        for field in attrs.fields(current):
            lines.append(f"| `{field.name}` | {_type_name(hints[field.name])} |")
            queue += [found for found in _records_in(hints[field.name]) if found not in described]
        lines.append("")
    return lines


def document() -> str:
    names = sorted(METHODS)
    index = ["| method | what it does |", "|---|---|"]
    for name in [*names, SUBSCRIBE]:
        anchor = name.replace(".", "")
        what = _summary_body_reply(METHODS[name])[0] if name in METHODS else "Stream the daemon's events."
        index.append(f"| [`{name}`](#{anchor}) | {what} |")
    parts = [INTRO, "\n".join(index) + "\n"]
    described: dict[type, str] = {}
    parts += [_section(METHODS[name], described) for name in names]
    parts.append(SUBSCRIBE_SECTION)
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    from page_check import write_or_check  # docs/ is sys.path[0] when run as a script

    return write_or_check(PAGE, document(), argv, "docs/protocol_methods.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
