"""The generic state-machine machinery: tables as data, one pure `step`, JSON round trips.

A machine is a `MachineSpec`: a `StrEnum` of states (the value is what SQLite stores), a
frozen attrs record of data (counters, the current plan, knobs), and a transition table

    {state: {EventType: target_state | Guarded}}

A plain target is an unconditional move that keeps the data. A `Guarded` entry wraps a pure
function `(state, data, event) -> Step | None` together with every state it may return
(`STAY` for "where it was"), so the diagrams can draw it and `step` can refuse a handler
that wanders off its declared edges. A handler returns None to refuse the event (a guard that does not hold): that is an
illegal transition like any other. `step` never changes anything when it raises.

Effects are frozen attrs records too: the machine asks, `daemon/` does the work and reports
back with an event. Nothing here reads the clock, sleeps or does I/O.
"""

from __future__ import annotations

import enum
import typing
from typing import Any, Callable, Iterable, Mapping, Union

import attrs

from stoker.states.convert import structure, unstructure
from stoker.states.reasons import ReasonCode

Handler = Callable[[Any, Any, Any], "Step | None"]


class IllegalTransition(Exception):
    """An event the table does not accept in the current state; nothing was changed."""

    def __init__(self, machine: str, state: enum.Enum, event: object, detail: str = "") -> None:
        self.machine = machine
        self.state = state
        self.event = event
        self.reason = ReasonCode.ILLEGAL_TRANSITION
        self.detail = detail
        name = type(event).__name__
        msg = f"{machine}: {name} is not accepted in state {state.value!r}"
        super().__init__(f"{msg} ({detail})" if detail else msg)


class MachineDefinitionError(Exception):
    """A table or handler broke the machine's own declaration (a bug, never user input)."""


