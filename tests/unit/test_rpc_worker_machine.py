"""The worker machine (states/worker/table.py): what an rpc-server's start, answer and exits mean."""

from __future__ import annotations

from stoker.states.worker import table as M
from stoker.states.machine import step
from stoker.states.reasons import ReasonCode

S = M.WorkerState
SETTINGS = M.WorkerSettings(max_restarts=2, stable_after=30.0, stop_grace=1.0)


def _run(events, state=S.STOPPED, data=None):
    data = data or M.WORKER.initial_data()
    steps = []
    for event in events:
        result = step(M.WORKER, state, data, event)
        state, data = result.state, result.data
        steps.append(result)
    return state, data, steps


def _start():
    return M.StartRequested("127.0.0.1:50052", "7.0.0", SETTINGS)


def _answer(version="7.0.0"):
    return M.Answered(version, ({"index": 0, "name": "CPU", "free_mib": 100, "total_mib": 200},))


def test_serving_only_once_it_answers_with_the_bundles_protocol():
    state, data, steps = _run([_start(), M.Spawned(10, 1.0), _answer()])
    assert state is S.SERVING and data.version == "7.0.0" and data.devices[0]["name"] == "CPU"
    assert steps[0].effects == (M.SpawnServer("127.0.0.1:50052"),)
    assert steps[-1].effects == (M.ArmStableTimer(30.0),)


def test_another_protocol_version_fails_and_stops_the_server():
    state, data, steps = _run([_start(), M.Spawned(10, 1.0), _answer("6.0.0")])
    assert state is S.FAILED and data.reason == ReasonCode.RPC_VERSION_MISMATCH
    assert steps[-1].evidence["expected"] == "7.0.0" and steps[-1].effects == (M.TerminateServer(1.0),)


def test_crashes_back_off_then_a_crash_loop_fails():
    crash = M.Exited(-9, ReasonCode.SERVER_CRASHED, {"line": None})
    state, data, steps = _run([_start(), M.Spawned(10), _answer(), crash])
    assert state is S.BACKOFF and steps[-1].effects == (M.StartBackoff(1),)
    state, data, _ = _run([M.BackoffElapsed(), M.Spawned(11), crash, M.BackoffElapsed(), crash], state, data)
    assert state is S.FAILED and data.reason == ReasonCode.CRASH_LOOP and data.evidence["crashes"] == 3


def test_stable_forgives_earlier_crashes():
    crash = M.Exited(1, ReasonCode.SERVER_CRASHED)
    state, data, _ = _run([_start(), crash, M.BackoffElapsed(), _answer(), M.Stable()])
    assert state is S.SERVING and data.crashes == 0


def test_a_bad_command_line_is_fatal_at_once():
    state, data, _ = _run(
        [_start(), M.Exited(0, ReasonCode.SERVER_BAD_ARGUMENTS, {"line": "error: unknown device: X"})]
    )
    assert state is S.FAILED and data.reason == ReasonCode.SERVER_BAD_ARGUMENTS


def test_stop_and_adoption():
    state, data, steps = _run([_start(), _answer(), M.StopRequested(), M.StopCompleted(0)])
    assert state is S.STOPPED and steps[2].effects == (M.TerminateServer(1.0),)
    adopted = M.Adopted("127.0.0.1:50052", "7.0.0", 42, 5.0, {"pid": 42}, SETTINGS)
    state, data, steps = _run([adopted], S.SERVING)  # the row a killed `stoker worker` left
    assert state is S.SERVING and data.pid == 42 and steps[0].effects[0] == M.WatchServer(42)
    state, _, steps = _run([_start()], S.SERVING)  # nothing proven alive: start afresh, said so
    assert state is S.STARTING and steps[0].evidence["previous_run_left"] == "serving"
