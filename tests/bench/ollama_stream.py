"""Ollama's `/api/chat` stream against the OpenAI route's stream, on the same model, side by side
in one run, on one daemon.

    .venv/bin/python tests/bench/ollama_stream.py [--model tiny|gemma|PATH] [--quick] [--no-write]

One daemon on a temporary STOKER_HOME serves the model, its front door and Ollama's API each on
a free port. The same raw client (tests/bench/rawchat.py: asyncio sockets, keep-alive, the
chunked body parsed from the bytes; here also Ollama's NDJSON lines) asks for the same streamed
chat answer on both routes: `/v1/chat/completions` (`max_tokens`, `ignore_eos`) and `/api/chat`
(`options.num_predict`, `options.ignore_eos`), so both generate exactly as many tokens. The two
routes take turns going first in every round. Figures: tokens/s on each route (every round's
tokens over every round's time, request to the body's end; target Ollama / OpenAI >= 0.99), the
median of the per-round ratios, the time to the first token, and the daemon's CPU per streamed
token on each route (what translating SSE events into NDJSON lines costs).

Results go to docs/benchmarks.md "Ollama API: /api/chat stream against the OpenAI route"
(`--no-write`: print only). Exits 1 on a MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from stoker.daemon.models.known import WELL_KNOWN  # noqa: E402
from tests.bench.frontdoor import DaemonCPU, checked, prepare_model, row, turns  # noqa: E402
from tests.bench.rawchat import Conn, Stream, chat_body, chunked_body  # noqa: E402
from tests.bench.report import engine_bundle, machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, write_config  # noqa: E402
from tests.model_files import GEMMA  # noqa: E402

ROUTES = ("OpenAI /v1/chat/completions", "Ollama /api/chat")
GOAL = 0.99


class OllamaConn(Conn):
    """`Conn` posting to /api/chat and reading Ollama's NDJSON lines: a token's line counted as it
    arrives, the last line's `eval_count` as what the engine generated."""

    def __init__(self, url: str) -> None:
        super().__init__(url, None)
        self.route = "/api/chat"

    async def _read(self, out: Stream, started: float) -> None:
        assert self.reader is not None
        head = await self.reader.readuntil(b"\r\n\r\n")
        out.status = int(head[9:12])
        pending = bytearray()
        done = False
        counted = 0
        generated: int | None = None
        if b"transfer-encoding: chunked" not in head.lower():
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            out.error = (await self.reader.readexactly(length)).decode(errors="replace")[:200]
            return
        async for piece in chunked_body(self.reader):
            pending += piece
            while (end := pending.find(b"\n")) >= 0:
                line = bytes(pending[:end])
                del pending[: end + 1]
                if line.startswith(b'{"error"'):
                    out.error = line.decode(errors="replace")[:200]
                elif line.endswith(b'"done":false}'):
                    if b'"content":""' not in line:
                        counted += 1
                        if out.ttft is None:
                            out.ttft = time.perf_counter() - started
                else:
                    last = json.loads(line)
                    done, generated = bool(last.get("done")), last.get("eval_count")
        out.tokens = generated if generated is not None else counted
        out.ok = out.status == 200 and done and not out.error


def ollama_body(prompt: str, tokens: int) -> bytes:
    return json.dumps(
        {
            "model": "default",
            "messages": [{"role": "user", "content": prompt}],
            "stream": True,
            "options": {"num_predict": tokens, "ignore_eos": True, "temperature": 0},
        }
    ).encode()


async def rounds(
    frontdoor: str, ollama: str, cpu: DaemonCPU, prompt: str, tokens: int, n: int
) -> tuple[list[list[Stream]], list[float]]:
    """`n` rounds of one stream on each route, taking turns; the daemon's CPU on each."""
    conns = [Conn(frontdoor, None), OllamaConn(ollama)]
    bodies = [chat_body(prompt, tokens), ollama_body(prompt, tokens)]
    warm = [chat_body(prompt, 4), ollama_body(prompt, 4)]
    for p, conn in enumerate(conns):  # connections open, the prompt cached, the engine's pool filled
        for _ in range(3):
            checked(await conn.chat(warm[p]), f"warm-up {ROUTES[p]}")
    cpu.spent = [0.0, 0.0, 0.0]
    out: list[list[Stream]] = [[], []]
    for i in range(n):
        for p in turns(i):
            out[p].append(checked(await cpu.during(p, conns[p].chat(bodies[p])), ROUTES[p]))
    for conn in conns:
        conn.close()
    return out, cpu.spent[:2]


