"""Idle unload (states/fleet/idle_unload.py) and the launch table's stop with cause idle: pure, no daemon."""

from __future__ import annotations

import functools
import math

import attrs
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from stoker.daemon.fleet.idle import serve_idle_unloads
from stoker.daemon.fleet.usage import ChangeSignal
from stoker.states.fleet.idle_unload import IdleFacts, due_in, keep_alive_seconds, review
from stoker.states.launch.table import LAUNCH
from stoker.states.launch.steps import stop_cause
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
from stoker.states.fleet.placement import loads_on_demand
from stoker.states.reasons import ReasonCode

PLAN = LaunchPlan("cpu", "x86-64-v3", "/b", "/b/llama-server", "/m.gguf", port=8099)
NOW = 1_000_000.0


def facts(**kw) -> IdleFacts:
    return IdleFacts(**{"name": "m", "state": S.READY, "idle_ttl_s": 60.0, "last_used": NOW - 10, **kw})


def test_due_when_its_ttl_has_passed_since_its_last_use():
    assert due_in(facts(), NOW) == 50.0  # 10 s idle of 60
    assert due_in(facts(last_used=NOW - 60), NOW) == 0.0
    assert due_in(facts(last_used=NOW - 3600), NOW) == 0.0  # long past: due now, never negative


@pytest.mark.parametrize(
    "why, kw",
    [
        ("no ttl", {"idle_ttl_s": 0.0}),
        ("pinned", {"pinned": True}),
        ("in flight", {"in_flight": 1}),
        ("held for it", {"waiting": 1}),
        ("never used nor ready", {"last_used": None}),
        *[(f"{state.value}", {"state": state}) for state in S if state is not S.READY],
    ],
)
def test_never_due_as_things_stand(why, kw):
    assert due_in(facts(**{"last_used": NOW - 3600, **kw}), NOW) is None, why


def test_review_unloads_the_due_and_sleeps_until_the_next():
    models = [
        facts(name="old", last_used=NOW - 100),  # due
        facts(name="soon", last_used=NOW - 45),  # in 15 s
        facts(name="later", last_used=NOW - 5, idle_ttl_s=30),  # in 25 s
        facts(name="busy", last_used=NOW - 100, in_flight=2),
        facts(name="pinned", last_used=NOW - 100, pinned=True),
    ]
    verdict = review(models, NOW)
    assert [(u.name, u.evidence) for u in verdict.due] == [("old", {"idle_s": 100.0, "idle_ttl_s": 60.0})]
    assert verdict.next_in == 15.0
    assert review([facts(state=S.STOPPED)], NOW).next_in is None  # nothing to wait for: sleep until a change


@given(
    ttl=st.floats(0, 1e6),
    used_ago=st.floats(0, 1e7),
    pinned=st.booleans(),
    in_flight=st.integers(0, 3),
    waiting=st.integers(0, 3),
    state=st.sampled_from(list(S)),
)
def test_never_unloads_a_model_in_use_pinned_or_not_ready_nor_before_its_ttl(
    ttl, used_ago, pinned, in_flight, waiting, state
):
    model = IdleFacts("m", state, ttl, pinned, in_flight, waiting, NOW - used_ago)
    verdict = review([model], NOW)
    if verdict.due:
        assert state is S.READY and not pinned and in_flight == waiting == 0 and ttl > 0
        assert used_ago >= ttl
    elif verdict.next_in is not None:
        assert 0 < verdict.next_in <= ttl + 1e-6  # it sleeps until the TTL has passed, never longer


def ready_data() -> LaunchData:
    data, state = LaunchData(), S.STOPPED
    for event in (UpRequested(), PlanReady(PLAN, request=1), Spawned(11), Ready()):
        result = step(LAUNCH, state, data, event)
        state, data = result.state, result.data
    assert state is S.READY
    return data


