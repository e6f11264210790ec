"""`RelayLoop`: one thread that relays every stream being pumped, socket to socket.

A streamed answer is one event per token. Read and written by trio's tasks, each event was a
pass of the scheduler and the relay's coroutines; read and written by a worker thread of its
own, each event woke that thread and took the interpreter's lock from the others, so 16
streams at ~1 100 tokens/s each (the tiny test model on an H200) were 16 threads handing the
lock around ~18 000 times a second. Here one thread waits on every pumped stream's engine
socket at once (a selector: epoll on Linux, kqueue on macOS): the engine writes a token's event
for each of its slots in the same step, so a wake-up finds several streams ready and relays
each with one read and one write, and no other thread takes turns with it.

A pump's sink (the client's socket) is written without blocking. A client whose window is full
stops only its own stream: what it could not take waits in the pump, the engine's socket is
not read meanwhile (so the engine, too, is held back), and the loop watches the client's
socket until it drains. A pump waiting on its source longer than its timeout ends with
`SourceSilent`; one stopped from trio's thread (`RelayLoop.pump`'s caller cancelled) ends at
once with b"", and nothing it uses is closed under it, since its caller waits for it.
"""

from __future__ import annotations

import math
import selectors
import socket
import threading
import time
from typing import Any, Callable

import attrs
import outcome
import trio

READ_BYTES = 64 * 1024


class SourceClosed(Exception):
    """The source closed its connection before the pump's end."""


class SourceSilent(Exception):
    """The source sent nothing for the pump's timeout."""


class SourceBroken(Exception):
    """Reading the source failed (a reset connection)."""


class SinkGone(Exception):
    """Writing to the sink failed: its peer left."""


@attrs.define(eq=False)
class Pump:
    """What one stream's relay does with each read of its source: `decode` it, and unless that
    ended the stream (`over()`), `shape` what it decoded into the bytes for the sink (b"" for
    nothing). The read that ends the stream is not written: its decoding is the pump's result,
    for the caller to write with the stream's end."""

    source: socket.socket
    sink: socket.socket
    decode: Callable[[bytes], bytes]
    over: Callable[[], bool]
    shape: Callable[[bytes], bytes]
    timeout: float


@attrs.define(eq=False)
class _Job:
    pump: Pump
    deliver: Callable[[outcome.Outcome[bytes]], None]
    deadline: float = math.inf  # while reading the source; none while the sink drains
    pending: memoryview | None = None  # what the sink could not take yet
    stopped: bool = False  # set from trio's thread: end now, with b""
    done: bool = False


