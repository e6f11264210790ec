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
fallback, probes, installs, pulls, engine updates, workers), so no effect is ever looked up
by name or silently dropped. `EffectDriver.drive` is the one loop that feeds a handler's
answer back to its machine, with one failure policy: a handler that raises is heard by the
machine as the failure event its service declared, built from the exception's reason code.
"""

from __future__ import annotations

import enum
import inspect
import logging
from typing import Any, Awaitable, Callable, Generic, Iterable, Mapping, TypeVar, cast

import attrs
import trio

from stoker.daemon.core.errors import StokerError, cause_of
from stoker.states.machine import (
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
from stoker.states.reasons import ReasonCode
from stoker.store import Store, StoreError, TransitionRecord

log = logging.getLogger(__name__)

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


@attrs.define(eq=False)
class MachineRunners:
    """A service's live machines of one spec by id, each with the lock that lets one task
    drive it at a time (a request and a resume never step the same machine together)."""

    spec: MachineSpec
    store: Store
    publish: Publish | None = None
    _runners: dict[str, MachineRunner] = attrs.field(factory=dict, init=False)
    _locks: dict[str, trio.Lock] = attrs.field(factory=dict, init=False)

    def runner(self, machine_id: str) -> MachineRunner:
        """The machine's runner, loaded from the store the first time it is asked for."""
        runner = self._runners.get(machine_id)
        if runner is None:
            runner = self._runners[machine_id] = MachineRunner(self.spec, machine_id, self.store, self.publish)
            self._locks[machine_id] = trio.Lock()
        return runner

    def lock(self, machine_id: str) -> trio.Lock:
        """Held while a task drives the machine (its runner was asked for first)."""
        return self._locks[machine_id]


class UnhandledEffect(Exception):
    """An effect reached a driver that has no handler for its type: a bug, never dropped."""


@attrs.frozen
class Failure:
    """A handler that raised, as its machine hears it: built from the exception in one place.

    `reason` is the exception's reason code (None for one that is not a StokerError: a bug),
    `evidence` what it said; `cause` is what an install or update records as the step's
    evidence (the precise code, the sentence, the evidence)."""

    effect: object
    reason: ReasonCode | None
    message: str
    evidence: Mapping[str, Any]
    cause: Mapping[str, Any]

    @classmethod
    def of(cls, effect: object, err: Exception) -> Failure:
        if isinstance(err, StokerError):
            return cls(effect, err.reason, err.message, dict(err.evidence), cause_of(err))
        named = {"effect": type(effect).__name__}
        return cls(effect, None, f"{type(err).__name__}: {err}", named, {**cause_of(err), **named})


# The failure event a machine hears for a handler that raised (None: nothing to tell it).
FailureEvent = Callable[..., object | None]


@attrs.frozen
class EffectDriver(Generic[R]):
    """The one way every service runs its machine's effects: a type -> handler map.

    Built against the machine's declared `effect_types`, so a service that forgets an effect
    (or handles one its machine never asks for) fails when it is constructed, not when that
    effect first turns up. `run` calls the handler with the effect and the service's context
    arguments (a backend, a runner) and returns what it returns: a sync handler's result, or
    an async handler's coroutine for the caller to await.

    `failed` is the machine's failure policy, as data: given a `Failure` and the context, the
    event the machine hears when a handler raises. A driver without one lets the error reach
    its caller (the fallback planner, whose caller hears it as the launch's PlanFailed).
    `stops`: exceptions that mean "stopped on purpose" (a cancelled pull): `drive` ends and
    the machine stays where it is, to be resumed.
    """

    spec: MachineSpec
    handlers: Mapping[type, Callable[..., R]]
    failed: FailureEvent | None = None
    stops: tuple[type[Exception], ...] = ()

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

    def run_all(self, effects: Iterable[object], *context: Any) -> None:
        """Hand each effect to its handler, in order: handlers that start work (a task, a
        timer) and report back later through the machine's events."""
        for effect in effects:
            self.run(effect, *context)

    def start_all(self, nursery: trio.Nursery, effects: Iterable[object], *context: Any) -> None:
        """Start each effect's async handler as a task of `nursery`: handlers
        that run for as long as their work does and report back through events."""
        for effect in effects:
            nursery.start_soon(cast(Callable[..., Awaitable[object]], self.run), effect, *context)

    async def drive(self, runner: MachineRunner, effects: Iterable[object], *context: Any) -> None:
        """Run `effects` in order, feeding each handler's event back to `runner`, until the
        machine asks for nothing more.

        A handler that raises is heard as `failed`'s event; one the machine refuses now (an
        answer that no longer fits its state) is logged and dropped, as a late event is."""
        queue = list(effects)
        while queue:
            effect = queue.pop(0)
            try:
                answer: object = self.run(effect, *context)
                event = await answer if inspect.isawaitable(answer) else answer
            except self.stops:
                return
            except Exception as err:
                if self.failed is None:
                    raise
                failure = Failure.of(effect, err)
                if failure.reason is None:
                    log.exception("%s: %s failed", runner.machine_id, type(effect).__name__)
                else:
                    log.info("%s: %s failed: %s", runner.machine_id, type(effect).__name__, failure.message)
                event = self.failed(failure, *context)
            if event is None:
                continue
            try:
                queue.extend(runner.fire(event).effects)
            except IllegalTransition as err:
                log.warning("%s: %s", runner.machine_id, err)
