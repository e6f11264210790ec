"""The front door's decisions (pure): which launch states a request waits through, which 503 a
held request gets and its Retry-After, and whether a request whose engine was lost before any
byte of its answer reached the client is sent again.

Not a machine: each request asks these questions with the facts of the moment, like
snapshot_policy.py. daemon/frontdoor/hold.py gathers the facts and acts on the answers.

Waiting: every launch state but ready comes back to ready by itself (planning, starting,
loading, a restart's or a config change's stop, a crash's backoff, a GPU plan that failed
and falls back to the next backend), except stopped and failed: only someone's `stoker up`
makes those ready, so a request is refused at once (503 frontdoor_server_down).

Holding: a request that finds its model not ready is refused at once when nothing will make
it ready (down, and not loaded on demand) or when `[frontdoor] max_queue` requests wait
already; otherwise it is held, loading the model first when it loads on demand. It gives up
when a load leaves the model down, or when the model fails while it waits. Once the hold is
over, `refusal` names the 503 from what the hold ended on: `placement_no_room` when no place
could be made for the model, `frontdoor_server_down` when it is down, else
`frontdoor_hold_timeout`; `RETRY_AFTER_S` is each one's Retry-After.

Sending again: the engine was lost under a request that had no answer yet (its connection
failed, or closed before the first byte). If the request cannot have caused it (it never
reached an engine; Stoker stopped that server on purpose; something outside killed it with
SIGKILL: a user, the kernel's OOM killer, the supervisor's own KILL), it is sent to the next
ready server, each time such a loss happens. If it may have caused it (the engine crashed by
itself, hung, or is still serving as if nothing happened), it is sent once more only: a
request that crashes the engine must not crash it in a loop. The launch machine's crash loop
bounds the rest: once it gives up, the held request is refused like any other.
"""

from __future__ import annotations

import enum

import attrs

from stoker.states.launch.records import AfterStop, LaunchState
from stoker.states.reasons import ReasonCode

S = LaunchState
READY = S.READY
# A stopped or failed server becomes ready only when someone asks (`stoker up`): no holding.
DOWN = frozenset({S.STOPPED, S.FAILED})
# Everything else comes back to ready by itself: a request waits through it.
WILL_BE_READY = frozenset(S) - DOWN - {READY}

# How an engine ended when nothing the request did can have ended it.
PLANNED_STOPS = frozenset({AfterStop.STOP, AfterStop.RESTART})
KILLED_FROM_OUTSIDE = frozenset({"SIGKILL"})
# Sends after a loss the request may have caused.
SUSPECT_RESENDS = 1
# However innocent, a request is sent at most this many times (each to a newly ready server).
MAX_SENDS = 10


# Seconds a refused client is told to wait before trying again (its Retry-After).
RETRY_AFTER_S: dict[ReasonCode, int] = {
    ReasonCode.FRONTDOOR_QUEUE_FULL: 2,  # a place in the queue frees as soon as one request is served
    ReasonCode.FRONTDOOR_HOLD_TIMEOUT: 5,  # the model is on its way; the next try may find it ready
    ReasonCode.PLACEMENT_NO_ROOM: 5,  # an idle model may be unloaded by then
    ReasonCode.FRONTDOOR_SERVER_DOWN: 30,  # only someone's `stoker up` brings it back
}


def waits(state: LaunchState) -> bool:
    """A request that arrives in `state` waits for ready (else it is sent, or refused when down)."""
    return state in WILL_BE_READY


def admit(state: LaunchState, loads_on_demand: bool, waiting: int, max_queue: int) -> ReasonCode | None:
    """Whether a request that finds its model not ready may be held: None, or why it is refused at once."""
    if not waits(state) and not loads_on_demand:
        return ReasonCode.FRONTDOOR_SERVER_DOWN
    if waiting >= max_queue:
        return ReasonCode.FRONTDOOR_QUEUE_FULL
    return None


class HoldMove(enum.StrEnum):
    """What a held request does next, from its model's state."""

    SERVE = "serve"  # ready: send it
    LOAD = "load"  # not loaded: load it (making room first), then wait
    WAIT = "wait"  # on its way to ready by itself
    GIVE_UP = "give_up"  # nothing will make it ready unasked


def hold_move(state: LaunchState, loads_on_demand: bool) -> HoldMove:
    """The next move of a held request whose model is in `state`."""
    if state is READY:
        return HoldMove.SERVE
    if loads_on_demand:
        return HoldMove.LOAD
    return HoldMove.WAIT if waits(state) else HoldMove.GIVE_UP


def gives_up_after(move: HoldMove, state: LaunchState) -> bool:
    """After a LOAD or a WAIT, whether the request stops holding: a load that left the model down,
    or a model that failed while it waited (that load had no room: it is not tried again)."""
    if move is HoldMove.LOAD:
        return state in DOWN
    return state is S.FAILED


def refusal(state: LaunchState, placing: bool, failed_reason: ReasonCode | None) -> ReasonCode | None:
    """The 503 a request gets once its hold is over (None: ready, send it). `placing`: the hold
    ended (its time ran out) while a place was being made for the model; `failed_reason`: why
    the launch machine failed, if it did."""
    if state is READY:
        return None
    if placing or (state is S.FAILED and failed_reason == ReasonCode.PLACEMENT_NO_ROOM):
        return ReasonCode.PLACEMENT_NO_ROOM
    if state in DOWN:
        return ReasonCode.FRONTDOOR_SERVER_DOWN
    return ReasonCode.FRONTDOOR_HOLD_TIMEOUT


@attrs.frozen
class EngineLoss:
    """What the front door knows once the engine was lost before any byte of the answer.

    `reached`: the connection was made (the engine may have read the request). `gone`: the
    server it was sent to is no longer the one served (the launch machine noticed). `state`,
    `after_stop` and `signal`: the launch machine's state and why it stops, and the signal
    that ended the server if it crashed, as the launch machine recorded them when noticed.
    """

    reached: bool
    gone: bool
    state: LaunchState
    after_stop: AfterStop = AfterStop.STOP
    signal: str | None = None


def innocent(loss: EngineLoss) -> bool:
    """The request cannot have caused the loss."""
    if not loss.gone:
        return False  # the server serves on: nothing says it was lost from outside
    if not loss.reached:
        return True  # no engine ever read it
    if loss.state is S.STOPPING:
        return loss.after_stop in PLANNED_STOPS  # stopped on purpose; a hang may be the request's doing
    return loss.signal in KILLED_FROM_OUTSIDE


def send_again(loss: EngineLoss, sends: int, suspect_losses: int) -> bool:
    """After `sends` sends and `suspect_losses` losses the request may have caused (this one
    counted): whether to send it once more, to the next ready server."""
    if sends >= MAX_SENDS:
        return False
    return innocent(loss) or suspect_losses <= SUSPECT_RESENDS
