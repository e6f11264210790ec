"""The front door's pure decisions (states/frontdoor/policy.py): which launch states a request
waits through, and when a request whose engine was lost before its answer is sent again."""

from __future__ import annotations

import pytest

from hypothesis import given, strategies as st

from stoker.states.frontdoor.policy import (
    DOWN,
    MAX_SENDS,
    RETRY_AFTER_S,
    WILL_BE_READY,
    EngineLoss,
    HoldMove,
    admit,
    gives_up_after,
    hold_move,
    innocent,
    refusal,
    send_again,
    waits,
)
from stoker.states.launch.records import AfterStop, LaunchState as S
from stoker.states.reasons import ReasonCode as R


def test_a_request_waits_through_every_state_that_comes_back_to_ready_by_itself():
    # a restart's or a config change's stop, a crash's backoff, a fallback's new plan...
    assert WILL_BE_READY == {S.PLANNING, S.STARTING, S.LOADING, S.STOPPING, S.CRASHED, S.BACKOFF}
    assert all(waits(state) for state in WILL_BE_READY)
    # ...but only `stoker up` makes a stopped or failed server ready; a ready one is sent to.
    assert not waits(S.STOPPED) and not waits(S.FAILED) and not waits(S.READY)


KILLED = EngineLoss(reached=True, gone=True, state=S.BACKOFF, signal="SIGKILL")
CRASHED = EngineLoss(reached=True, gone=True, state=S.CRASHED, signal="SIGSEGV")


@pytest.mark.parametrize(
    "loss",
    [
        KILLED,  # killed from outside (a user, the OOM killer)
        EngineLoss(reached=False, gone=True, state=S.CRASHED, signal="SIGSEGV"),  # never read it
        EngineLoss(reached=True, gone=True, state=S.STOPPING, after_stop=AfterStop.RESTART),
        EngineLoss(reached=True, gone=True, state=S.STOPPING, after_stop=AfterStop.STOP),
    ],
)
def test_a_loss_the_request_cannot_have_caused_sends_it_again_each_time(loss):
    assert innocent(loss)
    assert all(send_again(loss, sends, 0) for sends in range(1, MAX_SENDS))
    assert not send_again(loss, MAX_SENDS, 0)  # a bound however innocent


@pytest.mark.parametrize(
    "loss",
    [
        CRASHED,  # crashed by itself: the request may be why
        EngineLoss(reached=True, gone=True, state=S.BACKOFF, signal=None),  # an exit code
        EngineLoss(reached=True, gone=True, state=S.STOPPING, after_stop=AfterStop.HUNG),
        EngineLoss(reached=False, gone=False, state=S.READY),  # refused, yet the server serves on
        EngineLoss(reached=True, gone=False, state=S.READY, signal="SIGKILL"),  # a stale signal
    ],
)
def test_a_loss_the_request_may_have_caused_sends_it_once_more_only(loss):
    assert not innocent(loss)
    assert send_again(loss, 1, 1)
    assert not send_again(loss, 2, 2)  # a request that crashes the engine does not crash it in a loop
    # Losses it could not have caused do not count against it.
    assert send_again(KILLED, 3, 1) and not send_again(CRASHED, 4, 2)


def test_a_request_for_a_model_that_is_down_or_a_full_queue_is_refused_at_once():
    assert admit(S.STOPPED, loads_on_demand=False, waiting=0, max_queue=8) is R.FRONTDOOR_SERVER_DOWN
    assert admit(S.FAILED, loads_on_demand=False, waiting=0, max_queue=8) is R.FRONTDOOR_SERVER_DOWN
    assert admit(S.BACKOFF, loads_on_demand=False, waiting=8, max_queue=8) is R.FRONTDOOR_QUEUE_FULL
    assert admit(S.STOPPED, loads_on_demand=True, waiting=7, max_queue=8) is None  # loaded on demand
    assert admit(S.LOADING, loads_on_demand=False, waiting=0, max_queue=8) is None


def test_a_held_request_loads_a_model_not_loaded_and_waits_for_one_on_its_way():
    assert hold_move(S.READY, loads_on_demand=True) is HoldMove.SERVE
    assert hold_move(S.STOPPED, loads_on_demand=True) is HoldMove.LOAD
    assert hold_move(S.BACKOFF, loads_on_demand=False) is HoldMove.WAIT
    assert hold_move(S.STOPPED, loads_on_demand=False) is HoldMove.GIVE_UP  # stopped by the user meanwhile
    assert gives_up_after(HoldMove.LOAD, S.FAILED) and gives_up_after(HoldMove.LOAD, S.STOPPED)
    assert gives_up_after(HoldMove.WAIT, S.FAILED) and not gives_up_after(HoldMove.WAIT, S.STOPPED)
    assert not gives_up_after(HoldMove.LOAD, S.PLANNING)


@pytest.mark.parametrize(
    "state, placing, failed, reason, retry_after",
    [
        (S.READY, False, None, None, None),
        (S.LOADING, True, None, R.PLACEMENT_NO_ROOM, 5),  # no room made within the hold
        (S.FAILED, False, R.PLACEMENT_NO_ROOM, R.PLACEMENT_NO_ROOM, 5),  # this load found no room
        (S.FAILED, False, R.MODEL_MISSING, R.FRONTDOOR_SERVER_DOWN, 30),
        (S.STOPPED, False, None, R.FRONTDOOR_SERVER_DOWN, 30),
        (S.BACKOFF, False, None, R.FRONTDOOR_HOLD_TIMEOUT, 5),
    ],
)
def test_which_503_a_held_request_gets_and_its_retry_after(state, placing, failed, reason, retry_after):
    assert refusal(state, placing, failed) == reason
    assert (RETRY_AFTER_S[reason] if reason else None) == retry_after


@given(
    state=st.sampled_from(S),
    loads=st.booleans(),
    placing=st.booleans(),
    failed=st.sampled_from([None, R.PLACEMENT_NO_ROOM, R.CRASH_LOOP]),
)
def test_every_refusal_has_a_retry_after_and_a_ready_model_is_never_refused(state, loads, placing, failed):
    reason = refusal(state, placing, failed if state is S.FAILED else None)
    assert (reason is None) == (state is S.READY)
    assert reason is None or RETRY_AFTER_S[reason] > 0
    admitted = admit(state, loads, 0, 1)
    assert admitted is None or admitted in RETRY_AFTER_S
    if state in DOWN and not loads:
        assert hold_move(state, loads) is HoldMove.GIVE_UP
