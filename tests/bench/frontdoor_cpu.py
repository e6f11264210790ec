"""The daemon's CPU per short streamed request through the front door: two trees side by side.

    .venv/bin/python tests/bench/frontdoor_cpu.py --before ../main [--after .] [--block 200] [--blocks 10]
    .venv/bin/python tests/bench/frontdoor_cpu.py --before ../main --streams 16 [--tokens 256]

Two daemons run at once, each from its own checkout's virtual environment (`TREE/.venv`), each
serving the tiny generated model with its front door on a free port (16 slots). The same raw
client as tests/bench/frontdoor.py sends short streamed chat completions (4 tokens), in blocks of
`--block` requests to one daemon's front door, then to the other's, then the same to each engine
directly, the order turned at every block; each block's figure is the daemon's CPU (user +
system, from /proc) over it, per request. On a shared machine whose speed drifts from one minute
to the next, runs of one tree after the other measure the drift more than the trees (two runs of
tests/bench/frontdoor.py on one tree differed by 2x); blocks taking turns on two live daemons
weigh it on both alike. The figure to read is the median of the per-block ratios, after / before.

With `--streams N`, a block is `--block` rounds of N streams at once, each of `--tokens` tokens,
and the figure is the daemon's CPU per streamed token: the relay's work per event, at the event
rate many concurrent streams make (the tiny model on 16 slots streams thousands of tokens a
second, as an 8B model does on an H200).
Prints only (docs/benchmarks.md quotes it by hand).
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
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.bundles.tinymodel import write_tiny_model  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from tests.bench.rawchat import Conn, chat_body  # noqa: E402
from tests.bench.report import engine_bundle, machine  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, write_config  # noqa: E402

SLOTS = 16


def cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def start_daemon(tree: Path, home: Path, bundle_zip: Path | None) -> tuple[DaemonProcess, list[tuple[str, str | None]]]:
    """A daemon of `tree` on `home`, ready: it and its (engine, front door) URLs with their keys."""
    os.environ["STOKER_HOME"] = str(home)
    engine_bundle(StokerPaths.from_env(), bundle_zip)
    model = write_tiny_model(home / "tiny.gguf", n_ctx=4096)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = DaemonProcess(home)
    config = f"[server]\nmodel = {json.dumps(str(model))}\nctx_size = {SLOTS * 2048}\nparallel = {SLOTS}\n"
    write_config(daemon.paths, config + f"[frontdoor]\nport = {port}\n")
    own, sys.executable = sys.executable, str(tree / ".venv" / "bin" / "python")  # the harness starts sys.executable
    try:
        daemon.start()
    finally:
        sys.executable = own
    status = daemon.wait_state("ready", timeout=600)
    return daemon, [(status["endpoint"], status["api_key"]), (f"http://127.0.0.1:{port}", None)]


async def blocks(
    arms: dict[str, tuple[psutil.Process, list[Conn]]], size: int, count: int
) -> dict[tuple[str, int], list[float]]:
    """Per arm and path (0 direct, 1 front door), each block's daemon CPU per request, in ms."""
    body = chat_body("hi there", 4)
    for _, conns in arms.values():
        for conn in conns:
            for _ in range(3):  # connections open, the prompt cached, the front door's pool filled
                await conn.chat(chat_body("hi there", 2))
    spent: dict[tuple[str, int], list[float]] = {(name, path): [] for name in arms for path in (0, 1)}
    names = list(arms)
    for i in range(count):
        for path in (1, 0):
            for name in names if i % 2 == 0 else names[::-1]:
                proc, conns = arms[name]
                before = cpu_s(proc)
                for _ in range(size):
                    stream = await conns[path].chat(body)
                    if not stream.ok:
                        raise RuntimeError(f"{name}: status {stream.status}, {stream.error}")
                spent[(name, path)].append((cpu_s(proc) - before) / size * 1000)
    return spent


