"""A request's num_ctx (states/launch/context.py) and what the launch machine does with the
larger context it asks for: pure, no daemon, no clock."""

from __future__ import annotations

import pytest

from stoker.states.launch.context import context_for, num_ctx_of, planned_ctx_size, widen
from stoker.states.launch.records import (
    AfterStop,
    BackoffElapsed,
    BackoffStarted,
    ContextRequested,
    DownCause,
    DownRequested,
    LaunchPlan,
    LaunchSettings,
    LaunchState as S,
    MakePlan,
    PlanFailed,
    PlanReady,
    Ready,
    RestartRequested,
    ServerExited,
    Spawned,
    StopCompleted,
    Terminate,
    UpRequested,
)
from stoker.states.reasons import ReasonCode

from tests.unit.test_states_launch import drive, running as running_on

PLAN = LaunchPlan("cpu", "x86-64-v3", "/b", "/b/llama-server", "/m.gguf", ctx_size=256)
WIDE = LaunchPlan("cpu", "x86-64-v3", "/b", "/b/llama-server", "/m.gguf", ctx_size=512)


def running(*more, settings=LaunchSettings()):
    """A server ready with PLAN (-c 256), then `more`."""
    return running_on(*more, settings=settings, plan=PLAN)


# --- the decision -----------------------------------------------------------------------


def test_a_context_at_or_below_the_servers_is_served_as_it_is():
    for num_ctx in (1, 255, 256):
        assert widen(num_ctx, ctx_size=256, parallel=1, trained=1024).ctx_size is None


def test_a_larger_context_asks_for_a_relaunch_with_it():
    ask = widen(512, ctx_size=256, parallel=1, trained=1024)
    assert ask.ctx_size == 512
    assert ask.evidence == {
        "num_ctx": 512,
        "slot_ctx": 256,
        "parallel": 1,
        "trained_ctx": 1024,
        "ctx_size": 512,
        "was_ctx_size": 256,
    }


def test_num_ctx_is_one_slots_context_so_every_slot_gets_it():
    """Ollama's num_ctx is one conversation's; `-c` is every slot's together."""
    assert widen(1024, ctx_size=2048, parallel=2, trained=4096).ctx_size is None  # 1024 per slot already
    assert widen(1500, ctx_size=2048, parallel=2, trained=4096).ctx_size == 3000


def test_never_above_the_trained_context():
    ask = widen(100_000, ctx_size=256, parallel=2, trained=1024)
    assert ask.ctx_size == 2048 and ask.evidence["bounded_by"] == "trained_ctx"
    # Already at the trained context: nothing more to give, served as it is.
    assert widen(100_000, ctx_size=1024, parallel=1, trained=1024).ctx_size is None


def test_ctx_size_zero_is_the_trained_context_already():
    assert widen(100_000, ctx_size=0, parallel=1, trained=1024).ctx_size is None
    assert widen(100_000, ctx_size=0, parallel=1, trained=None).ctx_size is None


def test_an_unknown_trained_context_bounds_nothing_but_the_request():
    assert widen(600, ctx_size=256, parallel=1, trained=None).ctx_size == 600


@pytest.mark.parametrize(
    ("options", "num_ctx"),
    [(None, None), ({}, None), ({"temperature": 0}, None), ({"num_ctx": 8192}, 8192), ({"num_ctx": 8192.0}, 8192)],
)
def test_num_ctx_read_from_options(options, num_ctx):
    assert num_ctx_of(options) == num_ctx


def test_num_ctx_zero_or_below_is_the_models_own():
    assert num_ctx_of({"num_ctx": 0}) is None and num_ctx_of({"num_ctx": -1}) is None


@pytest.mark.parametrize("value", ["8k", True, 1.5, [1]])
def test_a_num_ctx_that_is_no_number_is_refused(value):
    with pytest.raises(ValueError, match="num_ctx must be a whole number"):
        num_ctx_of({"num_ctx": value})


def test_the_planned_ctx_size_is_the_larger_of_the_configs_and_the_asked():
    assert planned_ctx_size(4096, None) == 4096
    assert planned_ctx_size(4096, 8192) == 8192
    assert planned_ctx_size(8192, 4096) == 8192  # a config raised meanwhile wins
    assert planned_ctx_size(0, 8192) == 0  # the trained context of each slot is never made smaller