def report(streams: list[list[Stream]], spent: list[float], args: argparse.Namespace) -> tuple[str, bool]:
    tps = [[s.tokens / s.elapsed for s in route] for route in streams]
    ratios = [b / a for a, b in zip(*tps)]
    ratio = statistics.median(ratios)
    # On a shared machine one round's ratio swings with its neighbours' load: every round's
    # tokens over every round's time, per route, is the steadier figure.
    overall = [sum(s.tokens for s in route) / sum(s.elapsed for s in route) for route in streams]
    ttft = [[s.ttft * 1000 for s in route if s.ttft is not None] for route in streams]
    tokens = [sum(s.tokens for s in route) for route in streams]
    per_token = [c / n * 1e6 for c, n in zip(spent, tokens)]
    met = overall[1] / overall[0] >= GOAL
    lines = [
        "| figure | OpenAI route | Ollama route | Ollama against OpenAI | target | |",
        "|---|---:|---:|---:|---|---|",
        row(
            f"tokens/s of one stream ({args.tokens} tokens, {len(ratios)} rounds: all tokens over all the time)",
            f"{overall[0]:.0f}",
            f"{overall[1]:.0f}",
            f"{overall[1] / overall[0]:.3f}",
            f">= {GOAL}",
            met,
        ),
        row(
            "tokens/s, median of the rounds",
            f"{statistics.median(tps[0]):.0f}",
            f"{statistics.median(tps[1]):.0f}",
            f"{ratio:.3f} (per-round ratios {min(ratios):.3f}-{max(ratios):.3f})",
            "-",
            None,
        ),
        row(
            "time to first token p50",
            f"{percentile(ttft[0], 50):.2f} ms",
            f"{percentile(ttft[1], 50):.2f} ms",
            f"{percentile(ttft[1], 50) - percentile(ttft[0], 50):+.2f} ms",
            "-",
            None,
        ),
        row(
            "the daemon's CPU per streamed token",
            f"{per_token[0]:.1f} µs",
            f"{per_token[1]:.1f} µs",
            f"{per_token[1] - per_token[0]:+.1f} µs",
            "-",
            None,
        ),
    ]
    return "\n".join(lines) + "\n", met


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny (generated), gemma (Gemma 3 270M) or a GGUF path")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few rounds")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens = 3, 256
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ollama-bench-") as tmp:
        home = Path(tmp)
        os.environ["STOKER_HOME"] = str(home)
        paths = StokerPaths.from_env()
        bundle = engine_bundle(paths, args.bundle)
        spec, model = prepare_model(args.model, paths, home)
        port, ollama_port = free_port(), free_port()
        d = DaemonProcess(home)
        config = f"[server]\nmodel = {json.dumps(spec)}\nctx_size = 4096\n"
        if args.model == "gemma":
            config += f"extra_args = {json.dumps(list(WELL_KNOWN[GEMMA].launch_args))}\n"
        write_config(d.paths, config + f"[frontdoor]\nport = {port}\n[ollama]\nport = {ollama_port}\n")
        d.start()
        try:
            d.wait_state("ready", timeout=600)
            assert d.proc is not None
            streams, spent = asyncio.run(
                rounds(
                    f"http://127.0.0.1:{port}",
                    f"http://127.0.0.1:{ollama_port}",
                    DaemonCPU(d.proc.pid),
                    "Write a long story about a river.",
                    args.tokens,
                    args.rounds,
                )
            )
        finally:
            d.stop()
    table, met = report(streams, spent, args)
    command = f".venv/bin/python tests/bench/ollama_stream.py {' '.join(sys.argv[1:])}".strip()
    body = (
        (
            "**A smoke run (`--quick`): it shows that the bench runs; its figures measure little.**\n\n"
            if args.quick
            else ""
        )
        + f"`{command}` on {machine()}; engine {bundle.meta.version} ({bundle.meta.backend}); {model.name}. "
        f"Load average {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end.\n\n"
        "The same raw client (asyncio sockets, keep-alive, the chunked body parsed from the bytes) asks the same "
        "daemon for the same streamed chat answer on the OpenAI route (`max_tokens`, `ignore_eos`) and on Ollama's "
        "`/api/chat` (`options.num_predict`, `options.ignore_eos`), so both generate as many tokens; the routes "
        "take turns going first in every round. Tokens/s: the engine's count of generated tokens over the "
        "streams' time, request to end of body, summed over the rounds (the target's figure), and the median of "
        "the per-round ratios. The daemon's CPU "
        "(user + system, from /proc) is summed over each route's requests: the difference is what translating "
        "the engine's SSE events into Ollama's NDJSON lines costs (both routes' streams are read and written in a "
        "worker thread; Ollama's are translated there, each of the engine's reads into its lines).\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("Ollama API: /api/chat stream against the OpenAI route", body)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
