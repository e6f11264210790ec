"""The config machine: whether the config in force came from the file as it is now.

    valid --ConfigRejected--> invalid --ConfigAccepted--> valid (ApplyConfig)
    valid --ConfigAccepted (its model unusable)--> invalid

An invalid file never replaces the config in force; the rejection and its problems are a
transition in history, and `status` shows them until a valid file is accepted. A valid file
whose change would relaunch the server on a model file that cannot be loaded (missing, not a
regular file, not GGUF, an unreadable header) is rejected too, before anything is stopped:
the healthy server keeps serving on the config in force. The daemon checks the file and
reports what it found (`model_reason`, `model_problem`); this table decides.
"""

from __future__ import annotations

import enum

import attrs

from stoker.states.machine import MachineSpec, Step, guarded, str_tuple
from stoker.states.reasons import ReasonCode


class ConfigState(enum.StrEnum):
    VALID = "valid"
    INVALID = "invalid"


@attrs.frozen
class ConfigData:
    problems: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)


@attrs.frozen
class ConfigAccepted:
    """A valid file was read: `changed` lists the section.key names that changed, `relaunch` says
    whether they need the server relaunched, and `model_reason` / `model_problem` what checking
    the model file it names found before that relaunch (None: loadable, or nothing relaunches)."""

    changed: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)
    relaunch: bool = False
    model_reason: ReasonCode | None = attrs.field(default=None, converter=attrs.converters.optional(ReasonCode))
    model_problem: str | None = None
    model_key: str = "server.model"  # the key that names that model ([models.NAME] model for another)


@attrs.frozen
class ConfigRejected:
    problems: tuple[str, ...] = attrs.field(default=(), converter=str_tuple)


@attrs.frozen
class ApplyConfig:
    """Put the file's config in force (relaunching the server when `relaunch`)."""

    relaunch: bool = False


Effect = ApplyConfig


@guarded(ConfigState.VALID, ConfigState.INVALID)
def accepted(state: ConfigState, data: ConfigData, event: ConfigAccepted) -> Step:
    changed = {"changed": list(event.changed), "relaunch": event.relaunch}
    if event.relaunch and event.model_reason is not None:
        # Relaunching would stop a healthy server for a model that cannot load: keep serving.
        problems = (f"{event.model_key}: {event.model_problem or event.model_reason}",)
        return Step(
            ConfigState.INVALID, ConfigData(problems), (), event.model_reason, {**changed, "problems": list(problems)}
        )
    return Step(ConfigState.VALID, ConfigData(), (ApplyConfig(event.relaunch),), evidence=changed)


@guarded(ConfigState.INVALID)
def rejected(state: ConfigState, data: ConfigData, event: ConfigRejected) -> Step:
    evidence = {"problems": list(event.problems)}
    return Step(ConfigState.INVALID, ConfigData(event.problems), (), ReasonCode.CONFIG_INVALID, evidence)


CONFIG = MachineSpec(
    name="config",
    initial=ConfigState.VALID,
    data_type=ConfigData,
    transitions={
        ConfigState.VALID: {ConfigAccepted: accepted, ConfigRejected: rejected},
        ConfigState.INVALID: {ConfigAccepted: accepted, ConfigRejected: rejected},
    },
    description="Whether the config file in force is the file as it is now.",
    effect_types=Effect,
)