def test_the_server_that_runs_is_asked_about_its_plan_else_the_next_plans_context():
    ready = running().data  # ready with PLAN: -c 256
    assert context_for(512, state=S.READY, data=ready, ctx_size=4096, parallel=1, trained=1024).ctx_size == 512
    # Stopped: its next plan gets the config's ctx_size (4096 here), and with it any asked before.
    assert context_for(512, state=S.STOPPED, data=ready, ctx_size=256, parallel=1, trained=1024).ctx_size == 512
    assert context_for(512, state=S.STOPPED, data=ready, ctx_size=4096, parallel=1, trained=8192).ctx_size is None
    asked = drive(ContextRequested(1024), state=S.STOPPED, data=ready).data
    assert context_for(512, state=S.STOPPED, data=asked, ctx_size=256, parallel=1, trained=1024).ctx_size is None
    # A second request while the first one's restart is under way asks nothing more.
    restarting = running(ContextRequested(512))
    assert restarting.state is S.STOPPING
    assert (
        context_for(512, state=S.STOPPING, data=restarting.data, ctx_size=256, parallel=1, trained=1024).ctx_size
        is None
    )


def test_a_model_a_request_does_not_load_is_asked_nothing():
    stopped = running(DownRequested(), StopCompleted(0))
    ask = context_for(512, state=S.STOPPED, data=stopped.data, ctx_size=256, parallel=1, trained=1024, loads=False)
    assert ask.ctx_size is None


# --- the launch machine -----------------------------------------------------------------


def test_a_ready_server_is_drained_restarted_and_planned_with_the_context_asked():
    settings = LaunchSettings(stop_grace=3.0, drain_timeout=20.0)
    s = running(ContextRequested(512, {"num_ctx": 512}), settings=settings)
    assert s.state is S.STOPPING and s.data.after_stop is AfterStop.RESTART
    assert s.effects[0] == Terminate(3.0, drain=20.0)  # the requests in flight finish first
    assert s.evidence == {"num_ctx": 512} and s.data.ctx_size == 512
    s = drive(StopCompleted(0), state=s.state, data=s.data)
    assert s.state is S.PLANNING and s.effects == (MakePlan(previous=PLAN, request=2, ctx_size=512),)
    s = drive(PlanReady(WIDE, request=2), Spawned(43), Ready(), state=s.state, data=s.data)
    assert s.state is S.READY and s.data.plan == WIDE and s.data.crashes == 0


def test_the_context_asked_lasts_through_restarts_and_crashes_until_a_stop_for_good():
    s = running(ContextRequested(512), StopCompleted(0), PlanReady(WIDE, request=2), Spawned(43), Ready())
    s = drive(RestartRequested(), StopCompleted(0), state=s.state, data=s.data)
    assert s.effects == (MakePlan(previous=WIDE, request=3, ctx_size=512),)
    s = drive(PlanReady(WIDE, request=3), Spawned(44), Ready(), ServerExited(-9), state=s.state, data=s.data)
    assert s.state is S.CRASHED and s.data.ctx_size == 512  # respawned with the same (wide) plan
    for down in (DownRequested(), DownRequested(DownCause.IDLE), DownRequested(DownCause.EVICTED)):
        stopped = drive(
            BackoffStarted(0.1),
            BackoffElapsed(),
            Spawned(45),
            Ready(),
            down,
            StopCompleted(0),
            state=s.state,
            data=s.data,
        )
        assert stopped.state is S.STOPPED and stopped.data.ctx_size is None
        again = drive(UpRequested(), state=stopped.state, data=stopped.data)
        assert again.effects == (MakePlan(previous=WIDE, request=4, ctx_size=None),)  # the config's again


def test_a_stopped_model_loads_with_the_context_asked():
    """A request that loads a model asks first: one load, with its context."""
    s = drive(ContextRequested(512), UpRequested())
    assert s.state is S.PLANNING and s.effects == (MakePlan(request=1, ctx_size=512),)


def test_a_plan_that_fails_with_the_context_asked_forgets_it():
    """No room for the larger context: the request is refused with the plan's reason, and the next
    load (which a placement_no_room failure allows) plans the config's context."""
    s = running(ContextRequested(512), StopCompleted(0), PlanFailed(ReasonCode.PLACEMENT_NO_ROOM, request=2))
    assert s.state is S.FAILED and s.data.reason is ReasonCode.PLACEMENT_NO_ROOM and s.data.ctx_size is None
    s = drive(UpRequested(), state=s.state, data=s.data)
    assert s.effects == (MakePlan(previous=PLAN, request=3, ctx_size=None),)


def test_a_larger_context_while_planning_or_stopping_is_planned_at_once():
    s = drive(UpRequested(), ContextRequested(512))
    assert s.state is S.PLANNING and s.effects == (MakePlan(request=2, ctx_size=512),)
    s = running(RestartRequested(), ContextRequested(512), StopCompleted(0))
    assert s.state is S.PLANNING and s.effects == (MakePlan(previous=PLAN, request=2, ctx_size=512),)
    # A stop for good under way stays one: the context is dropped with the server.
    s = running(DownRequested(), ContextRequested(512), StopCompleted(0))
    assert s.state is S.STOPPED and s.data.ctx_size is None
