"""The control server on a tmp socket with a toy dispatch."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing

from stoker.daemon.control import error_codes, protocol
from stoker.daemon.control import server as control
from stoker.daemon.core.errors import StokerError
from stoker.daemon.core.events import DROPPED_TOPIC, EventBus
from stoker.states.reasons import ReasonCode

TIMEOUT = 10


@pytest.fixture
def sock_path():
    # AF_UNIX paths are limited to ~107 bytes; pytest's tmp_path can be longer.
    root = Path(tempfile.mkdtemp(prefix="stk-", dir="/tmp"))
    yield root / "run" / "stoker.sock"
    shutil.rmtree(root, ignore_errors=True)


class Toy:
    """A dispatch: echo, sleep, fail, boom; records how many calls run at once."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.release = trio.Event()
        self.on_stop = lambda: None

    async def __call__(self, method, params):
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if method == "echo":
                await trio.sleep(params.get("delay", 0))
                return params
            if method == "block":
                await self.release.wait()
                return "released"
            if method == "fail":
                raise StokerError(ReasonCode.PORT_IN_USE, evidence={"port": 8080})
            if method == "boom":
                raise RuntimeError("handler bug")
            if method == "stop":  # as `shutdown` does: set off the cancellation of this server
                self.on_stop()
                return {"stopping": True}
            raise StokerError(ReasonCode.UNKNOWN_METHOD, evidence={"method": method})
        finally:
            self.running -= 1