def as_evidence(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """The converter of every record's `evidence` field: a fresh dict, empty for None."""
    return dict(value or {})


@attrs.frozen
class Observed:
    """The base of an event that carries nothing but the evidence of what was seen (a step
    passed, the server answered); each such event is its own subclass."""

    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


@attrs.frozen
class Failure:
    """The base of an event that ends an attempt: the reason code that says why, and the
    evidence that decided it; each such event is its own subclass."""

    reason: ReasonCode
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


# The converters of records' tuple fields, so a record read back from JSON (lists) or built
# from any iterable compares and hashes the same.
def str_tuple(value: Iterable[Any]) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def int_tuple(value: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def float_tuple(value: Iterable[Any]) -> tuple[float, ...]:
    return tuple(float(v) for v in value)


# Named converters rather than `converter=tuple`: mypy's attrs plugin cannot bind the type
# variable of a bare builtin (nor a generic function's), so every Step(...) call would fail to
# type-check. as_tuple serves every tuple-of-records field; the field's annotation keeps its type.
def as_tuple(items: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(items)


def _states(items: Iterable[Any]) -> frozenset[Any]:
    return frozenset(items)


def _effect_types(effects: Any) -> tuple[type, ...]:
    """A machine's `Effect` union (or one effect class, or a tuple of them) as its classes."""
    if isinstance(effects, tuple):
        return effects
    return typing.get_args(effects) or (effects,)


@attrs.frozen
class Step:
    """The outcome of one accepted event: the new state and data, what to do, and why."""

    state: enum.StrEnum
    data: Any
    effects: tuple[Any, ...] = attrs.field(default=(), converter=as_tuple)
    reason: ReasonCode | None = None
    evidence: dict[str, Any] = attrs.field(factory=dict, converter=as_evidence, hash=False)


def step_with_reason(
    state: enum.StrEnum,
    data: Any,
    effects: Iterable[Any],
    reason: ReasonCode | None,
    evidence: Mapping[str, Any],
    **changes: Any,
) -> Step:
    """Move to `state` because of `reason`: the data keeps the reason and its evidence (what
    status shows until the next move clears them) and history records the same pair."""
    data = attrs.evolve(data, reason=reason, evidence=evidence, **changes)
    return Step(state, data, effects, reason, evidence)


class _Stay:
    """Target sentinel: the handler may leave the machine in the state it was in."""

    def __repr__(self) -> str:
        return "STAY"


STAY: Any = _Stay()


@attrs.frozen
class Guarded:
    """A guarded transition: a pure handler and every state it may move to (STAY included)."""

    handler: Handler
    targets: frozenset[Any] = attrs.field(converter=_states)

    @property
    def name(self) -> str:
        return getattr(self.handler, "__name__", "handler")

    def only(self, *targets: Any) -> "Guarded":
        """The same handler, declared with fewer targets for one row of the table."""
        return Guarded(self.handler, targets)

    def targets_from(self, state: enum.StrEnum) -> frozenset[enum.StrEnum]:
        """The concrete states this rule may reach from `state`."""
        return frozenset(state if t is STAY else t for t in self.targets)

    def __call__(self, state: Any, data: Any, event: Any) -> Step | None:
        return self.handler(state, data, event)


def guarded(*targets: enum.StrEnum) -> Callable[[Handler], Guarded]:
    """Decorator: declare a handler's possible target states next to its code."""

    def wrap(fn: Handler) -> Guarded:
        return Guarded(fn, targets)

    return wrap


Rule = Union[enum.StrEnum, Guarded]


@attrs.frozen
class MachineSpec:
    """Everything that defines one kind of machine, checked for consistency on creation."""

    name: str
    # Where it starts; its enum is the machine's set of states.
    initial: enum.StrEnum
    data_type: type
    transitions: Mapping[enum.StrEnum, Mapping[type, Rule]] = attrs.field(hash=False)
    terminal: frozenset[enum.StrEnum] = attrs.field(default=frozenset(), converter=_states)
    extra_events: tuple[type, ...] = ()
    description: str = ""
    # The effects its handlers may ask for (for the docs and the effect driver): its `Effect` union.
    effect_types: tuple[type, ...] = attrs.field(default=(), converter=_effect_types)

    def __attrs_post_init__(self) -> None:
        problems = []
        for state, row in self.transitions.items():
            if state not in set(self.states):
                problems.append(f"table row {state!r} is not a state")
            for event_type, rule in row.items():
                if not attrs.has(event_type):
                    problems.append(f"{event_type!r} is not an attrs event class")
                targets = rule.targets_from(state) if isinstance(rule, Guarded) else {rule}
                for target in targets:
                    if target not in set(self.states):
                        problems.append(f"{state}/{event_type.__name__} -> {target!r} is not a state")
        for state in self.terminal:
            if state not in set(self.states):
                problems.append(f"terminal {state!r} is not a state")
        if problems:
            raise MachineDefinitionError(f"{self.name}: " + "; ".join(problems))

    def machine_id(self, *key: str) -> str:
        """The store id of one machine of this kind: `<name>:<key parts joined by ->`, e.g.
        `probe:cuda`, `install:cuda-cu12`, `pull:<model name>`."""
        return f"{self.name}:{'-'.join(key)}"

    @property
    def states(self) -> type[enum.StrEnum]:
        """The machine's state enum: the initial state's."""
        return type(self.initial)

    @property
    def event_types(self) -> dict[str, type]:
        """Every event class the machine knows, by class name."""
        found: dict[str, type] = {}
        for row in self.transitions.values():
            for event_type in row:
                found[event_type.__name__] = event_type
        for event_type in self.extra_events:
            found[event_type.__name__] = event_type
        return found

    def accepted(self, state: enum.StrEnum) -> tuple[type, ...]:
        """The event types that have an entry in `state`'s row (guards may still refuse)."""
        return tuple(self.transitions.get(state, {}))

    def edges(self) -> list[tuple[enum.StrEnum, str, enum.StrEnum]]:
        """(from, event name, to) for every declared edge, in table order (for diagrams)."""
        out: list[tuple[enum.StrEnum, str, enum.StrEnum]] = []
        for state, row in self.transitions.items():
            for event_type, rule in row.items():
                if isinstance(rule, Guarded):
                    targets = sorted(rule.targets_from(state), key=list(self.states).index)
                else:
                    targets = [rule]
                out.extend((state, event_type.__name__, target) for target in targets)
        return out

    def reachable(self) -> set[enum.StrEnum]:
        """The states reachable from the initial state through declared edges."""
        seen = {self.initial}
        frontier = [self.initial]
        edges = self.edges()
        while frontier:
            current = frontier.pop()
            for source, _, target in edges:
                if source == current and target not in seen:
                    seen.add(target)
                    frontier.append(target)
        return seen

    def initial_data(self) -> Any:
        """The data a fresh machine starts with (the data type's defaults)."""
        return self.data_type()


def step(spec: MachineSpec, state: enum.StrEnum, data: Any, event: object) -> Step:
    """Apply one event: the new Step, or IllegalTransition with nothing changed."""
    rule = spec.transitions.get(state, {}).get(type(event))
    if rule is None:
        raise IllegalTransition(spec.name, state, event)
    if not isinstance(rule, Guarded):
        return Step(rule, data)
    result = rule(state, data, event)
    if result is None:
        raise IllegalTransition(spec.name, state, event, f"refused by {rule.name}")
    if not isinstance(result, Step):
        raise MachineDefinitionError(f"{spec.name}: {rule.name} returned {result!r}, not a Step")
    allowed = rule.targets_from(state)
    if result.state not in allowed:
        raise MachineDefinitionError(
            f"{spec.name}: {rule.name} moved {state.value} -> {result.state!r}, "
            f"which it does not declare from there ({sorted(t.value for t in allowed)})"
        )
    if not isinstance(result.data, spec.data_type):
        raise MachineDefinitionError(f"{spec.name}: {rule.name} returned data of the wrong type")
    return result


# --- JSON round trips for history and machine rows (states/convert.py's one converter) ----


def to_json(value: Any) -> Any:
    """A JSON-ready copy of events, effects, data records, enums, tuples and paths."""
    return unstructure(value)


def from_json(hint: Any, value: Any) -> Any:
    """Rebuild a value of type `hint` from `to_json`'s output (unknown fields are ignored)."""
    return structure(value, hint)


def event_to_json(event: object) -> tuple[str, dict[str, Any]]:
    """(event class name, its fields as JSON) for the history table."""
    return type(event).__name__, unstructure(event)


def event_from_json(spec: MachineSpec, name: str, payload: Mapping[str, Any]) -> object:
    """Rebuild an event recorded in history; KeyError for a name the machine never knew."""
    return from_json(spec.event_types[name], payload)


def data_to_json(data: Any) -> dict[str, Any]:
    """A machine's data record as JSON for its row."""
    return dict(unstructure(data))


def data_from_json(spec: MachineSpec, payload: Mapping[str, Any]) -> Any:
    """Rebuild a machine's data record; fields added since it was written take defaults."""
    return from_json(spec.data_type, payload)
