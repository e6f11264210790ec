"""A loopback peer that speaks the opening of ggml's RPC protocol with a version of our choosing.

It answers HELLO (cmd 14) with `version` and, after it, DEVICE_COUNT (15) and GET_DEVICE_MEMORY
(11) with the devices given, framed as ggml-rpc.cpp frames them. It is how a worker of another
protocol version is produced honestly here: the head reads it through the same code as a real
ggml-rpc-server, and llama-server itself, pointed at it, says `RPC server version mismatch`.
"""

from __future__ import annotations

import socket
import struct
import threading

CONN_CAPS = 24


class RpcPeer:
    def __init__(self, version: tuple[int, int, int], devices: tuple[tuple[int, int], ...] = ((1 << 30, 2 << 30),)):
        self.version = version
        self.devices = devices
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]
        self.hellos = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def close(self) -> None:
        self._stop = True
        try:
            self.sock.close()
        except OSError:
            pass

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    self._client(conn)
                except (OSError, struct.error):
                    pass

    @staticmethod
    def _read(conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = conn.recv(n - len(data))
            if not chunk:
                raise OSError("closed")
            data += chunk
        return data

    def _client(self, conn: socket.socket) -> None:
        while True:
            cmd, size = struct.unpack("<BQ", self._read(conn, 9))
            payload = self._read(conn, size) if size else b""
            if cmd == 14:
                self.hellos += 1
                answer = struct.pack("<BBBB", *self.version, 0) + bytes(CONN_CAPS)
            elif cmd == 15:
                answer = struct.pack("<I", len(self.devices))
            elif cmd == 11:
                (index,) = struct.unpack("<I", payload)
                answer = struct.pack("<QQ", *self.devices[index])
            else:
                return
            conn.sendall(struct.pack("<Q", len(answer)) + answer)
