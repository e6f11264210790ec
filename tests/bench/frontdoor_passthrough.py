"""What the front door adds to each of the engine's routes it passes on, against the engine directly,
side by side in one run.

    .venv/bin/python tests/bench/frontdoor_passthrough.py [--model tiny|gemma|PATH] [--rounds 300] [--quick] [--no-write]

One daemon on a temporary STOKER_HOME serves the model (`--reranking`, so that rerank answers) with
its front door on a free port; the engine's endpoint and per-launch key come from `status`. The same
raw client (one blocking keep-alive HTTP/1.1 socket per path, TCP_NODELAY, the answer read whole:
Content-Length or chunked) sends each route's request to the engine directly and through the front
door, the two taking turns going first, route after route, round after round (the machine is shared
and noisy: what drifts, drifts for both). Each request is timed by the client from its first byte
sent to its answer's last byte read. Per route: p50 and p99 of each path, and what the front door
adds (front p50 - direct p50, front p99 - direct p99, and the median of the paired differences).

The front door's own routes (/v1/models/{id}, /health) are set beside the engine's nearest
(/v1/models, /health): the engine has no /v1/models/{id}. Results go to docs/benchmarks.md
"Front door: passthrough routes" (`--no-write`: print only).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import attrs

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.bundles.tinymodel import write_tiny_model
from stoker.daemon.core.paths import StokerPaths
from stoker.daemon.models.known import WELL_KNOWN

from tests.bench.frontdoor import prepare_model
from tests.bench.report import engine_bundle, machine, percentile, write_section
from tests.integration.daemon_harness import DaemonProcess, write_config
from tests.model_files import GEMMA

# Greedy, held to letters by a grammar: the random tiny model's bytes never break a JSON answer.
GREEDY = {"temperature": 0, "grammar": "root ::= [a-z ]+"}
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


@attrs.frozen
class Case:
    """One route: the request both paths are sent (`direct_path`: the engine's nearest, if not the same)."""

    name: str
    method: str
    path: str
    body: dict | None = None
    direct_path: str | None = None


CASES = (
    Case(
        "POST /v1/chat/completions (4 tokens; for reference)",
        "POST",
        "/v1/chat/completions",
        {"messages": MESSAGES, "max_tokens": 4, **GREEDY},
    ),
    Case(
        "POST /v1/responses (4 tokens)",
        "POST",
        "/v1/responses",
        {"input": "once upon a time", "max_output_tokens": 4, **GREEDY},
    ),
    Case("POST /v1/messages/count_tokens", "POST", "/v1/messages/count_tokens", {"messages": MESSAGES}),
    Case(
        "POST /v1/rerank (3 documents)",
        "POST",
        "/v1/rerank",
        {"query": "the cat", "documents": ["a cat", "the train", "green steam"]},
    ),
    Case("POST /rerank", "POST", "/rerank", {"query": "the cat", "documents": ["a cat", "the train"]}),
    Case(
        "POST /infill (4 tokens)",
        "POST",
        "/infill",
        {"input_prefix": "def f(", "input_suffix": "):", "n_predict": 4, **GREEDY},
    ),
    Case("POST /tokenize", "POST", "/tokenize", {"content": "hello world, once upon a time"}),
    Case("POST /detokenize", "POST", "/detokenize", {"tokens": [321, 107, 104, 111, 111, 114]}),
    Case("POST /apply-template", "POST", "/apply-template", {"messages": MESSAGES}),
    Case("GET /props", "GET", "/props"),
    Case("GET /v1/models/{id} (own; engine: /v1/models)", "GET", "/v1/models/default", direct_path="/v1/models"),
    Case("GET /health (own, per model)", "GET", "/health"),
)


class Client:
    """One keep-alive connection; `ask` sends a request and reads its answer whole."""

    def __init__(self, url: str, key: str | None) -> None:
        parts = urlsplit(url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.host = f"{self.address[0]}:{self.address[1]}".encode()
        self.auth = b"Authorization: Bearer %s\r\n" % key.encode() if key else b""
        self.sock: socket.socket | None = None
        self.buffer = b""

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(self.address)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""
        return sock

    def ask(self, method: str, path: str, body: bytes | None) -> tuple[int, float]:
        """The answer's status and the seconds from the request's first byte to the answer's last."""
        if self.sock is not None and self._stale():
            self.close()
        if self.sock is None:
            self.sock = self._connect()
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n%s" % (method.encode(), path.encode(), self.host, self.auth)
        if body is not None:
            head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        data = head + b"\r\n" + (body or b"")
        started = time.perf_counter()
        self.sock.sendall(data)
        status, close = self._read_answer()
        elapsed = time.perf_counter() - started
        if close:
            self.sock.close()
            self.sock = None
        return status, elapsed

    def _stale(self) -> bool:
        """The server closed this idle connection (llama-server after 5 s), seen as an HTTP client's
        pool sees it before reusing one: a non-blocking peek."""
        assert self.sock is not None
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _fill(self) -> None:
        assert self.sock is not None
        more = self.sock.recv(65536)
        if not more:
            raise ConnectionError("the server closed the connection mid-answer")
        self.buffer += more

    def _take_line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            self._fill()
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _read_answer(self) -> tuple[int, bool]:
        status = int(self._take_line().split()[1])
        headers: dict[bytes, bytes] = {}
        while line := self._take_line():
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip().lower()
        if headers.get(b"transfer-encoding") == b"chunked":
            while size := int(self._take_line().split(b";")[0], 16):
                self._take(size + 2)
            while self._take_line():  # trailers, then the blank line
                pass
        else:
            self._take(int(headers.get(b"content-length", b"0")))
        return status, headers.get(b"connection") == b"close"

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


@attrs.define
class Timings:
    direct: list[float] = attrs.Factory(list)
    front: list[float] = attrs.Factory(list)
    statuses: set[tuple[int, int]] = attrs.Factory(set)
    own: list[float] = attrs.Factory(list)  # the front door's clock: the access log's added_ms, in seconds


def measure(engine: tuple[str, str], front: str, rounds: int, warmup: int) -> dict[str, Timings]:
    """Every case, both paths taking turns, `rounds` times after `warmup` unrecorded rounds."""
    clients = {
        case.name: (Client(engine[0], engine[1]), Client(front, None)) for case in CASES
    }  # one connection per path and case: each keeps alive as a client's would
    results = {case.name: Timings() for case in CASES}
    for n in range(warmup + rounds):
        for case in CASES:
            direct, through = clients[case.name]
            body = json.dumps({"model": "default", **case.body}).encode() if case.body is not None else None
            order = [(True, direct), (False, through)]
            if n % 2:
                order.reverse()
            seen: dict[bool, tuple[int, float]] = {}
            for is_direct, client in order:
                path = case.direct_path if is_direct and case.direct_path else case.path
                seen[is_direct] = client.ask(case.method, path, body)
            if n >= warmup:
                timing = results[case.name]
                timing.direct.append(seen[True][1])
                timing.front.append(seen[False][1])
                timing.statuses.add((seen[True][0], seen[False][0]))
    for pair in clients.values():
        for client in pair:
            client.close()
    return results


ACCESS = re.compile(r"stoker\.access: (\S+) (\S+) \S+ .*?added_ms=(\S+)")


def read_own_clock(log: str, results: dict[str, Timings], rounds: int) -> None:
    """Each case's `added_ms` from the daemon's access log (its last `rounds` requests: the
    recorded ones): what the front door's own clock says it added to the first byte, which the
    machine's other load (the daemon waiting for a core) does not reach."""
    seen: dict[tuple[str, str], list[float]] = {}
    for method, target, added in ACCESS.findall(log):
        if added != "-":
            seen.setdefault((method, target), []).append(float(added) / 1000)
    for case in CASES:
        results[case.name].own = seen.get((case.method, case.path), [])[-rounds:]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f}"


def signed_ms(seconds: float) -> str:
    return f"{seconds * 1000:+.2f}"


def report(results: dict[str, Timings]) -> str:
    lines = [
        (
            "| route | status (direct, front) | direct p50 | front p50 | added p50 | direct p99 | front p99 | added p99 "
            "| paired median | front door's clock p50 / p99 |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, t in results.items():
        d50, f50 = statistics.median(t.direct), statistics.median(t.front)
        d99, f99 = percentile(t.direct, 99), percentile(t.front, 99)
        paired = statistics.median(f - d for f, d in zip(t.front, t.direct))
        statuses = ", ".join(f"{a}/{b}" for a, b in sorted(t.statuses))
        own = f"{ms(statistics.median(t.own))} / {ms(percentile(t.own, 99))}" if t.own else "-"
        lines.append(
            f"| {name} | {statuses} | {ms(d50)} | {ms(f50)} | {signed_ms(f50 - d50)} | {ms(d99)} | {ms(f99)} | "
            f"{signed_ms(f99 - d99)} | {signed_ms(paired)} | {own} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny (generated), gemma (Gemma 3 270M) or a GGUF path")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 20 rounds")
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup = 20, 3
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="passthrough-bench-") as tmp:
        home = Path(tmp)
        os.environ["STOKER_HOME"] = str(home)
        paths = StokerPaths.from_env()
        bundle = engine_bundle(paths, args.bundle)
        if args.model == "tiny":  # with fill-in-the-middle tokens, so that /infill answers
            model = write_tiny_model(home / "tiny.gguf", n_ctx=4096, fim=True)
            spec = str(model)
        else:
            spec, model = prepare_model(args.model, paths, home)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        d = DaemonProcess(home)
        extra = ["--reranking"]
        if args.model == "gemma":
            extra += list(WELL_KNOWN[GEMMA].launch_args)
        config = (
            f"[server]\nmodel = {json.dumps(spec)}\nctx_size = 4096\nparallel = 2\nextra_args = {json.dumps(extra)}\n"
        )
        write_config(d.paths, config + f"[frontdoor]\nport = {port}\n")
        d.start()
        try:
            st = d.wait_state("ready", timeout=600)
            results = measure((st["endpoint"], st["api_key"]), f"http://127.0.0.1:{port}", args.rounds, args.warmup)
        finally:
            d.stop()
        read_own_clock(d.log_text(), results, args.rounds)

    table = report(results)
    command = f".venv/bin/python tests/bench/frontdoor_passthrough.py {' '.join(sys.argv[1:])}".strip()
    body = (
        (
            "**A smoke run (`--quick`: few rounds): it shows that the bench runs; its figures measure nothing.**\n\n"
            if args.quick
            else ""
        )
        + f"`{command}` on {machine()}; engine {bundle.meta.version} ({bundle.meta.backend}); {model.name} "
        f"(`--reranking`); {args.rounds} rounds after {args.warmup} of warm-up. Load average {load_before:.1f} at "
        f"the start, {os.getloadavg()[0]:.1f} at the end.\n\n"
        "Each route's request sent to the engine directly (its per-launch key) and through the front door by the "
        "same raw keep-alive client, the two taking turns going first; times in ms from the request's first byte "
        "sent to the answer's last byte read. `added`: front minus direct at that percentile; `paired median`: the "
        "median of each round's difference. The front door's clock: the access log's `added_ms` (from the request's "
        "arrival to its answer's first byte handed to the client's socket, less the engine's part; docs/frontdoor.md, "
        '"The time to first token the front door adds"), which the time the daemon waits for a core on a loaded '
        "machine does not reach; `-` for the own routes, answered without the engine. The own routes are set beside "
        "the engine's nearest.\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("Front door: passthrough routes", body)


if __name__ == "__main__":
    main()
