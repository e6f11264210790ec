"""Glue between the pure tables (states/) and the store: step, persist, publish; run effects.

`MachineRunner.fire(event)` steps the table, writes the machine row and its history row in
one transaction, then publishes `machine.<kind>.<state>` and returns the Step whose effects
the caller executes. An illegal event raises IllegalTransition, and a write SQLite refuses
for what it is raises StoreError; either way the runner's state, the store and subscribers
are untouched. A disk that refuses the write (full, read-only) stops nothing: the store keeps
the transition in memory, in order, until it can be written (`Store.health()` says so), and
the machine steps on.
Synchronous on purpose: a transition is a few hundred microseconds of SQLite, so the trio
daemon calls it directly.

The effects a Step asks for are carried out through an `EffectDriver`: one handler per
effect type, checked against the machine's declaration, shared by every service (launch,
fallback, probes, installs), so no effect is ever looked up by name or silently dropped.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Generic, Mapping, TypeVar

import attrs

from states.machine import (
    IllegalTransition,
    MachineDefinitionError,
    MachineSpec,
    Step,
    data_from_json,
    data_to_json,
    event_to_json,
    step,
    to_json,
)
from store import Store, StoreError, TransitionRecord

Publish = Callable[[dict[str, Any]], None]


@attrs.define(eq=False)
class MachineRunner:
    """One live machine: its spec, its id in the store, and where its events go.

    Construction loads the machine's row (resume after a daemon restart); a machine never
    seen starts in the spec's initial state with `initial_data` (or the data's defaults).
    """

    spec: MachineSpec
    machine_id: str
    store: Store
    publish: Publish | None = None
    initial_data: Any = None
    state: enum.StrEnum = attrs.field(init=False)
    data: Any = attrs.field(init=False)
    seq: int = attrs.field(init=False, default=0)
    resumed: bool = attrs.field(init=False, default=False)

    def __attrs_post_init__(self) -> None:
        record = self.store.machine(self.machine_id)
        if record is None:
            self.state = self.spec.initial
            self.data = self.spec.initial_data() if self.initial_data is None else self.initial_data
            return
        if record.kind != self.spec.name:
            raise StoreError(
                "internal_error",
                f"machine {self.machine_id!r} is a {record.kind!r} machine, not {self.spec.name!r}",
                evidence={"machine": self.machine_id, "kind": record.kind},
            )
        self.state = self.spec.states(record.state)
        self.data = data_from_json(self.spec, record.data)
        self.seq = record.seq
        self.resumed = True

    @property
    def kind(self) -> str:
        return self.spec.name

    def accepts(self, event: object) -> bool:
        """Whether `event` would be accepted now (guards included); changes nothing."""
        try:
            step(self.spec, self.state, self.data, event)
        except IllegalTransition:
            return False
        return True

    def fire(self, event: object) -> Step:
        """Step, persist (one transaction), publish; return the Step with its effects."""
        result = step(self.spec, self.state, self.data, event)
        name, payload = event_to_json(event)
        record = self.store.record_step(
            machine_id=self.machine_id,
            kind=self.spec.name,
            from_state=self.state.value,
            event=name,
            event_data=payload,
            to_state=result.state.value,
            data=data_to_json(result.data),
            reason=None if result.reason is None else str(result.reason),
            evidence=to_json(result.evidence),
            seq=self.seq + 1,
        )
        self.state, self.data, self.seq = result.state, result.data, record.seq
        if self.publish is not None:
            self.publish(self.event_message(record))
        return result

    def event_message(self, record: TransitionRecord) -> dict[str, Any]:
        """The bus message for one transition: `machine.<kind>.<to_state>`."""
        return {
            "topic": f"machine.{record.kind}.{record.to_state}",
            "machine": record.machine_id,
            "from": record.from_state,
            "to": record.to_state,
            "event": record.event,
            "event_data": record.event_data,
            "reason": record.reason,
            "evidence": record.evidence,
            "at": record.at,
            "seq": record.seq,
        }


# --- effects ------------------------------------------------------------------------------

R = TypeVar("R")


class UnhandledEffect(Exception):
    """An effect reached a driver that has no handler for its type: a bug, never dropped."""


@attrs.frozen
class EffectDriver(Generic[R]):
    """The one way every service runs its machine's effects: a type -> handler map.

    Built against the machine's declared `effect_types`, so a service that forgets an effect
    (or handles one its machine never asks for) fails when it is constructed, not when that
    effect first turns up. `run` calls the handler with the effect and the service's context
    arguments (a backend, a runner) and returns what it returns: a sync handler's result, or
    an async handler's coroutine for the caller to await.
    """

    spec: MachineSpec
    handlers: Mapping[type, Callable[..., R]]

    def __attrs_post_init__(self) -> None:
        declared, given = set(self.spec.effect_types), set(self.handlers)
        missing = sorted(t.__name__ for t in declared - given)
        stray = sorted(t.__name__ for t in given - declared)
        if missing or stray:
            raise MachineDefinitionError(
                f"{self.spec.name}: effect handlers do not match the declared effects "
                f"(missing {missing}, not declared {stray})"
            )

    def run(self, effect: object, *context: Any) -> R:
        """Hand `effect` to its handler; UnhandledEffect for a type without one."""
        handler = self.handlers.get(type(effect))
        if handler is None:
            raise UnhandledEffect(f"{self.spec.name}: no handler for effect {effect!r}")
        return handler(effect, *context)
