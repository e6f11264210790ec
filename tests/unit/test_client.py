"""The blocking client against a real control server, driven from worker threads."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from pathlib import Path

import pytest
import trio
import trio.testing

from stoker.daemon.control import server as control
from stoker.daemon.control.client import ControlClient
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.events import DROPPED_TOPIC, EventBus
from stoker.states.reasons import ReasonCode
from tests.waits import until

TIMEOUT = 15


@pytest.fixture
def sock_path():
    root = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
    yield root / "run" / "stoker.sock"
    shutil.rmtree(root, ignore_errors=True)


async def dispatch(method, params):
    if method == "echo":
        return params
    if method == "fail":
        raise StokerError(ReasonCode.MODEL_MISSING, "no such model", {"model": "/x.gguf"})
    if method == "big":
        return "y" * params["n"]
    raise StokerError(ReasonCode.UNKNOWN_METHOD, evidence={"method": method})


async def start(nursery, path, bus=None):
    return await nursery.start(control.serve_control, path, dispatch, bus or EventBus())


def in_thread(fn, *args, **kwargs):
    return trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


async def test_call_result_and_reason_coded_error(sock_path, nursery):
    path = await start(nursery, sock_path)
    client = ControlClient(path, timeout=5)

    def work():
        with client:
            assert client.call("echo", a=1, b=[1, 2]) == {"a": 1, "b": [1, 2]}
            with pytest.raises(StokerError) as info:
                client.call("fail")
            assert info.value.reason == ReasonCode.MODEL_MISSING
            assert info.value.message == "no such model"
            assert info.value.evidence == {"model": "/x.gguf"}
            with pytest.raises(StokerError) as info:
                client.call("nope")
            assert info.value.reason == ReasonCode.UNKNOWN_METHOD
            return client.call("echo", after="errors")

    with trio.fail_after(TIMEOUT):
        assert await in_thread(work) == {"after": "errors"}


def test_no_socket_means_daemon_not_running(sock_path):
    with pytest.raises(StokerError) as info:
        ControlClient(sock_path, timeout=1).call("status")
    assert info.value.reason == ReasonCode.DAEMON_NOT_RUNNING
    assert info.value.evidence["socket"] == str(sock_path)


def test_a_socket_nobody_listens_on_means_daemon_not_running(sock_path):
    sock_path.parent.mkdir(parents=True)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()
    with pytest.raises(StokerError) as info:
        ControlClient(sock_path, timeout=1).call("status")
    assert info.value.reason == ReasonCode.DAEMON_NOT_RUNNING


def test_default_socket_path_follows_stoker_home(stoker_home):
    assert ControlClient().socket_path == Path(stoker_home) / "run" / "stoker.sock"


async def test_one_client_shared_by_threads(sock_path, nursery):
    path = await start(nursery, sock_path)
    client = ControlClient(path, timeout=5)
    errors = []

    def worker(n):
        try:
            for i in range(25):
                assert client.call("echo", n=n, i=i) == {"n": n, "i": i}
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    def run_all():
        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        client.close()

    with trio.fail_after(TIMEOUT):
        await in_thread(run_all)
    assert errors == []


async def test_reconnects_after_the_daemon_restarts(sock_path):
    client = ControlClient(sock_path, timeout=5)
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            await start(nursery, sock_path)
            assert await in_thread(client.call, "echo") == {}
            nursery.cancel_scope.cancel()
        with pytest.raises(StokerError) as info:
            await in_thread(client.call, "echo")
        assert info.value.reason == ReasonCode.DAEMON_NOT_RUNNING
        async with trio.open_nursery() as nursery:
            await start(nursery, sock_path)
            assert await in_thread(client.call, "echo") == {}
            nursery.cancel_scope.cancel()
    client.close()


async def test_a_slow_reply_times_out(sock_path, nursery):
    release = trio.Event()

    async def slow_then_fresh(method, params):
        if method == "slow":
            await release.wait()
            return "late"
        release.set()  # the timed-out call's late reply goes out while this call is under way
        await trio.testing.wait_all_tasks_blocked()
        return await dispatch(method, params)

    path = await nursery.start(control.serve_control, sock_path, slow_then_fresh, EventBus())
    client = ControlClient(path, timeout=0.3)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(StokerError) as info:
            await in_thread(client.call, "slow")
        assert info.value.evidence["timeout_s"] == 0.3
        # The late reply to the timed-out call never reaches a later call.
        assert await in_thread(client.call, "echo", fresh=True) == {"fresh": True}


async def test_large_replies(sock_path, nursery):
    path = await start(nursery, sock_path)
    with trio.fail_after(TIMEOUT):
        result = await in_thread(ControlClient(path).call, "big", n=3 * 1024 * 1024)
    assert len(result) == 3 * 1024 * 1024


async def test_an_oversized_request_is_refused_before_sending(sock_path, nursery):
    path = await start(nursery, sock_path)
    client = ControlClient(path)
    with trio.fail_after(TIMEOUT):
        with pytest.raises(StokerError) as info:
            await in_thread(lambda: client.call("echo", blob="z" * (2 * 1024 * 1024)))
        assert info.value.reason == ReasonCode.REQUEST_TOO_LARGE
        assert await in_thread(client.call, "echo") == {}


async def test_subscribe_streams_events_and_close_from_another_thread(sock_path, nursery):
    bus = EventBus()
    path = await start(nursery, sock_path, bus)
    client = ControlClient(path, timeout=5)
    got = []
    with trio.fail_after(TIMEOUT):
        stream = await in_thread(client.subscribe)
        assert stream.ack["subscribed"] is True

        def read_all():
            for event in stream:
                got.append(event)

        async with trio.open_nursery() as inner:
            inner.start_soon(in_thread, read_all)
            for i in range(5):
                bus.publish({"topic": "t", "i": i})
            await until(lambda: len(got) >= 5, timeout=TIMEOUT, what="five events read by the worker thread")
            stream.close()  # from this thread, while the worker blocks in recv
    assert [e["i"] for e in got] == list(range(5))


async def test_subscribe_ends_with_the_dropped_notice(sock_path, nursery):
    bus = EventBus(buffer=2)
    path = await start(nursery, sock_path, bus)
    with trio.fail_after(TIMEOUT):
        stream = await in_thread(ControlClient(path).subscribe)
        for i in range(2000):  # the client reads nothing yet: it falls behind
            bus.publish({"topic": "t", "i": i, "pad": "p" * 500})
        events = await in_thread(list, stream)  # to the server's close, after the notice
    assert events[-1]["topic"] == DROPPED_TOPIC
    assert [e["i"] for e in events[:-1]] == list(range(len(events) - 1))


async def test_a_client_of_another_version_reads_what_it_knows_and_names_what_is_missing(sock_path, nursery):
    """A daemon newer than the CLI sends fields the CLI does not know: they are ignored. One
    older than the CLI lacks a field the CLI needs: daemon_version_skew, naming it and the method."""
    from stoker.daemon.control.replies import ModelList

    from tests.unit.test_cli_version_skew import MODEL_ROW as row

    newer = {
        "models": [row | {"served_by": [{"name": "default", "state": "ready", "since": 3}], "tier": "hot"}],
        "pulls": [],
        "remote": [],
    }
    older = {"models": [{k: v for k, v in row.items() if k != "path"}], "pulls": []}
    path = await start(nursery, sock_path)
    client = ControlClient(path, timeout=5)

    def work():
        with client:
            listed = client.call("echo", returns=ModelList, **newer)
            (model,) = listed.models
            assert model.path == "/m/SmolLM2.gguf" and model.served_by[0].name == "default"
            with pytest.raises(StokerError) as info:
                client.call("echo", returns=ModelList, **older)
            assert info.value.reason == ReasonCode.DAEMON_VERSION_SKEW
            assert "'echo'" in info.value.message and "$.models[0].path" in info.value.message
            assert "stoker shutdown" in info.value.message

    await in_thread(work)
