"""The front door's connections: many idle clients, slow clients, oversized requests, a LAN bind.

Real daemons, real llama-server (the tiny model), real sockets: 1000 idle connections (some
silent, some with half a request line) leave `stoker status` and a new chat request prompt and
are closed by the server after `[frontdoor] idle_timeout_s`; a client that trickles its headers
or its body is dropped; a body over `max_body_bytes` is refused with 413 in the API's own shape
without being read; a LAN bind without keys is refused at start and on reload, and with keys a
keyless request sent to the machine's LAN address gets 401.
"""

from __future__ import annotations

import contextlib
import json
import resource
import selectors
import socket
import time
from typing import Any, Iterator

import httpx
import psutil
import pytest

from tests.integration.daemon_harness import DaemonProcess, tiny_config, write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]

MESSAGES = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def frontdoor_config(model, port: int, **frontdoor: Any) -> str:
    lines = [f"port = {port}", *(f"{key} = {json.dumps(value)}" for key, value in frontdoor.items())]
    return tiny_config(model) + "[frontdoor]\n" + "\n".join(lines) + "\n"


@contextlib.contextmanager
def soft_open_files_limit(limit: int) -> Iterator[None]:
    """Children started inside inherit a soft RLIMIT_NOFILE of `limit` (a shell's usual 1024)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start(daemon: DaemonProcess, model, *, nofile: int | None = None, **frontdoor: Any) -> int:
    """Start `daemon` with its front door on a free port (and `[frontdoor]` keys); the port."""
    port = free_port()
    write_config(daemon.paths, frontdoor_config(model, port, **frontdoor))
    with soft_open_files_limit(nofile) if nofile else contextlib.nullcontext():
        daemon.start()
    return port


def chat(base: str, headers: dict[str, str] | None = None, timeout: float = 60.0) -> httpx.Response:
    body = {"model": "default", "messages": MESSAGES, "max_tokens": 2}
    return httpx.post(f"{base}/chat/completions", json=body, headers=headers, timeout=timeout, trust_env=False)


def established(pid: int, port: int) -> int:
    """The daemon's accepted connections to its front door."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED)


def wait_closed(socks: list[socket.socket], deadline: float) -> dict[socket.socket, float]:
    """When each socket was closed by the server (EOF or reset), waiting until `deadline`."""
    closed: dict[socket.socket, float] = {}
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ)
        while len(closed) < len(socks) and time.monotonic() < deadline:
            for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                except BlockingIOError:
                    continue
                if data == b"":
                    closed[sock] = time.monotonic()
                    sel.unregister(sock)
    return closed


