"""sd_notify against a NOTIFY_SOCKET of our own (path and abstract)."""

from __future__ import annotations

import os
import socket

import pytest
import trio

from stoker.daemon.core import sdnotify


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = tmp_path / "notify.sock"
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def test_unset_is_a_no_op():
    assert "NOTIFY_SOCKET" not in os.environ
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False


def test_messages_reach_the_socket(notify_socket):
    assert sdnotify.ready("serving on 127.0.0.1:8080")
    assert notify_socket.recv(4096) == b"READY=1\nSTATUS=serving on 127.0.0.1:8080"
    assert sdnotify.status("loading\nmodel")
    assert notify_socket.recv(4096) == b"STATUS=loading model"
    assert sdnotify.watchdog()
    assert notify_socket.recv(4096) == b"WATCHDOG=1"
    assert sdnotify.stopping()
    assert notify_socket.recv(4096) == b"STOPPING=1"


def test_abstract_socket(monkeypatch):
    name = f"stoker-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready()
        assert sock.recv(4096) == b"READY=1"


def test_a_missing_socket_is_logged_not_raised(tmp_path, monkeypatch):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-here"))
    assert sdnotify.ready() is False


def test_watchdog_interval():
    pid = str(os.getpid())
    assert sdnotify.watchdog_interval({}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "3000000"}) == 3.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": pid}) == 3.0
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "junk"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None


async def test_serve_watchdog_pings_at_half_the_interval(notify_socket, monkeypatch, autojump_clock):
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notify_socket.setblocking(False)
    async with trio.open_nursery() as nursery:
        interval = await nursery.start(sdnotify.serve_watchdog)
        assert interval == 2.0
        await trio.sleep(3.5)  # pings at 0, 1, 2, 3
        nursery.cancel_scope.cancel()
    pings = []
    while True:
        try:
            pings.append(notify_socket.recv(4096))
        except BlockingIOError:
            break
    assert pings == [b"WATCHDOG=1"] * 4


async def test_serve_watchdog_returns_when_not_asked():
    with trio.fail_after(1):
        async with trio.open_nursery() as nursery:
            assert await nursery.start(sdnotify.serve_watchdog) is None
