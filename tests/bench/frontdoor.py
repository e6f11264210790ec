"""The front door against the engine directly, side by side in one run, on one daemon.

    .venv/bin/python tests/bench/frontdoor.py [--model tiny|gemma|PATH] [--quick] [--no-write]

One daemon on a temporary STOKER_HOME serves the model with its front door on a free port and
`parallel` = 64 slots (each slot `--slot-ctx` tokens). The same raw client (asyncio sockets,
HTTP/1.1 keep-alive, chunked bodies and SSE events parsed from the bytes: no SDK, no httpx, so
the client is not what is measured) sends the same bytes to the engine directly (its endpoint and
per-launch key from `status`) and to the front door; the two paths take turns in every round.
Every request is a streamed chat completion with `ignore_eos`, so each path generates exactly as
many tokens.

1. Time to first token (a two-word prompt, `--ttft-tokens` tokens): p50 and p99 of each path,
   and of the added latency (each front door request against the direct one of its round). A
   third path, the engine directly again on a second connection, is the control: the engine
   against itself, whose paired p99 is the engine's own jitter (on 2 shared cores, tens of ms:
   no path can show a paired p99 under 1 ms there). The front door's own share is read from its
   clock (`added_ms` of each request's access-log line: from its head read to the first byte's
   write, less the engine's part). Target: p99 added < 1 ms, taken as the front door's p99 by its
   clock plus the median of what its clock cannot see (the p50 added against both direct
   connections, their mean in each round, less its clock's p50: the kernel's extra hops to and
   from the daemon).
2. Tokens/s of one long stream: median of the per-round ratios front door / direct (>= 0.99).
3. Aggregate tokens/s with 16 and 64 concurrent streams (one connection each): the same (>= 0.97).
   Beside it, how far apart the round's streams got their first tokens (the last one's time to
   first token less the first one's): how spread out the engine received the round's requests.
4. A planned restart (`restart` on the control socket, as `stoker restart` sends it) while
   clients loop through the front door: the longest request, the p99, and failures (target 0).

The tiny generated model is the worst case for the front door (the engine is fastest, so the
relay's cost is the largest share); Gemma 3 270M (`--model gemma`, from PyPI) is a real one.
Results go to docs/benchmarks.md "Front door" (`--no-write`: print only). Exits 1 on a MISS.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Awaitable, TypeVar

import attrs
import psutil

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stoker.daemon.bundles.tinymodel import write_tiny_model  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from stoker.daemon.models.known import WELL_KNOWN  # noqa: E402
from tests.model_files import GEMMA, model_file  # noqa: E402
from tests.bench.rawchat import Conn, Stream, chat_body  # noqa: E402
from tests.bench.report import engine_bundle, machine, percentile, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, write_config  # noqa: E402

PATHS = ("direct", "front door", "direct again")
ADDED = re.compile(r"stoker\.access: POST /v1/chat/completions 200 .* added_ms=([0-9.]+) ")
T = TypeVar("T")
# What the daemon logs when an engine connection failed before the engine answered (a retry).
RETRY_LINE = "the engine was lost before it answered"
TTFT_ADDED_MS = 1.0
ONE_STREAM = 0.99
CONCURRENT = 0.97


def checked(stream: Stream, what: str) -> Stream:
    if not stream.ok:
        raise RuntimeError(f"{what}: status {stream.status}, {stream.error}")
    return stream


def turns(i: int, n: int = 2) -> list[int]:
    """The order the `n` paths go in round i: each goes first in turn."""
    return [(i + k) % n for k in range(n)]


class DaemonCPU:
    """The daemon's CPU time (user + system) spent during each path's requests: what the front
    door costs in CPU, beside what the daemon spends anyway (reading the engine's log)."""

    def __init__(self, pid: int) -> None:
        self.proc = psutil.Process(pid)
        self.spent = [0.0, 0.0, 0.0]

    def now(self) -> float:
        t = self.proc.cpu_times()
        return t.user + t.system

    async def during(self, p: int, work: Awaitable[T]) -> T:
        before = self.now()
        out = await work
        self.spent[p] += self.now() - before
        return out


async def sequential(
    urls: list[tuple[str, str | None]], cpu: DaemonCPU, prompt: str, tokens: int, rounds: int
) -> list[list[Stream]]:
    """`rounds` streamed answers on each path, one at a time on one connection per path."""
    conns = [Conn(u, k) for u, k in urls]
    body = chat_body(prompt, tokens)
    for c in conns:  # warm: connections open, the prompt cached in a slot, the front door's pool filled
        for _ in range(3):
            checked(await c.chat(chat_body(prompt, min(tokens, 4))), "warm-up")
    cpu.spent = [0.0] * len(urls)
    out: list[list[Stream]] = [[] for _ in urls]
    for i in range(rounds):
        for p in turns(i, len(urls)):
            out[p].append(checked(await cpu.during(p, conns[p].chat(body)), PATHS[p]))
    for c in conns:
        c.close()
    return out


@attrs.frozen
class Concurrent:
    """Per path and round: the aggregate tokens/s, and the spread of the streams' first tokens
    (the last one's time to first token less the first one's, ms): how far apart the engine got
    the round's requests."""

    tps: list[list[float]]
    spread_ms: list[list[float]]
    pace: list[list[float]]  # a stream's tokens/s after its first token, the round's median
    tail_ms: list[list[float]]  # from a stream's last token to its body's end, the round's slowest


async def concurrent(
    urls: list[tuple[str, str | None]], cpu: DaemonCPU, n: int, rounds: int, tokens: int
) -> Concurrent:
    """Aggregate tokens/s of `n` streams at once, one connection each, per path and round."""
    pools = [[Conn(u, k) for _ in range(n)] for u, k in urls]
    prompt = "Tell me about rivers."
    body = chat_body(prompt, tokens)
    for pool in pools:  # the prompt cached in every slot, for both paths, before the first round
        for s in await asyncio.gather(*(c.chat(chat_body(prompt, 2)) for c in pool)):
            checked(s, "warm-up")
    out = Concurrent([[], []], [[], []], [[], []], [[], []])  # tps, spread_ms, pace, tail_ms
    for i in range(rounds):
        for p in turns(i):
            started = time.perf_counter()
            streams = await cpu.during(p, asyncio.gather(*(c.chat(body) for c in pools[p])))
            wall = time.perf_counter() - started
            for s in streams:
                checked(s, f"{PATHS[p]}, {n} streams")
            out.tps[p].append(sum(s.tokens for s in streams) / wall)
            firsts = [s.ttft for s in streams if s.ttft is not None]
            out.spread_ms[p].append((max(firsts) - min(firsts)) * 1000)
            out.pace[p].append(
                statistics.median((s.tokens - 1) / (s.elapsed - s.ttft) for s in streams if s.ttft is not None)
            )
            out.tail_ms[p].append(max((s.elapsed - s.last) * 1000 for s in streams if s.last is not None))
    for pool in pools:
        for c in pool:
            c.close()
    return out


@attrs.define
class RestartRun:
    restart_s: float  # from the restart call to the new server ready (polled status)
    stopping_s: float  # from the restart call to the old server gone (the state past stopping)
    latencies_ms: list[float]  # every request that began within the window
    before_ms: list[float]  # those that ended before the restart call
    failures: list[str]


async def restart(d: DaemonProcess, url: str, clients: int, tokens: int, settle_s: float) -> RestartRun:
    """Clients loop through the front door while the server is restarted."""
    body = chat_body("hi there", tokens)
    results: list[tuple[float, Stream]] = []
    stop = asyncio.Event()

    async def loop() -> None:
        conn = Conn(url, None)
        while not stop.is_set():
            began = time.perf_counter()
            results.append((began, await conn.chat(body)))
        conn.close()

    tasks = [asyncio.create_task(loop()) for _ in range(clients)]
    await asyncio.sleep(settle_s)
    asked = time.perf_counter()
    first_pid = (await asyncio.to_thread(d.call, "status"))["pid"]
    await asyncio.to_thread(d.call, "restart")
    stopped_s = None
    while True:
        st = await asyncio.to_thread(d.call, "status")
        if stopped_s is None and st["state"] not in ("ready", "stopping"):
            stopped_s = time.perf_counter() - asked  # the old server is gone
        if st["state"] == "ready" and st["pid"] != first_pid:
            break
        await asyncio.sleep(0.01)
    restart_s = time.perf_counter() - asked
    await asyncio.sleep(settle_s)
    stop.set()
    await asyncio.gather(*tasks)
    return RestartRun(
        restart_s=restart_s,
        stopping_s=restart_s if stopped_s is None else stopped_s,
        latencies_ms=[s.elapsed * 1000 for _, s in results],
        before_ms=[s.elapsed * 1000 for b, s in results if b + s.elapsed < asked],
        failures=[f"status {s.status}: {s.error}" for _, s in results if not s.ok],
    )


def prepare_model(spec: str, paths: StokerPaths, work: Path) -> tuple[str, Path]:
    """What goes in the config's server.model, and the file it is."""
    if spec == "tiny":
        # The tiny model's own context is 256 tokens; one of its slots here needs more.
        path = write_tiny_model(work / "tiny.gguf", n_ctx=4096)
        return str(path), path
    if spec == "gemma":
        # The file of the installed package (offline), served as the daemon serves `gemma3-270m`
        # (with its chat template: see main's extra_args).
        path = model_file(GEMMA, paths)
        return str(path), path
    path = model_file(spec, paths)
    return str(path), path


def row(name: str, a: str, b: str, figure: str, target: str, met: bool | None) -> str:
    verdict = "" if met is None else "PASS" if met else "MISS"
    return f"| {name} | {a} | {b} | {figure} | {target} | {verdict} |"


@attrs.define
class Results:
    ttft: list[list[Stream]]  # direct, front door, direct again
    ttft_cpu: list[float]
    own_ms: list[float]  # the front door's clock: `added_ms` of each time-to-first-token request
    long: list[list[Stream]]
    long_cpu: list[float]
    conc: dict[int, Concurrent]
    restarts: list[RestartRun]
    retries: int = 0  # the front door's retries, from the daemon's log


def measure(d: DaemonProcess, urls: list[tuple[str, str | None]], args: argparse.Namespace) -> Results:
    assert d.proc is not None
    cpu = DaemonCPU(d.proc.pid)
    started = time.perf_counter()

    def lap(what: str) -> None:
        print(f"{what}: done at {time.perf_counter() - started:.1f} s", file=sys.stderr)

    logged = len(d.log_text())
    ttft = asyncio.run(sequential([*urls, urls[0]], cpu, "hi there", args.ttft_tokens, args.ttft_rounds))
    ttft_cpu = list(cpu.spent)
    # The front door's own clock: its access-log lines of these rounds (the warm-up's first).
    own = [float(ms) for ms in ADDED.findall(d.log_text()[logged:])][3:]
    lap("time to first token")
    long = asyncio.run(sequential(urls, cpu, "Write a long story about a river.", args.long_tokens, args.long_rounds))
    long_cpu = list(cpu.spent)
    lap("one stream")
    conc = {n: asyncio.run(concurrent(urls, cpu, n, args.conc_rounds, args.conc_tokens)) for n in (16, 64)}
    lap("concurrent streams")
    runs = [
        asyncio.run(restart(d, urls[1][0], args.restart_clients, args.ttft_tokens, 1.0)) for _ in range(args.restarts)
    ]
    lap("restarts")
    return Results(ttft, ttft_cpu, own, long, long_cpu, conc, runs)


def report(r: Results, args: argparse.Namespace) -> tuple[str, bool]:
    """The table, and whether every target was met."""
    t = [[s.ttft * 1000 for s in path if s.ttft is not None] for path in r.ttft]
    added = [b - a for a, b in zip(t[0], t[1])]
    control = [c - a for a, c in zip(t[0], t[2])]  # the engine against itself
    p99_added = percentile(t[1], 99) - percentile(t[0], 99)
    own = r.own_ms
    # The hops the front door's clock misses: the median added against both direct connections
    # (their mean, each round: the two differ by a few tenths of a ms between themselves), less
    # the clock's median.
    against_both = [f - (a + c) / 2 for a, f, c in zip(*t)]
    unseen = max(0.0, percentile(against_both, 50) - percentile(own, 50))
    ttft_added_p99 = percentile(own, 99) + unseen
    tps = [[s.tokens / s.elapsed for s in path] for path in r.long]
    long_ratio = statistics.median(b / a for a, b in zip(*tps))
    conc_ratio = {n: statistics.median(b / a for a, b in zip(*v.tps)) for n, v in r.conc.items()}
    lat = [x for run in r.restarts for x in run.latencies_ms]
    before = [x for run in r.restarts for x in run.before_ms]
    failures = [f for run in r.restarts for f in run.failures]
    per_request = [c / len(r.ttft[p]) * 1000 for p, c in enumerate(r.ttft_cpu)]
    tokens = [sum(s.tokens for s in path) for path in r.long]
    per_token = [c / n * 1e6 for c, n in zip(r.long_cpu, tokens)]
    met = {
        "ttft": ttft_added_p99 < TTFT_ADDED_MS,
        "long": long_ratio >= ONE_STREAM,
        **{f"conc{n}": v >= CONCURRENT for n, v in conc_ratio.items()},
        "restart": not failures,
    }
    lines = [
        "| figure | direct | front door | front door against direct | target | |",
        "|---|---:|---:|---:|---|---|",
        row(
            f"time to first token p50 ({args.ttft_tokens}-token answers, {len(added)} rounds)",
            f"{percentile(t[0], 50):.2f} ms",
            f"{percentile(t[1], 50):.2f} ms",
            f"{percentile(added, 50):+.2f} ms (paired)",
            "-",
            None,
        ),
        row(
            "time to first token p99",
            f"{percentile(t[0], 99):.2f} ms",
            f"{percentile(t[1], 99):.2f} ms",
            f"{percentile(added, 99):+.2f} ms (paired); p99 against p99 {p99_added:+.2f} ms",
            "-",
            None,
        ),
        row(
            "control: the engine directly against itself (a second connection), p50 / p99",
            f"{percentile(t[0], 50):.2f} / {percentile(t[0], 99):.2f} ms",
            f"{percentile(t[2], 50):.2f} / {percentile(t[2], 99):.2f} ms (direct again)",
            f"{percentile(control, 50):+.2f} / {percentile(control, 99):+.2f} ms (paired); p99 against p99 "
            f"{percentile(t[2], 99) - percentile(t[0], 99):+.2f} ms",
            "-",
            None,
        ),
        row(
            f"the front door's own time to first byte, by its clock ({len(own)} requests), p50 / p99 / max",
            "-",
            f"{percentile(own, 50):.2f} / {percentile(own, 99):.2f} / {max(own):.2f} ms",
            f"p99 added {ttft_added_p99:.2f} ms (its clock's p99 + {unseen:.2f} ms it cannot see: the p50 against "
            f"both direct connections, {percentile(against_both, 50):+.2f} ms, less its p50)",
            f"< {TTFT_ADDED_MS:g} ms",
            met["ttft"],
        ),
        row(
            f"one stream, {args.long_tokens} tokens (tokens/s, median of {len(tps[0])})",
            f"{statistics.median(tps[0]):.0f}",
            f"{statistics.median(tps[1]):.0f}",
            f"{long_ratio:.3f}",
            f">= {ONE_STREAM}",
            met["long"],
        ),
    ]
    for n, v in r.conc.items():
        lines.append(
            row(
                f"{n} concurrent streams, {args.conc_tokens} tokens each (aggregate tokens/s, median of {len(v.tps[0])})",
                f"{statistics.median(v.tps[0]):.0f}",
                f"{statistics.median(v.tps[1]):.0f}",
                f"{conc_ratio[n]:.3f}",
                f">= {CONCURRENT}",
                met[f"conc{n}"],
            )
        )
    for n, v in r.conc.items():
        lines.append(
            row(
                f"{n} concurrent streams: the round's first tokens, from the first to the last (median)",
                f"{statistics.median(v.spread_ms[0]):.1f} ms",
                f"{statistics.median(v.spread_ms[1]):.1f} ms",
                f"+{statistics.median(v.spread_ms[1]) - statistics.median(v.spread_ms[0]):.1f} ms",
                "-",
                None,
            )
        )
        # Once its first token came: the pace of the engine and of the relay, the arrival aside.
        lines.append(
            row(
                f"{n} concurrent streams: a stream's tokens/s after its first token (median)",
                f"{statistics.median(v.pace[0]):.0f}",
                f"{statistics.median(v.pace[1]):.0f}",
                f"{statistics.median(b / a for a, b in zip(*v.pace)):.3f}",
                "-",
                None,
            )
        )
        # Where a stream's time after its first token goes: its tokens, or its end after the last.
        lines.append(
            row(
                f"{n} concurrent streams: from a stream's last token to its end (the round's slowest, median)",
                f"{statistics.median(v.tail_ms[0]):.1f} ms",
                f"{statistics.median(v.tail_ms[1]):.1f} ms",
                f"+{statistics.median(v.tail_ms[1]) - statistics.median(v.tail_ms[0]):.1f} ms",
                "-",
                None,
            )
        )
    lines += [
        row(
            f"planned restart, {args.restart_clients} clients looping ({len(r.restarts)} restarts, "
            f"{len(lat)} requests)",
            "-",
            f"max {max(lat):.0f} ms, p99 {percentile(lat, 99):.0f} ms (p50 {percentile(before, 50):.1f} ms before)",
            f"{len(failures)} failed; restart -> ready {statistics.median(run.restart_s for run in r.restarts):.2f} s, "
            f"of which stopping {statistics.median(run.stopping_s for run in r.restarts):.2f} s (medians)",
            "0 failed",
            met["restart"],
        ),
        row(
            "the daemon's CPU per short request (time-to-first-token rounds)",
            f"{per_request[0]:.2f} ms",
            f"{per_request[1]:.2f} ms",
            f"{per_request[1] - per_request[0]:+.2f} ms",
            "-",
            None,
        ),
        row(
            "the daemon's CPU per token streamed (one-stream rounds)",
            f"{per_token[0]:.0f} µs",
            f"{per_token[1]:.0f} µs",
            f"{per_token[1] - per_token[0]:+.0f} µs",
            "-",
            None,
        ),
    ]
    text = "\n".join(lines) + "\n"
    text += (
        f"\nRequests the front door sent twice (an engine connection that failed before any answer, from the "
        f"daemon's log): {r.retries}.\n"
    )
    if failures:
        text += "\nFailures during the restarts (first 5): " + "; ".join(f"`{f[:160]}`" for f in failures[:5]) + "\n"
    return text, all(met.values())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny (generated), gemma (Gemma 3 270M) or a GGUF path")
    ap.add_argument("--quick", action="store_true", help="a smoke run: few rounds, well under a minute")
    ap.add_argument("--ttft-rounds", type=int, default=400)
    ap.add_argument("--ttft-tokens", type=int, default=4)
    ap.add_argument("--long-rounds", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=1024)
    ap.add_argument("--conc-rounds", type=int, default=4)
    ap.add_argument("--conc-tokens", type=int, default=128)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--restart-clients", type=int, default=4)
    ap.add_argument("--slot-ctx", type=int, default=2048, help="tokens of context per slot")
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    args = ap.parse_args()
    if args.quick:
        args.ttft_rounds, args.long_rounds, args.long_tokens = 60, 3, 256
        args.conc_rounds, args.conc_tokens, args.restarts = 1, 32, 1
    parallel = 64
    load_before = os.getloadavg()[0]

    with tempfile.TemporaryDirectory(prefix="frontdoor-bench-") as tmp:
        home = Path(tmp)
        os.environ["STOKER_HOME"] = str(home)
        paths = StokerPaths.from_env()
        bundle = engine_bundle(paths, args.bundle)
        spec, model = prepare_model(args.model, paths, home)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        d = DaemonProcess(home)
        # The daemon's defaults (supervisor, snapshots) but for the model, its slots and the port:
        # a planned restart takes what a user's would.
        config = f"[server]\nmodel = {json.dumps(spec)}\nctx_size = {parallel * args.slot_ctx}\nparallel = {parallel}\n"
        if args.model == "gemma":
            config += f"extra_args = {json.dumps(list(WELL_KNOWN[GEMMA].launch_args))}\n"
        write_config(d.paths, config + f"[frontdoor]\nport = {port}\n")
        d.start()
        try:
            st = d.wait_state("ready", timeout=600)
            results = measure(d, [(st["endpoint"], st["api_key"]), (f"http://127.0.0.1:{port}", None)], args)
        finally:
            d.stop()
            log = d.log_text()
            (Path(tempfile.gettempdir()) / "frontdoor-bench-daemon.log").write_text(log)
        results.retries = log.count(RETRY_LINE)

    table, met = report(results, args)
    command = f".venv/bin/python tests/bench/frontdoor.py {' '.join(sys.argv[1:])}".strip()
    body = (
        (
            "**A smoke run (`--quick`: few rounds): it shows that the bench runs; its figures measure nothing.**\n\n"
            if args.quick
            else ""
        )
        + f"`{command}` on {machine()}; engine {bundle.meta.version} ({bundle.meta.backend}); {model.name}, "
        f"`parallel` {parallel}, {args.slot_ctx} tokens of context per slot. Load average {load_before:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end.\n\n"
        "The same raw client (asyncio sockets, keep-alive, chunked SSE parsed from the bytes) sends the same streamed "
        "chat completions (`ignore_eos`, so both paths generate as many tokens) to the engine directly, with its "
        "per-launch key, and to the front door; the paths take turns going first in every round. llama-server "
        "closes its connection after every streamed answer, so each direct request opens a new one (inside its "
        "timing, as a client's pool does), and so does the front door towards the engine. Ratios are medians of "
        "the per-round ratios; concurrent streams use one connection each. Restart: `restart` on the control "
        f"socket while {args.restart_clients} clients loop through the front door, from 1 s before to 1 s after "
        "the new server is ready (the daemon's own `[supervisor]` settings: `stop_grace_s` 10). The daemon's CPU (user + system, from /proc) is summed over each path's "
        "requests: the direct path's figure is what the daemon spends anyway (it reads the engine's log). "
        "Run `.venv/bin/python tests/bench/frontdoor.py` (the tiny model: the fastest engine, the front door's "
        "worst case) and `--model gemma` (Gemma 3 270M); `--quick` is a smoke run of a few rounds.\n\n" + table
    )
    print(body)
    if not args.no_write:
        write_section("Front door", body)
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