def read_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes, bool]:
    """One HTTP/1.1 response read off a raw socket: status, headers, body, and whether the
    server closed the connection after it (EOF within `timeout`)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"closed before a response: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    try:
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True
    except TimeoutError:
        closed = False
    return status, headers, body, closed


# --- 1000 idle connections -----------------------------------------------------------------

IDLE_S = 10.0


def test_a_thousand_idle_connections_leave_status_and_a_new_request_prompt(daemon, model):
    """Started with a soft open-files limit of 256 (macOS's default), the daemon raises it (and logs so); 1000 idle
    clients are all accepted and held, `stoker status` and a chat request stay prompt, and the
    server closes every idle one after idle_timeout_s."""
    port = start(daemon, model, nofile=256, idle_timeout_s=IDLE_S)
    base = f"http://127.0.0.1:{port}/v1"
    daemon.wait_state("ready")
    assert daemon.proc is not None
    assert chat(base).status_code == 200  # warm: the figures below are the idle clients' cost

    socks: list[socket.socket] = []
    try:
        opened = time.monotonic()
        for i in range(1000):
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                sock.sendall(b"POST /v1/chat/compl")  # half a request line, then nothing
            socks.append(sock)
        wait_until(
            lambda: established(daemon.proc.pid, port) >= 1000,
            timeout=10,
            what="the daemon holding all 1000 idle connections",
            detail=lambda: f"it holds {established(daemon.proc.pid, port)}",
        )

        began = time.monotonic()
        status = daemon.call("status")
        status_s = time.monotonic() - began
        began = time.monotonic()
        reply = chat(base)
        chat_s = time.monotonic() - began
        print(f"1000 idle connections: status in {status_s * 1000:.0f} ms, a chat request in {chat_s * 1000:.0f} ms")
        assert status["state"] == "ready" and status_s < 2.0, status_s
        assert reply.status_code == 200 and reply.json()["choices"], reply.text
        assert chat_s < 5.0, chat_s
        assert time.monotonic() - opened < IDLE_S, "measured while the idle connections were still open"

        closed = wait_closed(socks, opened + IDLE_S + 15)
        assert len(closed) == 1000, f"{1000 - len(closed)} idle connections were never closed by the server"
        after = sorted(t - opened for t in closed.values())
        print(f"idle connections closed {after[0]:.1f} s .. {after[-1]:.1f} s after they opened")
        assert after[0] >= IDLE_S - 1.0, "closed before the idle timeout"
        assert established(daemon.proc.pid, port) <= 1
        assert daemon.call("status")["state"] == "ready"
        # What made room for them: the soft limit the daemon started with, raised (and said so).
        soft, _ = psutil.Process(daemon.proc.pid).rlimit(psutil.RLIMIT_NOFILE)
        assert soft > 1100 and "open files limit raised from 256 to" in daemon.log_text(), soft
    finally:
        for sock in socks:
            sock.close()


# --- slow clients ----------------------------------------------------------------------------


def test_slow_clients_are_dropped(daemon, model):
    """Headers trickled a line at a time are cut at idle_timeout_s after the connection opened;
    a body trickled after complete headers gets 408 frontdoor_slow_client at slow_client_timeout_s,
    and a prompt client on the same daemon is served meanwhile."""
    port = start(daemon, model, idle_timeout_s=3, slow_client_timeout_s=2)
    daemon.wait_state("ready")

    with (
        socket.create_connection(("127.0.0.1", port)) as headers,
        socket.create_connection(("127.0.0.1", port)) as body,
    ):
        opened = time.monotonic()
        headers.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        headers_sent = time.monotonic()
        headers.settimeout(0.3)
        cut_at = None
        for i in range(40):  # a header line every 0.3 s: data keeps coming, the head never ends
            try:
                headers.sendall(f"X-Slow-{i}: y\r\n".encode())
                if headers.recv(1) == b"":
                    cut_at = time.monotonic()
                    break
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                cut_at = time.monotonic()
                break
        assert cut_at is not None, "a client trickling its headers for 12 s was never dropped"
        assert 3 - 0.5 <= cut_at - opened <= 3 + 3, cut_at - opened

        status, _, payload, closed = read_response(body, timeout=10)
        waited = time.monotonic() - headers_sent
        assert status == 408 and closed, (status, payload)
        error = json.loads(payload)["error"]
        assert error["code"] == "frontdoor_slow_client" and "slow_client_timeout_s" in error["message"], error
        assert 2 - 0.5 <= waited <= 2 + 3, waited
    assert chat(f"http://127.0.0.1:{port}/v1").status_code == 200


# --- oversized requests ------------------------------------------------------------------------

LIMIT = 64 * 1024


def test_an_oversized_body_gets_413_in_the_apis_shape_without_being_read(daemon, model):
    port = start(daemon, model, max_body_bytes=LIMIT, max_header_bytes=8192)
    base = f"http://127.0.0.1:{port}"

    # Content-Length over the limit: answered at once, though not one byte of the body was sent.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT + 1}\r\n\r\n".encode()
        )
        status, headers, payload, closed = read_response(sock, timeout=5)
    assert status == 413 and closed and headers.get("connection") == "close"
    error = json.loads(payload)["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "frontdoor_body_too_large"), error
    assert str(LIMIT) in error["message"] and "max_body_bytes" in error["message"]

    # Chunked: counted as it arrives, refused at the limit while the client is still sending.
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(LIMIT // 4096 + 1):
            sock.sendall(b"1000\r\n" + b"x" * 4096 + b"\r\n")  # and never the last chunk
        status, _, payload, closed = read_response(sock, timeout=5)
    assert status == 413 and closed
    assert json.loads(payload)["error"]["code"] == "frontdoor_body_too_large"

    # Just under the limit is read: the model is checked (404), not the size.
    padded = {"model": "no-such-model", "messages": MESSAGES, "pad": "x" * (LIMIT - 200)}
    assert len(json.dumps(padded)) < LIMIT
    under = httpx.post(f"{base}/v1/chat/completions", json=padded, trust_env=False, timeout=30)
    assert under.status_code == 404 and under.json()["error"]["code"] == "model_not_found"

    # The official SDKs see the refusal as an error with its code, not a broken connection.
    openai = pytest.importorskip("openai")
    anthropic = pytest.importorskip("anthropic")
    image = "data:image/png;base64," + "A" * (8 * 2**20)  # more than socket buffers hold
    big = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]
    client = openai.OpenAI(
        base_url=f"{base}/v1", api_key="none", max_retries=0, http_client=openai.DefaultHttpxClient(trust_env=False)
    )
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="default", messages=big, max_tokens=2)
    assert refused.value.status_code == 413 and refused.value.code == "frontdoor_body_too_large"
    claude = anthropic.Anthropic(
        base_url=base, api_key="none", max_retries=0, http_client=anthropic.DefaultHttpxClient(trust_env=False)
    )
    with pytest.raises(anthropic.APIStatusError) as too_large:
        claude.messages.create(model="default", max_tokens=2, messages=[{"role": "user", "content": "x" * 2 * LIMIT}])
    assert too_large.value.status_code == 413
    assert too_large.value.body["error"]["type"] == "request_too_large"
    assert too_large.value.body["error"]["code"] == "frontdoor_body_too_large"

    # Headers: over max_header_bytes in one piece, 431 in the API's shape; a head still
    # incomplete past it is cut by the HTTP parser (a bare 431).
    fat = httpx.get(f"{base}/v1/models", headers={"X-Fat": "y" * 9000}, trust_env=False)
    assert fat.status_code == 431 and fat.json()["error"]["code"] == "frontdoor_headers_too_large"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        for _ in range(6):
            sock.sendall(b"X-Fat: " + b"y" * 2000 + b"\r\n")
            time.sleep(0.05)
        status, _, _, closed = read_response(sock, timeout=5)
    assert status == 431 and closed
    daemon.wait_state("ready")
    assert chat(f"{base}/v1").status_code == 200


def test_limits_apply_on_reload(daemon, model):
    """A reload changes the body limit and the idle timeout for the next request and connection."""
    port = start(daemon, model, max_body_bytes=LIMIT)
    base = f"http://127.0.0.1:{port}/v1"
    padded = {"model": "no-such-model", "messages": MESSAGES, "pad": "x" * (2 * LIMIT)}
    refused = httpx.post(f"{base}/chat/completions", json=padded, trust_env=False)
    assert refused.status_code == 413
    write_config(daemon.paths, frontdoor_config(model, port, max_body_bytes=4 * LIMIT, idle_timeout_s=1))
    wait_until(
        lambda: "config reloaded: frontdoor.idle_timeout_s, frontdoor.max_body_bytes" in daemon.log_text(),
        timeout=30,
        what="the log line of the [frontdoor] change applied",
    )
    assert httpx.post(f"{base}/chat/completions", json=padded, trust_env=False).status_code == 404
    with socket.create_connection(("127.0.0.1", port)) as idle:
        opened = time.monotonic()
        (closed_at,) = wait_closed([idle], opened + 10).values()
    assert closed_at - opened < 3, closed_at - opened


# --- the LAN bind --------------------------------------------------------------------------------


def lan_address() -> str | None:
    """A non-loopback IPv4 address of this machine, or None."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


def refused_connection(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
    except OSError:
        return True
    return False


def test_a_lan_bind_without_keys_is_refused_at_start_and_on_reload(daemon, model):
    port = free_port()
    write_config(daemon.paths, frontdoor_config(model, port, host="0.0.0.0"))
    daemon.start()
    status = daemon.call("status")
    (problem,) = status["config"]["problems"]
    assert problem.startswith("frontdoor.host: 0.0.0.0 is reachable from other machines"), problem
    assert "require_keys = true" in problem
    assert problem in daemon.log_text()  # said in the log too
    assert refused_connection("127.0.0.1", port)  # nothing listens where the config asked
    with pytest.raises(Exception) as up:
        daemon.call("up")
    assert "config_invalid" in repr(up.value) or "require_keys" in str(up.value)
    daemon.stop()

    # Started on loopback, reloaded onto 0.0.0.0 without keys: refused, loopback kept.
    lan = lan_address()
    daemon.proc = None
    port = start(daemon, model)
    daemon.wait_state("ready")
    write_config(daemon.paths, frontdoor_config(model, port, host="0.0.0.0"))
    wait_until(lambda: daemon.call("status")["config"]["problems"], timeout=30, what="the LAN bind refused on reload")
    (problem,) = daemon.call("status")["config"]["problems"]
    assert "require_keys = true" in problem and "config rejected" in daemon.log_text()
    assert chat(f"http://127.0.0.1:{port}/v1").status_code == 200
    if lan is not None:
        assert refused_connection(lan, port)


def test_a_lan_bind_with_keys_answers_401_without_a_key_and_200_with_one(daemon, model):
    lan = lan_address()
    if lan is None:
        print("skipped: this machine has no non-loopback IPv4 address")
        pytest.skip("no non-loopback IPv4 address on this machine")
    port = start(daemon, model, host="0.0.0.0", require_keys=True)
    daemon.wait_state("ready")
    base = f"http://{lan}:{port}/v1"
    keyless = chat(base)
    assert keyless.status_code == 401, keyless.text
    assert keyless.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/models", trust_env=False).status_code == 401
    key = daemon.call("key.create", name="lan")["key"]
    keyed = chat(base, headers={"Authorization": f"Bearer {key}"})
    assert keyed.status_code == 200 and keyed.json()["choices"], keyed.text
    wrong = chat(base, headers={"Authorization": "Bearer sk-stoker-" + "A" * 43})
    assert wrong.status_code == 401