@attrs.define(eq=False)
class RelayLoop:
    """The thread that relays every pumped stream (started with the first, ended by `close`)."""

    _lock: threading.Lock = attrs.field(factory=threading.Lock)
    _asked: list[tuple[str, _Job | None]] = attrs.field(factory=list)
    _thread: threading.Thread | None = None
    _wake: tuple[socket.socket, socket.socket] | None = None
    _soonest: float = math.inf  # the loop's: no pump reading its source has a deadline before this

    async def pump(self, pump: Pump, interrupt: Callable[[], None]) -> bytes:
        """Relay `pump`'s stream until its end; its last read, decoded. If the caller is
        cancelled meanwhile, `interrupt()` is called (in trio's thread), the pump stops, and
        Cancelled is raised once the loop has let go of its sockets. Raises what `decode` and
        `shape` raise, `SourceClosed`, `SourceSilent`, `SourceBroken` or `SinkGone`."""
        await trio.lowlevel.checkpoint_if_cancelled()
        token, task = trio.lowlevel.current_trio_token(), trio.lowlevel.current_task()
        result: list[outcome.Outcome[bytes]] = []
        cancelled = False

        def deliver(done: outcome.Outcome[bytes]) -> None:  # in the loop's thread
            result.append(done)
            try:
                token.run_sync_soon(trio.lowlevel.reschedule, task)
            except trio.RunFinishedError:  # the daemon's run is over: nobody waits any more
                pass

        job = _Job(pump, deliver)

        def abort(_: object) -> trio.lowlevel.Abort:
            nonlocal cancelled
            cancelled = True
            job.stopped = True  # before `interrupt` shuts the source: the loop then reads its end as a stop
            interrupt()
            self._ask("stop", job)
            return trio.lowlevel.Abort.FAILED  # still waiting: the loop lets go soon

        self._ask("add", job)
        await trio.lowlevel.wait_task_rescheduled(abort)
        if cancelled:
            await trio.lowlevel.checkpoint()  # the scope that cancelled it still is: raises Cancelled
        return result[0].unwrap()

    def close(self) -> None:
        """End the thread once its pumps are over (the front door is going away)."""
        if self._thread is not None:
            self._ask("close", None)
            self._thread = None

    def _ask(self, what: str, job: _Job | None) -> None:
        with self._lock:
            if self._wake is None:
                self._wake = socket.socketpair()
                for end in self._wake:
                    end.setblocking(False)
            if self._thread is None and what == "add":
                self._thread = threading.Thread(target=self._run, args=(self._wake[0],), name="relay", daemon=True)
                self._thread.start()
            self._asked.append((what, job))
        try:
            self._wake[1].send(b"\0")
        except BlockingIOError:  # the loop has wake-ups enough waiting
            pass

    def _run(self, wake: socket.socket) -> None:
        poller = selectors.DefaultSelector()
        poller.register(wake.fileno(), selectors.EVENT_READ)
        by_fd: dict[int, _Job] = {}
        closing = False
        try:
            while not (closing and not by_fd):
                soonest = self._soonest
                wait = -1.0 if soonest == math.inf else max(0.0, soonest - time.monotonic())
                ready = poller.select(None if wait < 0 else wait)
                now = time.monotonic()
                for key, _ in ready:
                    fd = key.fd
                    if fd == wake.fileno():
                        closing = self._commands(wake, poller, by_fd, now) or closing
                    elif (job := by_fd.get(fd)) is not None:
                        if fd == job.pump.source.fileno() and job.pending is None:
                            self._read(job, poller, by_fd, now)
                        elif job.pending is not None:
                            self._drain(job, poller, by_fd, now)
                if now >= self._soonest:
                    for job in list(by_fd.values()):
                        if job.deadline <= now and job.pending is None:
                            silent = SourceSilent(f"the engine said nothing for {job.pump.timeout:g} s")
                            self._finish(job, poller, by_fd, outcome.Error(silent))
                    self._soonest = min((j.deadline for j in by_fd.values()), default=math.inf)
        except BaseException as exc:  # a bug here must not leave its pumps' callers waiting
            for job in set(by_fd.values()):
                if not job.done:
                    job.done = True
                    job.deliver(outcome.Error(exc))
            with self._lock:
                self._thread = None  # the next pump starts another
            raise
        finally:
            poller.close()

    def _commands(
        self, wake: socket.socket, poller: selectors.BaseSelector, by_fd: dict[int, _Job], now: float
    ) -> bool:
        """What trio's thread asked; whether to close."""
        try:
            while wake.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            asked, self._asked = self._asked, []
        closing = False
        for what, job in asked:
            if what == "close":
                closing = True
            elif job is None or job.done:
                continue
            elif what == "add":
                job.deadline = now + job.pump.timeout
                self._soonest = min(self._soonest, job.deadline)
                by_fd[job.pump.source.fileno()] = job
                poller.register(job.pump.source.fileno(), selectors.EVENT_READ)
                if job.stopped:
                    self._finish(job, poller, by_fd, outcome.Value(b""))
            else:  # "stop"
                self._finish(job, poller, by_fd, outcome.Value(b""))
        return closing

    def _read(self, job: _Job, poller: selectors.BaseSelector, by_fd: dict[int, _Job], now: float) -> None:
        pump = job.pump
        try:
            data = pump.source.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError as exc:
            self._finish(job, poller, by_fd, outcome.Value(b"") if job.stopped else outcome.Error(SourceBroken(exc)))
            return
        if not data:
            self._finish(job, poller, by_fd, outcome.Value(b"") if job.stopped else outcome.Error(SourceClosed()))
            return
        try:
            piece = pump.decode(data)
            if pump.over():
                self._finish(job, poller, by_fd, outcome.Value(piece))
                return
            out = pump.shape(piece) if piece else b""
        except Exception as exc:  # the decoding's or the shaping's own error, for the caller
            self._finish(job, poller, by_fd, outcome.Error(exc))
            return
        job.deadline = now + pump.timeout
        if out:
            self._send(job, memoryview(out), poller, by_fd)

    def _send(self, job: _Job, out: memoryview, poller: selectors.BaseSelector, by_fd: dict[int, _Job]) -> bool:
        """`out` to the sink, what it cannot take kept; whether the sink took all there was."""
        pump = job.pump
        try:
            sent = pump.sink.send(out)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            self._finish(job, poller, by_fd, outcome.Error(SinkGone(str(exc))))
            return False
        if sent == len(out):
            if job.pending is not None:  # drained: read the source again
                job.pending = None
                poller.unregister(pump.sink.fileno())
                del by_fd[pump.sink.fileno()]
                poller.register(pump.source.fileno(), selectors.EVENT_READ)
            return True
        if job.pending is None:  # the client's window is full: hold the source until it drains
            poller.unregister(pump.source.fileno())
            by_fd[pump.sink.fileno()] = job
            poller.register(pump.sink.fileno(), selectors.EVENT_WRITE)
            job.deadline = math.inf
        job.pending = out[sent:]
        return False

    def _drain(self, job: _Job, poller: selectors.BaseSelector, by_fd: dict[int, _Job], now: float) -> None:
        assert job.pending is not None
        if self._send(job, job.pending, poller, by_fd):
            job.deadline = now + job.pump.timeout
            self._soonest = min(self._soonest, job.deadline)

    def _finish(
        self, job: _Job, poller: selectors.BaseSelector, by_fd: dict[int, _Job], result: outcome.Outcome[Any]
    ) -> None:
        if job.done:
            return
        job.done = True
        for sock in (job.pump.source, job.pump.sink):
            fd = sock.fileno()
            if by_fd.get(fd) is job:
                del by_fd[fd]
                try:
                    poller.unregister(fd)
                except (KeyError, ValueError):  # not registered now (the source while the sink drained)
                    pass
        job.deliver(result)