class Peer:
    """A raw async client: send frames, read replies."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.decoder = protocol.FrameDecoder(protocol.MAX_REPLY_FRAME)

    @classmethod
    async def connect(cls, path: Path) -> "Peer":
        return cls(await trio.open_unix_socket(str(path)))

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def call(self, request_id, method, **params):
        await self.send(protocol.encode_request(request_id, method, params))
        return await self.read()

    async def closed(self) -> bool:
        """Whether the server hung up (EOF, or a reset: it closed with our bytes unread)."""
        try:
            return await self.read() is None
        except trio.BrokenResourceError:
            return True

    async def read(self):
        """The next message, or None at EOF."""
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                return protocol.decode_reply(frame)
            data = await self.stream.receive_some(65536)
            if not data:
                return None
            self.decoder.feed(data)


@pytest.fixture
async def server(sock_path, nursery):
    toy = Toy()
    bus = EventBus(buffer=16)
    path = await nursery.start(control.serve_control, sock_path, toy, bus)
    return path, toy, bus


async def test_directory_and_socket_permissions(server):
    path, _, _ = server
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(path).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


async def test_an_existing_open_directory_of_ours_is_tightened(sock_path, nursery):
    sock_path.parent.mkdir(parents=True, mode=0o755)
    os.chmod(sock_path.parent, 0o755)
    await nursery.start(control.serve_control, sock_path, Toy(), EventBus())
    assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o700


def test_a_directory_owned_by_someone_else_is_refused(sock_path, monkeypatch):
    sock_path.parent.mkdir(parents=True, mode=0o700)
    real = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: real + 4242)
    with pytest.raises(StokerError) as info:
        control.prepare_runtime_dir(sock_path.parent)
    assert "belongs to uid" in info.value.message


def test_a_symlinked_runtime_dir_is_refused(sock_path):
    target = sock_path.parent.parent / "elsewhere"
    target.mkdir(mode=0o700)
    sock_path.parent.symlink_to(target)
    with pytest.raises(StokerError):
        control.prepare_runtime_dir(sock_path.parent)


async def test_calls_results_and_errors(server):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        assert await peer.call(1, "echo", x=1) == protocol.Result(1, {"x": 1})
        reply = await peer.call("two", "fail")
        assert isinstance(reply, protocol.ErrorReply)
        assert (reply.id, reply.reason, reply.data) == ("two", "port_in_use", {"port": 8080})
        assert reply.code == error_codes.ERROR_CODES[ReasonCode.PORT_IN_USE]
        reply = await peer.call(3, "nope")
        assert (reply.id, reply.code, reply.reason) == (3, -32601, "unknown_method")


async def test_a_handler_bug_is_an_internal_error_and_the_connection_lives_on(server, caplog):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        reply = await peer.call(1, "boom")
        assert (reply.id, reply.reason, reply.code) == (1, "internal_error", -32603)
        assert reply.data["exception"] == "RuntimeError"
        assert "handler bug" in caplog.text  # the traceback is logged
        assert await peer.call(2, "echo") == protocol.Result(2, {})


@pytest.mark.parametrize(
    "line, code, request_id",
    [
        (b"{not json", error_codes.PARSE_ERROR, None),
        (b"\xff\xfe\n", error_codes.PARSE_ERROR, None),
        (b"[1, 2, 3]", -32600, None),
        (b"42", -32600, None),
        (b'{"jsonrpc": "2.0", "id": 5, "method": 7}', -32600, 5),
        (b'{"jsonrpc": "1.0", "id": 6, "method": "echo"}', -32600, 6),
        (b'{"jsonrpc": "2.0", "id": 7, "method": "echo", "params": [1]}', -32600, 7),
    ],
)
async def test_bad_input_gets_bad_request_and_the_connection_lives_on(server, line, code, request_id):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        await peer.send(line.rstrip(b"\n") + b"\n")
        reply = await peer.read()
        assert isinstance(reply, protocol.ErrorReply)
        assert (reply.code, reply.reason, reply.id) == (code, "bad_request", request_id)
        assert await peer.call(99, "echo", ok=True) == protocol.Result(99, {"ok": True})


async def test_an_oversized_frame_is_refused_and_the_next_client_is_served(server):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        chunk = b"x" * 65536
        try:
            for _ in range(protocol.MAX_FRAME // len(chunk) + 2):
                await peer.send(chunk)
        except trio.BrokenResourceError:
            pass  # the server may hang up before we finish sending
        reply = await peer.read()
        assert isinstance(reply, protocol.ErrorReply)
        assert (reply.reason, reply.id) == ("request_too_large", None)
        assert await peer.closed()  # and it closed this connection
        other = await Peer.connect(path)
        assert await other.call(1, "echo") == protocol.Result(1, {})


async def test_requests_on_one_connection_run_concurrently(server, autojump_clock):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        await peer.send(protocol.encode_request(1, "echo", {"delay": 0.5}))
        await peer.send(protocol.encode_request(2, "echo", {}))
        first, second = await peer.read(), await peer.read()
        assert (first.id, second.id) == (2, 1)


async def test_in_flight_requests_per_connection_are_limited(sock_path, nursery):
    toy = Toy()
    path = await nursery.start(
        lambda task_status: control.serve_control(sock_path, toy, EventBus(), max_in_flight=3, task_status=task_status)
    )
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        await peer.send(b"".join(protocol.encode_request(i, "block") for i in range(10)))
        await trio.testing.wait_all_tasks_blocked()  # every frame read that the limit lets in
        assert toy.running == 3
        toy.release.set()
        ids = {(await peer.read()).id for _ in range(10)}
        assert ids == set(range(10))
        assert toy.most == 3


async def test_many_concurrent_clients(server):
    path, _, _ = server
    results: dict[int, list] = {}

    async def client(n: int) -> None:
        peer = await Peer.connect(path)
        await peer.send(b"".join(protocol.encode_request(i, "echo", {"n": n, "i": i}) for i in range(10)))
        got = [await peer.read() for _ in range(10)]
        results[n] = sorted((reply.id, reply.result["n"], reply.result["i"]) for reply in got)
        await peer.stream.aclose()

    with trio.fail_after(TIMEOUT * 3):
        async with trio.open_nursery() as nursery:
            for n in range(50):
                nursery.start_soon(client, n)
    assert results == {n: [(i, n, i) for i in range(10)] for n in range(50)}


async def test_subscriber_gets_events_in_order(server):
    path, _, bus = server
    with trio.fail_after(TIMEOUT):
        bus.publish({"topic": "before"})
        peer = await Peer.connect(path)
        ack = await peer.call(1, "subscribe")
        assert ack == protocol.Result(1, {"subscribed": True, "seq": 1})
        for i in range(10):
            bus.publish({"topic": "t", "i": i})
        got = [await peer.read() for _ in range(10)]
        assert all(isinstance(m, protocol.Event) for m in got)
        assert [m.params["i"] for m in got] == list(range(10))
        assert [m.params["seq"] for m in got] == list(range(2, 12))


async def test_a_slow_subscriber_is_dropped_without_blocking_publish(server):
    path, _, bus = server
    payload = "x" * 2000
    with trio.fail_after(TIMEOUT * 2):
        slow = await Peer.connect(path)
        assert isinstance(await slow.call(1, "subscribe"), protocol.Result)
        fast = await Peer.connect(path)
        assert isinstance(await fast.call(1, "subscribe"), protocol.Result)
        fast_seqs = []

        async def read_fast():
            while (message := await fast.read()) is not None:
                fast_seqs.append(message.params["seq"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_fast)
            for _ in range(600):  # ~1.2 MB: more than the slow socket's buffer can hold
                start = trio.current_time()
                bus.publish({"topic": "t", "payload": payload})
                assert trio.current_time() - start < 0.05
                await trio.testing.wait_all_tasks_blocked()
            assert bus.statistics().dropped == 1
            # The slow reader finally reads: contiguous events, then the notice, then EOF.
            seqs, notice = [], None
            while (message := await slow.read()) is not None:
                if message.params["topic"] == DROPPED_TOPIC:
                    notice = message.params
                else:
                    seqs.append(message.params["seq"])
            assert notice is not None
            assert seqs == list(range(1, notice["missed_from_seq"]))
            bus.close()
        assert fast_seqs == list(range(1, 601))


async def test_requests_after_subscribe_are_ignored(server):
    path, _, bus = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        await peer.call(1, "subscribe")
        await peer.send(protocol.encode_request(2, "echo"))
        await trio.testing.wait_all_tasks_blocked()  # the server has read the request (and had its chance to answer)
        bus.publish({"topic": "t"})
        message = await peer.read()
        assert isinstance(message, protocol.Event)


async def test_a_stale_socket_file_is_replaced(sock_path, nursery):
    sock_path.parent.mkdir(parents=True, mode=0o700)
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(sock_path))
    dead.close()  # the file stays; nothing listens
    assert sock_path.exists()
    path = await nursery.start(control.serve_control, sock_path, Toy(), EventBus())
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        assert await peer.call(1, "echo") == protocol.Result(1, {})


async def test_a_file_that_is_not_a_socket_is_not_removed(sock_path):
    sock_path.parent.mkdir(parents=True, mode=0o700)
    sock_path.write_text("precious")
    with pytest.raises(StokerError):
        await control.serve_control(sock_path, Toy(), EventBus())
    assert sock_path.read_text() == "precious"


async def test_a_second_server_on_a_live_socket_refuses(server):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        with pytest.raises(StokerError) as info:
            await control.serve_control(path, Toy(), EventBus())
        assert info.value.reason == ReasonCode.DAEMON_ALREADY_RUNNING
        peer = await Peer.connect(path)  # the first one still serves
        assert await peer.call(1, "echo") == protocol.Result(1, {})


async def test_another_uid_is_refused(server, monkeypatch):
    path, toy, _ = server
    monkeypatch.setattr(control, "peer_uid", lambda sock: os.getuid() + 1)
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        try:
            await peer.send(protocol.encode_request(1, "echo"))
        except trio.BrokenResourceError:
            pass
        reply = await peer.read()
        assert isinstance(reply, protocol.ErrorReply) and reply.reason == "bad_request"
        assert await peer.closed()
    assert toy.most == 0


def test_peer_uid_is_ours_for_a_socketpair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        assert control.peer_uid(a) == os.getuid()


async def test_cancellation_closes_connections_and_removes_the_socket(sock_path):
    toy = Toy()
    with trio.fail_after(TIMEOUT):
        async with trio.open_nursery() as nursery:
            path = await nursery.start(control.serve_control, sock_path, toy, EventBus())
            idle = await Peer.connect(path)
            busy = await Peer.connect(path)
            await busy.send(protocol.encode_request(1, "block"))
            await trio.testing.wait_all_tasks_blocked()
            assert toy.running == 1  # cancelled while a handler runs, not before it began
            nursery.cancel_scope.cancel()
        assert await idle.read() is None
        assert await busy.read() is None
        assert not path.exists()


async def test_pipelined_frames_in_one_write(server):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        peer = await Peer.connect(path)
        blob = b"".join(protocol.encode_request(i, "echo", {"i": i}) for i in range(20))
        await peer.send(blob[:7])
        await peer.send(blob[7:])
        replies = [await peer.read() for _ in range(20)]
        assert sorted(r.id for r in replies) == list(range(20))
        assert all(r.result == {"i": r.id} for r in replies)


async def test_reply_frames_are_single_lines_of_json(server):
    path, _, _ = server
    with trio.fail_after(TIMEOUT):
        stream = await trio.open_unix_socket(str(path))
        await stream.send_all(protocol.encode_request(1, "echo", {"text": "a\nb"}))
        data = b""
        while not data.endswith(b"\n"):
            data += await stream.receive_some(4096)
        assert data.count(b"\n") == 1
        assert json.loads(data)["result"] == {"text": "a\nb"}


async def test_a_socket_path_that_is_too_long_is_a_clear_error(tmp_path):
    path = tmp_path / ("d" * 120) / "stoker.sock"
    with pytest.raises(StokerError) as info:
        await control.serve_control(path, Toy(), EventBus())
    assert "longer than" in info.value.message


async def test_a_handler_that_stops_the_server_still_gets_its_reply_out(sock_path):
    # `stoker shutdown` exited 3 about half the time: its handler sets off the daemon's
    # cancellation, which used to catch the reply before it was sent.
    toy = Toy()
    for attempt in range(20):  # trio's scheduling order is random: try it many times
        server = trio.CancelScope()
        toy.on_stop = server.cancel

        async def serve(task_status=trio.TASK_STATUS_IGNORED):
            with server:
                await control.serve_control(sock_path, toy, EventBus(), task_status=task_status)

        with trio.fail_after(TIMEOUT):
            async with trio.open_nursery() as nursery:
                path = await nursery.start(serve)
                peer = await Peer.connect(path)
                assert await peer.call(attempt, "stop") == protocol.Result(attempt, {"stopping": True})
                assert await peer.closed()


async def test_a_client_that_sends_half_a_frame_and_holds_is_dropped_without_blocking_others(server, autojump_clock):
    path, _, _ = server
    with trio.fail_after(control.FRAME_TIMEOUT_S + 5):
        holder = await Peer.connect(path)
        await holder.send(b'{"jsonrpc": "2.0", "id": 1, "method": "ec')  # and never the rest
        started = trio.current_time()
        other = await Peer.connect(path)  # meanwhile another client is served at once
        assert await other.call(2, "echo", n=1) == protocol.Result(2, {"n": 1})
        assert trio.current_time() - started < 1
        reply = await holder.read()
        assert isinstance(reply, protocol.ErrorReply) and reply.reason == "bad_request", reply
        assert "not finished" in reply.message
        assert await holder.closed()
        assert control.FRAME_TIMEOUT_S <= trio.current_time() - started < control.FRAME_TIMEOUT_S + 1
        assert await other.call(3, "echo") == protocol.Result(3, {})  # the other connection lives on


async def test_a_frame_trickled_byte_by_byte_is_dropped_once_it_has_taken_too_long(server, autojump_clock):
    path, _, _ = server
    with trio.fail_after(control.FRAME_TIMEOUT_S * 3):
        peer = await Peer.connect(path)
        started = trio.current_time()
        try:
            for byte in protocol.encode_request(1, "echo", {"pad": "x" * 100}):
                await peer.send(bytes([byte]))
                await trio.sleep(1)
        except trio.BrokenResourceError:
            pass  # the server hung up mid-way, as it should
        reply = await peer.read()
        assert isinstance(reply, protocol.ErrorReply) and reply.reason == "bad_request"
        assert trio.current_time() - started < control.FRAME_TIMEOUT_S + 2


async def test_an_idle_connection_between_frames_is_kept(server, autojump_clock):
    path, _, _ = server
    with trio.fail_after(control.FRAME_TIMEOUT_S * 20):
        peer = await Peer.connect(path)
        assert await peer.call(1, "echo") == protocol.Result(1, {})
        await trio.sleep(control.FRAME_TIMEOUT_S * 10)  # nothing begun: no deadline
        assert await peer.call(2, "echo") == protocol.Result(2, {})
        # Each read ends one frame and begins the next: every frame begun gets its own deadline,
        # though the connection has held an unfinished frame for far longer than one.
        frames = [protocol.encode_request(i, "echo", {}) for i in range(3, 10)]
        await peer.send(frames[0][:5])
        for i, frame in enumerate(frames):
            await trio.sleep(control.FRAME_TIMEOUT_S * 0.6)
            following = frames[i + 1][:5] if i + 1 < len(frames) else b""
            await peer.send(frame[5:] + following)
            assert await peer.read() == protocol.Result(i + 3, {})
