"""Placement of several models (states/fleet/placement.py) and who keeps a model down (the launch
table's `down_cause`): pure, no daemon."""

from __future__ import annotations

import pytest

from stoker.states.launch.table import LAUNCH
from stoker.states.launch.records import (
    DownCause,
    DownRequested,
    LaunchData,
    LaunchPlan,
    LaunchState as S,
    PlanReady,
    Ready,
    Spawned,
    StopCompleted,
    Terminate,
    UpRequested,
)
from stoker.states.machine import step
from stoker.states.fleet.placement import Resident, Verdict, loads_on_demand, place
from stoker.states.reasons import ReasonCode

PLAN = LaunchPlan("cpu", "x86-64-v3", "/b", "/b/llama-server", "/m.gguf", port=8099)


def drive(*events, state=S.STOPPED, data=None):
    data = LaunchData() if data is None else data
    result = None
    for event in events:
        result = step(LAUNCH, state, data, event)
        state, data = result.state, result.data
    return result


def ready_data():
    return drive(UpRequested(), PlanReady(PLAN, request=1), Spawned(11), Ready()).data


def test_an_eviction_is_a_drained_planned_stop_with_its_reason_and_cause_in_history():
    evict = DownRequested(DownCause.EVICTED, {"for": "b", "max_loaded": 1, "idle_s": 12.5})
    result = step(LAUNCH, S.READY, ready_data(), evict)
    assert result.state is S.STOPPING
    assert result.reason is ReasonCode.PLACEMENT_EVICTED
    assert result.evidence == {"cause": "evicted", "for": "b", "max_loaded": 1, "idle_s": 12.5}
    (terminate,) = [e for e in result.effects if isinstance(e, Terminate)]
    assert terminate.drain == result.data.settings.drain_timeout > 0  # its requests in flight finish first
    done = step(LAUNCH, result.state, result.data, StopCompleted(0))
    assert done.state is S.STOPPED and done.data.down_cause is DownCause.EVICTED
    assert loads_on_demand(done.state, done.data.down_cause)


def test_the_users_down_keeps_it_down_and_the_daemons_own_stops_never_override_it():
    down = drive(DownRequested(), state=S.READY, data=ready_data())
    stopped = step(LAUNCH, down.state, down.data, StopCompleted(0))
    assert stopped.data.down_cause is DownCause.USER and not loads_on_demand(stopped.state, DownCause.USER)
    for cause in (DownCause.SHUTDOWN, DownCause.EVICTED):
        again = step(LAUNCH, S.STOPPED, stopped.data, DownRequested(cause))
        assert again.data.down_cause is DownCause.USER
    # An evicted model the user then stops stays down.
    evicted = LaunchData(down_cause=DownCause.EVICTED)
    assert step(LAUNCH, S.STOPPED, evicted, DownRequested()).data.down_cause is DownCause.USER
    # Any start forgets who stopped it.
    assert step(LAUNCH, S.STOPPED, stopped.data, UpRequested()).data.down_cause is None


@pytest.mark.parametrize(
    "state, cause, loads",
    [
        (S.STOPPED, None, True),  # never loaded
        (S.STOPPED, DownCause.EVICTED, True),
        (S.STOPPED, DownCause.SHUTDOWN, True),
        (S.STOPPED, DownCause.USER, False),
        (S.STOPPED, DownCause.REMOVED, True),  # a section removed, then configured again
        (S.FAILED, None, False),  # stays failed until `stoker up`
        (S.READY, None, False),  # nothing to load
    ],
)
def test_which_models_a_request_loads(state, cause, loads):
    assert loads_on_demand(state, cause) is loads


def test_room_left_loads_at_once():
    verdict = place("b", [Resident("a", S.READY), Resident("b", S.STOPPED)], max_loaded=2)
    assert verdict.verdict is Verdict.LOAD