def test_an_idle_unload_is_a_drained_planned_stop_saved_as_idle_and_loaded_on_demand():
    idle = DownRequested(DownCause.IDLE, {"idle_s": 61.2, "idle_ttl_s": 60.0})
    result = step(LAUNCH, S.READY, ready_data(), idle)
    assert result.state is S.STOPPING and result.reason is ReasonCode.IDLE_UNLOADED
    assert result.evidence == {"cause": "idle", "idle_s": 61.2, "idle_ttl_s": 60.0}  # its history says why
    (terminate,) = [e for e in result.effects if isinstance(e, Terminate)]
    assert terminate.drain == result.data.settings.drain_timeout > 0  # its requests in flight finish first
    assert stop_cause(result.data, shutting_down=False) == "idle"  # the snapshots saved before TERM say so
    assert stop_cause(result.data, shutting_down=True) == "shutdown"
    done = step(LAUNCH, result.state, result.data, StopCompleted(0))
    assert done.state is S.STOPPED and done.data.down_cause is DownCause.IDLE
    assert loads_on_demand(done.state, done.data.down_cause)  # the next request loads it again
    # The user's down afterwards keeps it down; an idle unload never overrides the user's.
    assert step(LAUNCH, S.STOPPED, done.data, DownRequested()).data.down_cause is DownCause.USER
    user = LaunchData(down_cause=DownCause.USER)
    assert step(LAUNCH, S.STOPPED, user, DownRequested(DownCause.IDLE)).data.down_cause is DownCause.USER
    assert step(LAUNCH, S.STOPPED, done.data, UpRequested()).data.down_cause is None


def test_the_other_stops_keep_their_snapshot_causes():
    data = ready_data()
    for event, cause in (
        (DownRequested(), "stop"),
        (DownRequested(DownCause.EVICTED), "evicted"),
        (DownRequested(DownCause.REMOVED), "stop"),
    ):
        assert stop_cause(step(LAUNCH, S.READY, data, event).data, shutting_down=False) == cause


# --- the fleet's task (daemon/fleet/idle.py): it sleeps until the next due time, woken by changes


@attrs.define
class FakeMember:
    """A member as the task sees it; its supervisor is itself: an offered stop leaves ready."""

    name: str
    ttl: float
    last_used: float = 0.0
    in_flight: int = 0
    state: S = S.READY
    offered: list = attrs.field(factory=list)

    @property
    def supervisor(self) -> "FakeMember":
        return self

    def offer(self, event) -> None:
        self.offered.append((trio.current_time(), event))
        self.state = S.STOPPING

    def idle_facts(self) -> IdleFacts:
        return IdleFacts(self.name, self.state, self.ttl, in_flight=self.in_flight, last_used=self.last_used)


async def test_the_task_unloads_at_the_due_time_rearmed_by_use_and_never_polls(autojump_clock):
    a, b = FakeMember("a", ttl=10), FakeMember("b", ttl=25)
    change_signal, asked = ChangeSignal(), []

    def now() -> float:
        asked.append(trio.current_time())
        return trio.current_time()

    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(serve_idle_unloads, lambda: [a, b], change_signal, now=now))
        await trio.sleep(4)
        a.in_flight = 1  # a request starts at 4 s (no change_signal: the task finds it at a's due time, 10 s)
        await trio.sleep(8)
        a.in_flight, a.last_used = 0, trio.current_time()  # ... and ends at 12 s: the change_signal re-arms a
        change_signal.fire()
        await trio.sleep(100)
        nursery.cancel_scope.cancel()
    ((at_a, down_a),), ((at_b, down_b),) = a.offered, b.offered
    assert (at_a, down_a.cause, down_a.evidence) == (22.0, DownCause.IDLE, {"idle_s": 10.0, "idle_ttl_s": 10})
    assert (at_b, down_b.cause) == (25.0, DownCause.IDLE)
    # Woken at start, at a's first due time (in use: kept), at the change_signal, at a's and b's due
    # times; never in between, nor after (nothing left to wait for).
    assert asked == [0.0, 10.0, 12.0, 22.0, 25.0], asked


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (30, 30.0),
        (2.5, 2.5),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("250ms", 0.25),
        ("0", 0.0),
        (-1, math.inf),
        ("-1m", math.inf),
    ],
)
def test_keep_alive_reads_what_ollamas_clients_send(value, seconds):
    assert keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", True, "5 minutes", [], "1d"])
def test_a_keep_alive_that_is_no_duration_is_refused(value):
    with pytest.raises(ValueError):
        keep_alive_seconds(value)


def test_a_requests_keep_alive_wins_over_the_ttl():
    used = IdleFacts("m", S.READY, idle_ttl_s=60.0, last_used=100.0)
    assert due_in(used, 110.0) == 50.0
    assert due_in(attrs.evolve(used, keep_alive_s=0.0), 110.0) == 0.0  # unload once answered
    assert due_in(attrs.evolve(used, keep_alive_s=math.inf), 1e9) is None  # for good
    assert due_in(attrs.evolve(used, idle_ttl_s=0.0, keep_alive_s=5.0), 110.0) == 0.0  # a TTL of its own
