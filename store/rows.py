"""How a SQLite row becomes a frozen record: its JSON columns decoded, then the one converter.

Every record's `from_row` reads through `record_from_row`, so rows cross into the daemon the
way every other seam does (states/convert.py). A column an older daemon did not have is
missing from its rows, and NULL in rows written before a migration added it: either way the
record's default stands in. A column this reader does not know (a newer daemon's) is ignored.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Iterable, Mapping, Self, TypeVar, cast

import attrs
from attrs import AttrsInstance

from stoker.states.convert import structure

T = TypeVar("T")


def record_from_row(row: Mapping[str, Any], record: type[T], *, json_columns: Iterable[str] = ()) -> T:
    """`row` as a `record`: `json_columns` decoded from their text (empty when NULL)."""
    values = dict(row)
    for column in json_columns:
        text = values.get(column)
        values[column] = json.loads(text) if isinstance(text, (str, bytes)) and text else (text or {})
    for field in attrs.fields(cast("type[AttrsInstance]", record)):
        if values.get(field.name, 0) is None and field.default is not attrs.NOTHING:
            del values[field.name]  # NULL in a column added later: the record's default
    return structure(values, record)


class StoredRecord:
    """The base of the attrs records read back from a table: `from_row` through `record_from_row`,
    with the columns the table keeps as JSON text named once in `json_columns`."""

    json_columns: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return record_from_row(row, cls, json_columns=cls.json_columns)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(cast(AttrsInstance, self))
