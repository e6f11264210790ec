"""The config machine: whether the config in force came from the file as it is now.

    valid --ConfigRejected--> invalid --ConfigAccepted--> valid

An invalid file never replaces the config in force; the rejection and its problems are a
transition in history, and `status` shows them until a valid file is accepted.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from states.machine import MachineSpec, Step, guarded
from states.reasons import ReasonCode


class ConfigState(enum.StrEnum):
    VALID = "valid"
    INVALID = "invalid"


def _strs(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


@attrs.frozen
class ConfigData:
    problems: tuple[str, ...] = attrs.field(default=(), converter=_strs)


@attrs.frozen
class ConfigAccepted:
    """A valid file is now in force; `changed` lists the section.key names that changed."""

    changed: tuple[str, ...] = attrs.field(default=(), converter=_strs)
    relaunch: bool = False


@attrs.frozen
class ConfigRejected:
    problems: tuple[str, ...] = attrs.field(default=(), converter=_strs)


@guarded(ConfigState.VALID)
def accepted(state: ConfigState, data: ConfigData, event: ConfigAccepted) -> Step:
    return Step(ConfigState.VALID, ConfigData(), evidence={"changed": list(event.changed), "relaunch": event.relaunch})


@guarded(ConfigState.INVALID)
def rejected(state: ConfigState, data: ConfigData, event: ConfigRejected) -> Step:
    evidence = {"problems": list(event.problems)}
    return Step(ConfigState.INVALID, ConfigData(event.problems), (), ReasonCode.CONFIG_INVALID, evidence)


CONFIG = MachineSpec(
    name="config",
    states=ConfigState,
    initial=ConfigState.VALID,
    data_type=ConfigData,
    transitions={
        ConfigState.VALID: {ConfigAccepted: accepted, ConfigRejected: rejected},
        ConfigState.INVALID: {ConfigAccepted: accepted, ConfigRejected: rejected},
    },
    description="Whether the config file in force is the file as it is now.",
)