def test_the_least_recently_used_idle_unpinned_ready_model_is_evicted():
    residents = [
        Resident("pinned", S.READY, pinned=True, idle_s=900),
        Resident("busy", S.READY, in_flight=1, idle_s=800),
        Resident("awaited", S.READY, waiting=2, idle_s=700),
        Resident("recent", S.READY, idle_s=5),
        Resident("old", S.READY, idle_s=60),
        Resident("new", S.STOPPED),
    ]
    verdict = place("new", residents, max_loaded=5)
    assert verdict.verdict is Verdict.EVICT and verdict.victim == "old"
    assert verdict.evidence["for"] == "new" and verdict.evidence["idle_s"] == 60 and verdict.evidence["max_loaded"] == 5


def test_no_room_when_every_loaded_model_is_pinned_busy_or_on_its_way_up():
    residents = [Resident("p", S.READY, pinned=True), Resident("l", S.LOADING), Resident("q", S.READY, in_flight=3)]
    assert place("x", residents, max_loaded=3).verdict is Verdict.NO_ROOM
    # One of them stopping: its place frees by itself.
    stopping = [*residents[:2], Resident("q", S.STOPPING)]
    assert place("x", stopping, max_loaded=3).verdict is Verdict.WAIT_STOP
    # A failed or stopped model holds no place.
    assert place("x", [Resident("p", S.FAILED), Resident("l", S.STOPPED)], max_loaded=1).verdict is Verdict.LOAD


def test_pinned_models_always_have_room():
    residents = [Resident("p1", S.READY, pinned=True), Resident("p2", S.STOPPED, pinned=True)]
    assert place("p2", residents, max_loaded=1).verdict is Verdict.LOAD


def test_a_stopping_models_place_is_counted_as_freed_so_only_one_model_is_evicted_per_load():
    # Just after `b` was evicted for `c`: `b` still stops (it holds its place) and `a` is idle.
    residents = [Resident("a", S.READY, idle_s=30), Resident("b", S.STOPPING), Resident("c", S.STOPPED)]
    verdict = place("c", residents, max_loaded=2)
    assert verdict.verdict is Verdict.WAIT_STOP and verdict.victim is None
    # Over the cap (max_loaded lowered by a reload): the stop alone does not make room, `a` goes too.
    over = [Resident("a", S.READY, idle_s=30), Resident("d", S.READY, in_flight=1), Resident("b", S.STOPPING)]
    assert place("c", over, max_loaded=2).victim == "a"


def test_cold_loads_under_max_loaded_evict_one_model_each():
    """The fleet's loop (daemon/fleet/fleet.py `_try_load`): ask, act, ask again at once; a stop
    completes only while the load waits. Three cold loads with two places take three evictions."""
    states = {"a": S.READY, "b": S.READY, "c": S.STOPPED, "d": S.STOPPED, "e": S.STOPPED}
    idle = {"a": 20.0, "b": 10.0}
    evicted = []
    for wanted in ("c", "d", "e"):
        while True:
            residents = [Resident(n, s, idle_s=idle.get(n, 0.0)) for n, s in states.items()]
            verdict = place(wanted, residents, max_loaded=2)
            if verdict.verdict is Verdict.LOAD:
                states[wanted] = S.READY
                idle = {n: t + 1 for n, t in idle.items()} | {wanted: 0.0}
                break
            if verdict.verdict is Verdict.EVICT:
                evicted.append(verdict.victim)
                states[str(verdict.victim)] = S.STOPPING
                continue
            assert verdict.verdict is Verdict.WAIT_STOP, verdict
            states = {n: S.STOPPED if s is S.STOPPING else s for n, s in states.items()}  # the stop completes
    assert evicted == ["a", "b", "c"]


def test_a_model_that_failed_for_room_loads_again_whatever_form_its_reason_was_read_back_in():
    """The reason comes back from the store as a string after a daemon restart: the next request
    must still try to place the model again, not be refused until the config changes."""
    from stoker.states.launch.records import LaunchState

    for reason in (ReasonCode.PLACEMENT_NO_ROOM, "placement_no_room"):
        assert loads_on_demand(LaunchState.FAILED, None, reason)  # type: ignore[arg-type]
    assert not loads_on_demand(LaunchState.FAILED, None, "model_missing")  # type: ignore[arg-type]