async def stream_blocks(
    arms: dict[str, tuple[psutil.Process, list[list[Conn]]]],
    size: int,
    count: int,
    tokens: int,
    tails: dict[tuple[str, int], list[float]],
) -> dict[tuple[str, int], list[float]]:
    """Per arm and path, each block's daemon CPU per streamed token, in µs: `size` rounds of
    as many streams at once as each path has connections; into `tails`, each round's slowest
    time from a stream's last token to its end, in ms (the engine ends a round's streams in one
    step: how long the last of them waits for its end)."""
    body = chat_body("hi there", tokens)
    for _, paths in arms.values():
        for conns in paths:
            await asyncio.gather(*(conn.chat(chat_body("hi there", 2)) for conn in conns))
    spent: dict[tuple[str, int], list[float]] = {(name, path): [] for name in arms for path in (0, 1)}
    names = list(arms)
    for i in range(count):
        for path in (1, 0):
            for name in names if i % 2 == 0 else names[::-1]:
                proc, paths = arms[name]
                before, streamed = cpu_s(proc), 0
                for _ in range(size):
                    streams = await asyncio.gather(*(conn.chat(body) for conn in paths[path]))
                    for stream in streams:
                        if not stream.ok:
                            raise RuntimeError(f"{name}: status {stream.status}, {stream.error}")
                        streamed += stream.tokens
                    ends = [s.elapsed - s.last for s in streams if s.last is not None]
                    tails.setdefault((name, path), []).append(max(ends) * 1000)
                spent[(name, path)].append((cpu_s(proc) - before) / streamed * 1e6)
    return spent


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="the tree before (its .venv runs its daemon)")
    ap.add_argument("--after", type=Path, default=ROOT, help="the tree after (default: this one)")
    ap.add_argument("--block", type=int, default=200, help="requests per block")
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--streams", type=int, default=0, help="streams at once (0: one short request at a time)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream, with --streams")
    args = ap.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="frontdoor-cpu-") as tmp:
        daemons: list[DaemonProcess] = []
        arms: dict[str, tuple[psutil.Process, list[Conn]]] = {}
        many: dict[str, tuple[psutil.Process, list[list[Conn]]]] = {}
        try:
            for name, tree in (("before", args.before.resolve()), ("after", args.after.resolve())):
                home = Path(tmp) / name
                home.mkdir()
                daemon, urls = start_daemon(tree, home, args.bundle)
                daemons.append(daemon)
                assert daemon.proc is not None
                proc = psutil.Process(daemon.proc.pid)
                arms[name] = (proc, [Conn(url, key) for url, key in urls])
                many[name] = (proc, [[Conn(url, key) for _ in range(args.streams)] for url, key in urls])
            tails: dict[tuple[str, int], list[float]] = {}
            if args.streams:
                spent = asyncio.run(stream_blocks(many, args.block, args.blocks, args.tokens, tails))
            else:
                spent = asyncio.run(blocks(arms, args.block, args.blocks))
        finally:
            for daemon in daemons:
                daemon.stop()
    print(f"{machine()}; load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")
    if args.streams:
        print(
            f"{args.blocks} blocks of {args.block} rounds of {args.streams} streams of {args.tokens} tokens at once "
            "on each path of each daemon, taking turns"
        )
        unit = "µs of the daemon's CPU per streamed token"
    else:
        print(f"{args.blocks} blocks of {args.block} short streamed requests on each path of each daemon, taking turns")
        unit = "ms of the daemon's CPU per request"
    for path, label in ((1, "front door"), (0, "direct")):
        for name in arms:
            values = spent[(name, path)]
            shown = ", ".join(f"{v:.2f}" for v in values)
            print(f"{label}, {name}: median {statistics.median(values):.2f} {unit} ({shown})")
    for path, label in ((1, "front door"), (0, "direct")):
        for name in arms if tails else ():
            values = tails[(name, path)]
            print(
                f"{label}, {name}: a round's slowest time from a stream's last token to its end, "
                f"median {statistics.median(values):.2f} ms, p90 {statistics.quantiles(values, n=10)[-1]:.2f} ms"
            )
    ratios = [a / b for a, b in zip(spent[("after", 1)], spent[("before", 1)])]
    print(
        f"front door, after / before, per block: median {statistics.median(ratios):.3f} "
        f"({', '.join(f'{r:.2f}' for r in ratios)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
