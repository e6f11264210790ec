"""How a SQLite row becomes a frozen record: its JSON columns decoded, then the one converter.

Every record's `from_row` reads through `record_from_row`, so rows cross into the daemon the
way every other seam does (states/convert.py). A column an older daemon did not have is
missing from its rows, and NULL in rows written before a migration added it: either way the
record's default stands in. A column this reader does not know (a newer daemon's) is ignored.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping, TypeVar

import attrs
from attrs import AttrsInstance

from stoker.states.convert import structure

T = TypeVar("T", bound=AttrsInstance)


def record_from_row(row: Mapping[str, Any], record: type[T], *, json_columns: Iterable[str] = ()) -> T:
    """`row` as a `record`: `json_columns` decoded from their text (empty when NULL)."""
    values = dict(row)
    for column in json_columns:
        text = values.get(column)
        values[column] = json.loads(text) if isinstance(text, (str, bytes)) and text else (text or {})
    for field in attrs.fields(record):
        if values.get(field.name, 0) is None and field.default is not attrs.NOTHING:
            del values[field.name]  # NULL in a column added later: the record's default
    return structure(values, record)
