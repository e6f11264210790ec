"""One converter between attrs records and JSON values, for every seam Stoker has.

Socket replies and parameters, store rows, machine data, history events and evidence all cross
a seam as JSON; each is rebuilt on the other side by `structure(value, RecordType)` and written
by `unstructure(record)`, never by `Record(**row)`. A field the other side does not know is
ignored (a CLI older or newer than its daemon keeps working); a field a record needs and the
value lacks raises `MissingFields`, which names them, so the caller can say what is missing
rather than fail on a TypeError deep inside.
"""

from __future__ import annotations

import enum
from pathlib import PurePath
from typing import Any, TypeVar

import cattrs
from cattrs.preconf.json import make_converter

from stoker.states.reasons import ReasonCode, stored_reason

T = TypeVar("T")


class MissingFields(ValueError):
    """A value lacks fields the record it should become requires (or has them of the wrong type)."""

    def __init__(self, record: type, problems: list[str]) -> None:
        self.record = record
        self.problems = problems
        super().__init__(f"{record.__name__}: {'; '.join(problems)}")


def _make() -> cattrs.Converter:
    made = make_converter(forbid_extra_keys=False)
    # A reason code whose plugin was uninstalled since it was stored is still read.
    made.register_structure_hook(ReasonCode, lambda value, _: stored_reason(value))
    made.register_unstructure_hook(ReasonCode, lambda code: code.value)
    made.register_structure_hook_func(
        lambda cls: isinstance(cls, type) and issubclass(cls, PurePath), lambda value, cls: cls(value)
    )
    made.register_unstructure_hook_func(lambda cls: isinstance(cls, type) and issubclass(cls, PurePath), str)
    made.register_unstructure_hook_func(
        lambda cls: isinstance(cls, type) and issubclass(cls, enum.Enum), lambda member: member.value
    )
    return made


converter = _make()


def structure(value: Any, record: type[T]) -> T:
    """`value` (parsed JSON) as a `record`; MissingFields names what it lacks or has wrong."""
    try:
        return converter.structure(value, record)
    except cattrs.ClassValidationError as exc:
        raise MissingFields(record, _problems(exc)) from exc
    except (TypeError, ValueError, KeyError) as exc:
        raise MissingFields(record, [str(exc)]) from exc


def unstructure(value: Any) -> Any:
    """A JSON-ready copy of records, enums, paths, tuples and sets."""
    return converter.unstructure(value)


def _problems(exc: cattrs.ClassValidationError) -> list[str]:
    """cattrs' own sentences: `required field missing @ $.path`."""
    return [str(line) for line in cattrs.transform_error(exc)] or [str(exc)]
