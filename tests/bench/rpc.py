"""What RPC workers cost: tokens/s and time to first token, one model local vs split over two
loopback workers, in one run (so the ratios compare like with like on a busy machine).

    .venv/bin/python tests/bench/rpc.py [--model PATH] [--rounds 5] [--tokens 64] [--json]

The CPU bundle of this STOKER_HOME (or the build cache) runs both sides: `local` is
llama-server alone (-ngl 0, -t THREADS); `split` is the same llama-server with `--rpc
A,B -ngl all --tensor-split F,F` over two ggml-rpc-server processes on 127.0.0.1 (-t
THREADS/2 each), the command line Stoker's plan gives it (daemon/fallback/workers.py). Each
round: one streamed greedy completion of `--tokens` tokens on a fixed prompt, cache off; TTFT
is measured at the client (request sent -> first token event), tokens/s is the engine's own
`timings.predicted_per_second`. The rounds alternate local and split. Defaults to the cached
gemma-3-270m if there is one, else the tiny test model (whose figures say little).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stoker.daemon.bundles.tinymodel import write_tiny_model  # noqa: E402
from stoker.daemon.core.paths import StokerPaths  # noqa: E402
from stoker.daemon.workers.server import RPC_TOOL  # noqa: E402
from tests.bench.report import engine_bundle  # noqa: E402

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} never became healthy")


def wait_tcp(port: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


def one_round(url: str, tokens: int) -> dict[str, float]:
    body = {"prompt": PROMPT, "n_predict": tokens, "temperature": 0, "seed": 1, "cache_prompt": False, "stream": True}
    sent = time.perf_counter()
    first = None
    timings: dict[str, Any] = {}
    with httpx.stream("POST", url + "/completion", json=body, timeout=600, trust_env=False) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if first is None and event.get("content"):
                first = time.perf_counter()
            if event.get("stop"):
                timings = event.get("timings") or {}
    return {
        "ttft_ms": ((first or time.perf_counter()) - sent) * 1000,
        "tokens_per_s": float(timings.get("predicted_per_second") or 0.0),
        "prompt_ms": float(timings.get("prompt_ms") or 0.0),
    }


def start(argv: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")
    try:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=log.parent)
    finally:
        out.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="stoker-rpc-bench-"))
    paths = StokerPaths.from_env({**os.environ, "STOKER_HOME": str(work / "home")})
    bundle = engine_bundle(paths)
    server, rpc = bundle.server, bundle.root / bundle.meta.tools[RPC_TOOL]
    model = args.model
    if model is None:
        cached = sorted((Path.home() / ".cache/stoker/models").glob("gemma-3-270m*.gguf"))
        model = cached[0] if cached else write_tiny_model(work / "tiny.gguf")
    half = max(1, args.threads // 2)
    procs: list[subprocess.Popen] = []
    try:
        ports = [free_port(), free_port()]
        for port in ports:
            procs.append(
                start([str(rpc), "--host", "127.0.0.1", "--port", str(port), "-t", str(half)], work / f"rpc-{port}.log")
            )
            wait_tcp(port)
        common = [
            str(server),
            "-m",
            str(model),
            "-c",
            "2048",
            "-np",
            "1",
            "--host",
            "127.0.0.1",
            "-t",
            str(args.threads),
        ]
        local_port, split_port = free_port(), free_port()
        endpoints = ",".join(f"127.0.0.1:{p}" for p in ports)
        sides = {
            "local": (common + ["--port", str(local_port), "-ngl", "0"], local_port),
            "split": (
                common + ["--port", str(split_port), "-ngl", "all", "--rpc", endpoints, "--tensor-split", "1,1"],
                split_port,
            ),
        }
        results: dict[str, list[dict[str, float]]] = {"local": [], "split": []}
        for name, (argv, port) in sides.items():
            proc = start(argv, work / f"{name}.log")
            procs.append(proc)
            wait_http(f"http://127.0.0.1:{port}")
            one_round(f"http://127.0.0.1:{port}", 8)  # warm-up
        for _ in range(args.rounds):
            for name, (_argv, port) in sides.items():
                results[name].append(one_round(f"http://127.0.0.1:{port}", args.tokens))
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()

    summary: dict[str, Any] = {
        "model": str(model),
        "rounds": args.rounds,
        "tokens": args.tokens,
        "threads": args.threads,
    }
    for name, rows in results.items():
        summary[name] = {
            key: round(statistics.median(r[key] for r in rows), 2) for key in ("ttft_ms", "tokens_per_s", "prompt_ms")
        }
    summary["split_over_local"] = {
        "tokens_per_s": round(summary["split"]["tokens_per_s"] / summary["local"]["tokens_per_s"], 3),
        "ttft": round(summary["split"]["ttft_ms"] / summary["local"]["ttft_ms"], 3),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"model {summary['model']}, {args.rounds} rounds of {args.tokens} tokens, medians")
        for name in ("local", "split"):
            s = summary[name]
            print(
                f"  {name:5}  {s['tokens_per_s']:8.2f} tok/s  TTFT {s['ttft_ms']:8.1f} ms  prefill {s['prompt_ms']:8.1f} ms"
            )
        r = summary["split_over_local"]
        print(f"  split/local: tokens/s x{r['tokens_per_s']}, TTFT x{r['ttft']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
