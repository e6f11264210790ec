"""Value checks for config keys: each takes the TOML value and returns the typed one or raises
`Invalid`, which `Config.from_mapping` collects as "section.key: what is wrong".

`setting(default, check)` declares a section's key with its check (daemon/config/model.py reads
it back from the attrs field's metadata).
"""

from __future__ import annotations

import ipaddress
import math
import re
from typing import Any, Callable, Mapping

import attrs


class Invalid(Exception):
    """One key's problem; collected, never raised to the caller."""


def describe(value: Any) -> str:
    return f"{type(value).__name__} {value!r}"[:120]


def integer(low: int, high: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise Invalid(f"must be an integer, got {describe(value)}")
        if not low <= value <= high:
            raise Invalid(f"must be between {low} and {high}, got {value}")
        return value

    return check


def seconds(*, allow_zero: bool = False, high: float = 7 * 24 * 3600) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise Invalid(f"must be a number of seconds, got {describe(value)}")
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero) or value > high:
            low = "at least 0" if allow_zero else "more than 0"
            raise Invalid(f"must be {low} and at most {high:g} seconds, got {value}")
        return float(value)

    return check


def one_of(*options: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in options or not isinstance(value, str):
            raise Invalid(f"must be one of {', '.join(repr(o) for o in options)}, got {value!r}"[:200])
        return value

    return check


def boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {describe(value)}")
    return value


def ip_address(hint: str) -> Callable[[Any], str]:
    """Any IP address (`hint` says which the setting expects); a host name is refused."""

    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise Invalid(f"must be {hint}, got {describe(value)}")
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise Invalid(f"must be {hint}, got {value!r}") from None
        return value

    return check


def loopback_ip(value: Any) -> str:
    if not isinstance(value, str):
        raise Invalid(f"must be a loopback IP address such as 127.0.0.1, got {describe(value)}")
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise Invalid(f"must be a loopback IP address such as 127.0.0.1 or ::1, got {value!r}") from None
    if not address.is_loopback:
        raise Invalid(f"must be a loopback address (127.0.0.0/8 or ::1); {value} would expose the server")
    return value


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def byte_size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match:
            return int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    raise Invalid(f'must be a number of bytes or a size such as "2 GiB", got {describe(value)}')


def auto_or(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """ "auto" (Stoker scales it with the model), or what `check` accepts."""

    def either(value: Any) -> Any:
        if value == "auto":
            return "auto"
        try:
            return check(value)
        except Invalid as err:
            raise Invalid(f'must be "auto" or {str(err).removeprefix("must be ")}') from None

    return either


def optional(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """None (the key is left to another section), or what `check` accepts."""

    def either(value: Any) -> Any:
        return None if value is None else check(value)

    return either


def setting(default: Any, check: Callable[[Any], Any]) -> Any:
    return attrs.field(default=default, metadata={"check": check})


def checked_values(
    prefix: str,
    fields: Mapping[str, attrs.Attribute[Any]],
    table: Mapping[str, Any],
    problems: list[str],
    *,
    unknown: str = "unknown key",
) -> dict[str, Any]:
    """Each key of `table` through its `setting`'s check: the values that pass; a problem
    ("PREFIX.key: ...") for each that does not, or that no field names (`unknown` says so)."""
    values: dict[str, Any] = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            problems.append(f"{prefix}.{key}: {unknown} (known: {', '.join(fields)})")
            continue
        try:
            values[key] = field.metadata["check"](value)
        except Invalid as err:
            problems.append(f"{prefix}.{key}: {err}")
    return values
