"""The front door's address follows the config: a reload that changes `[frontdoor] port` or
`host` closes the old socket and listens on the new one, and `stoker status` names the address
really bound. Real daemon, real llama-server (the tiny model), real sockets.
"""

from __future__ import annotations

import socket

import pytest

from tests.faults.test_frontdoor_connections import chat, free_port, frontdoor_config, read_response, refused_connection
from tests.integration.daemon_harness import write_config
from tests.waits import wait_until

pytestmark = [pytest.mark.engine]


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


def frontdoor_of(daemon) -> dict:
    return daemon.call("status")["frontdoor"]


def test_a_reload_that_moves_the_front_door_closes_the_old_socket_and_status_says_the_new_one(daemon, model):
    first = free_port()
    write_config(daemon.paths, frontdoor_config(model, first))
    daemon.start()
    daemon.wait_state("ready")
    assert chat(f"http://127.0.0.1:{first}/v1").status_code == 200
    # A client connected to the old address before the move: its connection is served on.
    kept = socket.create_connection(("127.0.0.1", first))
    try:
        second = free_port()
        write_config(daemon.paths, frontdoor_config(model, second))
        fd = wait_until(
            lambda: (f := frontdoor_of(daemon))["url"] == f"http://127.0.0.1:{second}/v1" and f,
            timeout=30,
            what="status to name the new port",
            detail=lambda: f"{frontdoor_of(daemon)}\n{daemon.log_text()[-3000:]}",
        )
        assert fd["address"] == f"127.0.0.1:{second}"
        assert refused_connection("127.0.0.1", first), "the old socket still accepts connections"
        assert chat(f"http://127.0.0.1:{second}/v1").status_code == 200
        kept.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        status, _, body, closed = read_response(kept, timeout=30)
        assert status == 200 and b"default" in body and closed, body
    finally:
        kept.close()

    if not ipv6_loopback():
        print("host change not checked: no IPv6 loopback on this machine")
        return
    write_config(daemon.paths, frontdoor_config(model, second, host="::1"))
    wait_until(
        lambda: frontdoor_of(daemon)["url"] == f"http://[::1]:{second}/v1",
        timeout=30,
        what="status to name the new host",
        detail=lambda: str(frontdoor_of(daemon)),
    )
    assert refused_connection("127.0.0.1", second), "the old host's socket still accepts connections"
    assert chat(f"http://[::1]:{second}/v1").status_code == 200
