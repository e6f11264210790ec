"""The front door's pure decisions (states/frontdoor_policy.py): which launch states a request
waits through, and when a request whose engine was lost before its answer is sent again."""

from __future__ import annotations

import pytest

from states.frontdoor_policy import MAX_SENDS, WILL_BE_READY, EngineLoss, innocent, send_again, waits
from states.launch_records import AfterStop, LaunchState as S


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
