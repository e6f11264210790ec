"""Socket methods declare their parameters once; one validator checks every request against them.

A handler is wrapped by `@method(name, Param(...), ..., errors=(...))`: the declaration says each
parameter's name, type, bounds, whether it is required and what it means, and the reason codes
the method can answer with. `Method.validate` refuses, as `bad_request` and before the handler
runs, whatever a declaration does not allow: unknown keys, a missing required one, a wrong type
(a JSON `true` is not an integer), a number beyond SQLite's 64-bit integers (the store would
raise OverflowError deep inside), a value outside its bounds or choices. A `null` for an
optional parameter means "not given". The handler then reads a complete mapping: every declared
name is present, with its default where the request left it out.

The same declarations generate docs/protocol-methods.md (docs/protocol_methods.py), so the
reference cannot drift from what the daemon accepts.
"""

from __future__ import annotations

import enum
import inspect
import math
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Collection, Mapping

import attrs

from stoker.daemon.core.errors import StokerError
from stoker.states.reasons import ReasonCode

if TYPE_CHECKING:
    from stoker.daemon.control.controlled import ControlledDaemon

# SQLite stores integers as 64-bit signed; Python's sqlite3 raises OverflowError beyond them.
SQLITE_INT_MIN = -(2**63)
SQLITE_INT_MAX = 2**63 - 1


class Kind(enum.Enum):
    """A parameter's JSON type; the value is how the reference names it."""

    INTEGER = "integer"
    NUMBER = "number"
    BOOLEAN = "boolean"
    STRING = "string"
    STRINGS = "array of strings"


@attrs.frozen
class Choices:
    """The values a string may take when only the running daemon knows them (loaded backends)."""

    doc: str
    values: Callable[[ControlledDaemon], Collection[str]]


@attrs.frozen
class Param:
    """One parameter of a socket method: its name, JSON type, bounds and meaning."""

    name: str
    kind: Kind
    doc: str
    required: bool = False
    default: Any = None
    low: int | None = None
    high: int | None = None
    choices: Choices | None = None

    def describe(self) -> str:
        """Type and bounds in words, for the reference and for error messages."""
        text = self.kind.value
        if self.low is not None and self.high is not None:
            text += f", {self.low} to {self.high}"
        elif self.low is not None:
            text += f", at least {self.low}"
        elif self.high is not None:
            text += f", at most {self.high}"
        if self.choices is not None:
            text += f", {self.choices.doc}"
        return text

    def check(self, value: Any, daemon: ControlledDaemon) -> Any:
        """`value` if this parameter allows it; else StokerError(bad_request) saying why."""
        if not _has_kind(value, self.kind):
            raise self._refuse(value, f"must be {_article(self.kind.value)}")
        if isinstance(value, int) and not isinstance(value, bool) and not SQLITE_INT_MIN <= value <= SQLITE_INT_MAX:
            raise self._refuse(value, "is beyond the 64-bit integers the daemon stores")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise self._refuse(value, f"must be {self.describe()}")
        if self.choices is not None:
            allowed = self.choices.values(daemon)
            items = value if isinstance(value, list) else [value]
            wrong = [item for item in items if item not in allowed]
            if wrong:
                raise self._refuse(value, f"must be {self.choices.doc}: {', '.join(allowed)}")
        return value

    def _refuse(self, value: Any, why: str) -> StokerError:
        shown = repr(value)
        return StokerError(
            ReasonCode.BAD_REQUEST,
            f"The parameter {self.name!r} {why}; got {shown[:80]}.",
            {"param": self.name, "expected": self.describe(), "got": shown[:200]},
        )


def _has_kind(value: Any, kind: Kind) -> bool:
    if kind is Kind.BOOLEAN:
        return isinstance(value, bool)
    if isinstance(value, bool):  # JSON true is not 1
        return False
    if kind is Kind.INTEGER:
        return isinstance(value, int)
    if kind is Kind.NUMBER:
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
    if kind is Kind.STRING:
        return isinstance(value, str)
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _article(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


Handler = Callable[["ControlledDaemon", Mapping[str, Any]], Awaitable[Any]]


@attrs.frozen
class Method:
    """A socket method: its handler, its parameters and the reasons it can fail with.

    `errors` lists the reason codes a caller should expect besides bad_request and
    internal_error (which any method can answer); a backend family is written with `<backend>`.
    The handler's docstring says what the method does and, after "Reply:", what it answers.
    """

    name: str
    handler: Handler
    params: tuple[Param, ...] = ()
    errors: tuple[str, ...] = ()
    # The record the reply is, or `tuple[Record, ...]` for a list of them (docs/protocol-methods.md
    # lists their fields); a client reads it with `call(name, returns=result)`.
    result: Any = None

    @property
    def doc(self) -> str:
        """The handler's docstring, dedented."""
        return inspect.cleandoc(self.handler.__doc__ or "")

    def validate(self, daemon: ControlledDaemon, given: Mapping[str, Any]) -> dict[str, Any]:
        """Every declared parameter, checked, with defaults filled; bad_request otherwise."""
        declared = {param.name: param for param in self.params}
        unknown = sorted(set(given) - set(declared))
        if unknown:
            takes = f"takes {', '.join(sorted(declared))}" if declared else "takes no parameters"
            raise StokerError(
                ReasonCode.BAD_REQUEST,
                f"{self.name} {takes}; unknown: {', '.join(unknown)}.",
                {"method": self.name, "unknown": unknown, "allowed": sorted(declared)},
            )
        checked: dict[str, Any] = {}
        for param in self.params:
            value = given.get(param.name)
            if value is None:
                if param.required:
                    raise StokerError(
                        ReasonCode.BAD_REQUEST,
                        f"{self.name} needs the parameter {param.name!r} ({param.describe()}).",
                        {"method": self.name, "missing": param.name},
                    )
                checked[param.name] = param.default
            else:
                checked[param.name] = param.check(value, daemon)
        return checked

    async def __call__(self, daemon: ControlledDaemon, given: Mapping[str, Any]) -> Any:
        """Validate `given`, then run the handler on the complete parameters."""
        return await self.handler(daemon, self.validate(daemon, given))


def method(name: str, *params: Param, errors: tuple[str, ...] = (), result: Any = None) -> Callable[[Handler], Method]:
    """Declare a handler as the socket method `name` (registers nothing: see daemon.control.methods)."""

    def declare(handler: Handler) -> Method:
        return Method(name, handler, tuple(params), tuple(errors), result)

    return declare
